"""Compute and dQ warps of the SM100 backward kernel (a mixin of
:class:`flexattn_sm100.bwd_kernel.Sm100BwdKernel`; it reads the static config from ``self``). Never
run on SM100 hardware.

Compute thread ``t = 128 wg + r`` (``W`` warpgroups: k2q-1cta W = 2, tile_m = 128; d256 W = 1,
tile_m = 64) owns K row ``r`` (TMEM lane ``r``) and the Q columns ``64 wg + e``, ``e < 64``, of S^T
and dP^T, read with ``tcgen05.ld 32x32b.x32`` in two 32-column chunks: register ``e`` of the pair is
accumulator ``(r, 64 wg + e)`` = score ``(q = 64 wg + e, k = r)``, the element
``TmemLoadLayout(tile_m, 128, W, transposed=True)`` gives group ``t``, word ``e // 32``, bit
``e % 32`` (``tests/test_bwd_layout_agreement.py`` checks every register). In a ``k2q-2cta`` pair
rank ``c``'s K row ``r`` is row ``128 c + r`` of the 256-row plan block: subtile ``c`` of
``TmemLoadLayout(128, 256, 2, transposed=True)``, the same group, word and bit. Per step::

    [partial] words = mask_block_masks[entry, subtile c, group t]  (2 int32, GMEM -> registers)
    wait S^T_j  -> 64 registers ; P = exp2(S^T scale log2e - LSE2[q]) ; bit 0 -> P = 0
    P (16-bit) -> TMEM columns 32 + 32 wg .. (inside this thread's own S columns) ; arrive P_j
    wait dP^T_j ; [wait dS_{j-1} consumed] dS^T = P (dP^T - D[q]) -> SMEM row r ; arrive dS_j
    release the LSE2 / D stage (each warp once its lanes read it; to both CTAs of a pair)

dQ thread ``t`` (the warpgroup after the compute warps) owns accumulator row ``t``: dQ row ``t``, or
with dQ^T (d256) dQ column ``128 h + t`` of the CTA's half ``h``. Per step it waits for dQ_j, loads
``DQ_CHUNK`` columns at a time, releases the TMEM columns after the last load, and per chunk writes
its warp's 4 KB run (conflict-free 16-byte vectors) and bulk-adds it into the fp32 accumulator.
In a ``k2q-2cta`` pair only rank 0 adds to GMEM: rank 1's dQ warps hand each chunk to the same slot of
rank 0's run (``st.async``, DSMEM) and rank 0 adds its own before the bulk add (bwd_kernel docstring).
Deterministic mode: thread 0 (of rank 0 in a pair) waits until the (q head, Q block) turnstile equals
the entry's ticket (``dq_write_order`` rank times the splits, plus the split: the halves of one
writer take turns) before the first add, and advances it after every add of the step completed.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import nvvm

from maskplan_kernels.consumer_dq import bulk_reduce_add_f32, turnstile_advance, turnstile_wait
from maskplan_kernels.consumer_k2q import head_range
from maskplan_kernels.consumer_plan import element_ptr

from .bwd_helpers import (
    DQ_CHUNK,
    DQ_RUN_BYTES,
    WARP_ROWS,
    chunk_copy,
    dq_run_layout,
    operand_2d,
    store_async_remote,
)
from .fwd_helpers import shift_columns, tcgen05_fence_after, tcgen05_fence_before, tmem_acc

#: S^T / dP^T columns per tcgen05.ld of a compute thread
S_CHUNK = 32


class ComputeRoles:
    """Compute-warp and dQ-warp methods (mixin)."""

    # -- fragments (also traced by the layout-agreement probe) --------------------------------------
    def compute_fragments(self, thr, tmem_ptr, r: Int32) -> dict:
        """TMEM copies and coordinate tensors of compute thread ``r`` of its warpgroup; chunk ``c``
        of warpgroup ``wg`` is the chunk-0 partition shifted ``64 wg + 32 c`` columns."""
        tm, tn = self.tile_m, self.cta_n
        tStS = tmem_acc(thr["s"], (tn, tm), tmem_ptr + self.tmem_s)
        tPtdP = tmem_acc(thr["dp"], (tn, tm), tmem_ptr + self.tmem_dp)
        tScS = thr["s"].partition_C(cute.make_identity_tensor((tn, tm)))
        s_load, tLtS, tLcS = chunk_copy(tStS, tScS, r, S_CHUNK)
        _, tLtdP, _ = chunk_copy(tPtdP, tScS, r, S_CHUNK)
        # P^T packed: S_CHUNK fp32 columns hold 2 * S_CHUNK 16-bit values of one thread's row
        p_store, tStP, tScP = chunk_copy(tStS, tScS, r, S_CHUNK, store=True)
        return {
            "s_load": s_load,
            "tLtS": tLtS,
            "tLcS": tLcS,  # (k row, q column) of the chunk-0 registers
            "tLtdP": tLtdP,
            "p_store": p_store,
            "tStP": shift_columns(tStP, self.tmem_p - self.tmem_s),
            "tScP": tScP,  # (k row, packed column) of the P registers
        }

    def ds_store_view(self, sdS: cute.Tensor) -> cute.Tensor:
        """dS^T as the plain (cta_n, tile_m) tensor the compute threads write: the dK MMA's A
        operand layout (same buffer as the dQ MMA's MN-major A)."""
        return cute.make_tensor(sdS.iterator, operand_2d(sdS.layout))

    # -- compute warps --------------------------------------------------------------------------------
    @cute.jit
    def compute_role(
        self, thr, tmem_ptr, s, plan, work, pipes, bars, mdK, mdV, scale_log2, softmax_scale, tidx, cta_rank
    ):
        wg, r = tidx // 128, tidx % 128
        f = self.compute_fragments(thr, tmem_ptr, r)
        col0 = wg * self.payload_elements  # this thread's first Q column
        sdS2 = self.ds_store_view(s["sdS"])
        words = cute.make_rmem_tensor(self.payload_words, Int32)
        stats_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        j = Int32(0)
        for g in cutlass.range(work.q_per_kv, unroll=1):
            hr = head_range(plan, work, g)
            for i in cutlass.range(hr.partial_cnt, unroll=1):
                # spec 6.2 direct delivery: this thread's words of payload group tidx of the CTA's plane
                first = self.payload_offset(hr.partial_off + i, cta_rank, tidx)
                src = element_ptr(plan.mask_block_masks, first, align=4 * self.payload_words)
                cute.autovec_copy(cute.make_tensor(src, cute.make_layout(self.payload_words)), words)
                stats_state = self.compute_step(
                    f, s, sdS2, pipes, bars, stats_state, j, col0, r, scale_log2, words
                )
                j += 1
            for _ in cutlass.range(hr.full_cnt, unroll=1):
                stats_state = self.compute_step(
                    f, s, sdS2, pipes, bars, stats_state, j, col0, r, scale_log2, None
                )
                j += 1
        self.epilogue(thr, tmem_ptr, bars, mdK, mdV, work, softmax_scale, j, wg, r)

    @cute.jit
    def compute_step(self, f, s, sdS2, pipes, bars, stats_state, j: Int32, col0: Int32, r: Int32,
                     scale_log2: Float32, words):  # fmt: skip
        n_chunks = self.payload_elements // S_CHUNK
        stage = stats_state.index
        pipes.stats.consumer_wait(stats_state)
        # P^T = exp2(S^T scale log2e - LSE2[q]); packed predicate after the exponential (spec 5.1)
        cute.arch.mbarrier_wait(bars.s, j & 1)
        tcgen05_fence_after()
        rP = cute.make_rmem_tensor((S_CHUNK, n_chunks), Float32)
        rS = cute.make_rmem_tensor(f["tLcS"].shape, Float32)
        for c in cutlass.range_constexpr(n_chunks):
            cute.copy(f["s_load"], shift_columns(f["tLtS"], col0 + c * S_CHUNK), rS)
            cute.arch.fence_view_async_tmem_load()
            for e in cutlass.range_constexpr(S_CHUNK):
                lse2 = s["sLSE"][col0 + c * S_CHUNK + e, stage]
                p = cute.math.exp2(rS[e] * scale_log2 - lse2, fastmath=True)
                if const_expr(words is not None):
                    p = p if ((words[c] >> e) & 1) != 0 else Float32(0.0)
                rP[e, c] = p
        # P^T -> TMEM, 16-bit, two values per column: register i holds Q columns 2i, 2i + 1
        rP32 = cute.make_rmem_tensor(f["tScP"].shape, Float32)
        rP16 = cute.make_tensor(
            cute.recast_ptr(rP32.iterator, dtype=self.dtype), cute.make_layout(2 * S_CHUNK)
        )
        rP16.store(rP.load().to(self.dtype))
        cute.copy(f["p_store"], rP32, shift_columns(f["tStP"], col0 // 2))
        cute.arch.fence_view_async_tmem_store()
        tcgen05_fence_before()
        cute.arch.mbarrier_arrive(bars.p)
        # dS^T = P^T (dP^T - D[q]) -> SMEM, once the dK / dQ MMAs of the previous step read dS
        cute.arch.mbarrier_wait(bars.dp, j & 1)
        tcgen05_fence_after()
        if j > 0:
            cute.arch.mbarrier_wait(bars.dq, (j - 1) & 1)
        rdP = cute.make_rmem_tensor(f["tLcS"].shape, Float32)
        rdS = cute.make_rmem_tensor(S_CHUNK, self.dtype)
        for c in cutlass.range_constexpr(n_chunks):
            cute.copy(f["s_load"], shift_columns(f["tLtdP"], col0 + c * S_CHUNK), rdP)
            cute.arch.fence_view_async_tmem_load()
            ds = cute.make_rmem_tensor(S_CHUNK, Float32)
            for e in cutlass.range_constexpr(S_CHUNK):
                ds[e] = rP[e, c] * (rdP[e] - s["sDsum"][col0 + c * S_CHUNK + e, stage])
            rdS.store(ds.load().to(self.dtype))
            for v in cutlass.range_constexpr(S_CHUNK // 8):  # 16-byte runs (the swizzle keeps 8 together)
                dst = cute.local_tile(sdS2[r, None], (8,), ((col0 + c * S_CHUNK) // 8 + v,))
                cute.autovec_copy(cute.local_tile(rdS, (8,), (v,)), dst)
        # generic reads of LSE2 / D and generic writes of dS, then hand both to the async proxy
        cute.arch.fence_view_async_shared()
        tcgen05_fence_before()
        cute.arch.mbarrier_arrive(bars.ds)
        cute.arch.sync_warp()  # the warp's reads of LSE2 / D are done: its lanes 0 (.. 1) release
        pipes.stats.consumer_release(stats_state)
        stats_state.advance()
        return stats_state

    @cute.jit
    def epilogue(
        self, thr, tmem_ptr, bars, mdK, mdV, work, softmax_scale: Float32, n: Int32, wg: Int32, r: Int32
    ):
        """dK (times the softmax scale) and dV rows ``< k_valid`` (input dtype): the CTA's slice of
        head-dim columns (all, or half ``work.split`` of them), warpgroup ``wg`` of ``W`` taking
        ``1 / W`` of it. A K block without any entry stores zeros."""
        tn, geo = self.cta_n, self.geometry
        if n > 0:
            cute.arch.mbarrier_wait(bars.dkv, 0)
            tcgen05_fence_after()
        store = r < work.k_valid
        for m_x, key, offset, d, cols, scale in (
            (mdV, "dv", self.tmem_dv, self.head_dim_v, geo.dv_cols, None),
            (mdK, "dk", self.tmem_dk, self.head_dim_qk, geo.dk_cols, softmax_scale),
        ):
            part = cols // (self.num_compute_threads // 128)
            width = 32 if part % 32 == 0 else 16
            acc = tmem_acc(thr[key], (tn, cols), tmem_ptr + offset)
            coords = thr[key].partition_C(cute.make_identity_tensor((tn, cols)))
            load, tL, tLc = chunk_copy(acc, coords, r, width)
            regs = cute.make_rmem_tensor(tLc.shape, Float32)
            out = cute.make_rmem_tensor(width, self.dtype)
            heads = m_x.shape[1]
            # the CTA's columns of K row r: (cols,)
            first = ((work.k_offset + work.n_block * tn + r) * heads + work.kv_head) * d + work.split * cols
            row = cute.make_tensor(element_ptr(m_x, first), cute.make_layout(cols))
            for c in cutlass.range_constexpr(part // width):
                col = wg * part + c * width
                if n > 0:
                    cute.copy(load, shift_columns(tL, col), regs)
                    cute.arch.fence_view_async_tmem_load()
                    if const_expr(scale is not None):
                        for e in cutlass.range_constexpr(width):
                            regs[e] = regs[e] * scale
                else:
                    regs.fill(0.0)
                out.store(regs.load().to(self.dtype))
                if store:
                    cute.autovec_copy(out, cute.local_tile(row, (width,), (col // width,)))
        if n > 0:
            tcgen05_fence_before()

    # -- dQ warps -------------------------------------------------------------------------------------
    def dq_fragments(self, thr, tmem_ptr, t: Int32) -> dict:
        acc = self.geometry.dq_acc  # (rows, columns): dQ, or the CTA's slice of dQ^T
        tQtdQ = tmem_acc(thr["dq"], acc, tmem_ptr + self.tmem_dq)
        coords = thr["dq"].partition_C(cute.make_identity_tensor(acc))
        load, tL, tLc = chunk_copy(tQtdQ, coords, t, DQ_CHUNK)
        return {"load": load, "tL": tL, "tLc": tLc}

    @cute.jit
    def dq_role(self, thr, tmem_ptr, s, plan, work, bars, mdQaccum, mdQsem, t: Int32, cta_rank):
        f = self.dq_fragments(thr, tmem_ptr, t)
        w, lane = t // WARP_ROWS, t % WARP_ROWS
        first_run = work.split * len(self.dq_warps) + w  # this warp's accumulator rows: 128 split + 32 w ..
        run = s["sdQ"][None, w]
        slot = cute.make_tensor(run.iterator, dq_run_layout())[lane, None]  # (4, DQ_CHUNK / 4)
        regs = cute.make_rmem_tensor(f["tLc"].shape, Float32)
        j = Int32(0)
        for g in cutlass.range(work.q_per_kv, unroll=1):
            hr = head_range(plan, work, g)
            ranges = (
                (hr.partial_off, hr.partial_cnt, plan.mask_block_idx, plan.dq_write_order),
                (hr.full_off, hr.full_cnt, plan.full_block_idx, plan.dq_write_order_full),
            )
            for off, cnt, block_idx, write_order in ranges:  # partial, then full: the MMA warp's order
                for i in cutlass.range(cnt, unroll=1):
                    blk = work.qblk_base + block_idx[off + i]
                    ticket = write_order[off + i] * self.splits + work.split
                    self.dq_step(f, bars, regs, run, slot, mdQaccum, mdQsem, hr.q_head, blk, ticket, j, t,
                                 first_run, w, lane, cta_rank)  # fmt: skip
                    j += 1
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def dq_step(self, f, bars, regs, run, slot, mdQaccum, mdQsem, q_head: Int32, q_block: Int32,
                ticket: Int32, j: Int32, t: Int32, first_run: Int32, w: Int32, lane: Int32,
                cta_rank):  # fmt: skip
        geo = self.geometry
        n_chunks = geo.dq_acc[1] // DQ_CHUNK
        turn = pipeline.NamedBarrier(self.dq_turn_barrier_id, self.num_dq_threads)
        counter = element_ptr(mdQsem, q_head * mdQsem.shape[1] + q_block, align=4)
        writer = cta_rank == 0  # a pair's rank 0 adds the pair's dQ to GMEM (a single CTA: itself)
        cute.arch.mbarrier_wait(bars.dq, j & 1)
        tcgen05_fence_after()
        if const_expr(self.deterministic):
            if writer:
                turnstile_wait(counter, ticket, t)  # thread 0 spins; every dQ warp then fences
                turn.arrive_and_wait()
        block = q_head * mdQaccum.shape[1] + q_block * self.tile_m * self.head_dim_qk
        for c in cutlass.range_constexpr(n_chunks):
            cute.copy(f["load"], shift_columns(f["tL"], c * DQ_CHUNK), regs)
            cute.arch.fence_view_async_tmem_load()
            if const_expr(c == n_chunks - 1):  # every dQ column of this thread is in registers
                tcgen05_fence_before()
                cute.arch.mbarrier_arrive(bars.dq_empty)
            dst = block + (c * (geo.dq_block_rows // WARP_ROWS) + first_run) * WARP_ROWS * DQ_CHUNK
            if const_expr(self.pair == 1):
                self.add_chunk(regs, run, slot, element_ptr(mdQaccum, dst), lane, None, None)
            else:
                chunk = j * n_chunks + c  # this warp's handoffs so far: the parity of both barriers
                if writer:
                    self.add_chunk(regs, run, slot, element_ptr(mdQaccum, dst), lane, bars, w, chunk)
                else:  # the peer: its chunk into the same slot of the leader's run, once that is free
                    cute.arch.mbarrier_wait(bars.dq_peer_empty + w, chunk & 1)
                    self.send_to_leader(regs, slot, bars.dq_peer_full + w)
        if const_expr(self.deterministic):
            if writer:
                if lane == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=False)  # this warp's adds are in GMEM
                    cute.arch.fence_proxy("async.global")
                turn.arrive_and_wait()
                turnstile_advance(counter, t)

    @cute.jit
    def add_chunk(self, regs, run, slot, dst: cute.Pointer, lane: Int32, bars, w: Int32, chunk=None):
        """This thread's ``DQ_CHUNK`` dQ values into its slot of the warp's run, then the run (a 4 KB
        block of the accumulator order) bulk-added to ``dst``. In a pair (``bars`` given) the run first
        receives the peer's values of the same chunk and the slot takes the sum."""
        if lane == 0:  # the previous add has read this warp's run
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            if const_expr(bars is not None):  # ... so the peer may write its chunk there
                cute.arch.mbarrier_arrive_and_expect_tx(bars.dq_peer_full + w, DQ_RUN_BYTES)
                cute.arch.mbarrier_arrive(bars.dq_peer_empty + w, 1, scope=nvvm.MemScopeKind.CLUSTER)
        cute.arch.sync_warp()
        mine = cute.make_tensor(regs.iterator, slot.layout.shape)
        if const_expr(bars is not None):
            cute.arch.mbarrier_wait(bars.dq_peer_full + w, chunk & 1)
            # one 16-byte vector at a time; the warp sync keeps ptxas from hoisting all 8 loads (32
            # more live registers than the dQ warps' 80 hold: it spilled without)
            for v in cutlass.range_constexpr(DQ_CHUNK // 4):
                peer = cute.local_tile(slot, (4,), (v,))
                peer.store(peer.load() + cute.local_tile(mine, (4,), (v,)).load())
                cute.arch.sync_warp()
        else:
            cute.autovec_copy(mine, slot)
        cute.arch.fence_view_async_shared()
        cute.arch.sync_warp()
        if lane == 0:
            bulk_reduce_add_f32(run.iterator, dst, DQ_RUN_BYTES)
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def send_to_leader(self, regs: cute.Tensor, slot: cute.Tensor, full: cute.Pointer):
        """``st.async`` of this thread's ``DQ_CHUNK`` values, 16 bytes at a time, to the same slot of
        the leader's (rank 0) run; each store completes its bytes on the leader's ``full`` barrier."""
        bits = cute.make_tensor(cute.recast_ptr(regs.iterator, dtype=Int32), cute.make_layout(DQ_CHUNK))
        base = cute.arch.map_dsmem_ptr(cute.recast_ptr(slot.iterator, dtype=Int32), 0)
        leader_full = cute.arch.map_dsmem_ptr(full, 0)
        for v in cutlass.range_constexpr(DQ_CHUNK // 4):  # columns 4v .. 4v + 3: one 16-byte vector
            dst = base + cute.crd2idx(4 * v, slot.layout)
            store_async_remote(dst, tuple(bits[4 * v + i] for i in range(4)), leader_full)
