"""K2Q counting (spec 4.4) in CuTe DSL: the counting half of the sparse transpose of the backward
Q-major bitsets into per-K-block partial/full contributor counts.

The oracle is :func:`maskplan_core.reference.transpose.k2q_counts`: for mask head ``h`` and compact
K plan row ``kr`` (sample ``b``, K block ``j``), count the Q plan rows ``r`` of sample ``b`` whose bit
``j`` is set in ``visible & ~full`` (partial) and in ``full`` (full). It reads the bitsets by column;
it never rescans the endpoints. No atomics and no zero-filled output: every count is written once.

Work decomposition (one CTA per (32 consecutive compact K rows, mask head))::

    grid  = (ceil(upper_k_rows / 32), Hmask, 1)        block = (32 * num_warps, 1, 1)

    lane l of every warp  -> compact K row kr = 32 * blockIdx.x + l   (its sample b and K block j)
    warp w                -> a contiguous slice of sample b's Q plan rows:
                               [q_rows * w / W, q_rows * (w + 1) / W)
    per Q row r: bit j of visible_bits[h, r, j // 32] and full_bits[h, r, j // 32]
                 (lanes of one sample read the same word or its neighbour: broadcast loads)
    shared [W, 32] partial / full sums -> warp 0 adds the W slices, stores counts[h, kr]

Padding K rows (past the exact row count) belong to the dummy sample (no Q rows): count 0.

Compile-time (``Constexpr``): ``num_warps``. Runtime: ``Hmask``, the bounds, ``k_words``, ``B + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ._cute_args import row_major
from ._jit_cache import compile_stage
from ._primitives import WARP, WarpsPerCta
from .geometry import DESC_COLS, DESC_ROW_BEGIN, DESC_ROW_COUNT


@dataclass(frozen=True)
class K2QCountConfig(WarpsPerCta):
    """Static configuration of the K2Q count kernel (every field is compile-time)."""

    num_warps: int = 8


class K2QCount:
    """Column walk over the backward bitsets; see the module docstring."""

    def __init__(self, config: K2QCountConfig):
        self.config = config
        self.num_warps = config.num_warps
        self.num_threads = config.num_threads

    @cute.jit
    def __call__(
        self,
        visible_bits: cute.Pointer,  # int32 (Hmask, uq, k_words): backward Q2K bitsets
        full_bits: cute.Pointer,  # int32 (Hmask, uq, k_words)
        row_batch_k: cute.Pointer,  # int32 (uk,): sample of each compact K row (B for padding)
        desc_q: cute.Pointer,  # int32 (B+1, 8): backward "q" descriptor (Q row begin/count)
        desc_k: cute.Pointer,  # int32 (B+1, 8): backward "k" descriptor (K row begin)
        partial_counts: cute.Pointer,  # int32 (Hmask, uk), written
        full_counts: cute.Pointer,  # int32 (Hmask, uk), written
        hmask: Int32,
        uq: Int32,
        uk: Int32,
        k_words: Int32,
        batch_plus_one: Int32,
        stream: cuda.CUstream,
    ):
        mVisible = row_major(visible_bits, hmask, uq, k_words, wide=True)
        mFull = row_major(full_bits, hmask, uq, k_words, wide=True)
        mRowBatchK = row_major(row_batch_k, uk)
        mDescQ = row_major(desc_q, batch_plus_one, DESC_COLS)
        mDescK = row_major(desc_k, batch_plus_one, DESC_COLS)
        mPartial = row_major(partial_counts, hmask, uk, wide=True)
        mFullCnt = row_major(full_counts, hmask, uk, wide=True)
        self.kernel(mVisible, mFull, mRowBatchK, mDescQ, mDescK, mPartial, mFullCnt, uk).launch(
            grid=[(uk + WARP - 1) // WARP, hmask, 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mVisible: cute.Tensor,
        mFull: cute.Tensor,
        mRowBatchK: cute.Tensor,
        mDescQ: cute.Tensor,
        mDescK: cute.Tensor,
        mPartial: cute.Tensor,
        mFullCnt: cute.Tensor,
        uk: Int32,
    ):
        chunk, head, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        smem = cutlass.memory.SmemAllocator()
        # (num_warps, 32): per-warp partial sums of every lane's K row
        sPartial = smem.allocate_tensor(Int32, cute.make_layout((self.num_warps, WARP), stride=(WARP, 1)), 16)
        sFull = smem.allocate_tensor(Int32, cute.make_layout((self.num_warps, WARP), stride=(WARP, 1)), 16)

        k_row = chunk * WARP + lane
        k_row_ok = k_row < uk
        dummy = mDescQ.shape[0] - 1
        batch = dummy
        if k_row_ok:
            batch = mRowBatchK[k_row]
        j = k_row - mDescK[batch, DESC_ROW_BEGIN]  # sample-local K block
        q_begin = mDescQ[batch, DESC_ROW_BEGIN]
        q_count = mDescQ[batch, DESC_ROW_COUNT]
        word = j // WARP
        shift = j % WARP

        lo = (q_count * warp) // self.num_warps
        hi = (q_count * (warp + 1)) // self.num_warps
        partial = Int32(0)
        full = Int32(0)
        for m in cutlass.range(lo, hi, 1, unroll=4):
            r = q_begin + m
            v = (mVisible[head, r, word] >> shift) & 1
            f = (mFull[head, r, word] >> shift) & 1
            partial = partial + (v & (f ^ 1))
            full = full + f
        sPartial[warp, lane] = partial
        sFull[warp, lane] = full
        cute.arch.sync_threads()
        if warp == 0:
            p_sum = Int32(0)
            f_sum = Int32(0)
            for w in cutlass.range_constexpr(self.num_warps):
                p_sum = p_sum + sPartial[w, lane]
                f_sum = f_sum + sFull[w, lane]
            if k_row_ok:
                mPartial[head, k_row] = p_sum
                mFullCnt[head, k_row] = f_sum


def compile_k2q_count(config: K2QCountConfig, *, options: str | None = None):
    """Compile (cached) the K2Q count kernel for ``config`` (:func:`._jit_cache.compile_stage`)."""
    return compile_stage("k2q_count", K2QCount, config, pointers=7, ints=5, options=options)
