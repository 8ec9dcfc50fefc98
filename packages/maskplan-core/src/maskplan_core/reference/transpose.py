"""K2Q (spec 4.4, 4.7): a sparse transpose of the backward Q-major bitsets, and dQ write order."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..payload import PayloadLayout
from .block_geometry import BlockGeometry
from .classify import Classification, unpack_bits
from .csr import BlockLists, Csr, block_flags, exclusive_offsets, pack_payloads


def _k2q_keys(flags: torch.Tensor, geom: BlockGeometry):
    """For every set (h, q_row, k_block): its K2Q row key ``h * n_k_rows + k_row`` and coordinates."""
    h, r, j = flags.nonzero(as_tuple=True)
    row_b, row_m = geom.q_row_owner()
    k_row = geom.cu_k_rows[row_b[r]] + j
    return h * geom.n_k_rows + k_row, h, r, j, row_m[r]


def k2q_counts(cls: Classification, geom: BlockGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """Counting half: partial and full Q contributors per (mask head, K plan row), int32."""
    hmask = cls.partial_counts.shape[0]
    out = []
    for flags in block_flags(cls, geom):
        key = _k2q_keys(flags, geom)[0]
        n = hmask * geom.n_k_rows
        out.append(torch.bincount(key, minlength=n).to(torch.int32).reshape(hmask, geom.n_k_rows))
    return out[0], out[1]


@dataclass(frozen=True)
class K2QLists(BlockLists):
    dq_write_order: torch.Tensor
    dq_write_order_full: torch.Tensor


def materialize_k2q(
    mask_func, cls: Classification, geom: BlockGeometry, layout: PayloadLayout, counts
) -> K2QLists:
    """Write half: K-major partial/full CSRs (Q blocks ascending), payloads, dQ write ranks.

    ``dq_write_order`` of an entry (K block j -> Q block i) is j's rank among all K blocks
    (partial or full) that contribute to Q block i, ascending in j: a fixed order in which
    deterministic dQ accumulation applies the contributions.
    """
    visible = unpack_bits(cls.visible_bits, geom.max_k_blocks)
    rank = visible.to(torch.int32).cumsum(-1, dtype=torch.int32) - 1  # [H, R, K]
    lists = []
    for flags, cnt in zip(block_flags(cls, geom), counts, strict=False):
        key, h, r, j, m = _k2q_keys(flags, geom)
        order = torch.argsort(key * max(geom.max_q_blocks, 1) + m, stable=True)
        h, r, j, m = h[order], r[order], j[order], m[order]
        lists.append((Csr(cnt, exclusive_offsets(cnt), m.to(torch.int32)), rank[h, r, j], (h, r, j)))
    (partial, p_rank, (ph, pr, pj)), (full, f_rank, _) = lists
    return K2QLists(
        partial=partial,
        full=full,
        masks=pack_payloads(mask_func, geom, layout, ph, pr, pj),
        dq_write_order=p_rank,
        dq_write_order_full=f_rank,
    )
