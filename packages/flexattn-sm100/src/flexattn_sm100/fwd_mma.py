"""The MMA warp of the SM100 forward kernel (:class:`flexattn_sm100.fwd_kernel.Sm100FwdKernel`, a
mixin as :class:`flexattn_sm100.fwd_softmax.SoftmaxRole` is): it takes each task's record, issues
S = Q K^T into TMEM per K/V stage and O += P V once the softmax warpgroups have written P, and
releases the Q, K and V stages it has read (qstage1; :meth:`MmaRole.mma_role_qstage2` interleaves
two q stages). With a CTA pair the leader issues every MMA (cta_group::2) and its peer only
consumes the records (:meth:`MmaRole.skip_tasks`).
"""

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import tcgen05

from maskplan_kernels.consumer_plan import fetch_task

from .fwd_helpers import tcgen05_fence_after, tmem_acc


class MmaRole:
    """MMA-warp methods (mixin)."""

    @cute.jit
    def skip_tasks(self, sTask, pipes):
        """The peer CTA's MMA warp: consume the task records (the sched pipeline counts it)."""
        sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.sched_stages)
        valid, _, sched_state = fetch_task(pipes.sched, sched_state, sTask)
        while valid != 0:
            valid, _, sched_state = fetch_task(pipes.sched, sched_state, sTask)

    @cute.jit
    def mma_operands(self, qk_thr, pv_thr, sQ, sK, sV, tmem_ptr, q: int):
        """The SMEM descriptors and, for q stage ``q``, the TMEM S (stage 0 of its S stages) and O
        operands the MMA warp issues with."""
        tSrQ = qk_thr.make_fragment_A(sQ)  # (MMA, MMA_M, MMA_K, q_stages) SMEM descriptors
        tSrK = qk_thr.make_fragment_B(sK)  # (MMA, MMA_N, MMA_K, kv_stages)
        tOrV = pv_thr.make_fragment_B(sV)  # (MMA, MMA_N, MMA_K, kv_stages)
        tStS = tmem_acc(qk_thr, (self.mma_tile_m, self.tile_n), tmem_ptr + self.tmem_s_offsets[q])
        tOtO = tmem_acc(pv_thr, (self.mma_tile_m, self.head_dim_v), tmem_ptr + self.tmem_o_offsets[q])
        return tSrQ, tSrK, tOrV, tStS, tOtO

    @cute.jit
    def p_operand(self, pv_thr, tP_layout, tmem_ptr, q: int, s_index):
        """The A operand of P V for q stage ``q``: P (16-bit) over the first tile_n / 2 columns of
        its S stage ``s_index`` (the stage of the S it was computed from)."""
        proto = pv_thr.make_fragment_A(cute.make_tensor(tmem_ptr, tP_layout.outer))[None, None, None, 0]
        columns = self.tmem_s_offsets[q] + s_index * self.tmem_s_stride
        return cute.make_tensor(cute.recast_ptr(tmem_ptr + columns, dtype=proto.element_type), proto.layout)

    def mma_input_states(self):
        """The MMA warp's consumer states of the task records, Q and K/V."""
        consumer = pipeline.PipelineUserType.Consumer
        return (
            pipeline.make_pipeline_state(consumer, self.sched_stages),
            pipeline.make_pipeline_state(consumer, 1),
            pipeline.make_pipeline_state(consumer, self.kv_stages),
        )

    def mma_stage_states(self) -> tuple:
        """The MMA warp's states of S (producer), P (consumer) and O (producer), q stage after q stage
        (flat: the DSL threads plainly unpacked locals through its loops)."""
        producer, consumer = pipeline.PipelineUserType.Producer, pipeline.PipelineUserType.Consumer
        states = []
        for _ in range(self.q_stages):
            states += [
                pipeline.make_pipeline_state(producer, self.s_stages),
                pipeline.make_pipeline_state(consumer, 1),
                pipeline.make_pipeline_state(producer, 1),
            ]
        return tuple(states)

    @cute.jit
    def begin_task(self, pipes, q_state, kv_state):
        """Wait for the task's Q and its first K tile; returns the K walk's state (the V walk keeps
        ``kv_state``: K_j and V_j share a stage)."""
        pipes.q.consumer_wait(q_state)
        k_state = kv_state.clone()
        pipes.k.consumer_wait(k_state)
        return k_state

    @cute.jit
    def mma_role(self, qk_mma, pv_mma, qk_thr, pv_thr, sQ, sK, sV, tP_layout, tmem_ptr, sTask, pipes):
        """qstage1: S double-buffered in TMEM, so S_{j+1} is computed while the softmax works on S_j.
        P_j lies over S_j's stage (``p_stage`` follows S one block behind ``s_state``), and S_{j+2},
        the next MMA into that stage, is issued in iteration j + 1: after P_j V_j (TMEM picture in
        ``fwd_kernel``'s module docstring)."""
        tSrQ, tSrK, tOrV, tStS, tOtO = self.mma_operands(qk_thr, pv_thr, sQ, sK, sV, tmem_ptr, 0)
        s_pipe, p_pipe, o_pipe = pipes.s[0], pipes.p[0], pipes.o[0]
        sched_state, q_state, kv_state = self.mma_input_states()
        s_state, p_state, o_state = self.mma_stage_states()
        p_stage = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.s_stages)
        valid, t, sched_state = fetch_task(pipes.sched, sched_state, sTask)
        while valid != 0:
            n = t.partial_cnt + t.full_cnt
            if n > 0:
                k_state = self.begin_task(pipes, q_state, kv_state)
                s_state = self.issue_qk(qk_mma, tSrQ, tSrK, tStS, s_pipe, s_state, k_state, 0)
                k_state = self.release_k(pipes, k_state)
                for j in cutlass.range(n, unroll=1):
                    if j + 1 < n:  # S_{j+1} overlaps the softmax of block j
                        pipes.k.consumer_wait(k_state)
                        s_state = self.issue_qk(qk_mma, tSrQ, tSrK, tStS, s_pipe, s_state, k_state, 0)
                        k_state = self.release_k(pipes, k_state)
                    p_pipe.consumer_wait(p_state)
                    pipes.v.consumer_wait(kv_state)
                    if j == 0:
                        o_pipe.producer_acquire(o_state)  # the previous epilogue has read O
                    tcgen05_fence_after()
                    tOrP = self.p_operand(pv_thr, tP_layout, tmem_ptr, 0, p_stage.index)
                    self.issue_pv(pv_mma, tOtO, tOrP, tOrV, kv_state.index, j > 0)
                    p_pipe.consumer_release(p_state)  # fires when P V completes: O stable
                    p_state.advance()
                    p_stage.advance()
                    pipes.v.consumer_release(kv_state)
                    kv_state.advance()
                o_state = self.commit_o(o_pipe, o_state)
                q_state = self.release_q(pipes, q_state)
            valid, t, sched_state = fetch_task(pipes.sched, sched_state, sTask)

    @cute.jit
    def mma_role_qstage2(
        self, qk_mma, qk_mma_1, pv_mma, qk_thr, pv_thr, sQ, sK, sV, tP_layout, tmem_ptr, sTask, pipes
    ):
        """qstage2: per K block ``j`` the two q stages alternate on the tensor cores, so one stage's
        softmax overlaps the other stage's GEMMs::

            S0 = Q0 K_0^T ; S1 = Q1 K_0^T
            for j: wait P0 ; O0 += P0 V_j ; S0 = Q0 K_{j+1}^T     (P0 lies in S0's columns: the
                   wait P1 ; O1 += P1 V_j ; S1 = Q1 K_{j+1}^T      MMAs of one thread run in order)
        """
        tSrQ, tSrK, tOrV, tStS0, tOtO0 = self.mma_operands(qk_thr, pv_thr, sQ, sK, sV, tmem_ptr, 0)
        _, _, _, tStS1, tOtO1 = self.mma_operands(qk_thr, pv_thr, sQ, sK, sV, tmem_ptr, 1)
        tOrP0 = self.p_operand(pv_thr, tP_layout, tmem_ptr, 0, 0)  # one S stage per q stage
        tOrP1 = self.p_operand(pv_thr, tP_layout, tmem_ptr, 1, 0)
        sched_state, q_state, kv_state = self.mma_input_states()
        s0, p0, o0, s1, p1, o1 = self.mma_stage_states()
        valid, t, sched_state = fetch_task(pipes.sched, sched_state, sTask)
        while valid != 0:
            n = t.partial_cnt + t.full_cnt
            if n > 0:
                k_state = self.begin_task(pipes, q_state, kv_state)
                s0 = self.issue_qk(qk_mma, tSrQ, tSrK, tStS0, pipes.s[0], s0, k_state, 0)
                s1 = self.issue_qk(qk_mma_1, tSrQ, tSrK, tStS1, pipes.s[1], s1, k_state, 1)
                k_state = self.release_k(pipes, k_state)
                for j in cutlass.range(n, unroll=1):
                    has_next = j + 1 < n
                    pipes.v.consumer_wait(kv_state)
                    if has_next:
                        pipes.k.consumer_wait(k_state)
                    p0, o0, s0 = self.stage_step(
                        qk_mma, pv_mma, tSrQ, tSrK, tOrV, tStS0, tOtO0, tOrP0, pipes, 0, p0, o0, s0,
                        kv_state, k_state, j, has_next,
                    )  # fmt: skip
                    p1, o1, s1 = self.stage_step(
                        qk_mma_1, pv_mma, tSrQ, tSrK, tOrV, tStS1, tOtO1, tOrP1, pipes, 1, p1, o1, s1,
                        kv_state, k_state, j, has_next,
                    )  # fmt: skip
                    if has_next:
                        k_state = self.release_k(pipes, k_state)
                    pipes.v.consumer_release(kv_state)
                    kv_state.advance()
                o0 = self.commit_o(pipes.o[0], o0)
                o1 = self.commit_o(pipes.o[1], o1)
                q_state = self.release_q(pipes, q_state)
            valid, t, sched_state = fetch_task(pipes.sched, sched_state, sTask)

    @cute.jit
    def stage_step(
        self, qk_mma, pv_mma, tSrQ, tSrK, tOrV, tStS, tOtO, tOrP, pipes, q: cutlass.Constexpr[int], p_state,
        o_state, s_state, kv_state, k_state, j, has_next,
    ):  # fmt: skip
        """qstage2, q stage ``q``, K block ``j``: O_q (+)= P_q V_j, then S_q = Q_q K_{j+1}^T unless
        ``j`` is the last block. ``qk_mma`` is the stage's own tiled MMA: its ACCUMULATE field is set
        under this runtime branch, and the other stage's branch must not depend on that value."""
        pipes.p[q].consumer_wait(p_state)
        if j == 0:
            pipes.o[q].producer_acquire(o_state)  # the previous epilogue of this stage has read O_q
        tcgen05_fence_after()
        self.issue_pv(pv_mma, tOtO, tOrP, tOrV, kv_state.index, j > 0)
        pipes.p[q].consumer_release(p_state)  # fires when P V completes: O_q stable
        p_state.advance()
        if has_next:  # issued after the P V that reads P_q from these columns
            s_state = self.issue_qk(qk_mma, tSrQ, tSrK, tStS, pipes.s[q], s_state, k_state, q)
        return p_state, o_state, s_state

    @cute.jit
    def issue_pv(self, pv_mma, tOtO, tOrP, tOrV, v_stage: Int32, accumulate):
        """O (+)= P V[v_stage]; block 0 of a task overwrites O."""
        for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            if const_expr(kb == 0):
                pv_mma.set(tcgen05.Field.ACCUMULATE, accumulate)
            else:
                pv_mma.set(tcgen05.Field.ACCUMULATE, True)
            cute.gemm(pv_mma, tOtO, tOrP[None, None, kb], tOrV[None, None, kb, v_stage], tOtO)

    @cute.jit
    def issue_qk(self, qk_mma, tSrQ, tSrK, tStS, s_pipe, s_state, k_state, q: cutlass.Constexpr[int]):
        """S[stage] = Q_q K^T for the K tile in ``k_state`` (waited for by the caller)."""
        s_pipe.producer_acquire(s_state)  # the softmax has read this S stage
        tcgen05_fence_after()
        tStS_s = cute.make_tensor(tStS.iterator + s_state.index * self.tmem_s_stride, tStS.layout)
        for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            qk_mma.set(tcgen05.Field.ACCUMULATE, kb != 0)
            cute.gemm(qk_mma, tStS_s, tSrQ[None, None, kb, q], tSrK[None, None, kb, k_state.index], tStS_s)
        s_pipe.producer_commit(s_state)
        s_state.advance()
        return s_state

    @cute.jit
    def commit_o(self, o_pipe, o_state):
        """O is final once the MMAs issued so far complete (the task's last P V)."""
        o_pipe.producer_commit(o_state)
        o_state.advance()
        return o_state

    @cute.jit
    def release_q(self, pipes, q_state):
        """The task's Q tiles are free once the MMAs issued so far complete."""
        pipes.q.consumer_release(q_state)
        q_state.advance()
        return q_state

    @cute.jit
    def release_k(self, pipes, k_state):
        """The K stage is released when the MMAs issued so far complete."""
        pipes.k.consumer_release(k_state)
        k_state.advance()
        return k_state
