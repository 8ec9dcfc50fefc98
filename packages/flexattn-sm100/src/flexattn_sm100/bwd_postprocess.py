"""SM100 backward postprocess: the fp32 dQ accumulator -> dQ in the input dtype, times the softmax scale.

The accumulator is in the SM100 main kernel's own order (:mod:`flexattn_sm100.bwd_helpers`: per Q
block, the stored ``rows x cols`` matrix in 4 KB runs of 32 rows x ``DQ_CHUNK`` columns,
lane-interleaved 16-byte vectors), not the SM90 WGMMA fragment order, so this kernel is SM100's own;
the preprocess (LSE2, D, zeroed accumulator and turnstiles) is layout-independent. Never run on SM100
hardware.

One CTA per (sample-local Q block ``m``, q head ``hq``, sample ``b``); thread ``t`` plays dQ thread
``t`` of the main kernel and reads accumulator row ``t`` back with the same map:

* 128-row Q blocks (k2q-1cta): the matrix is dQ (128 x Dqk), 128 threads; thread ``t`` stores dQ row
  ``t`` (16-byte vectors) when ``m * tile_m + t < q_len``;
* 64-row Q blocks (d256): the matrix is dQ^T (Dqk x 64), Dqk threads; thread ``t`` stores dQ column
  ``t`` of the rows ``< q_len`` (a warp's 32 columns are one 64-byte segment of a dQ row).

Rows of padding never leave the workspace.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from maskplan_kernels.consumer_entry import DqPostprocessHostEntry
from maskplan_kernels.consumer_plan import CUTE_DTYPES, SequenceDesc, element_ptr, sample_q

from .bwd_helpers import DQ_CHUNK, WARP_ROWS, dq_run_layout
from .payload_layout import TMEM_LANES


class Sm100BwdPostprocess(DqPostprocessHostEntry):
    """Static configuration: head dim, dtype, block rows (128: dQ order; 64: dQ^T order)."""

    #: this consumer's deterministic main kernel adds every contribution to a zeroed accumulator
    zero_unvisited = False

    def __init__(self, head_dim: int, dtype: str, *, tile_m: int = TMEM_LANES):
        self.transposed = tile_m < TMEM_LANES
        self.rows, self.cols = (head_dim, tile_m) if self.transposed else (tile_m, head_dim)
        if tile_m not in (64, TMEM_LANES) or self.rows % WARP_ROWS or self.cols % DQ_CHUNK:
            raise ValueError(
                f"tile_m={tile_m}, head_dim={head_dim}: the dQ order takes 64- or 128-row Q blocks, "
                "32-row runs of 32-column chunks"
            )
        self.dtype = CUTE_DTYPES[dtype]
        self.head_dim, self.tile_m = head_dim, tile_m
        self.num_threads = self.rows

    def kernel_operands(self) -> tuple:
        return ()

    @cute.kernel
    def kernel(
        self,
        mdQaccum: cute.Tensor,
        mdQsem: cute.Tensor | None,  # None: zero_unvisited is False, the accumulator was zeroed
        mdQ: cute.Tensor,
        sequence_desc: SequenceDesc,
        q_block_begin: cute.Tensor,
        softmax_scale: Float32,
    ):
        t, _, _ = cute.arch.thread_idx()
        m_block, q_head, b = cute.arch.block_idx()
        sample = sample_q(sequence_desc, b)
        if m_block < sample.blocks:  # Q blocks of the sample
            d, tm = self.head_dim, self.tile_m
            q_offset, q_len = sample.offset, sample.length
            w, lane = t // WARP_ROWS, t % WARP_ROWS
            block = q_head * mdQaccum.shape[1] + (q_block_begin[b] + m_block) * tm * d
            regs = cute.make_rmem_tensor(DQ_CHUNK, Float32)
            out = cute.make_rmem_tensor(DQ_CHUNK, self.dtype)
            heads = mdQ.shape[1]
            first = ((q_offset + m_block * tm) * heads + q_head) * d  # dQ[row 0 of the block, 0]
            if const_expr(self.transposed):  # thread t's dQ column: (tile_m,) Q rows
                dst = cute.make_tensor(
                    element_ptr(mdQ, first + t, align=2), cute.make_layout(tm, stride=heads * d)
                )
            else:  # thread t's dQ row: (Dqk,) columns
                dst = cute.make_tensor(element_ptr(mdQ, first + t * heads * d), cute.make_layout(d))
            for c in cutlass.range_constexpr(self.cols // DQ_CHUNK):
                run = element_ptr(mdQaccum, block + (c * (self.rows // WARP_ROWS) + w) * WARP_ROWS * DQ_CHUNK)
                src = cute.make_tensor(run, dq_run_layout())[lane, None]
                cute.autovec_copy(src, cute.make_tensor(regs.iterator, src.layout.shape))
                out.store((regs.load() * softmax_scale).to(self.dtype))
                if const_expr(self.transposed):
                    for e in cutlass.range_constexpr(DQ_CHUNK):
                        if m_block * tm + c * DQ_CHUNK + e < q_len:
                            dst[c * DQ_CHUNK + e] = out[e]
                else:
                    if m_block * tm + t < q_len:
                        cute.autovec_copy(out, cute.local_tile(dst, (DQ_CHUNK,), (c,)))
