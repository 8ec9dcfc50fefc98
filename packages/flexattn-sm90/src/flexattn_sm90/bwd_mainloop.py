"""MMA warpgroups of the SM90 backward kernel: the per-Q-block step and the dK/dV epilogue.

A mixin of :class:`flexattn_sm90.bwd_kernel.Sm90BwdKernel` (it reads the static config from
``self``). The two warpgroups split S^T as the payload layout says: 128 x 128 and 64 x 128 tiles,
64 K rows each (P^T and dS^T stay in registers as the A of dK / dV); 64 x 64 tile (head dim 256),
32 Q columns each (P^T and dS^T meet in SMEM and dK / dV split the head dim). The 64 x 96 tile
((192, 128)) computes S, not S^T: the Q side is each GEMM's A (``operands``), every S^T below reads
S, dK / dV read dK^T / dV^T, and P / dS leave by plain stmatrix. One step (one K2Q entry, Q block
``m`` of head ``hq``), in issue order::

    [the sample's last Q block: wait Q and dO, zero_tail(Q, dO)]
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

Steps follow the merged walk of the K row's partial and full lists, descending, ascending in the
mirrored order (``consumer_k2q.walk_row``), each specialised at compile time for its kind. Partial
entries apply the packed predicate to P^T after the exponential, so a masked element is
exactly 0 whatever its score (tail rows of another sample, rows without a visible key). Full
entries never touch the mask pipeline.

Tiles reaching past the sample (K / V rows from ``k_valid`` on, Q / dO rows of its last Q block
from ``q_len`` on) hold the next sample's rows, as TMA loaded them. They meet zero probabilities,
but 0 * inf = nan, so both warpgroups zero them (``zero_tail``) before any GEMM reads the stage::

    Q stage (tile_m rows)           all 256 threads: rows >= q_len - m * tile_m := 0,
    [ sample's rows | next sample ]     fence.proxy.async, barrier of both warpgroups

The MMA warpgroups do it rather than the producer warp: they are waiting for that stage anyway and
have 8x its threads. The producer's round trip (land on its own barrier, zero, then signal) delayed
the first step of nearly every K block of a varlen batch of short samples: fwd+bwd on 15 documents
as samples (S = 8192) ran 3.7% below no zeroing that way, 1.3% below this way
(benchmarks/RESULTS.md, session 26).
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from maskplan_kernels.consumer_k2q import head_range, walk_row
from maskplan_kernels.stage_fill import zero_rows

from .bwd_helpers import dq_chunk_layout, item_state, stage_result, store_result_rows
from .fwd_helpers import acc_as_operand_a, acc_mn_view, transpose_view, wgmma


class StepOperands(NamedTuple):
    """What one step works with: WGMMA fragments of every GEMM and the pipelines. The roles below
    are S^T's; computing S, the K-side and Q-side operands swap A and B (``BwdMainloop.operands``)."""

    tSrK: cute.Tensor  # A of S^T: (MMA, MMA_M, MMA_K)
    tSrQ: cute.Tensor  # B of S^T: (MMA, MMA_N, MMA_K, stages)
    tPrV: cute.Tensor  # A of dP^T
    tPrdO: cute.Tensor  # B of dP^T (stages)
    tVrdO: cute.Tensor  # B of dV: dO^T, MN-major (stages)
    tKrQ: cute.Tensor  # B of dK: Q^T, MN-major (stages)
    tQrdS: cute.Tensor  # A of dQ: dS (stages), in either orientation
    tQrK: cute.Tensor  # B of dQ: K^T, MN-major, in either orientation
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
        self, mmas, mdK, mdV, s, plan, items, scale_log2: Float32, softmax_scale: Float32, pipes,
        tidx: Int32,
    ):  # fmt: skip
        pipe_kv, pipe_q, pipe_do, pipe_mask = pipes[:4]
        # warp-uniform, so the WGMMA descriptors of this warpgroup's operand slices are built in uniform
        # registers: as a per-thread value each descriptor took two R2UR moves before its WGMMA
        wg = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)
        tm, tn = self.tile_m, self.tile_n
        slices = [(m.get_slice(wg * self.threads_per_wg), m.get_slice(tidx)) for m in mmas]
        (wg_sdp, thr_sdp), (wg_dk, thr_dk), (wg_dv, thr_dv), (wg_dq, thr_dq) = slices
        sQ, sdO, sK, sV, sdS = s["sQ"], s["sdO"], s["sK"], s["sV"], s["sdS"]

        # the K side (K, V, P^T, dS^T: tile_n rows) is A of S^T, dP^T, dK and dV and the Q side (Q,
        # dO, their transposes) is B; in S orientation the roles swap (self.operands says so)
        def k_side(w, view):
            if const_expr(self.q_rows_on_m):
                return w.make_fragment_B(w.partition_B(view))
            return w.make_fragment_A(w.partition_A(view))

        def q_side(w, view):
            if const_expr(self.q_rows_on_m):
                return w.make_fragment_A(w.partition_A(view))
            return w.make_fragment_B(w.partition_B(view))

        if const_expr(self.pds_in_smem):
            # dS^T / P^T as the MN-major operand of dK / dV: (tile_n, tile_m, stages) views of dS / P
            tVrP = k_side(wg_dv, transpose_view(s["sP"]))
            tKrdS = k_side(wg_dk, transpose_view(sdS))
        else:
            tVrP = thr_dv.make_fragment_A(thr_dv.partition_shape_A((tn, tm)))
            tKrdS = thr_dk.make_fragment_A(thr_dk.partition_shape_A((tn, tm)))
        dk_shape, dv_shape = (self.head_dim_qk, tn), (self.head_dim_v, tn)
        if const_expr(not self.q_rows_on_m):
            dk_shape, dv_shape = dk_shape[::-1], dv_shape[::-1]
        ops = StepOperands(
            tSrK=k_side(wg_sdp, sK),
            tSrQ=q_side(wg_sdp, sQ),
            tPrV=k_side(wg_sdp, sV),
            tPrdO=q_side(wg_sdp, sdO),
            tVrdO=q_side(wg_dv, transpose_view(sdO)),
            tKrQ=q_side(wg_dk, transpose_view(sQ)),
            tQrdS=wg_dq.make_fragment_A(wg_dq.partition_A(sdS)),
            tQrK=wg_dq.make_fragment_B(wg_dq.partition_B(transpose_view(sK))),
            tVrP=tVrP,
            tKrdS=tKrdS,
            acc_dk=cute.make_rmem_tensor(thr_dk.partition_shape_C(dk_shape), Float32),
            acc_dv=cute.make_rmem_tensor(thr_dv.partition_shape_C(dv_shape), Float32),
            pipe_q=pipe_q,
            pipe_do=pipe_do,
            pipe_mask=pipe_mask,
        )
        acc_s_shape = thr_sdp.partition_shape_C((tm, tn) if self.q_rows_on_m else (tn, tm))
        acc_dq_shape = thr_dq.partition_shape_C((tm, self.head_dim_qk))
        # this thread's slot of its warpgroup's dQ chunk, in fragment order: (4, elements / 4)
        chunk_layout = dq_chunk_layout(self.dq_elements)
        chunk = cute.make_tensor(s["sdQ"].iterator + self.dq_chunk_offset(wg), chunk_layout)
        tdQsdQ = chunk[tidx % self.threads_per_wg, None]

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.do_stages)
        mask_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.mask_stages)
        words = cute.make_rmem_tensor(self.payload_words, Int32)
        step = Int32(0)
        item = Int32(0)
        dq_owned = Int32(0)  # 1: this warpgroup holds its dQ chunk (taken by an epilogue)
        valid, work, q_len = self.next_work(items, item)  # q_len: the sample's queries, for zero_tail
        while valid != 0:
            ops.acc_dk.fill(0.0)
            ops.acc_dv.fill(0.0)
            kv_state = item_state(1, item, pipeline.PipelineUserType.Consumer)
            pipe_kv.consumer_wait(kv_state)
            if work.k_valid < tn:
                self.zero_tail((sK, sV), work.k_valid, tidx)
            for g in cutlass.range(work.q_per_kv, unroll=1):
                hr = head_range(plan, work, g)
                left_p, left_f = hr.partial_cnt, hr.full_cnt
                for _ in cutlass.range(hr.partial_cnt + hr.full_cnt, unroll=1):
                    nxt = walk_row(plan, hr, left_p, left_f, not self.mirrored)
                    dq_full = self.dq_full_barrier(wg, self.dq_writer_of(step))
                    q_rows = q_len - nxt.q_block * tm
                    if q_rows < tm:  # the step's own waits then find the stages landed
                        ops.pipe_q.consumer_wait(q_state)
                        ops.pipe_do.consumer_wait(do_state)
                        stages = (sQ[None, None, q_state.index], sdO[None, None, do_state.index])
                        self.zero_tail(stages, q_rows, tidx)
                    if nxt.partial != 0:
                        q_state, do_state, mask_state = self.step(
                            ops, mmas, thr_sdp, acc_s_shape, acc_dq_shape, tdQsdQ, s, scale_log2,
                            q_state, do_state, mask_state, words, tidx, wg, dq_full, dq_owned, True,
                        )  # fmt: skip
                    else:
                        q_state, do_state, mask_state = self.step(
                            ops, mmas, thr_sdp, acc_s_shape, acc_dq_shape, tdQsdQ, s, scale_log2,
                            q_state, do_state, mask_state, words, tidx, wg, dq_full, dq_owned, False,
                        )  # fmt: skip
                    dq_owned = Int32(0)
                    left_p, left_f = nxt.partial_left, nxt.full_left
                    step += 1
            # this warp's GEMMs reading K and V have retired (the step's last wait): the next item's
            # K / V may land while this one's dK / dV leave
            pipe_kv.consumer_release(kv_state)
            dq_owned = self.epilogue(mmas, ops, mdK, mdV, s, work, tidx, wg, softmax_scale, dq_owned)
            item += 1
            valid, work, q_len = self.next_work(items, item)

    @cute.jit
    def epilogue(self, mmas, ops, mdK, mdV, s, work, tidx: Int32, wg: Int32, softmax_scale: Float32,
                 dq_owned: Int32) -> Int32:  # fmt: skip
        """dK / dV of the item -> rows < k_valid of its K block, staged in the SMEM of dS [, P] and the
        dQ chunks (sK / sV are the next item's already). The dQ chunks are taken from the dQ writer
        first, as for a step's dQ; the warpgroup's next step then finds its chunk its own. Returns
        ``dq_owned``."""
        owned = dq_owned
        if wg < self.dq_chunks:  # a shared chunk (dq_chunks == 1): warpgroup 0 takes it
            if dq_owned == 0:
                cute.arch.barrier(barrier_id=self.BAR_DQ_EMPTY + wg, number_of_threads=self.dq_pair_threads)
            owned = Int32(1)
        # both warpgroups' GEMMs have retired (dS [and P] are free) and the dQ chunks are taken
        cute.arch.barrier(barrier_id=self.BAR_PDS, number_of_threads=self.num_mma_threads)
        results = ((mmas[1], ops.acc_dk, s["sdK"], softmax_scale), (mmas[2], ops.acc_dv, s["sdV"], None))
        for mma, acc, s_x, scale in results:
            if const_expr(self.q_rows_on_m):  # dK^T / dV^T: written transposed into the staging tile
                stage_result(mma, acc, transpose_view(s_x), tidx, scale, transpose=True)
            else:
                stage_result(mma, acc, s_x, tidx, scale)
        cute.arch.barrier(barrier_id=self.BAR_PDS, number_of_threads=self.num_mma_threads)
        # dK / dV of this block and kv head -> rows < k_valid
        first = work.k_offset + work.n_block * self.tile_n
        for s_x, m_x in ((s["sdK"], mdK), (s["sdV"], mdV)):
            store_result_rows(s_x, m_x, first, work.kv_head, tidx, self.num_mma_threads, work.k_valid)
        # the staging SMEM is dS and dQ's again
        cute.arch.barrier(barrier_id=self.BAR_PDS, number_of_threads=self.num_mma_threads)
        return owned

    def operands(self, k_side, q_side) -> tuple:
        """``(A, B)`` of S, dP, dK or dV from its K-side operand (K, V, P, dS) and its Q-side one (Q,
        dO): S^T = K Q^T puts the K side on WGMMA M, S = Q K^T (and dK^T = Q^T dS) the Q side."""
        return (q_side, k_side) if self.q_rows_on_m else (k_side, q_side)

    def q_of(self, r: int, c: int) -> int:
        """Which index of the score fragment's (row ``r``, column ``c``) is its Q row's: the row of S,
        the column of S^T: the index of its statistic in :meth:`q_row_stats`' ``out``."""
        return r if self.q_rows_on_m else c

    @cute.jit
    def q_row_stats(self, thr_sdp, s_stat: cute.Tensor, stage: Int32, out: cute.Tensor):
        """``out[i]`` = the per-Q-row statistic (LSE or D) of the ``i``-th Q row of this thread's
        score fragment (a column of S^T, a row of S), read from SMEM stage ``stage``."""
        # the stage's tile_m values broadcast along the K side of the score tile
        shape, stride = ((self.tile_n, self.tile_m), (0, 1))
        if const_expr(self.q_rows_on_m):
            shape, stride = ((self.tile_m, self.tile_n), (1, 0))
        bcast = cute.make_tensor(s_stat[None, stage].iterator, cute.make_layout(shape, stride=stride))
        t_mn = acc_mn_view(thr_sdp.partition_C(bcast))
        for i in cutlass.range_constexpr(cute.size(out)):
            out[i] = t_mn[i, 0] if const_expr(self.q_rows_on_m) else t_mn[0, i]

    @cute.jit
    def step(
        self, ops: StepOperands, mma, thr_sdp, acc_s_shape, acc_dq_shape, tdQsdQ, s,
        scale_log2: Float32, q_state, do_state, mask_state, words, tidx: Int32, wg: Int32, dq_full: Int32,
        dq_owned: Int32, partial: cutlass.Constexpr[bool],
    ):  # fmt: skip
        mma_sdp, mma_dk, mma_dv, mma_dq = mma
        stage, do_stage = q_state.index, do_state.index
        acc_s = cute.make_rmem_tensor(acc_s_shape, Float32)
        acc_dp = cute.make_rmem_tensor(acc_s_shape, Float32)
        s_mn, dp_mn = acc_mn_view(acc_s), acc_mn_view(acc_dp)
        n_rows, n_cols = cute.size(s_mn, mode=[0]), cute.size(s_mn, mode=[1])
        stat = cute.make_rmem_tensor(n_rows if const_expr(self.q_rows_on_m) else n_cols, Float32)

        ops.pipe_q.consumer_wait(q_state)
        # LSE [and the payload] are read before the S GEMM is issued: read after its wait, the loads
        # queued behind the GEMMs' issue and stalled the exponentials (MIO throttle, short scoreboard)
        self.q_row_stats(thr_sdp, s["sLSE"], stage, stat)
        if const_expr(partial):
            ops.pipe_mask.consumer_wait(mask_state)
            cute.autovec_copy(s["sMask"][None, tidx, mask_state.index], words)
        s_ab = self.operands(ops.tSrK, ops.tSrQ[None, None, None, stage])
        wgmma(mma_sdp, acc_s, *s_ab, zero_init=True, wait=-1)
        ops.pipe_do.consumer_wait(do_state)
        dp_ab = self.operands(ops.tPrV, ops.tPrdO[None, None, None, do_stage])
        wgmma(mma_sdp, acc_dp, *dp_ab, zero_init=True, wait=1)
        # P = exp2(S scale log2e - LSE2[q])
        for c in cutlass.range_constexpr(n_cols):
            for r in cutlass.range_constexpr(n_rows):
                s_mn[r, c] = cute.math.exp2(s_mn[r, c] * scale_log2 - stat[self.q_of(r, c)], fastmath=True)
        if const_expr(partial):  # spec 5.1 on the fragment (S or S^T): bit e guards register e
            for w in cutlass.range_constexpr(self.payload_words):
                for b in cutlass.range_constexpr(min(32, self.payload_elements - 32 * w)):
                    e = 32 * w + b
                    acc_s[e] = acc_s[e] if ((words[w] >> b) & 1) != 0 else Float32(0.0)
        if const_expr(self.pds_in_smem):
            self.store_scores(mma_sdp, acc_s, s["sP"], stage, tidx)
        else:
            ops.tVrP.store(acc_as_operand_a(acc_s).load().to(self.dtype))
        # dS = P (dP - D[q])
        self.q_row_stats(thr_sdp, s["sDsum"], do_stage, stat)
        warpgroup.wait_group(0)
        for c in cutlass.range_constexpr(n_cols):
            for r in cutlass.range_constexpr(n_rows):
                dp_mn[r, c] = s_mn[r, c] * (dp_mn[r, c] - stat[self.q_of(r, c)])
        rdS = self.store_scores(mma_sdp, acc_dp, s["sdS"], stage, tidx)
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
            dv_ab = self.operands(tVrP, ops.tVrdO[None, None, None, do_stage])
            wgmma(mma_dv, ops.acc_dv, *dv_ab, zero_init=False, wait=-1)
        # dQ = dS K
        acc_dq = cute.make_rmem_tensor(acc_dq_shape, Float32)
        wgmma(mma_dq, acc_dq, ops.tQrdS[None, None, None, stage], ops.tQrK, zero_init=True, wait=1)
        ops.pipe_do.consumer_release(do_state)  # dV has read dO
        do_state.advance()
        # dK += dS^T Q (dK^T += Q^T dS)
        dk_ab = self.operands(tKrdS, ops.tKrQ[None, None, None, stage])
        wgmma(mma_dk, ops.acc_dk, *dk_ab, zero_init=False, wait=1)
        # dQ -> this warpgroup's SMEM chunk, once the dQ writer has emptied it (a chunk shared by
        # both warpgroups: warpgroup 1's turn comes once warpgroup 0's add has read it), unless
        # the item's epilogue before took it
        if dq_owned == 0:
            cute.arch.barrier(barrier_id=self.BAR_DQ_EMPTY + wg, number_of_threads=self.dq_pair_threads)
        cute.autovec_copy(cute.make_tensor(acc_dq.iterator, tdQsdQ.layout.shape), tdQsdQ)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=dq_full, number_of_threads=self.dq_pair_threads)
        warpgroup.wait_group(0)
        ops.pipe_q.consumer_release(q_state)
        q_state.advance()
        return q_state, do_state, mask_state

    @cute.jit
    def zero_tail(self, tiles, valid_rows: Int32, tidx: Int32):
        """Rows ``valid_rows`` and after of each landed SMEM tile in ``tiles`` (rows, cols) := 0, by
        all MMA threads, ordered before either warpgroup's next WGMMA (see the module docstring)."""
        for tile in tiles:
            zero_rows(tile, valid_rows, tidx, self.num_mma_threads)
        # generic-proxy zeros, read by the WGMMAs through the async proxy
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=self.BAR_PDS, number_of_threads=self.num_mma_threads)

    @cute.jit
    def store_scores(
        self, mma_sdp, acc: cute.Tensor, s_x: cute.Tensor, stage: Int32, tidx: Int32
    ) -> cute.Tensor:
        """The score-shaped fp32 fragment ``acc`` (P or dS) in the input dtype (returned) -> stage
        ``stage`` of the (tile_m, tile_n) SMEM tile ``s_x``. As S^T, fragment element (k, q) is
        element (q, k) of the tile: a column of the fragment is a contiguous row piece of the tile,
        so stmatrix.trans writes each 8x8 matrix in 16-byte rows (element-wise 2-byte stores took
        twice the SMEM wavefronts and 8x the instructions; fwd+bwd at D=128 is 2.7-3.9% faster this
        way, benchmarks/RESULTS.md). As S, plain stmatrix."""
        if const_expr(self.q_rows_on_m):
            return stage_result(mma_sdp, acc, s_x[None, None, stage], tidx, None)
        return stage_result(mma_sdp, acc, transpose_view(s_x)[None, None, stage], tidx, None, transpose=True)
