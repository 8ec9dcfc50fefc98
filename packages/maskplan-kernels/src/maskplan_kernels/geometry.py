"""Varlen geometry (spec 3.2, 4.2) in CuTe DSL: compact plan-row prefixes, ``sequence_desc``,
row ownership and prefix validation, for the forward view and (optionally) the backward view.

The oracle is :func:`maskplan_core.reference.block_geometry` (+ ``geometry_error_flags``): for
well-formed prefixes every written row of ``sequence_desc`` equals ``BlockGeometry.sequence_desc``
and every valid entry of ``row_batch`` equals ``BlockGeometry.q_row_owner()[0]`` (the sample of
each compact row; likewise for K rows). Fixed-length plans run the same kernel on their
synthesised prefixes (validation off).

Work decomposition (ONE CTA, ``num_threads`` threads; B up to a few thousand)::

    grid = (1, 1, 1)        block = (num_threads, 1, 1)

    phase 1  validate (varlen only): thread t checks samples t, t + T, ... (len < 0, len > max_seqlen),
             thread 0 the first/last prefix values; CTA OR -> CU_* error bits.
    phase 2  chunks of T samples, thread = sample b:
               q_len, k_len = cu[b+1] - cu[b]          (0 for every sample when a prefix is bad)
               blocks = ceil(len / tile) per (view, axis), CTA exclusive scan + running carry
               sequence_desc[b] = (q_off, k_off, q_len, k_len, row_begin, row_count, inner_blocks, 0)
             one descriptor per (view, outer axis): forward "q"; backward "q" (classify, K2Q) and "k"
             (the backward view's own descriptor). Row ``B`` of each is all zeros: the dummy sample.
    phase 3  warp w fills row ownership of samples w, w + W, ... (lane = row), then every thread
             fills padding rows [n_rows, upper_rows) with the dummy sample B.
    thread 0 writes the allocation header: rows (slots 0, 3, 4), zero nnz slots, the error word.

Upper bounds instead of exact sizes (no host read before the header): the workspace is sized by
:class:`ViewBounds`, and padding rows point at the dummy sample (q_len = k_len = 0), so every
later pre-header stage sees them as empty rows and writes zeros for them. With a malformed prefix
the error bits are set and every sample is written empty, so no later stage can index outside
its workspace; the build raises at the header read.

Compile-time (``Constexpr``): ``num_threads``, ``has_backward``. Runtime: sizes, tiles, bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from maskplan_core.error_flags import (
    CU_K_END,
    CU_K_MAX,
    CU_K_ORDER,
    CU_K_START,
    CU_Q_END,
    CU_Q_MAX,
    CU_Q_ORDER,
    CU_Q_START,
)
from maskplan_core.geometry import PlanGeometry

from ._cute_args import row_major
from ._jit_cache import compile_stage
from ._primitives import SCAN_SCRATCH, WARP, block_exclusive_sum, block_reduce

# sequence_desc[B + 1, 8] columns (BlockGeometry.sequence_desc)
DESC_Q_OFFSET, DESC_K_OFFSET, DESC_Q_LEN, DESC_K_LEN = 0, 1, 2, 3
DESC_ROW_BEGIN, DESC_ROW_COUNT, DESC_INNER_BLOCKS = 4, 5, 6
DESC_COLS = 8

# allocation header slots (maskplan_core.schema.HEADER_FIELDS)
HDR_FWD_Q_ROWS, HDR_FWD_PARTIAL, HDR_FWD_FULL = 0, 1, 2
HDR_BWD_Q_ROWS, HDR_BWD_K_ROWS, HDR_BWD_PARTIAL, HDR_BWD_FULL = 3, 4, 5, 6
HDR_ERROR = 7
HEADER_LEN = 8


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ViewBounds:
    """Host-known upper bounds of one view geometry (no device read): workspace sizes.

    For fixed-length input they are exact. For varlen, ``q_rows`` bounds
    ``sum_b ceil(q_len_b / tile_m)`` by both ``B * ceil(max_seqlen_q / tile_m)`` and
    ``(total_q + B * (tile_m - 1)) // tile_m``; both hold for every well-formed prefix. A sample
    is no longer than the total either, so a generous ``max_seqlen_*`` (a model's context length
    for a short batch, as FlashAttention callers pass it) sizes nothing past the tokens there are:
    the per-sample block bounds take the smaller of the two as well.
    """

    tile_m: int
    tile_n: int
    batch: int
    q_rows: int
    k_rows: int
    max_q_blocks: int
    max_k_blocks: int

    @property
    def k_words(self) -> int:
        """uint32 words per Q-major bitset row (upper bound of ``BlockGeometry.k_words``)."""
        return max(1, _cdiv(self.max_k_blocks, 32))

    @classmethod
    def of(cls, g: PlanGeometry, tile_m: int, tile_n: int) -> ViewBounds:
        mq, mk = _cdiv(g.max_seqlen_q, tile_m), _cdiv(g.max_seqlen_k, tile_n)
        q_rows, k_rows = g.batch * mq, g.batch * mk
        if g.varlen:
            q_rows = min(q_rows, (g.total_q + g.batch * (tile_m - 1)) // tile_m)
            k_rows = min(k_rows, (g.total_k + g.batch * (tile_n - 1)) // tile_n)
            mq = min(mq, max(1, _cdiv(g.total_q, tile_m)))
            mk = min(mk, max(1, _cdiv(g.total_k, tile_n)))
        return cls(tile_m, tile_n, g.batch, q_rows, k_rows, mq, mk)


@dataclass(frozen=True)
class GeometryConfig:
    """Static configuration of the geometry kernel (every field is compile-time)."""

    has_backward: bool
    num_threads: int = 1024

    def __post_init__(self) -> None:
        if self.num_threads % WARP or not WARP <= self.num_threads <= 1024:
            raise ValueError(f"num_threads must be a multiple of 32 in [32, 1024], got {self.num_threads}")


class VarlenGeometry:
    """One CTA builds every view's row prefixes; see the module docstring."""

    def __init__(self, config: GeometryConfig):
        self.config = config
        self.has_backward = config.has_backward
        self.num_threads = config.num_threads
        self.num_warps = config.num_threads // WARP

    @cute.jit
    def __call__(
        self,
        cu_seqlens_q: cute.Pointer,  # int32 (B+1,)
        cu_seqlens_k: cute.Pointer,  # int32 (B+1,)
        header: cute.Pointer,  # int32 (8,), written (slots 0..7)
        desc_fwd: cute.Pointer,  # int32 (B+1, 8), written: forward "q" descriptor + dummy row
        row_batch_fwd: cute.Pointer,  # int32 (uq_fwd,), written
        desc_bwd_q: cute.Pointer,  # int32 (B+1, 8), written when has_backward
        row_batch_bwd_q: cute.Pointer,  # int32 (uq_bwd,)
        desc_bwd_k: cute.Pointer,  # int32 (B+1, 8): the backward view's "k" descriptor
        row_batch_bwd_k: cute.Pointer,  # int32 (uk_bwd,)
        batch: Int32,
        total_q: Int32,
        total_k: Int32,
        max_seqlen_q: Int32,
        max_seqlen_k: Int32,
        tile_m_fwd: Int32,
        tile_n_fwd: Int32,
        tile_m_bwd: Int32,
        tile_n_bwd: Int32,
        uq_fwd: Int32,
        uq_bwd: Int32,
        uk_bwd: Int32,
        validate: Int32,
        stream: cuda.CUstream,
    ):
        mCuQ = row_major(cu_seqlens_q, batch + 1)
        mCuK = row_major(cu_seqlens_k, batch + 1)
        mHeader = row_major(header, 8)
        mDescF = row_major(desc_fwd, batch + 1, DESC_COLS)
        mDescBQ = row_major(desc_bwd_q, batch + 1, DESC_COLS)
        mDescBK = row_major(desc_bwd_k, batch + 1, DESC_COLS)
        # (upper rows,)
        mRbF = row_major(row_batch_fwd, cutlass.max(uq_fwd, 1))
        mRbBQ = row_major(row_batch_bwd_q, cutlass.max(uq_bwd, 1))
        mRbBK = row_major(row_batch_bwd_k, cutlass.max(uk_bwd, 1))
        self.kernel(
            mCuQ,
            mCuK,
            mHeader,
            mDescF,
            mRbF,
            mDescBQ,
            mRbBQ,
            mDescBK,
            mRbBK,
            total_q,
            total_k,
            max_seqlen_q,
            max_seqlen_k,
            tile_m_fwd,
            tile_n_fwd,
            tile_m_bwd,
            tile_n_bwd,
            uq_fwd,
            uq_bwd,
            uk_bwd,
            validate,
        ).launch(grid=[1, 1, 1], block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        mHeader: cute.Tensor,
        mDescF: cute.Tensor,
        mRbF: cute.Tensor,
        mDescBQ: cute.Tensor,
        mRbBQ: cute.Tensor,
        mDescBK: cute.Tensor,
        mRbBK: cute.Tensor,
        total_q: Int32,
        total_k: Int32,
        max_q: Int32,
        max_k: Int32,
        tm_f: Int32,
        tn_f: Int32,
        tm_b: Int32,
        tn_b: Int32,
        uq_f: Int32,
        uq_b: Int32,
        uk_b: Int32,
        validate: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        batch = cute.size(mCuQ) - 1
        smem = cutlass.memory.SmemAllocator()
        sScratch = smem.allocate_tensor(Int32, cute.make_layout(SCAN_SCRATCH), byte_alignment=16)

        # ---- phase 1: prefix validation (spec 3.2) -----------------------------------------
        flags = Int32(0)
        if validate != 0:
            flags = self.prefix_flags(mCuQ, total_q, max_q, 0, tidx, batch) | self.prefix_flags(
                mCuK, total_k, max_k, 4, tidx, batch
            )
        flags = block_reduce(flags, sScratch, self.num_warps, "or")
        prefixes_ok = flags == 0

        # ---- phase 2: per-sample block counts, CTA scans, descriptors -----------------------
        carry_f = Int32(0)
        carry_bq = Int32(0)
        carry_bk = Int32(0)
        for c0 in cutlass.range(0, batch, self.num_threads, unroll=1):
            b = c0 + tidx
            q_off = Int32(0)
            k_off = Int32(0)
            q_len = Int32(0)
            k_len = Int32(0)
            if (b < batch) & prefixes_ok:
                q_off = mCuQ[b]
                k_off = mCuK[b]
                q_len = cutlass.min(cutlass.max(mCuQ[b + 1] - q_off, 0), max_q)
                k_len = cutlass.min(cutlass.max(mCuK[b + 1] - k_off, 0), max_k)
            qb_f = (q_len + tm_f - 1) // tm_f
            kb_f = (k_len + tn_f - 1) // tn_f
            ex_f, tot_f = block_exclusive_sum(qb_f, sScratch, self.num_warps)
            if b < batch:
                self.write_desc(mDescF, b, q_off, k_off, q_len, k_len, carry_f + ex_f, qb_f, kb_f)
            carry_f = carry_f + tot_f
            if const_expr(self.has_backward):
                qb_b = (q_len + tm_b - 1) // tm_b
                kb_b = (k_len + tn_b - 1) // tn_b
                ex_bq, tot_bq = block_exclusive_sum(qb_b, sScratch, self.num_warps)
                ex_bk, tot_bk = block_exclusive_sum(kb_b, sScratch, self.num_warps)
                if b < batch:
                    self.write_desc(mDescBQ, b, q_off, k_off, q_len, k_len, carry_bq + ex_bq, qb_b, kb_b)
                    self.write_desc(mDescBK, b, q_off, k_off, q_len, k_len, carry_bk + ex_bk, kb_b, qb_b)
                carry_bq = carry_bq + tot_bq
                carry_bk = carry_bk + tot_bk

        if tidx == 0:
            zero = Int32(0)
            self.write_desc(mDescF, batch, zero, zero, zero, zero, zero, zero, zero)
            if const_expr(self.has_backward):
                self.write_desc(mDescBQ, batch, zero, zero, zero, zero, zero, zero, zero)
                self.write_desc(mDescBK, batch, zero, zero, zero, zero, zero, zero, zero)
            mHeader[0] = carry_f
            mHeader[1] = zero
            mHeader[2] = zero
            if const_expr(self.has_backward):
                mHeader[3] = carry_bq
                mHeader[4] = carry_bk
            else:
                mHeader[3] = zero
                mHeader[4] = zero
            mHeader[5] = zero
            mHeader[6] = zero
            mHeader[7] = flags
        cute.arch.sync_threads()  # descriptors (global) visible to the whole CTA

        # ---- phase 3: row ownership -----------------------------------------------------------
        self.fill_row_batch(mDescF, mRbF, carry_f, uq_f, batch, tidx)
        if const_expr(self.has_backward):
            self.fill_row_batch(mDescBQ, mRbBQ, carry_bq, uq_b, batch, tidx)
            self.fill_row_batch(mDescBK, mRbBK, carry_bk, uk_b, batch, tidx)

    @cute.jit
    def prefix_flags(
        self,
        mCu: cute.Tensor,
        total: Int32,
        max_len: Int32,
        shift: cutlass.Constexpr[int],
        tidx: Int32,
        batch: Int32,
    ) -> Int32:
        """The four rules of ``maskplan_core.error_flags.prefix_error_flags`` for one prefix."""
        start_bit = CU_Q_START if const_expr(shift == 0) else CU_K_START
        end_bit = CU_Q_END if const_expr(shift == 0) else CU_K_END
        order_bit = CU_Q_ORDER if const_expr(shift == 0) else CU_K_ORDER
        max_bit = CU_Q_MAX if const_expr(shift == 0) else CU_K_MAX
        flags = Int32(0)
        if tidx == 0:
            if mCu[0] != 0:
                flags = flags | start_bit
            if mCu[batch] != total:
                flags = flags | end_bit
        for b in cutlass.range(tidx, batch, self.num_threads, unroll=1):
            n = mCu[b + 1] - mCu[b]
            if n < 0:
                flags = flags | order_bit
            if n > max_len:
                flags = flags | max_bit
        return flags

    @cute.jit
    def write_desc(
        self,
        mDesc: cute.Tensor,
        b: Int32,
        q_off: Int32,
        k_off: Int32,
        q_len: Int32,
        k_len: Int32,
        row_begin: Int32,
        row_count: Int32,
        inner: Int32,
    ):
        mDesc[b, DESC_Q_OFFSET] = q_off
        mDesc[b, DESC_K_OFFSET] = k_off
        mDesc[b, DESC_Q_LEN] = q_len
        mDesc[b, DESC_K_LEN] = k_len
        mDesc[b, DESC_ROW_BEGIN] = row_begin
        mDesc[b, DESC_ROW_COUNT] = row_count
        mDesc[b, DESC_INNER_BLOCKS] = inner
        mDesc[b, 7] = Int32(0)

    @cute.jit
    def fill_row_batch(
        self, mDesc: cute.Tensor, mRb: cute.Tensor, n_rows: Int32, upper: Int32, batch: Int32, tidx: Int32
    ):
        """Warp per sample (lane = row), then the padding rows -> dummy sample ``batch``."""
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        for b in cutlass.range(warp, batch, self.num_warps, unroll=1):
            begin = mDesc[b, DESC_ROW_BEGIN]
            count = mDesc[b, DESC_ROW_COUNT]
            for i in cutlass.range(lane, count, WARP, unroll=1):
                if begin + i < upper:
                    mRb[begin + i] = b
        for r in cutlass.range(n_rows + tidx, upper, self.num_threads, unroll=1):
            mRb[r] = batch


# ------------------------------------------------------------------------------------------------
# host side


def compile_geometry(config: GeometryConfig, *, options: str | None = None):
    """Compile (cached) the geometry kernel for ``config`` (:func:`._jit_cache.compile_stage`)."""
    return compile_stage("geometry", VarlenGeometry, config, pointers=9, ints=13, options=options)
