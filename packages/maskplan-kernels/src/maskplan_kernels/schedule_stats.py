"""Forward schedule, pass 1 of 2 (spec 4.8): per-L2-section totals.

For every section ``s`` (see :mod:`maskplan_kernels._sections`)::

    stats[s] = (sum of task costs, positive-cost tasks, zero-cost tasks, 0)

Pass 2 (:mod:`maskplan_kernels.schedule_scatter`) ranks the sections by the first column and
places each task. The oracle of both passes together is
:func:`maskplan_core.reference.schedule.forward_schedule`.

Work decomposition (one warp per section, no atomics)::

    grid = (ceil(num_sections / num_warps), 1, 1)        block = (32 * num_warps, 1, 1)
    warp -> section s; lanes stride over its tasks t (head = h0 + t // q_rows, m = t % q_rows),
    cost = partial + full count of the task's Q row (mask head = head, or 0 when shared);
    warp sums (redux) -> lane 0 stores the row.

Compile-time (``Constexpr``): ``num_warps``. Runtime: section parameters, bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ._cute_args import row_major
from ._jit_cache import compile_stage
from ._primitives import WARP, WarpsPerCta, warp_sum
from ._sections import section_tasks, task_cost, task_of
from .geometry import DESC_COLS

STATS_COLS = 4


@dataclass(frozen=True)
class ScheduleStatsConfig(WarpsPerCta):
    """Static configuration of the section-stats kernel (every field is compile-time)."""

    num_warps: int = 4


class ScheduleStats:
    """One warp per L2 section; see the module docstring."""

    def __init__(self, config: ScheduleStatsConfig):
        self.config = config
        self.num_warps = config.num_warps
        self.num_threads = config.num_threads

    @cute.jit
    def __call__(
        self,
        counts: cute.Pointer,  # int32 (2, Hmask, uq): partial and full counts of the forward rows
        sequence_desc: cute.Pointer,  # int32 (B+1, 8): forward "q" descriptor
        stats: cute.Pointer,  # int32 (num_sections, 4), written
        hmask: Int32,
        uq: Int32,
        batch_plus_one: Int32,
        num_sections: Int32,
        num_heads_kv: Int32,
        qhead_per_kvhead: Int32,
        pack_gqa: Int32,
        mask_per_head: Int32,
        row_bytes_kv: Int32,
        budget: Int32,
        stream: cuda.CUstream,
    ):
        mPartialCnt = row_major(counts, hmask, uq, wide=True)
        mFullCnt = row_major(counts + hmask * uq, hmask, uq, wide=True)
        mDesc = row_major(sequence_desc, batch_plus_one, DESC_COLS)
        mStats = row_major(stats, num_sections, STATS_COLS)
        self.kernel(
            mPartialCnt,
            mFullCnt,
            mDesc,
            mStats,
            num_heads_kv,
            qhead_per_kvhead,
            pack_gqa,
            mask_per_head,
            row_bytes_kv,
            budget,
        ).launch(
            grid=[(num_sections + self.num_warps - 1) // self.num_warps, 1, 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mPartialCnt: cute.Tensor,
        mFullCnt: cute.Tensor,
        mDesc: cute.Tensor,
        mStats: cute.Tensor,
        num_heads_kv: Int32,
        qhead_per_kvhead: Int32,
        pack_gqa: Int32,
        mask_per_head: Int32,
        row_bytes_kv: Int32,
        budget: Int32,
    ):
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        num_sections = mStats.shape[0]
        s = bidx * self.num_warps + warp
        if s < num_sections:
            _, h0, q_rows, row0, tasks = section_tasks(
                s, mDesc, num_heads_kv, qhead_per_kvhead, pack_gqa, row_bytes_kv, budget
            )
            cost_sum = Int32(0)
            positive = Int32(0)
            for t in cutlass.range(lane, tasks, WARP, unroll=1):
                head, m = task_of(t, h0, q_rows)
                cost = task_cost(mPartialCnt, mFullCnt, head, row0 + m, mask_per_head)
                cost_sum = cost_sum + cost
                positive = positive + cutlass.select_(cost > 0, Int32(1), Int32(0))
            cost_sum = warp_sum(cost_sum)
            positive = warp_sum(positive)
            if lane == 0:
                mStats[s, 0] = cost_sum
                mStats[s, 1] = positive
                mStats[s, 2] = tasks - positive
                mStats[s, 3] = Int32(0)


def compile_schedule_stats(config: ScheduleStatsConfig, *, options: str | None = None):
    """Compile (cached) the section-stats kernel for ``config`` (:func:`._jit_cache.compile_stage`)."""
    return compile_stage("schedule_stats", ScheduleStats, config, pointers=3, ints=10, options=options)
