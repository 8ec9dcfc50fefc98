"""Q2K materialisation (spec 4.6) in CuTe DSL: exact-size partial/full CSRs and packed payloads.

The oracle is :func:`maskplan_core.reference.csr.materialize_q2k`. For mask head ``h`` and compact
Q plan row ``r`` (in ``(h, r)`` order, the CSR order):

    mask_block_idx [off_p[h, r] + i] = i-th partial K block of the row (ascending)
    full_block_idx [off_f[h, r] + i] = i-th full K block of the row (ascending)
    mask_block_masks[off_p[h, r] + i] = payload of that tile through the consumer's layout

and, for varlen plans whose row bound exceeded the exact row count, the compact copies of the
counts and offsets (``write_compact``; fixed-length plans keep the scan's tensors as they are).

Work decomposition (persistent CTAs over the ``Hmask * rows * ROW_PARTS``
work items, item = (h, r, part); the parts of a row split its packing passes, part 0 alone writes
its indices and counts)::

    grid = (num_ctas, 1, 1)        block = (32 * num_warps, 1, 1)

    once per CTA   every lane loads its payload-table entries into registers (TilePacker.load_table)
    per item       all threads: sample, counts, offsets; endpoints of the tile's rows -> shared
                   per chunk of 32 bitset words (1024 K blocks):
                     warp 0, lane = word: popcounts, warp exclusive scans -> ranks; writes the
                       full and partial indices (lowest bit first) and the partial blocks to a
                       shared list
                     all warps, per pass of up to `slots` listed partial blocks (TilePacker):
                       build their tile bitmaps, pack, store

Compile-time (``Constexpr``): ``MaterializeConfig`` (tile, nfunc, words_per_tile, num_warps).
Runtime: sizes, bounds, nnz, ``write_compact``; the layout table is a pointer.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ._cute_args import row_major
from ._jit_cache import compile_stage
from ._primitives import WARP, lowest_bit_index, warp_broadcast, warp_inclusive_sum
from ._tile_packer import ROW_PARTS, MaterializeConfig, TilePacker, index_vector
from .geometry import DESC_COLS, DESC_K_LEN, DESC_Q_LEN, DESC_Q_OFFSET, DESC_ROW_BEGIN

LIST_CAPACITY = WARP * WARP  # partial blocks of one chunk of 32 words


class Q2KMaterialize:
    """Persistent CTAs, one (mask head, Q plan row) at a time; see the module docstring."""

    def __init__(self, config: MaterializeConfig):
        self.config = config
        self.packer = TilePacker(config, "k")
        self.tile_m = config.tile_m
        self.num_threads = config.num_threads
        self.words_per_tile = config.words_per_tile

    @cute.jit
    def __call__(
        self,
        mask_func: cute.Pointer,  # int32 (Hmask, nfunc, total_q)
        row_batch: cute.Pointer,  # int32 (uq,)
        sequence_desc: cute.Pointer,  # int32 (B+1, 8): forward "q" descriptor
        visible_bits: cute.Pointer,  # int32 (Hmask, uq, k_words)
        full_bits: cute.Pointer,  # int32 (Hmask, uq, k_words)
        counts_ws: cute.Pointer,  # int32 (4, Hmask, uq): partial cnt, full cnt, partial off, full off
        counts_out: cute.Pointer,  # int32 (4, Hmask, n_rows): compact copy, written if write_compact
        partial_idx: cute.Pointer,  # int32 (nnz_p,), written
        full_idx: cute.Pointer,  # int32 (nnz_f,), written
        masks: cute.Pointer,  # int32 (nnz_p, words_per_tile), written
        table: cute.Pointer,  # int32 (words_per_tile * 32,): payload_source_table(layout)
        hmask: Int32,
        total_q: Int32,
        uq: Int32,
        k_words: Int32,
        n_rows: Int32,
        batch_plus_one: Int32,
        nnz_p: Int32,
        nnz_f: Int32,
        write_compact: Int32,
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        v = self.packer.host_views(
            mask_func, visible_bits, full_bits, counts_ws, counts_out, masks, table,
            hmask=hmask, total_q=total_q, uq=uq, k_words=k_words, ws_rows=uq, out_rows=n_rows, nnz_p=nnz_p,
        )  # fmt: skip
        mDesc = row_major(sequence_desc, batch_plus_one, DESC_COLS)
        self.kernel(
            v.mask, row_major(row_batch, uq), mDesc, v.visible, v.full, v.counts_ws, v.counts_out,
            index_vector(partial_idx, nnz_p), index_vector(full_idx, nnz_f), v.masks, v.table,
            n_rows, write_compact,
        ).launch(grid=[num_ctas, 1, 1], block=[self.num_threads, 1, 1], stream=stream)  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mMask: cute.Tensor,
        mRowBatch: cute.Tensor,
        mDesc: cute.Tensor,
        mVisible: cute.Tensor,
        mFull: cute.Tensor,
        mCountsWs: cute.Tensor,
        mCountsOut: cute.Tensor,
        mPartialIdx: cute.Tensor,
        mFullIdx: cute.Tensor,
        mMasks: cute.Tensor,
        mTable: cute.Tensor,
        n_rows: Int32,
        write_compact: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()

        smem = cutlass.memory.SmemAllocator()
        sEnd, sBitmap, sStage = self.packer.allocate(smem)
        sList = smem.allocate_tensor(Int32, cute.make_layout(LIST_CAPACITY), byte_alignment=16)
        sMeta = smem.allocate_tensor(Int32, cute.make_layout(WARP), byte_alignment=16)

        self.packer.init(sBitmap, tidx)
        regs = self.packer.load_table(mTable, warp, lane)
        hmask = mVisible.shape[0]
        k_words = mVisible.shape[2]

        for item in cutlass.range(bidx, hmask * n_rows * ROW_PARTS, num_ctas, unroll=1):
            # part: packs passes part, part + ROW_PARTS, ...; part 0 writes the rest
            head, row, part = self.packer.row_item(item, n_rows)
            batch = mRowBatch[row]
            q_offset = mDesc[batch, DESC_Q_OFFSET]
            q_len = mDesc[batch, DESC_Q_LEN]
            k_len = mDesc[batch, DESC_K_LEN]
            first_local = (row - mDesc[batch, DESC_ROW_BEGIN]) * self.tile_m
            cnt_p, cnt_f, off_p, off_f = self.packer.row_counts(
                mCountsWs, mCountsOut, head, row, part, write_compact, tidx
            )
            if cnt_p > 0:
                self.packer.load_rows(mMask, sEnd, head, q_offset, q_len, first_local, tidx)
            if cnt_p + cnt_f > 0:
                carry_p = Int32(0)
                carry_f = Int32(0)
                for c0 in cutlass.range(0, k_words, WARP, unroll=1):
                    if warp == 0:
                        self.enumerate_chunk(
                            mVisible,
                            mFull,
                            mPartialIdx,
                            mFullIdx,
                            sList,
                            sMeta,
                            head,
                            row,
                            c0,
                            k_words,
                            off_p + carry_p,
                            off_f + carry_f,
                            part == 0,
                            lane,
                        )
                    cute.arch.sync_threads()  # sList, sMeta (and the row endpoints) visible
                    n_list = sMeta[0]
                    n_full = sMeta[1]
                    slots = self.packer.slots
                    for e0 in cutlass.range(part * slots, n_list, ROW_PARTS * slots, unroll=1):
                        n = cutlass.min(n_list - e0, slots)
                        self.packer.build_bitmap(sEnd, sBitmap, sList, e0, n, 0, k_len, tidx)
                        cute.arch.sync_threads()
                        entry0 = off_p + carry_p + e0
                        self.packer.pack(sBitmap, sStage, regs, mMasks, entry0, n, warp, lane)
                        cute.arch.sync_threads()  # the next pass rewrites the bitmaps
                    carry_p = carry_p + n_list
                    carry_f = carry_f + n_full
                    cute.arch.sync_threads()  # sList / sMeta / sEnd are free again

    @cute.jit
    def enumerate_chunk(
        self,
        mVisible: cute.Tensor,
        mFull: cute.Tensor,
        mPartialIdx: cute.Tensor,
        mFullIdx: cute.Tensor,
        sList: cute.Tensor,
        sMeta: cute.Tensor,
        head: Int32,
        row: Int32,
        c0: Int32,
        k_words: Int32,
        pos_p0: Int32,
        pos_f0: Int32,
        write_indices,
        lane: Int32,
    ):
        """Warp 0: indices of the chunk's 32 words (lane = word) in ascending K order.

        Writes ``sMeta[0]`` = partial blocks in the chunk (listed in ``sList``), ``sMeta[1]`` = full;
        the global indices only where ``write_indices`` (the row's part 0).
        """
        w = c0 + lane
        vis = Int32(0)
        full = Int32(0)
        if w < k_words:
            vis = mVisible[head, row, w]
            full = mFull[head, row, w]
        part = vis & ~full
        n_p = cute.arch.popc(part)
        n_f = cute.arch.popc(full)
        incl_p = warp_inclusive_sum(n_p, lane)
        incl_f = warp_inclusive_sum(n_f, lane)
        slot = incl_p - n_p  # chunk-local rank of this word's first partial block
        pos_f = pos_f0 + incl_f - n_f
        x = full
        if write_indices:
            while x != 0:
                mFullIdx[pos_f] = w * WARP + lowest_bit_index(x)
                pos_f = pos_f + 1
                x = x & (x - 1)
        x = part
        while x != 0:
            block = w * WARP + lowest_bit_index(x)
            if write_indices:
                mPartialIdx[pos_p0 + slot] = block
            sList[slot] = block
            slot = slot + 1
            x = x & (x - 1)
        total_p = warp_broadcast(incl_p, WARP - 1)
        total_f = warp_broadcast(incl_f, WARP - 1)
        if lane == 0:
            sMeta[0] = total_p
            sMeta[1] = total_f


def compile_q2k_materialize(config: MaterializeConfig, *, options: str | None = None):
    """Compile (cached) the Q2K materialiser for ``config`` (:func:`._jit_cache.compile_stage`)."""
    return compile_stage("q2k_materialize", Q2KMaterialize, config, pointers=11, ints=10, options=options)
