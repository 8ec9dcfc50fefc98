"""SM100 backward postprocess: the fp32 dQ accumulator -> dQ in the input dtype, times the softmax scale.

The accumulator is in the SM100 main kernel's own order (:mod:`flexattn_sm100.bwd_helpers`: per Q
block, dQ warp ``w`` and column chunk ``c`` form one 4 KB run, lane-interleaved 16-byte vectors), not
the SM90 WGMMA fragment order, so this kernel is SM100's own; the preprocess (LSE2, D, zeroed
accumulator and turnstiles) is layout-independent. Never run on SM100 hardware.

One CTA of 128 threads per (sample-local Q block ``m``, q head ``hq``, sample ``b``); thread ``t``
plays dQ thread ``t`` of the main kernel: it reads row ``t`` of the block back with the same map
and stores it when ``m * tile_m + t < q_len``. Rows of padding never leave the workspace.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from maskplan_kernels.consumer_plan import (
    DqPostprocessHostEntry,
    SequenceDesc,
    element_ptr,
    sample_q,
)

from .bwd_helpers import DQ_CHUNK, WARP_ROWS, dq_run_layout

_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


class Sm100BwdPostprocess(DqPostprocessHostEntry):
    """Static configuration: head dim, dtype, block rows (= dQ threads of the main kernel)."""

    def __init__(self, head_dim: int, dtype: str, *, tile_m: int = 128):
        if tile_m != 4 * WARP_ROWS or head_dim % DQ_CHUNK:
            raise ValueError(
                f"tile_m={tile_m}, head_dim={head_dim}: the dQ order takes 128 rows, 32-column chunks"
            )
        self.dtype = _DTYPES[dtype]
        self.head_dim, self.tile_m = head_dim, tile_m
        self.num_threads = tile_m

    def kernel_operands(self) -> tuple:
        return ()

    @cute.kernel
    def kernel(
        self,
        mdQaccum: cute.Tensor,
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
            store = m_block * tm + t < q_len
            heads = mdQ.shape[1]
            row = cute.make_tensor(
                element_ptr(mdQ, ((q_offset + m_block * tm + t) * heads + q_head) * d), cute.make_layout(d)
            )
            for c in cutlass.range_constexpr(d // DQ_CHUNK):
                run = element_ptr(mdQaccum, block + (c * 4 + w) * WARP_ROWS * DQ_CHUNK)
                src = cute.make_tensor(run, dq_run_layout())[lane, None]
                cute.autovec_copy(src, cute.make_tensor(regs.iterator, src.layout.shape))
                out.store((regs.load() * softmax_scale).to(self.dtype))
                if store:
                    cute.autovec_copy(out, cute.local_tile(row, (DQ_CHUNK,), (c,)))
