"""Consumer warpgroups of the SM90 forward kernel: the MMA/softmax main loop and the epilogue.

A mixin of :class:`flexattn_sm90.fwd_kernel.Sm90FwdKernel` (it reads the kernel's static config
from ``self``). Per task both consumer warpgroups visit the partial range (packed predicate
applied) and then the full range (no mask work) of their 128-row Q tile, 64 rows each::

    simple      per block: S = QK^T; wait; [mask]; softmax; O += PV; wait
    overlap     S_{i+1} is issued before O += P_i V_i and the softmax of S_{i+1} runs while
                P_i V_i is still on the tensor cores; O is rescaled once P_i V_i retires (FA3's
                intra-warpgroup overlap). Q is released before the last PV GEMM, so with one Q
                buffer the next task's Q load starts while this task finishes. Every GEMM is
                issued and waited for within one step: ptxas serialises a WGMMA still in flight
                across a loop edge (what a schedule issuing S_{i+1} at the end of step i, then
                consuming it in step i + 1, ran into: C7517)

Every schedule consumes the same pipelines in the same order; the payload of a partial block is
read before its S is used and the mask pipeline advances only on partial blocks.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from maskplan_kernels.consumer_entry import rows_from
from maskplan_kernels.consumer_plan import apply_packed_predicate, element_ptr, fetch_task
from maskplan_kernels.consumer_softmax import LOG2_E

from .fwd_helpers import (
    acc_as_operand_a,
    acc_mn_view,
    finalize_softmax,
    online_softmax_scores,
    rescale_rows,
    stage_fragment,
    store_rows,
    transpose_view,
    wgmma,
)

SCHEDULES = ("simple", "overlap")
#: consumer main-loop schedule when none is asked for (one of SCHEDULES). Measured on H200
#: (B=2, S=8192, H=16, bf16; benchmarks/RESULTS.md, session 7): ``overlap`` ran 1-8% faster than
#: ``simple`` at D=128 except on random-5 (every block partial, 2% slower), 0-4% at D=64 and 6-18%
#: at D=256; the retired ``pipelined`` schedule (S_{i+1} in flight across the loop edge, which
#: ptxas serialised) 4-9% slower at D=128; overlap with FA3's warpgroup turns (pingpong) won
#: nowhere by more than 2% and lost up to 9%, so it is not kept
DEFAULT_SCHEDULE = "overlap"


class Operands(NamedTuple):
    """What the consumer main loop works with (WGMMA fragments, softmax state, pipelines)."""

    mma_qk: object
    mma_pv: object
    tSrQ: cute.Tensor
    tSrK: cute.Tensor
    tOrV: cute.Tensor
    tOrP: cute.Tensor
    acc_o: cute.Tensor
    row_max: cute.Tensor
    row_sum: cute.Tensor
    correction: cute.Tensor  # O's per-row factor of the last softmax step
    pipe_k: object
    pipe_v: object
    pipe_mask: object
    sMask: cute.Tensor
    masks: cute.Tensor
    scale_log2: Float32
    tidx: Int32
    wg: Int32


class ConsumerMainloop:
    """Consumer-side warp-role methods (mixin)."""

    @cute.jit
    def consumer(
        self, mma_qk, mma_pv, mma_o, mO, mLSE, mMaxLogit, sQ, sK, sV, sO, sTask, sMask, plan,
        softmax_scale: Float32, pipes, tidx: Int32,
    ):  # fmt: skip
        scale_log2 = softmax_scale * Float32(LOG2_E)
        pipe_q, pipe_k, pipe_v, pipe_mask, pipe_sched = pipes
        wg = tidx // self.threads_per_wg
        # WGMMA operands: A/B descriptors per warpgroup, C per thread
        wg_qk, wg_pv = mma_qk.get_slice(wg * self.threads_per_wg), mma_pv.get_slice(wg * self.threads_per_wg)
        thr_qk, thr_pv = mma_qk.get_slice(tidx), mma_pv.get_slice(tidx)
        # (row, col) in the tile of each acc_o element, as (rows, cols) of this thread
        tOcO = acc_mn_view(thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v))))
        num_rows = cute.size(tOcO, mode=[0])
        ops = Operands(
            mma_qk=mma_qk,
            mma_pv=mma_pv,
            tSrQ=wg_qk.make_fragment_A(wg_qk.partition_A(sQ)),  # (MMA, MMA_M, MMA_K, q_buffers)
            tSrK=wg_qk.make_fragment_B(wg_qk.partition_B(sK)),  # (MMA, MMA_N, MMA_K, stages)
            tOrV=wg_pv.make_fragment_B(wg_pv.partition_B(transpose_view(sV))),  # (MMA, MMA_N, MMA_K, stages)
            tOrP=thr_pv.make_fragment_A(thr_pv.partition_shape_A((self.tile_m, self.tile_n))),
            acc_o=cute.make_rmem_tensor(thr_pv.partition_shape_C((self.tile_m, self.head_dim_v)), Float32),
            row_max=cute.make_rmem_tensor(num_rows, Float32),
            row_sum=cute.make_rmem_tensor(num_rows, Float32),
            correction=cute.make_rmem_tensor(num_rows, Float32),
            pipe_k=pipe_k,
            pipe_v=pipe_v,
            pipe_mask=pipe_mask,
            sMask=sMask,
            masks=plan.mask_block_masks,
            scale_log2=scale_log2,
            tidx=tidx,
            wg=wg,
        )
        acc_s_shape = thr_qk.partition_shape_C((self.tile_m, self.tile_n))
        lse = cute.make_rmem_tensor(num_rows, Float32)

        sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.sched_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_buffers)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        mask_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.mask_stages)

        valid, t, sched_state = fetch_task(pipe_sched, sched_state, sTask)
        while valid != 0:
            ops.acc_o.fill(0.0)
            ops.row_max.fill(-Float32.inf)
            ops.row_sum.fill(0.0)
            has_blocks = t.partial_cnt + t.full_cnt > 0
            if has_blocks:
                pipe_q.consumer_wait(q_state)
                # this task's Q buffer
                task_ops = ops._replace(tSrQ=ops.tSrQ[None, None, None, q_state.index])
                if const_expr(self.schedule == "overlap"):  # releases Q itself, before its last GEMM
                    kv_state, mask_state = self.mainloop_overlap(
                        task_ops, acc_s_shape, t, kv_state, mask_state, pipe_q, q_state
                    )
                else:
                    kv_state, mask_state = self.mainloop_simple(
                        task_ops, acc_s_shape, t, kv_state, mask_state
                    )
                    pipe_q.consumer_release(q_state)
                q_state.advance()
            finalize_softmax(ops.acc_o, ops.row_max, ops.row_sum, lse, scale_log2)
            self.epilogue(ops, mma_o, sO, lse, tOcO, mO, mLSE, mMaxLogit, softmax_scale, t)
            valid, t, sched_state = fetch_task(pipe_sched, sched_state, sTask)

    # -- packed predicate delivery ----------------------------------------------------------------
    @cute.jit
    def read_payload(self, ops, mask_state, entry: Int32, words: cute.Tensor):
        """This thread's payload registers of partial entry ``entry`` (register ``slot`` = plane word
        ``payload_layout.register_source(tidx, slot)``): from the SMEM stage (spec 6.2: wait, copy
        to registers, release) or directly from GMEM."""
        if const_expr(self.mask_via_smem):
            ops.pipe_mask.consumer_wait(mask_state)
            for slot in cutlass.range_constexpr(self.payload_registers):
                group, word = self.payload_layout.register_source(ops.tidx, slot)
                words[slot] = ops.sMask[word, group, mask_state.index]
            # generic-proxy reads must complete before cp.async.bulk (async proxy) rewrites the slot
            cute.arch.fence_proxy("async.shared", space="cta")
            ops.pipe_mask.consumer_release(mask_state)
            mask_state.advance()
        else:
            plane = cute.make_tensor(
                element_ptr(ops.masks, entry * self.payload_plane, 16),
                cute.make_layout((self.payload_words, self.payload_groups)),
            )
            for slot in cutlass.range_constexpr(self.payload_registers):
                group, word = self.payload_layout.register_source(ops.tidx, slot)
                words[slot] = plane[word, group]
        return mask_state

    # -- schedules --------------------------------------------------------------------------------
    @cute.jit
    def issue_s(self, ops, acc_s: cute.Tensor, state, wait: cutlass.Constexpr[int]):
        """``S = Q K^T`` of the K stage ``state`` (``wait``: as :func:`wgmma`)."""
        wgmma(ops.mma_qk, acc_s, ops.tSrQ, ops.tSrK[None, None, None, state.index], zero_init=True, wait=wait)

    @cute.jit
    def issue_pv(self, ops, state, wait: cutlass.Constexpr[int]):
        """``O += P V`` of the V stage ``state``, P from the A-operand registers."""
        tV = ops.tOrV[None, None, None, state.index]
        wgmma(ops.mma_pv, ops.acc_o, ops.tOrP, tV, zero_init=False, wait=wait)

    @cute.jit
    def softmax_to_p(self, ops, acc_s: cute.Tensor, words):
        """[Packed predicate,] online softmax step, P (input dtype) into the PV A-operand registers."""
        self.softmax_scores(ops, acc_s, words)
        self.rescale_to_p(ops, acc_s)

    @cute.jit
    def softmax_scores(self, ops, acc_s: cute.Tensor, words):
        """[Packed predicate,] the score half of the softmax step (leaves O alone)."""
        if const_expr(words is not None):
            apply_packed_predicate(acc_s, words, self.payload_elements, self.payload_layout.register_bit)
        online_softmax_scores(acc_s, ops.row_max, ops.row_sum, ops.correction, ops.scale_log2)

    @cute.jit
    def rescale_to_p(self, ops, acc_s: cute.Tensor):
        """The O half of the softmax step, then P into the PV A-operand registers."""
        rescale_rows(ops.acc_o, ops.correction)
        ops.tOrP.store(acc_as_operand_a(acc_s).load().to(self.dtype))

    @cute.jit
    def mainloop_simple(self, ops, acc_s_shape, t, kv_state, mask_state):
        words = cute.make_rmem_tensor(self.payload_registers, Int32)
        for i in cutlass.range(t.partial_cnt, unroll=1):
            mask_state = self.read_payload(ops, mask_state, t.partial_off + i, words)
            kv_state = self.simple_step(ops, acc_s_shape, kv_state, words)
        for _ in cutlass.range(t.full_cnt, unroll=1):
            kv_state = self.simple_step(ops, acc_s_shape, kv_state, None)
        return kv_state, mask_state

    @cute.jit
    def simple_step(self, ops, acc_s_shape, kv_state, words):
        acc_s = cute.make_rmem_tensor(acc_s_shape, Float32)
        ops.pipe_k.consumer_wait(kv_state)
        self.issue_s(ops, acc_s, kv_state, 0)
        ops.pipe_k.consumer_release(kv_state)
        self.softmax_to_p(ops, acc_s, words)
        ops.pipe_v.consumer_wait(kv_state)
        self.issue_pv(ops, kv_state, 0)
        ops.pipe_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    @cute.jit
    def mainloop_overlap(self, ops, acc_s_shape, t, kv_state, mask_state, pipe_q, q_state):
        """GEMM issue order ``S_0; S_1, P_0 V_0; S_2, P_1 V_1; ...; P_{n-1} V_{n-1}``::

            step j:   issue S_j = Q K_j^T, issue O += P_{j-1} V_{j-1}
                      wait S_j  -> [mask,] softmax scores of S_j      (P_{j-1} V_{j-1} still runs)
                      wait PV   -> O *= correction_j, P_j into registers
        """
        total = t.partial_cnt + t.full_cnt
        words = cute.make_rmem_tensor(self.payload_registers, Int32)
        acc_s = cute.make_rmem_tensor(acc_s_shape, Float32)
        ops.pipe_k.consumer_wait(kv_state)
        self.issue_s(ops, acc_s, kv_state, -1)
        if t.partial_cnt > 0:  # the payload read overlaps S_0
            mask_state = self.read_payload(ops, mask_state, t.partial_off, words)
        warpgroup.wait_group(0)
        ops.pipe_k.consumer_release(kv_state)
        if t.partial_cnt > 0:
            self.softmax_scores(ops, acc_s, words)
            if t.partial_cnt > 1:
                mask_state = self.read_payload(ops, mask_state, t.partial_off + 1, words)
        else:
            self.softmax_scores(ops, acc_s, None)
        ops.tOrP.store(acc_as_operand_a(acc_s).load().to(self.dtype))  # O is still 0: no rescale
        for j in cutlass.range(1, t.partial_cnt, unroll=1):
            kv_state, mask_state = self.overlap_step(
                ops, acc_s, words, kv_state, mask_state, True, j + 1 < t.partial_cnt, t.partial_off + j + 1
            )
        for _ in cutlass.range(cutlass.max(t.partial_cnt, 1), total, unroll=1):
            kv_state, mask_state = self.overlap_step(
                ops, acc_s, words, kv_state, mask_state, False, None, None
            )
        pipe_q.consumer_release(q_state)  # the last S GEMM has retired
        ops.pipe_v.consumer_wait(kv_state)
        self.issue_pv(ops, kv_state, 0)
        ops.pipe_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state, mask_state

    @cute.jit
    def overlap_step(
        self, ops, acc_s, words, kv_state, mask_state, partial: cutlass.Constexpr[bool], next_partial,
        next_entry,
    ):  # fmt: skip
        """Step ``j`` of :meth:`mainloop_overlap`; ``kv_state`` is block ``j - 1``'s stage."""
        s_state = kv_state.clone()
        s_state.advance()
        ops.pipe_k.consumer_wait(s_state)
        self.issue_s(ops, acc_s, s_state, -1)
        ops.pipe_v.consumer_wait(kv_state)
        self.issue_pv(ops, kv_state, -1)
        warpgroup.wait_group(1)  # S_j is in acc_s (groups retire in order); P_{j-1} V_{j-1} may run
        ops.pipe_k.consumer_release(s_state)
        self.softmax_scores(ops, acc_s, words if const_expr(partial) else None)
        # the payload of block j + 1 (block j's words are consumed): from SMEM while PV runs; a
        # direct GMEM read after the step, where the registers it holds do not overlap the softmax
        # and S_{j+1} covers its latency
        if const_expr(self.mask_via_smem):
            mask_state = self.read_next_payload(ops, mask_state, next_partial, next_entry, words)
        warpgroup.wait_group(0)  # tOrP and O are free again
        ops.pipe_v.consumer_release(kv_state)
        self.rescale_to_p(ops, acc_s)
        if const_expr(not self.mask_via_smem):
            mask_state = self.read_next_payload(ops, mask_state, next_partial, next_entry, words)
        return s_state, mask_state

    @cute.jit
    def read_next_payload(self, ops, mask_state, next_partial, next_entry, words):
        if const_expr(next_partial is not None):
            if next_partial:
                mask_state = self.read_payload(ops, mask_state, next_entry, words)
        return mask_state

    # -- epilogue ---------------------------------------------------------------------------------
    @cute.jit
    def epilogue(
        self, ops, mma_o, sO: cute.Tensor, lse: cute.Tensor, tOcO: cute.Tensor, mO: cute.Tensor,
        mLSE: cute.Tensor, mMaxLogit, softmax_scale: Float32, t,
    ):  # fmt: skip
        """Store O rows of valid positions (``< q_valid``; input dtype), their LSE (fp32), and fold
        their scaled row maxima into ``mMaxLogit[head]``. Tile row ``R`` is position
        ``R // G`` of q head ``G * t.head + R % G`` with PackGQA (``G`` = :attr:`pack_group`),
        position ``R`` of ``t.head`` otherwise.

        O goes through SMEM, ``o_chunk`` columns at a time, so that global memory sees whole rows::

            registers --stmatrix--> sO (tile_m x o_chunk) --16-byte row vectors--> O

        Each warpgroup stages and stores only its own 64 rows, so a warpgroup barrier orders the
        two hops. Stored straight from the WGMMA fragment (4-byte pieces of 8 rows per warp
        instruction), O took a fifth to a third of the time of short tasks (sliding window,
        documents; benchmarks/RESULTS.md, session 8)."""
        g = self.pack_group
        pos0 = t.q_offset + t.m_block * self.tile_positions
        for r in cutlass.range_constexpr(cute.size(tOcO, mode=[0])):
            row = tOcO[r, 0][0]
            if row // g < t.q_valid and tOcO[r, 0][1] == 0:
                mLSE[t.head * g + row % g, pos0 + row // g] = lse[r]
        if const_expr(mMaxLogit is not None):
            if const_expr(self.pack_gqa):
                self.fold_max_logit_per_row(ops.row_max, tOcO, mMaxLogit, softmax_scale, t)
            else:
                self.fold_max_logit(ops.row_max, tOcO, mMaxLogit, softmax_scale, t)

        r_o = cute.make_rmem_tensor_like(ops.acc_o, self.dtype)
        r_o.store(ops.acc_o.load().to(self.dtype))
        # (tile_m, Dv) of O; mO is ((G, total_q), Dv, Hkv) with PackGQA, (total_q, Hq, Dv) otherwise
        mO_head = mO[None, None, t.head] if const_expr(self.pack_gqa) else mO[None, t.head, None]
        gO = cute.local_tile(
            rows_from(mO_head, t.q_offset, self.pack_gqa),
            (self.tile_m, self.head_dim_v),
            (t.m_block, 0),
        )
        # a chunk's fragment (its WGMMA C ownership) is a run of r_o's registers: C values are
        # ordered column group major
        chunk_layout = cute.make_layout(mma_o.get_slice(ops.tidx).partition_shape_C(sO.shape))
        wg_rows = 64
        s_rows = cute.local_tile(sO, (wg_rows, self.o_chunk), (ops.wg, 0))
        tid = ops.tidx % self.threads_per_wg  # the thread's index in its warpgroup
        # the chunks holding O's columns (its head dim may end inside the tile: io_head_dims)
        for c in cutlass.range_constexpr(-(-self.io_head_dim_v // self.o_chunk)):
            self.warpgroup_barrier(ops.wg)  # the warpgroup's last reads of sO are done
            r_chunk = cute.make_tensor(r_o.iterator + c * cute.size(chunk_layout), chunk_layout)
            stage_fragment(mma_o, r_chunk, sO, ops.tidx)
            self.warpgroup_barrier(ops.wg)  # the chunk is in sO
            g_rows = cute.local_tile(gO, (wg_rows, self.o_chunk), (ops.wg, c))
            store_rows(
                s_rows, g_rows, tid, self.threads_per_wg, ops.wg * wg_rows, g, t.q_valid,
                valid_cols=self.io_head_dim_v - c * self.o_chunk,
            )  # fmt: skip

    @cute.jit
    def warpgroup_barrier(self, wg: Int32):
        """Named barrier of consumer warpgroup ``wg``'s 128 threads (ids 1, 2; 0 is the CTA's)."""
        cute.arch.barrier(barrier_id=1 + wg, number_of_threads=self.threads_per_wg)

    @cute.jit
    def fold_max_logit(self, row_max, tOcO, mMaxLogit, softmax_scale: Float32, t):
        """All rows of the tile are one head: one atomic per warp."""
        m = -Float32.inf
        for r in cutlass.range_constexpr(cute.size(tOcO, mode=[0])):
            if tOcO[r, 0][0] < t.q_valid:
                m = cute.arch.fmax(m, row_max[r])
        # the 4 lanes of a quad hold the same rows: reduce over the 8 quads of the warp
        for offset in (16, 8, 4):
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=offset))
        if cute.arch.lane_idx() == 0 and m != -Float32.inf:
            cute.arch.atomic_fmax(mMaxLogit.iterator + t.head, m * softmax_scale)

    @cute.jit
    def fold_max_logit_per_row(self, row_max, tOcO, mMaxLogit, softmax_scale: Float32, t):
        """PackGQA: rows belong to different heads; the quad's first lane folds each of its rows."""
        g = self.pack_group
        for r in cutlass.range_constexpr(cute.size(tOcO, mode=[0])):
            row = tOcO[r, 0][0]
            if row // g < t.q_valid and tOcO[r, 0][1] == 0 and row_max[r] != -Float32.inf:
                head = t.head * g + row % g
                cute.arch.atomic_fmax(mMaxLogit.iterator + head, row_max[r] * softmax_scale)
