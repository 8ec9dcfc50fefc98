"""MMA warpgroups of the SM90 backward kernel: the per-Q-block step and the dK/dV epilogue.

A mixin of :class:`flexattn_sm90.bwd_kernel.Sm90BwdKernel` (it reads the static config from
``self``). The two warpgroups split S^T as the payload layout says: 128 x 128 and 64 x 128 tiles,
64 K rows each (P^T and dS^T stay in registers as the A of dK / dV); 64 x 64 tile (head dims
192 / 256), 32 Q columns each (P^T and dS^T meet in SMEM and dK / dV split the head dim). One step
(one K2Q entry, Q block ``m`` of head ``hq``), in issue order::

    wait Q          S^T  = K Q^T                  (async)
    wait dO         dP^T = V dO^T                 (async; S^T done)
    [wait payload]  P^T  = exp2(S^T * scale*log2e - LSE2[q])  [bit e == 0 -> P^T[e] = 0]
                    dP^T done;  dS^T = P^T (dP^T - D[q])
                    dS^T -> SMEM as dS (stmatrix.trans)       [P^T -> SMEM as P likewise]
                    dV  += P^T dO   (RS)          (async)     [after the barrier, SS]
                    barrier of both warpgroups: dS [and P] complete in SMEM
                    dQ   = dS K     (SS)          (async; dV done -> release dO)
                    dK  += dS^T Q   (RS or SS)    (async; dQ done)
                    dQ -> SMEM chunk (dQ writer bulk-adds it)    wait all -> release Q

Steps follow the merged descending walk of the K row's partial and full lists
(``consumer_plan.walk_descending``), each specialised at compile time for its kind. Partial
entries apply the packed predicate to P^T after the exponential, so a masked element is
exactly 0 whatever its score (tail rows of another sample, rows without a visible key). Full
entries never touch the mask pipeline.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from maskplan_kernels.consumer_plan import head_range, total_steps, walk_descending

from .bwd_helpers import dq_chunk_layout, stage_result, store_result_rows
from .fwd_helpers import acc_as_operand_a, acc_mn_view, transpose_view, wgmma


class StepOperands(NamedTuple):
    """What one step works with: WGMMA fragments of every GEMM and the pipelines."""

    tSrK: cute.Tensor  # A of S^T: (MMA, MMA_M, MMA_K)
    tSrQ: cute.Tensor  # B of S^T: (MMA, MMA_N, MMA_K, stages)
    tPrV: cute.Tensor  # A of dP^T
    tPrdO: cute.Tensor  # B of dP^T (stages)
    tVrdO: cute.Tensor  # B of dV: dO^T, MN-major (stages)
    tKrQ: cute.Tensor  # B of dK: Q^T, MN-major (stages)
    tQrdS: cute.Tensor  # A of dQ: dS (stages)
    tQrK: cute.Tensor  # B of dQ: K^T, MN-major
    tVrP: cute.Tensor  # A of dV: P^T in the input dtype (registers, or SMEM with stages)
    tKrdS: cute.Tensor  # A of dK: dS^T in the input dtype (registers, or SMEM with stages)
    acc_dk: cute.Tensor
    acc_dv: cute.Tensor
    pipe_q: object
    pipe_do: object
    pipe_mask: object


class BwdMainloop:
    """MMA-warpgroup methods (mixin)."""

    @cute.jit
    def mma_warpgroups(
        self, mmas, mdK, mdV, s, plan, work, scale_log2: Float32, softmax_scale: Float32, pipes,
        tidx: Int32,
    ):  # fmt: skip
        pipe_kv, pipe_q, pipe_do, pipe_mask = pipes
        # warp-uniform, so the WGMMA descriptors of this warpgroup's operand slices are built in uniform
        # registers: as a per-thread value each descriptor took two R2UR moves before its WGMMA
        wg = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)
        tm, tn = self.tile_m, self.tile_n
        slices = [(m.get_slice(wg * self.threads_per_wg), m.get_slice(tidx)) for m in mmas]
        (wg_sdp, thr_sdp), (wg_dk, thr_dk), (wg_dv, thr_dv), (wg_dq, thr_dq) = slices
        sQ, sdO, sK, sV, sdS = s["sQ"], s["sdO"], s["sK"], s["sV"], s["sdS"]
        if const_expr(self.pds_in_smem):
            # dS^T / P^T as the MN-major A of dK / dV: (tile_n, tile_m, stages) views of dS / P
            tVrP = wg_dv.make_fragment_A(wg_dv.partition_A(transpose_view(s["sP"])))
            tKrdS = wg_dk.make_fragment_A(wg_dk.partition_A(transpose_view(sdS)))
        else:
            tVrP = thr_dv.make_fragment_A(thr_dv.partition_shape_A((tn, tm)))
            tKrdS = thr_dk.make_fragment_A(thr_dk.partition_shape_A((tn, tm)))
        ops = StepOperands(
            tSrK=wg_sdp.make_fragment_A(wg_sdp.partition_A(sK)),
            tSrQ=wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ)),
            tPrV=wg_sdp.make_fragment_A(wg_sdp.partition_A(sV)),
            tPrdO=wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO)),
            tVrdO=wg_dv.make_fragment_B(wg_dv.partition_B(transpose_view(sdO))),
            tKrQ=wg_dk.make_fragment_B(wg_dk.partition_B(transpose_view(sQ))),
            tQrdS=wg_dq.make_fragment_A(wg_dq.partition_A(sdS)),
            tQrK=wg_dq.make_fragment_B(wg_dq.partition_B(transpose_view(sK))),
            tVrP=tVrP,
            tKrdS=tKrdS,
            acc_dk=cute.make_rmem_tensor(thr_dk.partition_shape_C((tn, self.head_dim_qk)), Float32),
            acc_dv=cute.make_rmem_tensor(thr_dv.partition_shape_C((tn, self.head_dim_v)), Float32),
            pipe_q=pipe_q,
            pipe_do=pipe_do,
            pipe_mask=pipe_mask,
        )
        ops.acc_dk.fill(0.0)
        ops.acc_dv.fill(0.0)
        acc_s_shape = thr_sdp.partition_shape_C((tn, tm))
        acc_dq_shape = thr_dq.partition_shape_C((tm, self.head_dim_qk))
        # this thread's slot of its warpgroup's dQ chunk, in fragment order: (4, elements / 4)
        chunk_layout = dq_chunk_layout(self.dq_elements)
        chunk = cute.make_tensor(s["sdQ"].iterator + self.dq_chunk_offset(wg), chunk_layout)
        tdQsdQ = chunk[tidx % self.threads_per_wg, None]

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.do_stages)
        mask_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.mask_stages)
        if total_steps(plan, work) > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipe_kv.consumer_wait(kv_state)
        words = cute.make_rmem_tensor(self.payload_words, Int32)
        step = Int32(0)
        for g in cutlass.range(work.q_per_kv, unroll=1):
            hr = head_range(plan, work, g)
            left_p, left_f = hr.partial_cnt, hr.full_cnt
            for _ in cutlass.range(hr.partial_cnt + hr.full_cnt, unroll=1):
                nxt = walk_descending(plan, hr, left_p, left_f)
                dq_full = self.dq_full_barrier(wg, self.dq_writer_of(step))
                if nxt.partial != 0:
                    q_state, do_state, mask_state = self.step(
                        ops, mmas, thr_sdp, acc_s_shape, acc_dq_shape, tdQsdQ, s, scale_log2,
                        q_state, do_state, mask_state, words, tidx, wg, dq_full, True,
                    )  # fmt: skip
                else:
                    q_state, do_state, mask_state = self.step(
                        ops, mmas, thr_sdp, acc_s_shape, acc_dq_shape, tdQsdQ, s, scale_log2,
                        q_state, do_state, mask_state, words, tidx, wg, dq_full, False,
                    )  # fmt: skip
                left_p, left_f = nxt.partial_left, nxt.full_left
                step += 1
        # every GEMM reading K and V has retired in both warpgroups: sK and sV stage dK and dV
        cute.arch.barrier(barrier_id=self.BAR_PDS, number_of_threads=self.num_mma_threads)
        stage_result(mmas[1], ops.acc_dk, sK, tidx, softmax_scale)
        stage_result(mmas[2], ops.acc_dv, sV, tidx, None)
        cute.arch.barrier(barrier_id=self.BAR_PDS, number_of_threads=self.num_mma_threads)
        # dK / dV of this block and kv head -> rows < k_valid
        first = work.k_offset + work.n_block * self.tile_n
        for s_x, m_x in ((sK, mdK), (sV, mdV)):
            store_result_rows(s_x, m_x, first, work.kv_head, tidx, self.num_mma_threads, work.k_valid)

    @cute.jit
    def stat_columns(self, thr_sdp, s_stat: cute.Tensor, stage: Int32, out: cute.Tensor):
        """``out[c]`` = the per-Q-row statistic (LSE or D) of column ``c`` of this thread's S^T
        fragment (a column of S^T is a Q row), read from SMEM stage ``stage``."""
        # (tile_n, tile_m) broadcast of the stage's tile_m values along the K rows
        bcast = cute.make_tensor(
            s_stat[None, stage].iterator, cute.make_layout((self.tile_n, self.tile_m), stride=(0, 1))
        )
        t_mn = acc_mn_view(thr_sdp.partition_C(bcast))
        for c in cutlass.range_constexpr(cute.size(out)):
            out[c] = t_mn[0, c]

    @cute.jit
    def step(
        self, ops: StepOperands, mma, thr_sdp, acc_s_shape, acc_dq_shape, tdQsdQ, s,
        scale_log2: Float32, q_state, do_state, mask_state, words, tidx: Int32, wg: Int32, dq_full: Int32,
        partial: cutlass.Constexpr[bool],
    ):  # fmt: skip
        mma_sdp, mma_dk, mma_dv, mma_dq = mma
        stage, do_stage = q_state.index, do_state.index
        acc_s = cute.make_rmem_tensor(acc_s_shape, Float32)
        acc_dp = cute.make_rmem_tensor(acc_s_shape, Float32)
        s_mn, dp_mn = acc_mn_view(acc_s), acc_mn_view(acc_dp)
        n_rows, n_cols = cute.size(s_mn, mode=[0]), cute.size(s_mn, mode=[1])
        stat = cute.make_rmem_tensor(n_cols, Float32)

        ops.pipe_q.consumer_wait(q_state)
        # LSE [and the payload] are read before the S GEMM is issued: read after its wait, the loads
        # queued behind the GEMMs' issue and stalled the exponentials (MIO throttle, short scoreboard)
        self.stat_columns(thr_sdp, s["sLSE"], stage, stat)
        if const_expr(partial):
            ops.pipe_mask.consumer_wait(mask_state)
            cute.autovec_copy(s["sMask"][None, tidx, mask_state.index], words)
        wgmma(mma_sdp, acc_s, ops.tSrK, ops.tSrQ[None, None, None, stage], zero_init=True, wait=-1)
        ops.pipe_do.consumer_wait(do_state)
        wgmma(mma_sdp, acc_dp, ops.tPrV, ops.tPrdO[None, None, None, do_stage], zero_init=True, wait=1)
        # P^T = exp2(S^T scale log2e - LSE2[q])
        for c in cutlass.range_constexpr(n_cols):
            for r in cutlass.range_constexpr(n_rows):
                s_mn[r, c] = cute.math.exp2(s_mn[r, c] * scale_log2 - stat[c], fastmath=True)
        if const_expr(partial):  # spec 5.1 on the transposed fragment: bit e guards register e
            for w in cutlass.range_constexpr(self.payload_words):
                for b in cutlass.range_constexpr(min(32, self.payload_elements - 32 * w)):
                    e = 32 * w + b
                    acc_s[e] = acc_s[e] if ((words[w] >> b) & 1) != 0 else Float32(0.0)
        if const_expr(self.pds_in_smem):
            self.store_transposed(mma_sdp, acc_s, s["sP"], stage, tidx)
        else:
            ops.tVrP.store(acc_as_operand_a(acc_s).load().to(self.dtype))
        # dS^T = P^T (dP^T - D[q])
        self.stat_columns(thr_sdp, s["sDsum"], do_stage, stat)
        warpgroup.wait_group(0)
        for c in cutlass.range_constexpr(n_cols):
            for r in cutlass.range_constexpr(n_rows):
                dp_mn[r, c] = s_mn[r, c] * (dp_mn[r, c] - stat[c])
        rdS = self.store_transposed(mma_sdp, acc_dp, s["sdS"], stage, tidx)
        if const_expr(self.pds_in_smem):
            tVrP, tKrdS = ops.tVrP[None, None, None, stage], ops.tKrdS[None, None, None, stage]
        else:
            tVrP, tKrdS = ops.tVrP, ops.tKrdS
            tKrdS.store(acc_as_operand_a(rdS).load())
            # dV += P^T dO (its A is this warpgroup's own registers: no need to wait for the other)
            wgmma(mma_dv, ops.acc_dv, tVrP, ops.tVrdO[None, None, None, do_stage], zero_init=False, wait=-1)
        # the dS^T stores, and the reads of LSE, D [and the payload] before the bulk copies refill
        # their stages (all released after this), are ordered before the async proxy
        cute.arch.fence_view_async_shared()
        if const_expr(partial):
            ops.pipe_mask.consumer_release(mask_state)
            mask_state.advance()
        cute.arch.barrier(barrier_id=self.BAR_PDS, number_of_threads=self.num_mma_threads)
        if const_expr(self.pds_in_smem):
            wgmma(mma_dv, ops.acc_dv, tVrP, ops.tVrdO[None, None, None, do_stage], zero_init=False, wait=-1)
        # dQ = dS K
        acc_dq = cute.make_rmem_tensor(acc_dq_shape, Float32)
        wgmma(mma_dq, acc_dq, ops.tQrdS[None, None, None, stage], ops.tQrK, zero_init=True, wait=1)
        ops.pipe_do.consumer_release(do_state)  # dV has read dO
        do_state.advance()
        # dK += dS^T Q
        wgmma(mma_dk, ops.acc_dk, tKrdS, ops.tKrQ[None, None, None, stage], zero_init=False, wait=1)
        # dQ -> this warpgroup's SMEM chunk, once the dQ writer has emptied it (a chunk shared by
        # both warpgroups: warpgroup 1's turn comes once warpgroup 0's add has read it)
        cute.arch.barrier(barrier_id=self.BAR_DQ_EMPTY + wg, number_of_threads=self.dq_pair_threads)
        cute.autovec_copy(cute.make_tensor(acc_dq.iterator, tdQsdQ.layout.shape), tdQsdQ)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=dq_full, number_of_threads=self.dq_pair_threads)
        warpgroup.wait_group(0)
        ops.pipe_q.consumer_release(q_state)
        q_state.advance()
        return q_state, do_state, mask_state

    @cute.jit
    def store_transposed(
        self, mma_sdp, acc: cute.Tensor, s_x: cute.Tensor, stage: Int32, tidx: Int32
    ) -> cute.Tensor:
        """The S^T-shaped fp32 fragment ``acc`` in the input dtype (returned) -> stage ``stage`` of the
        (tile_m, tile_n) SMEM tile ``s_x``: fragment element (k, q) is element (q, k) of the tile. A
        column of the fragment is a contiguous row piece of the tile, so stmatrix.trans writes each
        8x8 matrix in 16-byte rows (element-wise 2-byte stores took twice the SMEM wavefronts and
        8x the instructions; fwd+bwd at D=128 is 2.7-3.9% faster this way, benchmarks/RESULTS.md)."""
        return stage_result(mma_sdp, acc, transpose_view(s_x)[None, None, stage], tidx, None, transpose=True)
