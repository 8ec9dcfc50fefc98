"""Stage 6 (spec 4.8 + ARCHITECTURE.md "L2 section"): the forward work queue ``fwd_work_desc``.

One task per (valid Q plan row, scheduled head); ``fwd_work_desc[t] = (m_block, head, batch,
q_valid_rows)``. Order: positive-cost tasks grouped by L2 section (sections by descending total
cost, stable), within a section by descending cost, ties in head/Q-block order; zero-cost tasks
last in batch/head/Q-block order. The reference uses stable sorts; the order is the contract.
"""

from __future__ import annotations

import torch

from .block_geometry import BlockGeometry

L2_SECTION_BYTES = 50 * 1024 * 1024


def heads_per_section(
    kv_bytes: torch.Tensor, num_heads_kv: int, budget: int = L2_SECTION_BYTES
) -> torch.Tensor:
    """Largest power of two ``p <= num_heads_kv`` with ``kv_bytes * p <= budget`` (at least 1), per sample."""
    p = torch.ones_like(kv_bytes)
    while True:
        grow = (p * 2 <= num_heads_kv) & (kv_bytes * p * 2 <= budget)
        if not bool(grow.any()):
            return p
        p = torch.where(grow, p * 2, p)


def _stable_order(order: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    return order[torch.argsort(key[order], stable=True)]


def forward_schedule(
    costs: torch.Tensor,
    geom: BlockGeometry,
    *,
    num_heads_kv: int,
    kv_head_of: torch.Tensor,
    row_bytes_kv: int,
) -> torch.Tensor:
    """int32 ``[tasks, 4]`` in queue order.

    ``costs``: int64 ``[scheduled_heads, n_q_rows]`` (partial + full blocks of the task's row);
    ``kv_head_of``: int64 ``[scheduled_heads]``; ``row_bytes_kv``: ``(Dqk + Dv) * element_size``.
    """
    device = costs.device
    n_heads, n_rows = costs.shape
    row_b, row_m = geom.q_row_owner()
    head = torch.arange(n_heads, device=device).unsqueeze(1).expand(n_heads, n_rows).reshape(-1)
    b = row_b.unsqueeze(0).expand(n_heads, n_rows).reshape(-1)
    m = row_m.unsqueeze(0).expand(n_heads, n_rows).reshape(-1)
    cost = costs.reshape(-1)
    base = (b * n_heads + head) * max(geom.max_q_blocks, 1) + m  # batch/head/Q-block tie order
    hps = heads_per_section(geom.k_lens * row_bytes_kv, num_heads_kv)
    section = b * num_heads_kv + kv_head_of[head] // hps[b]
    n_sections = geom.batch * num_heads_kv
    section_cost = torch.zeros(n_sections, dtype=torch.int64, device=device).index_add_(0, section, cost)
    section_order = torch.argsort(-section_cost, stable=True)
    section_rank = torch.empty_like(section_order)
    section_rank[section_order] = torch.arange(n_sections, device=device)
    zero = cost == 0
    order = torch.argsort(base)
    order = _stable_order(order, torch.where(zero, 0, -cost))
    order = _stable_order(order, torch.where(zero, 0, section_rank[section]))
    order = _stable_order(order, zero.to(torch.int64))
    q_valid = torch.clamp(geom.q_lens[b] - m * geom.tile_m, max=geom.tile_m)
    return torch.stack([m, head, b, q_valid], 1)[order].to(torch.int32)
