"""Backward preprocess: per-row statistics and zeroed dQ workspace, per (q head, Q block).

Architecture-neutral SIMT kernel (plain loads, stores and shuffles): the SM90 and SM100 backward
launchers both run it before their main kernel, at their backward tile's ``tile_m`` (64 or 128
on SM90, 128 on SM100). The workspace it writes is the main kernels' contract; only the dQ accumulator's
order inside a block is the consumer's own, and this kernel zeroes the block as one run.

One CTA of 256 threads per (sample-local Q block ``m``, q head ``hq``, sample ``b``) of the
backward geometry (``tile_m`` rows); blocks past a sample's ``ceil(q_len / tile_m)`` exit. With
``blk = q_block_begin[b] + m`` (the global, padded Q block) and ``i < tile_m``, row ``q = m*tile_m+i``::

    D[hq, blk*tile_m + i]    = sum_d dO[q, hq, d] * O[q, hq, d]  - dlse[hq, q]     (0 where lse = -inf
                                                                       or past q_len)
    LSE2[hq, blk*tile_m + i] = lse[hq, q] * log2(e),  +inf where lse = -inf or past q_len
    dQaccum[hq, blk]         = 0      (tile_m x D fp32, the main kernel bulk-adds into it; not with
                                       zero_dq_accum=False, where the main kernel stores the first
                                       contribution: BackwardCompiler.stores_first_dq)
    dQsemaphore[hq, blk]     = 0      (the Q block's turnstile, where the main kernel keeps one)
    dQsemaphore[Hq * n_qblk] = 0      (by block (0, 0, 0): a persistent main kernel's ticket counter)

``LSE2 = +inf`` makes ``P = exp2(s * scale * log2 e - LSE2) = 0`` for rows without a visible key
and for padding rows, so they contribute nothing (and never NaN): their ``D`` is 0 whatever
``dlse`` says there, as ``dS = P (dP - D)`` would turn a NaN one into NaN (torch's ``logsumexp``
backward gives NaN on rows whose every LSE is -inf: a ring attention's merge of such rows).
Four threads share a row, each reducing every fourth 16-byte piece of it, then a quad shuffle.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ._cute_args import row_major
from .consumer_entry import backward_q_desc, thd_tensor
from .consumer_k2q import ticket_counter
from .consumer_plan import CUTE_DTYPES, SequenceDesc, element_ptr, sample_q
from .consumer_softmax import LOG2_E

VECTOR = 8  # 16-bit elements in a 16-byte load


@cute.jit
def quad_sum(x: Float32) -> Float32:
    """Sum over the 4 consecutive lanes that share a row."""
    x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
    return x + cute.arch.shuffle_sync_bfly(x, offset=2)


class BwdPreprocess:
    """Static configuration: head dims (``head_dim_qk`` the dQ accumulator's, ``head_dim_v`` the O /
    dO tensors', a multiple of 8), dtype, block rows and whether the dQ accumulator is zeroed (a
    ``dlse`` is subtracted where the launch passes one)."""

    threads_per_row = 4

    def __init__(
        self, head_dim_qk: int, head_dim_v: int, dtype: str, *, tile_m: int = 64, zero_dq_accum: bool = True,
    ):  # fmt: skip
        self.dtype = CUTE_DTYPES[dtype]
        self.zero_dq_accum = zero_dq_accum
        self.head_dim_qk, self.head_dim_v = head_dim_qk, head_dim_v
        self.tile_m = tile_m
        self.num_threads = tile_m * self.threads_per_row
        # 16-byte pieces of an O / dO row per thread (the last ones past the row where its pieces do
        # not split evenly over the row's threads: skipped)
        self.row_pieces = -(-head_dim_v // (VECTOR * self.threads_per_row))
        self.zero_part = tile_m * head_dim_qk // self.num_threads  # dQ accumulator values per thread
        if head_dim_v % VECTOR or self.zero_part % 4:
            raise ValueError(f"head dims ({head_dim_qk}, {head_dim_v}) do not split into 16-byte vectors")

    @cute.jit
    def from_pointers(
        self,
        out: cute.Pointer,  # (total_q, Hq, Dv)  16-byte aligned
        dout: cute.Pointer,  # (total_q, Hq, Dv)
        lse: cute.Pointer,  # fp32 (Hq, total_q)
        dlse: cute.Pointer | None,  # fp32 (Hq, total_q)
        lse_log2: cute.Pointer,  # fp32 (Hq, n_qblk * tile_m)  output
        dsum: cute.Pointer,  # fp32 (Hq, n_qblk * tile_m)  output
        dq_accum: cute.Pointer,  # fp32 (Hq, n_qblk * tile_m * Dqk)  output (zeroed)
        dq_semaphore: cute.Pointer,  # int32 (Hq, n_qblk)  output (zeroed)
        sequence_desc: cute.Pointer,  # (B, 8) of a varlen view; fixed length: a dummy never read
        q_block_begin: cute.Pointer,  # (B,)
        total_q: Int32,
        num_heads_q: Int32,
        batch: Int32,
        n_qblk: Int32,
        max_q_blocks: Int32,
        varlen: Int32,
        stream: cuda.CUstream,
    ):
        dv, tm = self.head_dim_v, self.tile_m
        self.kernel(
            thd_tensor(out, total_q, num_heads_q, dv),
            thd_tensor(dout, total_q, num_heads_q, dv),
            row_major(lse, num_heads_q, total_q),
            row_major(dlse, num_heads_q, total_q) if const_expr(dlse is not None) else None,
            row_major(lse_log2, num_heads_q, n_qblk * tm),
            row_major(dsum, num_heads_q, n_qblk * tm),
            row_major(dq_accum, num_heads_q, n_qblk * tm * self.head_dim_qk),
            row_major(dq_semaphore, num_heads_q, n_qblk),
            backward_q_desc(sequence_desc, varlen, batch=batch, total_q=total_q, tile_m=tm),
            row_major(q_block_begin, batch),
        ).launch(grid=[max_q_blocks, num_heads_q, batch], block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mdLSE: cute.Tensor | None,
        mLSE2: cute.Tensor,
        mDsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdQsem: cute.Tensor,
        sequence_desc: SequenceDesc,
        q_block_begin: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, q_head, b = cute.arch.block_idx()
        # Q blocks of the sample: the inner blocks of the K2Q view
        sample = sample_q(sequence_desc, b)
        if m_block < sample.blocks:
            tm = self.tile_m
            q_offset, q_len = sample.offset, sample.length
            blk = q_block_begin[b] + m_block
            row, part = tidx // self.threads_per_row, tidx % self.threads_per_row
            q_local = m_block * tm + row
            token = q_offset + q_local
            dot = Float32(0.0)
            if q_local < q_len:
                # this thread's 16-byte pieces of the row: ``part``, ``part + 4``, ... so a row's 4
                # threads read 64 contiguous bytes per load (whole sectors)
                pieces, stride = self.row_pieces, VECTOR * self.threads_per_row
                seg = cute.make_layout((VECTOR, pieces), stride=(1, stride))
                offset = (token * mO.shape[1] + q_head) * self.head_dim_v + part * VECTOR
                r_o = cute.make_rmem_tensor(seg.shape, self.dtype)
                r_do = cute.make_rmem_tensor(seg.shape, self.dtype)
                if const_expr(self.head_dim_v % stride == 0):
                    cute.autovec_copy(cute.make_tensor(element_ptr(mO, offset), seg), r_o)
                    cute.autovec_copy(cute.make_tensor(element_ptr(mdO, offset), seg), r_do)
                else:
                    r_o.fill(0.0)
                    r_do.fill(0.0)
                    piece = cute.make_layout(VECTOR)
                    for p in cutlass.range_constexpr(pieces):
                        if part * VECTOR + p * stride < self.head_dim_v:
                            at = offset + p * stride
                            cute.autovec_copy(cute.make_tensor(element_ptr(mO, at), piece), r_o[None, p])
                            cute.autovec_copy(cute.make_tensor(element_ptr(mdO, at), piece), r_do[None, p])
                prod = r_o.load().to(Float32) * r_do.load().to(Float32)
                dot = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            dot = quad_sum(dot)
            if part == 0:
                lse2 = Float32.inf
                d = Float32(0.0)
                if q_local < q_len:
                    lse = mLSE[q_head, token]
                    if lse != -Float32.inf:
                        lse2 = lse * Float32(LOG2_E)
                        d = dot
                        if const_expr(mdLSE is not None):
                            d = dot - mdLSE[q_head, token]
                mLSE2[q_head, blk * tm + row] = lse2
                mDsum[q_head, blk * tm + row] = d
            if const_expr(self.zero_dq_accum):
                # this block's dQ accumulator, one contiguous tile_m x Dqk fp32 run: thread t writes
                # the 16-byte vectors t, t + threads, ..., so each warp store covers 512 contiguous bytes
                run = cute.make_layout((4, self.zero_part // 4), stride=(1, 4 * self.num_threads))
                zeros = cute.make_rmem_tensor(run.shape, Float32)
                zeros.fill(0.0)
                offset = (q_head * mdQaccum.shape[1] + blk * tm * self.head_dim_qk) + tidx * 4
                cute.autovec_copy(zeros, cute.make_tensor(element_ptr(mdQaccum, offset), run))
            if tidx == 0:
                mdQsem[q_head, blk] = Int32(0)
        if m_block + q_head + b == 0 and tidx == 0:
            # the persistent main kernel's ticket counter; block (0, 0, 0) exists in every launch
            ticket_counter(mdQsem)[0] = Int32(0)


__all__ = ["BwdPreprocess", "quad_sum"]
