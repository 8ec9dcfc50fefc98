"""Load warp of the SM100 backward kernel (a mixin of :class:`flexattn_sm100.bwd_kernel.Sm100BwdKernel`;
it reads the static config from ``self``). Never run on SM100 hardware.

TMA: the CTA's K and V block once (its own 128 rows, in a ``k2q-2cta`` pair too), then per step the Q
and dO tiles of the visited Q block (a pair: this rank's half of each, multicast to both CTAs) and,
by bulk copy, that block's LSE2 and D (a pair: rank 0 LSE2, rank 1 D, multicast)::

    K, V  -> kv stage (once)
    for every K2Q entry j (partial then full, per Q head of the kv group):
        Q_j + LSE2_j, D_j -> Q stage / stats stage j % q_stages
        dO_j              -> dO stage

A sample's last K block and last Q block also hold the next sample's first rows. They meet zero
probabilities (keys: masked; queries: masked, never stored), but 0 * inf = nan in the MMAs, so a
nan / inf there would reach this sample. A CTA without a pair therefore lands such a K / V, Q or dO
tile on a barrier of its own, zeroes the rows past the sample (``stage_fill.land_zeroing_tail``,
the rows through ``stage_fill.row_view``) and only then signals the stage::

    K, V stage  [ k_valid rows | next sample ]   TMA -> mbar_tail; zero rows >= k_valid; fence.proxy.async;
    Q / dO stage [ q_len - m_block tile_m rows | next sample ]   plain arrive on the stage's full barrier

A ``k2q-2cta`` pair does not zero yet: its Q / dO halves are multicast onto both CTAs' barriers.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import cpasync

from maskplan_kernels.consumer_k2q import head_range, total_steps
from maskplan_kernels.consumer_plan import desc_field
from maskplan_kernels.geometry import DESC_Q_LEN
from maskplan_kernels.stage_fill import fill_stage, row_view


class LoadRole:
    """Load-warp methods (mixin)."""

    @cute.jit
    def load_role(
        self, thr, tma_k, mK, tma_v, mV, tma_q, mQ, tma_do, mdO, mLSE, mDsum, s, plan, work, kv_heads, pipes,
        cta_rank, mbar_tail,
    ):  # fmt: skip
        no_mcast = cute.make_layout(1)
        # Q and dO: this CTA's 1 / pair of each tile, multicast to the pair (mask: every rank)
        pair_layout = cute.make_layout(self.pair)
        mcast = {"mcast_mask": cutlass.Int16((1 << self.pair) - 1)} if self.pair > 1 else {}
        dqk, dv_, tm, tn = self.head_dim_qk, self.head_dim_v, self.tile_m, self.cta_n
        # LSE2 and D: one per rank of a pair (2 of them), multicast
        bulk_op = cpasync.CopyBulkG2SMulticastOp() if self.pair > 1 else cpasync.CopyBulkG2SOp()
        bulk_f32 = cute.make_copy_atom(bulk_op, Float32)
        kv_head = work.kv_head  # K / V's: the item's over the split (a pair's items are never split)
        if const_expr(self.pair == 1):
            kv_head = work.kv_head // (kv_heads // mK.shape[2])
        if total_steps(plan, work) > 0:
            # K and V of this CTA's block, once: (cta_n, D, n_blocks, 1) of this sample and kv head
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            kv_copies, kv_rows = [], []
            for atom, m_x, s_x, t, d, name in (
                (tma_k, mK, s["sK"], thr["s"], dqk, "k"),
                (tma_v, mV, s["sV"], thr["dp"], dv_, "v"),
            ):
                g_x = cute.flat_divide(
                    cute.domain_offset((work.k_offset, 0), m_x[None, None, kv_head]), (tn, d)
                )
                t_s, t_g = cpasync.tma_partition(
                    atom, 0, no_mcast, cute.group_modes(s_x, 0, 3), cute.group_modes(t.partition_A(g_x), 0, 3)
                )
                kv_copies.append((atom, t_g[None, work.n_block, 0], t_s[None, 0]))
                kv_rows.append(row_view(s_x[None, None, None, 0], tn, d, self.swizzle_bits[name]))
            kv_tail = self.tail_of(True, work.k_valid, kv_rows, mbar_tail)
            fill_stage(pipes.kv, kv_state, kv_copies, tail=kv_tail)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.do_stages)
        q_len = desc_field(plan.sequence_desc, plan.k_row_batch[work.row], DESC_Q_LEN)
        for g in cutlass.range(work.q_per_kv, unroll=1):
            hr = head_range(plan, work, g)
            # Q, dO: (tile_m, D, q_blocks, 1) of this sample and q head
            g_q = cute.flat_divide(
                cute.domain_offset((work.q_offset, 0), mQ[None, None, hr.q_head]), (tm, dqk)
            )
            g_do = cute.flat_divide(
                cute.domain_offset((work.q_offset, 0), mdO[None, None, hr.q_head]), (tm, dv_)
            )
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_q,
                cta_rank,
                pair_layout,
                cute.group_modes(s["sQ"], 0, 3),
                cute.group_modes(thr["s"].partition_B(g_q), 0, 3),
            )
            tdOsdO, tdOgdO = cpasync.tma_partition(
                tma_do, cta_rank, pair_layout, cute.group_modes(s["sdO"], 0, 3),
                cute.group_modes(thr["dp"].partition_B(g_do), 0, 3),
            )  # fmt: skip
            stats_row = hr.q_head * mLSE.shape[1]
            tiles = (tma_q, tQgQ, tQsQ, tma_do, tdOgdO, tdOsdO)
            for i in cutlass.range(hr.partial_cnt, unroll=1):  # a sample's last Q block is partial
                q_state, do_state = self.load_step(
                    plan.mask_block_idx[hr.partial_off + i], work, stats_row, pipes, q_state, do_state, tiles,
                    bulk_f32, mLSE, mDsum, s, mcast, cta_rank, q_len, mbar_tail, True,
                )  # fmt: skip
            for i in cutlass.range(hr.full_cnt, unroll=1):
                q_state, do_state = self.load_step(
                    plan.full_block_idx[hr.full_off + i], work, stats_row, pipes, q_state, do_state, tiles,
                    bulk_f32, mLSE, mDsum, s, mcast, cta_rank, q_len, mbar_tail, False,
                )  # fmt: skip

    @cute.jit
    def load_step(
        self, m_block, work, stats_row, pipes, q_state, do_state, tiles, bulk_f32, mLSE, mDsum, s, mcast,
        cta_rank, q_len, mbar_tail, partial: cutlass.Constexpr[bool],
    ):  # fmt: skip
        """Q + (LSE2, D) into stage ``q_state`` of the Q and stats pipelines, dO into its own; a CTA of
        a pair loads its half of Q and dO and one of LSE2 (rank 0) and D (rank 1) for both
        (``mcast``). A ``partial`` block may be the sample's last: Q and dO rows past ``q_len`` are
        zeroed (module docstring); a full block never holds such rows."""
        tma_q, tQgQ, tQsQ, tma_do, tdOgdO, tdOsdO = tiles
        q_valid = q_len - m_block * self.tile_m
        q_copy = ((tma_q, tQgQ[None, m_block, 0], tQsQ[None, q_state.index]),)
        q_rows = (row_view(s["sQ"][None, None, None, q_state.index], self.tile_m, self.head_dim_qk,
                           self.swizzle_bits["q"]),)  # fmt: skip
        fill_stage(pipes.q, q_state, q_copy, tail=self.tail_of(partial, q_valid, q_rows, mbar_tail), **mcast)
        pipes.stats.producer_acquire(q_state)
        bar = pipes.stats.producer_get_barrier(q_state)
        first = stats_row + (work.qblk_base + m_block) * self.tile_m
        stats = cute.make_layout(self.tile_m)
        for i, (m_stat, s_stat) in enumerate(((mLSE, s["sLSE"]), (mDsum, s["sDsum"]))):
            src = cute.make_tensor(
                cute.make_ptr(
                    Float32, (m_stat.iterator + first).toint(), cute.AddressSpace.gmem, assumed_align=16
                ),
                stats,
            )
            dst = cute.make_tensor(s_stat[None, q_state.index].iterator, stats)
            if const_expr(self.pair > 1):
                if cta_rank == i:  # statistic i is rank i's to load, for the pair
                    with cute.arch.elect_one():
                        cute.copy(bulk_f32, src, dst, mbar_ptr=bar, **mcast)
            else:
                with cute.arch.elect_one():
                    cute.copy(bulk_f32, src, dst, mbar_ptr=bar)
        q_state.advance()
        do_copy = ((tma_do, tdOgdO[None, m_block, 0], tdOsdO[None, do_state.index]),)
        do_rows = (row_view(s["sdO"][None, None, None, do_state.index], self.tile_m, self.head_dim_v,
                            self.swizzle_bits["do"]),)  # fmt: skip
        do_tail = self.tail_of(partial, q_valid, do_rows, mbar_tail)
        fill_stage(pipes.do, do_state, do_copy, tail=do_tail, **mcast)
        do_state.advance()
        return q_state, do_state

    def tail_of(self, may_hold_tail: bool, valid_rows, rows, mbar_tail):
        """``stage_fill.fill_stage``'s ``tail`` of a tile that ``may_hold_tail``: None with a pair
        (it does not zero, module docstring) or for a tile that never holds rows past the sample."""
        return (valid_rows, rows, mbar_tail) if self.pair == 1 and may_hold_tail else None
