"""The reference planner: spec section 4 as a pipeline of named stages.

geometry -> classify (fwd [, bwd]) -> K2Q count -> header (one host read, errors raised)
         -> materialise Q2K [, K2Q + dQ order] -> forward schedule -> MaskPlan
"""

from __future__ import annotations

import torch

from ..consumer import ViewConfig, check_build_inputs
from ..error_flags import raise_for_error_flags
from ..geometry import PlanGeometry
from ..plan import MaskPlan, PlanView
from ..plan_ready import mark_ready
from .block_geometry import BlockGeometry, block_geometry, geometry_error_flags
from .classify import classify
from .csr import allocation_header, materialize_q2k
from .schedule import forward_schedule
from .transpose import k2q_counts, materialize_k2q


def build_plan(
    mask_func: torch.Tensor,
    geometry: PlanGeometry,
    forward: ViewConfig,
    backward: ViewConfig | None,
    consumer: str,
) -> MaskPlan:
    """Build every view of a plan with the reference stages (runs on CPU and CUDA tensors)."""
    check_build_inputs(mask_func, geometry, forward, backward)
    flags = geometry_error_flags(geometry)
    raise_for_error_flags(flags, mask_func, geometry)  # a bad prefix makes every later stage meaningless
    fwd_geom = block_geometry(geometry, forward.tile_m, forward.tile_n)
    fwd_cls = classify(mask_func, fwd_geom)
    bwd_geom = bwd_cls = counts = None
    if backward is not None:
        bwd_geom = block_geometry(geometry, backward.tile_m, backward.tile_n)
        bwd_cls = classify(mask_func, bwd_geom)
        counts = k2q_counts(bwd_cls, bwd_geom)
    header = allocation_header(fwd_cls, fwd_geom, counts, bwd_geom, flags | fwd_cls.error_flags)
    header, longest_k_row = read_back(header, counts)
    raise_for_error_flags(header[-1], mask_func, geometry)
    views = {"forward": _forward_view(mask_func, geometry, forward, fwd_geom, fwd_cls)}
    if backward is not None:
        views["backward"] = _backward_view(
            mask_func, geometry, backward, bwd_geom, bwd_cls, counts, longest_k_row
        )
    mark_ready(views.values(), mask_func.device)  # CUDA: consumers on other streams wait for this point
    return MaskPlan(geometry, views, tuple(header), consumer)


def _forward_view(mask_func, g: PlanGeometry, cfg: ViewConfig, geom: BlockGeometry, cls) -> PlanView:
    lists = materialize_q2k(mask_func, cls, geom, cfg.layout)
    pack = cfg.signature.topology.pack_gqa
    n_sched = g.num_heads_kv if pack else g.num_heads_q
    sched = torch.arange(n_sched, device=g.device)
    kv_head_of = sched if pack else sched // g.qhead_per_kvhead
    mask_head = sched if g.mask_heads > 1 and not pack else torch.zeros_like(sched)
    costs = (cls.partial_counts + cls.full_counts).to(torch.int64)[mask_head]
    element = g.dtype.itemsize
    work = forward_schedule(
        costs,
        geom,
        num_heads_kv=g.num_heads_kv,
        kv_head_of=kv_head_of,
        row_bytes_kv=(g.head_dim_qk + g.head_dim_v) * element,
    )
    tensors = _csr_tensors(lists) | _sequence_desc(g, geom, "q") | {"fwd_work_desc": work}
    return PlanView("forward", cfg.signature, cfg.layout, g, tensors)


def read_back(
    header: torch.Tensor, counts: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[list[int], int]:
    """The build's one host read: the 8-value header and, with ``counts`` (a backward view's int32
    ``[Hmask, K rows]`` partial and full K2Q counts), the entries of its longest K2Q row
    (``PlanView.longest_row``; 0 without rows or counts)."""
    if counts is None or counts[0].numel() == 0:
        return header.tolist(), 0
    *values, longest = torch.cat((header, (counts[0] + counts[1]).amax().view(1))).tolist()
    return values, longest


def _backward_view(
    mask_func, g: PlanGeometry, cfg: ViewConfig, geom: BlockGeometry, cls, counts, longest: int
) -> PlanView:
    lists = materialize_k2q(mask_func, cls, geom, cfg.layout, counts)
    order = {"dq_write_order": lists.dq_write_order, "dq_write_order_full": lists.dq_write_order_full}
    tensors = _csr_tensors(lists) | _sequence_desc(g, geom, "k") | order
    return PlanView("backward", cfg.signature, cfg.layout, g, tensors, longest_row=longest)


def _sequence_desc(g: PlanGeometry, geom: BlockGeometry, outer: str) -> dict[str, torch.Tensor]:
    """Varlen views retain their descriptor; a fixed-length view's is derived where it is read
    (``PlanView.sequence_desc``, ``maskplan_core.plan.fixed_sequence_desc``)."""
    return {"sequence_desc": geom.sequence_desc(outer)} if g.varlen else {}


def _csr_tensors(lists) -> dict[str, torch.Tensor]:
    return {
        "mask_block_cnt": lists.partial.cnt,
        "mask_block_offset": lists.partial.offset,
        "mask_block_idx": lists.partial.idx,
        "mask_block_masks": lists.masks,
        "full_block_cnt": lists.full.cnt,
        "full_block_offset": lists.full.offset,
        "full_block_idx": lists.full.idx,
    }
