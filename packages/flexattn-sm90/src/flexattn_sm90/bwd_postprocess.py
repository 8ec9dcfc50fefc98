"""SM90 backward postprocess: the fp32 dQ accumulator -> dQ in the input dtype, times the softmax scale.

One CTA of 256 threads per (sample-local Q block ``m``, q head ``hq``, sample ``b``). Thread ``t``
plays MMA thread ``t`` of the main kernel's dQ ``TiledMma`` (:func:`bwd_helpers.make_dq_tiled_mma`,
the same builder): it reads its accumulator fragment from the fragment-ordered chunk of warpgroup
``t // 128`` (:func:`bwd_helpers.dq_chunk_layout`), scales and converts it, and stages it into a
padded SMEM tile by ``stmatrix``; the CTA then stores the rows of the block that lie inside the
sample (``< q_len``) in 16-byte row pieces, so each warp store writes whole lines (the C fragment
itself holds 4-byte row pieces). Rows of padding never leave the workspace.

``zero_unvisited`` (where the main kernel stores each block's first contribution and nothing
zeroes the accumulator: deterministic mode, and atomic mode on sparse K2Q rows): a block whose
turnstile count is 0 had no contribution, and its dQ is written as 0 without reading the
accumulator.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from maskplan_kernels.consumer_entry import DqPostprocessHostEntry
from maskplan_kernels.consumer_plan import CUTE_DTYPES, SequenceDesc, element_ptr, sample_q

from .bwd_helpers import (
    dq_chunk_layout,
    dq_warpgroup_tile,
    make_dq_tiled_mma,
    stage_result,
    store_result_rows,
)


class Sm90BwdPostprocess(DqPostprocessHostEntry):
    """Static configuration: head dim, dtype, block rows, MMA warpgroups of the main kernel, and
    whether unvisited blocks are told by their turnstile count (module docstring)."""

    def __init__(
        self, head_dim: int, dtype: str, *, tile_m: int = 64, num_warpgroups: int = 2,
        zero_unvisited: bool = False, io_head_dim: int | None = None,
    ):  # fmt: skip
        self.dtype = CUTE_DTYPES[dtype]
        self.zero_unvisited = zero_unvisited
        self.head_dim, self.tile_m = head_dim, tile_m
        self._io_head_dim = io_head_dim or head_dim
        self.num_wg = num_warpgroups
        self.num_threads = 128 * num_warpgroups
        rows, cols = dq_warpgroup_tile(tile_m, head_dim, num_warpgroups)
        self.dq_chunk = rows * cols  # one warpgroup's chunk, as the main kernel writes it
        self.dq_elements = self.dq_chunk // 128

    def io_head_dim(self) -> int:
        """dQ's head dim: the accumulator's, or narrower (its columns past dQ's are not stored)."""
        return self._io_head_dim

    def kernel_operands(self) -> tuple:
        return (make_dq_tiled_mma(self.dtype, self.head_dim, self.tile_m, self.num_wg),)

    @cute.kernel
    def kernel(
        self,
        mdQaccum: cute.Tensor,
        mdQsem: cute.Tensor | None,
        mdQ: cute.Tensor,
        sequence_desc: SequenceDesc,
        q_block_begin: cute.Tensor,
        mma_dq: cute.TiledMma,
        softmax_scale: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, q_head, b = cute.arch.block_idx()
        sample = sample_q(sequence_desc, b)
        if m_block < sample.blocks:  # Q blocks of the sample
            d, tm = self.head_dim, self.tile_m
            q_offset, q_len = sample.offset, sample.length
            blk = q_block_begin[b] + m_block
            wg, t = tidx // 128, tidx % 128
            thr = mma_dq.get_slice(tidx)
            acc = cute.make_rmem_tensor(thr.partition_shape_C((tm, d)), Float32)
            # (tile_m * D,) of this block -> this thread's slot of its warpgroup's chunk: (4, elements / 4)
            first = q_head * mdQaccum.shape[1] + blk * tm * d + wg * self.dq_chunk
            src = cute.make_tensor(element_ptr(mdQaccum, first), dq_chunk_layout(self.dq_elements))[t, None]
            visited = Int32(1)
            if const_expr(self.zero_unvisited):
                acc.fill(0.0)
                visited = mdQsem[q_head, blk]
            if visited != 0:
                cute.autovec_copy(src, cute.make_tensor(acc.iterator, src.layout.shape))
            # rows 2 D + 16 bytes apart: for D a multiple of 16 any 8 consecutive rows start at distinct
            # 16-byte bank offsets (an stmatrix 8x8 matrix has no bank conflict; no swizzle atom fits
            # D = 80 or 96), and every row stays 16-byte aligned for store_rows
            pitch = d + 8
            sdQ = cutlass.memory.SmemAllocator().allocate_tensor(
                self.dtype, cute.make_layout((tm, d), stride=(pitch, 1)), 16
            )
            stage_result(mma_dq, acc, sdQ, tidx, softmax_scale)
            cute.arch.sync_threads()
            # the block's rows inside the sample; at most the tile (store_rows' last pass may run past it)
            valid = cutlass.min(q_len - m_block * tm, tm)
            store_result_rows(sdQ, mdQ, q_offset + m_block * tm, q_head, tidx, self.num_threads, valid)
