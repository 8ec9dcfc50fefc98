"""The softmax warpgroup of the SM100 forward kernel: packed predicate, online softmax, O rescale,
epilogue. A mixin of :class:`flexattn_sm100.fwd_kernel.Sm100FwdKernel` (it reads the kernel's static
config from ``self``). Never run on SM100 hardware.

Thread ``t`` (0..127) of the warpgroup of payload subtile ``r`` (the CTA rank of a pair, the q stage
with qstage2, else 0) owns score row ``128 r + t`` of the plan block: ``tcgen05.ld 32x32b`` of the
subtile's S in TMEM puts column ``e`` in its register ``e`` (:func:`fwd_helpers.score_tmem_load`,
the fragment :mod:`flexattn_sm100.payload_layout` describes), so the row max and row sum are plain
per-thread scalars and the packed predicate is the thread's own ``words_per_group`` words of payload
group ``t`` of subtile ``r``: loaded from GMEM directly (1CTA, qstage2) or from the CTA's SMEM
payload ring (2CTA, spec 6.2). With qstage2 each q stage has its own warpgroup, S, P and O (P over
S's columns) and S/P/O pipelines. P_j is always stored over the first tile_n / 2 columns of the S
stage S_j was read from (the MMA warp issues the next S into that stage only after P_j V_j: see
:mod:`flexattn_sm100.fwd_kernel`). Per block::

    [partial] payload words -> registers (ring: wait stage, copy, fence.proxy.async, release)
    wait S[j] ; tcgen05.ld S -> 128 fp32 registers ; release S[j] (the MMA may acquire it for S[j + 2])
    [partial] register e = -inf unless bit e % 32 of word e // 32            (spec 5.1)
    m' = max(m, rowmax) ; P = 2^(S * scale_log2 - m' * scale_log2) ; l = l * 2^((m - m') * scale_log2) + sum P
    acquire P (= the P V of block j-1 completed: O is stable)
    [j > 0 and some row of the warp changed its max] O *= correction (tcgen05.ld/st, 32 columns a time)
    tcgen05.st P (16-bit, packed two per column, over S[j]) ; commit P -> the MMA warp issues O += P V

O is only ever visited O_CHUNK = 32 columns at a time (rescale and epilogue), so a thread holds 32
of its row's Dv (up to 256) O values at once, next to the 128 score and 64 packed-P registers.

Epilogue: wait O ; O / l -> GMEM (rows < q_valid) ; LSE = (m * scale_log2 + log2 l) * ln 2 ;
rows that saw no key get O = 0 and LSE = -inf (the SM90 kernel's and the reference's convention).
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import tcgen05

from maskplan_kernels.consumer_plan import apply_packed_predicate, fetch_task
from maskplan_kernels.consumer_softmax import LN_2, LOG2_E

from .fwd_helpers import (
    O_CHUNK,
    load_words,
    read_staged_words,
    row_chunk_copies,
    score_tmem_load,
    shift_columns,
    softmax_update,
    tcgen05_fence_after,
    tcgen05_fence_before,
    tmem_acc,
)


class SoftmaxFragments(NamedTuple):
    """TMEM partitions, copies and registers of one softmax thread (built once per CTA)."""

    s_load: object  # tcgen05.ld 32x32b.x32 of a score tile
    tLtS: cute.Tensor  # this thread's S stage-0 TMEM partition
    tLcS: cute.Tensor  # score coordinates (m, n) of this thread's registers rS[e] (tests)
    rS: cute.Tensor  # (128,) fp32 score row -> P
    p_store: object  # tcgen05.st 32x32b of the packed P
    tPtP: cute.Tensor  # this thread's P TMEM partition (tile_n / 2 columns over S stage 0)
    tPcP: cute.Tensor  # (row, packed column) of rP32[j] (tests)
    rP32: cute.Tensor  # the packed P as fp32 registers (tile_n / 2)
    rP: cute.Tensor  # the same registers as tile_n 16-bit values, rS's layout
    o_load: object  # tcgen05.ld 32x32b of O_CHUNK columns of O
    o_store: object  # tcgen05.st 32x32b of O_CHUNK columns of O
    tLtO: cute.Tensor  # chunk 0 of this thread's O row (TMEM)
    tStO: cute.Tensor
    tLcO: cute.Tensor  # O coordinates (m, d) of rO[e] for chunk 0 (tests)
    rO: cute.Tensor  # (O_CHUNK,) fp32


class SoftmaxRole:
    """Softmax-warpgroup methods (mixin)."""

    def softmax_fragments(self, qk_thr, pv_thr, tmem_ptr, tidx, q: int = 0) -> SoftmaxFragments:
        """Fragments of thread ``tidx`` of q stage ``q``'s warpgroup."""
        # S stage 0: ((128, tile_n), 1, 1) fp32 in TMEM, and the (m, n) coordinates of its elements
        tStS = tmem_acc(qk_thr, (self.mma_tile_m, self.tile_n), tmem_ptr + self.tmem_s_offsets[q])
        # (m, n) of the plan block for this CTA's slice of q stage q's tile (2CTA: rows 128 r + [0,
        # 128); qstage2: rows 128 q + [0, 128))
        block = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS = qk_thr.partition_C(cute.local_tile(block, (self.mma_tile_m, self.tile_n), (q, 0)))
        s_load, tLtS, tLcS = score_tmem_load(tStS, tScS, tidx)
        rS = cute.make_rmem_tensor(tLcS.shape, Float32)
        # P: tile_n 16-bit values per row = tile_n / 2 fp32 columns of the CTA's 128 lanes, over the
        # first columns of S (stage 0 here; each block's P goes over its own S stage)
        p_cols = self.tile_n * self.dtype.width // 32
        tStP = cute.make_tensor(
            tmem_ptr + self.tmem_s_offsets[q],
            cute.composition(tStS.layout, cute.make_layout((self.cta_tile_m, p_cols))),
        )
        tScP = cute.make_tensor(
            tScS.iterator, cute.composition(tScS.layout, cute.make_layout((self.cta_tile_m, p_cols)))
        )
        p_store = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(32)), Float32), tStP
        )
        thr_p = p_store.get_slice(tidx)
        tPcP = thr_p.partition_S(tScP)
        rP32 = cute.make_rmem_tensor(tPcP.shape, Float32)
        rP = cute.make_tensor(cute.recast_ptr(rP32.iterator, dtype=self.dtype), rS.layout)
        # O: ((128, Dv), 1, 1) fp32 in TMEM, visited O_CHUNK columns at a time
        tOtO = tmem_acc(pv_thr, (self.mma_tile_m, self.head_dim_v), tmem_ptr + self.tmem_o_offsets[q])
        o_load, o_store, tLtO, tStO = row_chunk_copies(tOtO, tidx, O_CHUNK)
        o_block = cute.make_identity_tensor((self.tile_m, self.head_dim_v))
        cO = pv_thr.partition_C(cute.local_tile(o_block, (self.mma_tile_m, self.head_dim_v), (q, 0)))
        cO_chunk = cute.make_tensor(
            cO.iterator, cute.composition(cO.layout, cute.make_layout((self.cta_tile_m, O_CHUNK)))
        )
        tLcO = o_load.get_slice(tidx).partition_D(cO_chunk)
        return SoftmaxFragments(
            s_load, tLtS, tLcS, rS, p_store, thr_p.partition_D(tStP), tPcP, rP32, rP, o_load, o_store,
            tLtO, tStO, tLcO, cute.make_rmem_tensor(tLcO.shape, Float32),
        )  # fmt: skip

    @cute.jit
    def softmax_role(
        self, qk_thr, pv_thr, tmem_ptr, mO, mLSE, mMaxLogit, sTask, sMask, plan, softmax_scale: Float32,
        pipes, tidx: Int32, q: cutlass.Constexpr[int], subtile,
    ):  # fmt: skip
        """Thread ``tidx`` of the warpgroup of q stage ``q`` (payload ``subtile``)."""
        scale_log2 = softmax_scale * Float32(LOG2_E)
        frags = self.softmax_fragments(qk_thr, pv_thr, tmem_ptr, tidx, q)
        stage_pipes = (pipes.s[q], pipes.p[q], pipes.o[q])
        words = cute.make_rmem_tensor(self.payload_words, Int32)
        sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.sched_stages)
        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.s_stages)
        p_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        o_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        mask_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Consumer, max(1, self.mask_stages)
        )

        valid, t, sched_state = fetch_task(pipes.sched, sched_state, sTask)
        while valid != 0:
            m = -Float32.inf
            l_sum = Float32(0.0)
            for i in cutlass.range(t.partial_cnt, unroll=1):
                # this thread's words of payload group tidx, subtile ``subtile`` (spec 6.2)
                if const_expr(self.mask_stages > 0):
                    mask_state = read_staged_words(pipes.mask, mask_state, sMask, tidx, words)
                else:
                    plane = self.payload_plane_index(t.partial_off + i, subtile)
                    offset = plane * self.payload_plane + tidx * self.payload_words
                    load_words(plan.mask_block_masks, offset, words)
                s_state, p_state, m, l_sum = self.softmax_block(
                    frags, stage_pipes, s_state, p_state, m, l_sum, scale_log2, i > 0, words
                )
            for i in cutlass.range(t.full_cnt, unroll=1):
                s_state, p_state, m, l_sum = self.softmax_block(
                    frags, stage_pipes, s_state, p_state, m, l_sum, scale_log2, t.partial_cnt + i > 0, None
                )
            o_state = self.epilogue(
                frags, stage_pipes[2], o_state, t, m, l_sum, scale_log2, softmax_scale, mO, mLSE, mMaxLogit,
                subtile * self.cta_tile_m + tidx,
            )  # fmt: skip
            valid, t, sched_state = fetch_task(pipes.sched, sched_state, sTask)

    @cute.jit
    def softmax_block(
        self, frags: SoftmaxFragments, stage_pipes, s_state, p_state, m: Float32, l_sum: Float32,
        scale_log2: Float32, has_o, words,
    ):  # fmt: skip
        """One K block of this thread's row; see the module docstring. ``stage_pipes``: the q stage's
        (S, P, O) pipelines."""
        s_pipe, p_pipe, _ = stage_pipes
        rS = frags.rS
        s_pipe.consumer_wait(s_state)
        tcgen05_fence_after()
        s_columns = s_state.index * self.tmem_s_stride  # this block's S stage, and then its P
        cute.copy(frags.s_load, shift_columns(frags.tLtS, s_columns), rS)
        cute.arch.fence_view_async_tmem_load()
        tcgen05_fence_before()
        s_pipe.consumer_release(s_state)
        s_state.advance()
        if const_expr(words is not None):
            apply_packed_predicate(rS, words, self.payload_elements)
        m, l_sum, correction = softmax_update(rS, m, l_sum, scale_log2)
        frags.rP.store(rS.load().to(self.dtype))
        p_pipe.producer_acquire(p_state)  # P V of the previous block completed
        tcgen05_fence_after()
        if has_o:
            if cute.arch.vote_any_sync(correction != Float32(1.0)):  # warp-uniform: tcgen05.ld/st are
                self.rescale_o(frags, correction)  # warp-collective
        cute.copy(frags.p_store, frags.rP32, shift_columns(frags.tPtP, s_columns))
        cute.arch.fence_view_async_tmem_store()
        tcgen05_fence_before()
        p_pipe.producer_commit(p_state)
        p_state.advance()
        return s_state, p_state, m, l_sum

    @cute.jit
    def rescale_o(self, frags: SoftmaxFragments, factor: Float32):
        """O row *= factor, O_CHUNK TMEM columns at a time."""
        rO = frags.rO
        for c in cutlass.range_constexpr(self.head_dim_v // O_CHUNK):
            cute.copy(frags.o_load, shift_columns(frags.tLtO, c * O_CHUNK), rO)
            cute.arch.fence_view_async_tmem_load()
            for e in cutlass.range_constexpr(cute.size(rO)):
                rO[e] = rO[e] * factor
            cute.copy(frags.o_store, rO, shift_columns(frags.tStO, c * O_CHUNK))

    @cute.jit
    def epilogue(
        self, frags: SoftmaxFragments, o_pipe, o_state, t, m: Float32, l_sum: Float32, scale_log2: Float32,
        softmax_scale: Float32, mO: cute.Tensor, mLSE: cute.Tensor, mMaxLogit, row_in_tile: Int32,
    ):  # fmt: skip
        """Store this thread's O row ``row_in_tile`` of the plan block (input dtype) and LSE when the
        row is < q_valid, and fold its scaled row max into ``mMaxLogit[head]`` (one atomic per warp).
        Every row of the tile takes part in the TMEM reads (warp-collective); only valid rows write."""
        store = row_in_tile < t.q_valid
        q_row = t.q_offset + t.m_block * self.tile_m + row_in_tile
        num_heads = mO.shape[1]
        row_offset = (cutlass.Int64(q_row) * num_heads + t.head) * self.head_dim_v
        gO_row = cute.make_tensor(
            cute.make_ptr(
                self.dtype, (mO.iterator + row_offset).toint(), cute.AddressSpace.gmem, assumed_align=16
            ),
            cute.make_layout(self.head_dim_v),
        )
        empty = l_sum == Float32(0.0)
        inv = Float32(0.0) if empty else cute.arch.rcp_approx(l_sum)
        lse = (
            -Float32.inf if empty else (m * scale_log2 + cute.math.log2(l_sum, fastmath=True)) * Float32(LN_2)
        )
        rO = frags.rO
        out = cute.make_rmem_tensor(cute.make_layout(O_CHUNK), self.dtype)
        has_blocks = t.partial_cnt + t.full_cnt > 0
        if has_blocks:
            o_pipe.consumer_wait(o_state)
            tcgen05_fence_after()
        for c in cutlass.range_constexpr(self.head_dim_v // O_CHUNK):
            if has_blocks:
                cute.copy(frags.o_load, shift_columns(frags.tLtO, c * O_CHUNK), rO)
                cute.arch.fence_view_async_tmem_load()
                for e in cutlass.range_constexpr(O_CHUNK):
                    rO[e] = rO[e] * inv
            else:
                rO.fill(0.0)
            out.store(cute.make_tensor(rO.iterator, cute.make_layout(O_CHUNK)).load().to(self.dtype))
            if store:
                cute.autovec_copy(out, cute.local_tile(gO_row, (O_CHUNK,), (c,)))
        if has_blocks:
            tcgen05_fence_before()
            o_pipe.consumer_release(o_state)
            o_state.advance()
        if store:
            mLSE[t.head, q_row] = lse
        if const_expr(mMaxLogit is not None):
            row_m = m if store else -Float32.inf
            for offset in (16, 8, 4, 2, 1):
                row_m = cute.arch.fmax(row_m, cute.arch.shuffle_sync_bfly(row_m, offset=offset))
            if cute.arch.lane_idx() == 0 and row_m != -Float32.inf:
                cute.arch.atomic_fmax(mMaxLogit.iterator + t.head, row_m * softmax_scale)
        return o_state
