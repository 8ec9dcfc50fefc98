"""K2Q materialisation (spec 4.7) in CuTe DSL: the write half of the sparse transpose, the backward
payloads and ``dq_write_order`` / ``dq_write_order_full``.

The oracle is :func:`maskplan_core.reference.transpose.materialize_k2q`. For mask head ``h`` and
compact K plan row ``kr`` (sample ``b``, K block ``j``), over the Q plan rows ``r`` of sample ``b``
in ascending order (Q block ``m = r - row_begin[b]``):

    partial (bit j of visible & ~full):  mask_block_idx[off_p + i] = m,  payload of tile (m, j),
                                         dq_write_order[off_p + i] = rank of j in row r
    full    (bit j of full):             full_block_idx[off_f + i] = m,
                                         dq_write_order_full[off_f + i] = rank of j in row r

where ``rank of j in row r`` = number of visible K blocks of Q row ``r`` below ``j`` (popcount of
the row's visible words before word ``j // 32`` plus the masked word itself).

Work decomposition (persistent CTAs over the ``Hmask * k_rows * ROW_PARTS``
work items, item = (h, kr, part); the parts of a row split its packing passes, part 0 alone writes
its indices, dq ranks and counts)::

    grid = (num_ctas, 1, 1)        block = (32 * num_warps, 1, 1)

    once per CTA   payload-table registers (TilePacker.load_table)
    per item       per chunk of num_threads Q rows (thread = Q row, ascending):
                     bit j of the row's visible/full word -> partial/full flag
                     ONE CTA exclusive scan of (partial | full << 16) -> both ranks at once
                     write idx + dq rank, list partial Q blocks in shared memory
                     per pass of up to `slots` listed Q blocks (TilePacker): endpoints of their
                     rows (fetched to registers while the previous pass packs) -> bitmaps of
                     block j -> pack, store

Compile-time (``Constexpr``): ``MaterializeConfig``. Runtime: sizes, bounds, nnz, ``write_compact``.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ._cute_args import row_major
from ._jit_cache import compile_stage
from ._primitives import SCAN_SCRATCH, WARP, block_exclusive_sum
from ._tile_packer import ROW_PARTS, MaterializeConfig, TilePacker, index_vector
from .geometry import DESC_COLS, DESC_K_LEN, DESC_Q_LEN, DESC_Q_OFFSET, DESC_ROW_BEGIN, DESC_ROW_COUNT

_HALF = 16  # the packed scan keeps the partial rank in bits 0..15 and the full rank in 16..31


class K2QMaterialize:
    """Persistent CTAs, one (mask head, K plan row) at a time; see the module docstring."""

    def __init__(self, config: MaterializeConfig):
        if config.num_threads >= 1 << _HALF:
            raise ValueError("the packed rank scan needs fewer than 65536 threads")
        self.config = config
        self.packer = TilePacker(config, "q")
        self.tile_m = config.tile_m
        self.num_threads = config.num_threads
        self.num_warps = config.num_warps
        self.words_per_tile = config.words_per_tile

    @cute.jit
    def __call__(
        self,
        mask_func: cute.Pointer,  # int32 (Hmask, nfunc, total_q)
        row_batch_k: cute.Pointer,  # int32 (uk,): sample of each compact K row
        desc_q: cute.Pointer,  # int32 (B+1, 8): backward "q" descriptor (Q rows of each sample)
        desc_k: cute.Pointer,  # int32 (B+1, 8): backward "k" descriptor (K row begin)
        visible_bits: cute.Pointer,  # int32 (Hmask, uq, k_words): backward Q2K bitsets
        full_bits: cute.Pointer,  # int32 (Hmask, uq, k_words)
        counts_ws: cute.Pointer,  # int32 (4, Hmask, uk): partial cnt, full cnt, partial off, full off
        counts_out: cute.Pointer,  # int32 (4, Hmask, n_k_rows): compact copy if write_compact
        partial_idx: cute.Pointer,  # int32 (nnz_p,), written
        full_idx: cute.Pointer,  # int32 (nnz_f,), written
        dq_order: cute.Pointer,  # int32 (nnz_p,), written
        dq_order_full: cute.Pointer,  # int32 (nnz_f,), written
        masks: cute.Pointer,  # int32 (nnz_p, words_per_tile), written
        table: cute.Pointer,  # int32 (words_per_tile * 32,)
        hmask: Int32,
        total_q: Int32,
        uq: Int32,
        uk: Int32,
        k_words: Int32,
        n_k_rows: Int32,
        batch_plus_one: Int32,
        nnz_p: Int32,
        nnz_f: Int32,
        write_compact: Int32,
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        v = self.packer.host_views(
            mask_func, visible_bits, full_bits, counts_ws, counts_out, masks, table,
            hmask=hmask, total_q=total_q, uq=uq, k_words=k_words, ws_rows=uk, out_rows=n_k_rows, nnz_p=nnz_p,
        )  # fmt: skip
        self.kernel(
            v.mask, row_major(row_batch_k, uk),
            row_major(desc_q, batch_plus_one, DESC_COLS), row_major(desc_k, batch_plus_one, DESC_COLS),
            v.visible, v.full, v.counts_ws, v.counts_out,
            index_vector(partial_idx, nnz_p), index_vector(full_idx, nnz_f),
            index_vector(dq_order, nnz_p), index_vector(dq_order_full, nnz_f), v.masks, v.table,
            n_k_rows, write_compact,
        ).launch(grid=[num_ctas, 1, 1], block=[self.num_threads, 1, 1], stream=stream)  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mMask: cute.Tensor,
        mRowBatchK: cute.Tensor,
        mDescQ: cute.Tensor,
        mDescK: cute.Tensor,
        mVisible: cute.Tensor,
        mFull: cute.Tensor,
        mCountsWs: cute.Tensor,
        mCountsOut: cute.Tensor,
        mPartialIdx: cute.Tensor,
        mFullIdx: cute.Tensor,
        mDqOrder: cute.Tensor,
        mDqOrderFull: cute.Tensor,
        mMasks: cute.Tensor,
        mTable: cute.Tensor,
        n_k_rows: Int32,
        write_compact: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()

        smem = cutlass.memory.SmemAllocator()
        sEnd, sBitmap, sStage = self.packer.allocate(smem)
        sList = smem.allocate_tensor(Int32, cute.make_layout(self.num_threads), byte_alignment=16)
        sScratch = smem.allocate_tensor(Int32, cute.make_layout(SCAN_SCRATCH), byte_alignment=16)

        self.packer.init(sBitmap, tidx)
        regs = self.packer.load_table(mTable, warp, lane)
        rEnd = cute.make_rmem_tensor((self.packer.nfunc,), Int32)  # this thread's row of the next pass
        hmask = mVisible.shape[0]

        for item in cutlass.range(bidx, hmask * n_k_rows * ROW_PARTS, num_ctas, unroll=1):
            # part: packs passes part, part + ROW_PARTS, ...; part 0 writes the rest
            head, k_row, part = self.packer.row_item(item, n_k_rows)
            batch = mRowBatchK[k_row]
            j = k_row - mDescK[batch, DESC_ROW_BEGIN]  # sample-local K block
            q_begin = mDescQ[batch, DESC_ROW_BEGIN]
            q_count = mDescQ[batch, DESC_ROW_COUNT]
            q_offset = mDescQ[batch, DESC_Q_OFFSET]
            q_len = mDescQ[batch, DESC_Q_LEN]
            k_len = mDescQ[batch, DESC_K_LEN]
            cnt_p, cnt_f, off_p, off_f = self.packer.row_counts(
                mCountsWs, mCountsOut, head, k_row, part, write_compact, tidx
            )
            if cnt_p + cnt_f > 0:
                word = j // WARP
                shift = j - word * WARP
                below = ~(Int32(-1) << shift)  # bits of K blocks j' < j inside word j // 32
                carry_p = Int32(0)
                carry_f = Int32(0)
                for c0 in cutlass.range(0, q_count, self.num_threads, unroll=1):
                    m = c0 + tidx  # sample-local Q block of this thread
                    r = q_begin + m
                    vis = Int32(0)
                    full = Int32(0)
                    if m < q_count:
                        vis = mVisible[head, r, word]
                        full = mFull[head, r, word]
                    is_vis = (vis >> shift) & 1
                    is_full = (full >> shift) & 1
                    is_part = is_vis & (is_full ^ 1)
                    ex, tot = block_exclusive_sum(is_part | (is_full << _HALF), sScratch, self.num_warps)
                    rank_p = ex & 0xFFFF
                    rank_f = ex >> _HALF
                    n_list = tot & 0xFFFF
                    if is_part != 0:
                        sList[rank_p] = m
                    if (is_vis != 0) & (part == 0):
                        dq_rank = cute.arch.popc(vis & below)
                        for w in cutlass.range(0, word, 1, unroll=1):
                            dq_rank = dq_rank + cute.arch.popc(mVisible[head, r, w])
                        if is_part != 0:
                            pos = off_p + carry_p + rank_p
                            mPartialIdx[pos] = m
                            mDqOrder[pos] = dq_rank
                        else:
                            pos = off_f + carry_f + rank_f
                            mFullIdx[pos] = m
                            mDqOrderFull[pos] = dq_rank
                    cute.arch.sync_threads()  # sList visible
                    # passes of `slots` tiles; the next pass's rows and bitmaps are written only
                    # after a barrier every thread passes once done with this pass's reads
                    slots = self.packer.slots
                    stride = ROW_PARTS * slots
                    fetch = (mMask, rEnd, head, q_offset, q_len, sList)
                    self.packer.fetch_rows(*fetch, part * slots, n_list, tidx)
                    for e0 in cutlass.range(part * slots, n_list, stride, unroll=1):
                        n = cutlass.min(n_list - e0, slots)
                        self.packer.store_rows(sEnd, rEnd, tidx)
                        cute.arch.sync_threads()
                        self.packer.build_bitmap(sEnd, sBitmap, sList, e0, n, j, k_len, tidx)
                        cute.arch.sync_threads()
                        # the next pass's rows load while this one packs
                        self.packer.fetch_rows(*fetch, e0 + stride, n_list, tidx)
                        entry0 = off_p + carry_p + e0
                        self.packer.pack(sBitmap, sStage, regs, mMasks, entry0, n, warp, lane)
                    carry_p = carry_p + n_list
                    carry_f = carry_f + (tot >> _HALF)


def compile_k2q_materialize(config: MaterializeConfig, *, options: str | None = None):
    """Compile (cached) the K2Q materialiser for ``config`` (:func:`._jit_cache.compile_stage`)."""
    return compile_stage("k2q_materialize", K2QMaterialize, config, pointers=14, ints=11, options=options)
