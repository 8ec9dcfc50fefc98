"""Forward schedule, pass 2 of 2 (spec 4.8): ``fwd_work_desc`` in the exact reference order.

Order (:func:`maskplan_core.reference.schedule.forward_schedule`): positive-cost tasks sorted by
(section rank, cost descending, tie order), then zero-cost tasks in (batch, head, Q block) order;
section rank = position of the section in a STABLE sort by descending section cost. Each task
``(head, Q plan row)`` becomes ``(m_block, head, batch, q_valid_rows)``.

Bounded counting, no sort (one CTA per section; ``stats`` from :mod:`schedule_stats`)::

    grid = (num_sections, 1, 1)        block = (32 * num_warps, 1, 1)

    1. section start   positive tasks of the sections ranked before s:
                         sum over s' of npos[s'] where cost[s'] > cost[s] or (== and s' < s)
                       zero start = all positive tasks + nzero of sections s' < s
                       (threads stride over all sections, CTA sums; (batch, head, m) order of the
                       zero tasks is section index order then tie order, so this is exact)
    2. histogram       warp w takes the contiguous tie-order slice [T w / W, T (w+1) / W) and counts
                       its tasks per cost in shared hist[w][cost]  (cost <= the sample's K blocks)
    3. bucket offsets  per cost: exclusive prefix over warps (hist[w][c] becomes a warp offset) and
                       totals; warp 0: start[c] = section start + tasks of larger cost (suffix scan
                       from the top cost), start[0] = zero start
    4. scatter         warp w walks its slice 32 tasks at a time in tie order: lanes of equal cost
                       (match.any) take consecutive slots start[c] + hist[w][c] + rank-in-group,
                       the group leader advances hist[w][c]

Compile-time (``Constexpr``): ``num_warps``, ``bins`` (>= max K blocks of a sample + 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ._cute_args import row_major
from ._jit_cache import compile_stage
from ._primitives import (
    FULL_MASK,
    SCAN_SCRATCH,
    WARP,
    WarpsPerCta,
    block_reduce,
    warp_broadcast,
    warp_inclusive_sum,
)
from ._sections import section_tasks, task_cost, task_of
from .geometry import DESC_COLS, DESC_INNER_BLOCKS, DESC_Q_LEN
from .schedule_stats import STATS_COLS

WORK_COLS = 4  # m_block, head, batch, q_valid_rows
MAX_SMEM_BINS = 48 * 1024  # Int32 slots of histogram the CTA may hold (192 KiB)
PREFERRED_SMEM_BINS = 11 * 1024  # 44 KiB


@dataclass(frozen=True)
class ScheduleScatterConfig(WarpsPerCta):
    """Static configuration of the scatter kernel (every field is compile-time)."""

    bins: int  # >= max K blocks of a sample + 1 (a task's cost is at most its sample's K blocks)
    num_warps: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bins < 1 or (self.num_warps + 1) * self.bins > MAX_SMEM_BINS:
            raise ValueError(
                f"bins={self.bins} with num_warps={self.num_warps} needs {(self.num_warps + 1) * self.bins} "
                f"shared Int32 slots (max {MAX_SMEM_BINS})"
            )

    @classmethod
    def for_max_k_blocks(cls, max_k_blocks: int) -> ScheduleScatterConfig:
        """A power-of-two bin count (few compiled variants) and as many warps (up to 8) as keep the
        histograms within 44 KiB, under the 48 KiB that needs no opt-in (one warp past 4096 bins)."""
        bins = 32
        while bins < max_k_blocks + 1:
            bins *= 2
        warps = max(1, min(8, PREFERRED_SMEM_BINS // bins - 1))
        return cls(bins=bins, num_warps=warps)


class ScheduleScatter:
    """One CTA per L2 section; see the module docstring."""

    def __init__(self, config: ScheduleScatterConfig):
        self.config = config
        self.bins = config.bins
        self.num_warps = config.num_warps
        self.num_threads = config.num_threads

    @cute.jit
    def __call__(
        self,
        counts: cute.Pointer,  # int32 (2, Hmask, uq): partial and full counts of the forward rows
        sequence_desc: cute.Pointer,  # int32 (B+1, 8): forward "q" descriptor
        stats: cute.Pointer,  # int32 (num_sections, 4) from ScheduleStats
        work: cute.Pointer,  # int32 (num_tasks, 4), written
        hmask: Int32,
        uq: Int32,
        batch_plus_one: Int32,
        num_sections: Int32,
        num_tasks: Int32,
        num_heads_kv: Int32,
        qhead_per_kvhead: Int32,
        pack_gqa: Int32,
        mask_per_head: Int32,
        row_bytes_kv: Int32,
        budget: Int32,
        tile_m: Int32,
        stream: cuda.CUstream,
    ):
        mPartialCnt = row_major(counts, hmask, uq, wide=True)
        mFullCnt = row_major(counts + hmask * uq, hmask, uq, wide=True)
        mDesc = row_major(sequence_desc, batch_plus_one, DESC_COLS)
        mStats = row_major(stats, num_sections, STATS_COLS)
        mWork = row_major(work, cutlass.max(num_tasks, 1), WORK_COLS)
        self.kernel(
            mPartialCnt,
            mFullCnt,
            mDesc,
            mStats,
            mWork,
            num_heads_kv,
            qhead_per_kvhead,
            pack_gqa,
            mask_per_head,
            row_bytes_kv,
            budget,
            tile_m,
        ).launch(grid=[num_sections, 1, 1], block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        mPartialCnt: cute.Tensor,
        mFullCnt: cute.Tensor,
        mDesc: cute.Tensor,
        mStats: cute.Tensor,
        mWork: cute.Tensor,
        num_heads_kv: Int32,
        qhead_per_kvhead: Int32,
        pack_gqa: Int32,
        mask_per_head: Int32,
        row_bytes_kv: Int32,
        budget: Int32,
        tile_m: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        s, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        W = self.num_warps
        bins = self.bins

        smem = cutlass.memory.SmemAllocator()
        # (W, bins): per-warp histogram, then per-warp cursor offsets
        sHist = smem.allocate_tensor(Int32, cute.make_layout((W, bins), stride=(bins, 1)), byte_alignment=16)
        # (bins,): per-cost totals, then absolute bucket starts
        sStart = smem.allocate_tensor(Int32, cute.make_layout(bins), byte_alignment=16)
        sScratch = smem.allocate_tensor(Int32, cute.make_layout(SCAN_SCRATCH), byte_alignment=16)

        batch, h0, q_rows, row0, tasks = section_tasks(
            s, mDesc, num_heads_kv, qhead_per_kvhead, pack_gqa, row_bytes_kv, budget
        )
        q_len = mDesc[batch, DESC_Q_LEN]
        max_cost = mDesc[batch, DESC_INNER_BLOCKS]
        if tasks > 0:
            # ---- 1. where this section's positive and zero-cost tasks start ---------------------
            num_sections = mStats.shape[0]
            my_cost = mStats[s, 0]
            before_pos = Int32(0)
            before_zero = Int32(0)
            all_pos = Int32(0)
            for s2 in cutlass.range(tidx, num_sections, self.num_threads, unroll=1):
                c2 = mStats[s2, 0]
                p2 = mStats[s2, 1]
                ranked_before = (c2 > my_cost) | ((c2 == my_cost) & (s2 < s))
                before_pos = before_pos + cutlass.select_(ranked_before, p2, Int32(0))
                before_zero = before_zero + cutlass.select_(s2 < s, mStats[s2, 2], Int32(0))
                all_pos = all_pos + p2
            pos_start = block_reduce(before_pos, sScratch, W, "add")
            pos_total = block_reduce(all_pos, sScratch, W, "add")
            zero_start = pos_total + block_reduce(before_zero, sScratch, W, "add")

            # ---- 2. per-warp cost histograms of contiguous tie-order slices ---------------------
            n_bins = max_cost + 1
            for i in cutlass.range(tidx, W * n_bins, self.num_threads, unroll=1):
                w2 = i // n_bins
                sHist[w2, i - w2 * n_bins] = Int32(0)
            cute.arch.sync_threads()
            lo = (tasks * warp) // W
            hi = (tasks * (warp + 1)) // W
            for t in cutlass.range(lo + lane, hi, WARP, unroll=1):
                head, m = task_of(t, h0, q_rows)
                cost = task_cost(mPartialCnt, mFullCnt, head, row0 + m, mask_per_head)
                cute.arch.atomic_add((sHist.iterator + warp * bins) + cost, Int32(1))
            cute.arch.sync_threads()

            # ---- 3. warp offsets per cost, then absolute bucket starts --------------------------
            for c in cutlass.range(tidx, n_bins, self.num_threads, unroll=1):
                run = Int32(0)
                for w2 in cutlass.range_constexpr(W):
                    x = sHist[w2, c]
                    sHist[w2, c] = run
                    run = run + x
                sStart[c] = run
            cute.arch.sync_threads()
            if warp == 0:
                carry = Int32(0)
                for k0 in cutlass.range(0, max_cost, WARP, unroll=1):
                    c = max_cost - (k0 + lane)  # descending costs max_cost .. 1
                    v = Int32(0)
                    if c >= 1:
                        v = sStart[c]
                    incl = warp_inclusive_sum(v, lane)
                    if c >= 1:
                        sStart[c] = pos_start + carry + incl - v
                    carry = carry + warp_broadcast(incl, WARP - 1)
                if lane == 0:
                    sStart[0] = zero_start
            cute.arch.sync_threads()

            # ---- 4. scatter in tie order ----------------------------------------------------------
            for t0 in cutlass.range(lo, hi, WARP, unroll=1):
                t = t0 + lane
                ok = t < hi
                cost = Int32(-1)
                head = Int32(0)
                m = Int32(0)
                if ok:
                    head, m = task_of(t, h0, q_rows)
                    cost = task_cost(mPartialCnt, mFullCnt, head, row0 + m, mask_per_head)
                peers = Int32(cute.arch.match_sync(FULL_MASK, cost))
                earlier = peers & Int32(cute.arch.lanemask_lt())
                slot = Int32(0)
                if ok:
                    slot = sStart[cost] + sHist[warp, cost] + cute.arch.popc(earlier)
                cute.arch.sync_warp()
                if ok & (earlier == 0):
                    sHist[warp, cost] = sHist[warp, cost] + cute.arch.popc(peers)
                cute.arch.sync_warp()
                if ok:
                    mWork[slot, 0] = m
                    mWork[slot, 1] = head
                    mWork[slot, 2] = batch
                    mWork[slot, 3] = cutlass.min(q_len - m * tile_m, tile_m)


def compile_schedule_scatter(config: ScheduleScatterConfig, *, options: str | None = None):
    """Compile (cached) the scatter kernel for ``config`` (:func:`._jit_cache.compile_stage`)."""
    return compile_stage("schedule_scatter", ScheduleScatter, config, pointers=4, ints=12, options=options)
