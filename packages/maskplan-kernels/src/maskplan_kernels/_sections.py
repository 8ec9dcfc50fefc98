"""L2 sections of the forward schedule (spec 4.8, ARCHITECTURE.md "L2 section"): device helpers
shared by the schedule kernels, and their host-side parameters.

Section ``s = b * Hkv + i`` of sample ``b`` holds kv heads ``[i * hps_b, min((i + 1) * hps_b, Hkv))``
where ``hps_b`` is the largest power of two ``p <= Hkv`` with ``k_len_b * row_bytes_kv * p <= budget``
(at least 1), exactly :func:`maskplan_core.reference.schedule.heads_per_section`. Its tasks are the
scheduled heads of those kv heads (a contiguous range: kv heads with PackGQA, their
``qhead_per_kvhead`` Q heads otherwise) times the sample's Q plan rows, in tie order
``t = (head - h0) * q_rows + m``. Sections ``i >= ceil(Hkv / hps_b)`` are empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from maskplan_core.geometry import PlanGeometry
from maskplan_core.reference.schedule import L2_SECTION_BYTES

from .geometry import DESC_K_LEN, DESC_ROW_BEGIN, DESC_ROW_COUNT


@dataclass(frozen=True)
class ScheduleParams:
    """Runtime scalars of the schedule kernels (derived from the plan geometry and the view)."""

    num_sections: int  # B * Hkv
    num_heads_kv: int
    qhead_per_kvhead: int
    pack_gqa: int  # 0 / 1
    mask_per_head: int  # 1 when the task's mask head is its scheduled head, 0 when it is head 0
    row_bytes_kv: int  # (Dqk + Dv) * element size
    budget: int = L2_SECTION_BYTES

    @classmethod
    def of(cls, g: PlanGeometry, pack_gqa: bool) -> ScheduleParams:
        element = g.dtype.itemsize
        return cls(
            num_sections=g.batch * g.num_heads_kv,
            num_heads_kv=g.num_heads_kv,
            qhead_per_kvhead=g.qhead_per_kvhead,
            pack_gqa=int(pack_gqa),
            mask_per_head=int(g.mask_heads > 1 and not pack_gqa),
            row_bytes_kv=(g.head_dim_qk + g.head_dim_v) * element,
        )


@cute.jit
def section_tasks(
    s: Int32,
    mDesc: cute.Tensor,
    num_heads_kv: Int32,
    qhead_per_kvhead: Int32,
    pack_gqa: Int32,
    row_bytes_kv: Int32,
    budget: Int32,
):
    """``(batch, h0, q_rows, row0, tasks)`` of section ``s``: its sample, first scheduled head, Q
    rows per head, first compact Q row and task count (heads x rows, head-major; :func:`task_of`).
    A section takes as many kv heads (a power of two) as fit the L2 ``budget`` with the sample's
    K and V rows."""
    batch = s // num_heads_kv
    i = s - batch * num_heads_kv
    kv_bytes = Int64(mDesc[batch, DESC_K_LEN]) * Int64(row_bytes_kv)
    hps = Int32(1)
    while (hps * 2 <= num_heads_kv) & (kv_bytes * Int64(hps * 2) <= Int64(budget)):
        hps = hps * 2
    kv0 = i * hps
    h0 = Int32(0)
    nh = Int32(0)
    if kv0 < num_heads_kv:
        kv1 = cutlass.min(kv0 + hps, num_heads_kv)
        h0 = kv0
        nh = kv1 - kv0
        if pack_gqa == 0:
            h0 = kv0 * qhead_per_kvhead
            nh = nh * qhead_per_kvhead
    q_rows = mDesc[batch, DESC_ROW_COUNT]
    return batch, h0, q_rows, mDesc[batch, DESC_ROW_BEGIN], nh * q_rows


@cute.jit
def task_of(t: Int32, h0: Int32, q_rows: Int32):
    """``(head, m)``: the scheduled head and sample-local Q block of a section's task ``t``."""
    hq = t // q_rows
    return h0 + hq, t - hq * q_rows


@cute.jit
def task_cost(
    mPartialCnt: cute.Tensor, mFullCnt: cute.Tensor, head: Int32, row: Int32, mask_per_head: Int32
) -> Int32:
    """Partial + full blocks of the task's Q row (reference ``_forward_view`` costs)."""
    mh = cutlass.select_(mask_per_head != 0, head, Int32(0))
    return mPartialCnt[mh, row] + mFullCnt[mh, row]
