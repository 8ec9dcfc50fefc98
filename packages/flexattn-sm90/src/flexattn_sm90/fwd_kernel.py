"""SM90 (Hopper) persistent attention forward that consumes a MaskPlan's forward view (spec 6.1, 6.2).

One CTA = one producer warpgroup + two consumer (MMA/softmax) warpgroups, 384 threads::

    warp 0 (producer WG)   scheduler: takes tasks from ``fwd_work_desc`` through an atomic
                           counter of the stream, zero again at exit (next_task); TMA loads of
                           Q, K, V; bulk copy of partial payloads
    warps 1-3              idle (give their registers back and exit)
    WG1, WG2 (consumers)   64 Q rows each of the 128-row tile: S = Q K^T (WGMMA SS), packed
                           predicate (partial blocks), online softmax, O += P V (WGMMA RS), epilogue
                           (fwd_mainloop.py; schedules simple / overlap)

Per task ``(m_block, head, batch, q_valid_rows)``::

    row = sequence_desc[batch].row_begin + m_block,   h = head if Hmask > 1 else 0
    for e in mask_block_offset[h, row] + [0, mask_block_cnt[h, row]):   # partial blocks
        S = Q K[mask_block_idx[e]]^T ; S[bit == 0] = -inf ; softmax step ; O += P V
    for e in full_block_offset[h, row] + [0, full_block_cnt[h, row]):   # full blocks, no mask work
        S = Q K[full_block_idx[e]]^T ; softmax step ; O += P V
    O /= rowsum, LSE = max*scale + ln(rowsum); rows with no visible key: O = 0, LSE = -inf

Pipelines (mbarrier based, all CTA-local)::

    sched  2 stages   producer lane 0 -> 256 consumer threads   decoded task record in SMEM
    Q      q_buffers  TMA                -> 8 consumer warps   (2 up to D = 128: a task's Q, then
                                                                    its first K / V block, load
                                                                    while the previous task runs;
                                                                    with one, q_after_first_kv
                                                                    may issue Q after that block)
    K, V   kv_stages  TMA                -> 8 consumer warps
    mask   2 stages   cp.async.bulk      -> 256 consumer threads   (spec 6.2; advances on partial
                                                                    blocks only)

The epilogue stages O through ``sO`` (``tile_m x config.o_chunk_cols``, the SMEM left next to
the operand tiles) so it reaches GMEM in whole rows (``fwd_mainloop.epilogue``).

With ``mask_via_smem=False`` each consumer thread loads its payload words GMEM -> registers
directly (same ABI, spec 9.10). A thread's payload registers come from the plane words the payload
layout's ``register_source`` names, and guard its scores by ``register_bit``.

PackGQA (``config.pack_gqa``, ``G = Hq / Hkv``): a task's head is a kv head and its 128 tile rows are
``G`` q heads x ``128 / G`` positions, row ``R`` = (position ``R // G``, q head ``G * kv_head + R % G``).
Q arrives by one TMA box ``(G, 128 / G, D)`` of the ``((heads, positions), D)`` view of Q; O, LSE
and the max logit are written per row to that row's head and position.

Physical rows are ``q_offset/k_offset + sample-local position``; Q/K/V tiles past the tensor end
are zero-filled by TMA, partial payloads carry the K tail (bit 0), and output rows past
``q_valid_rows`` are never stored. A sample's tail K block (always partial) also holds the next
sample's first rows: their scores are masked, but their V rows meet zero probabilities in P V, so a
nan / inf there would reach this sample (0 * inf = nan). The producer therefore lands such a V
block on a barrier of its own, zeroes the rows past the sample and only then signals the stage::

    V stage (tile_n rows)      TMA -> mbar_tail; producer waits, zeroes rows >= k_len - n_block * tile_n,
    [ k_len rows | next sample ]      fence.proxy.async, then a plain arrive on the stage's full barrier
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from maskplan_kernels.consumer_entry import FwdHostEntry
from maskplan_kernels.consumer_k2q import take_ticket
from maskplan_kernels.consumer_plan import (
    CUTE_DTYPES,
    PDL,
    TASK_WORDS,
    FwdPlanTensors,
    after_predecessor,
    decode_task,
    group_heads,
    heads_rows,
    load_payload_plane,
    publish_task,
    record_pipeline,
    select_modes,
)
from maskplan_kernels.stage_fill import fill_stage

from .config import SMEM_LIMIT, Sm90FwdConfig
from .fwd_helpers import register_split, smem_layout_row_major
from .fwd_mainloop import DEFAULT_SCHEDULE, SCHEDULES, ConsumerMainloop


class Sm90FwdKernel(FwdHostEntry, ConsumerMainloop):
    """Static configuration of one compiled forward kernel; see the module docstring."""

    #: CTAs take tasks from the stream's scheduler counter (:meth:`next_task`)
    persistent = True

    def __init__(
        self,
        config: Sm90FwdConfig,
        *,
        mask_via_smem: bool = True,
        schedule: str = DEFAULT_SCHEDULE,
        per_sample: bool = False,
    ):
        if config.num_consumer_warpgroups != 2 or config.tile_m != 128:
            raise NotImplementedError("the SM90 forward kernel uses a 128-row tile on 2 consumer warpgroups")
        self.config = config
        self.row_granule = config.row_granule if per_sample else 0  # q, k, v rows per sample
        self.dtype = CUTE_DTYPES[config.dtype]
        self.head_dim_qk, self.head_dim_v = config.head_dim_qk, config.head_dim_v
        self.io_head_dim_v = config.io_head_dims[1]  # where O's stores stop (loads: TMA zero-fills)
        self.tile_m, self.tile_n = config.tile_m, config.tile_n
        # PackGQA: G q heads x (tile_m / G) positions per tile; otherwise G = 1 head per tile
        self.pack_gqa = config.pack_gqa
        self.pack_group = config.qhead_per_kvhead if config.pack_gqa else 1
        self.tile_positions = config.plan_tile_m
        self.kv_stages = config.kv_stages
        self.q_buffers = config.q_buffers
        self.q_after_first_kv = config.q_after_first_kv
        self.o_chunk = config.o_chunk_cols
        # the epilogue's 16-byte pieces: a warpgroup covers whole rows of a chunk per pass
        assert self.o_chunk % 16 == 0 and 128 % (self.o_chunk // 8) == 0 and (1024 // self.o_chunk) <= 64
        self.mask_stages = config.mask_pipeline_stages
        self.mask_via_smem = mask_via_smem
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}; one of {SCHEDULES}")
        self.schedule = schedule
        # payload ABI (payload_layout.py is the one source of truth)
        self.payload_layout = layout = config.payload_layout
        self.payload_groups = layout.groups
        self.payload_words = layout.words_per_group
        self.payload_registers = layout.register_words  # uint32 registers one thread loads
        self.payload_elements = layout.elements_per_thread
        self.payload_plane = layout.words_per_tile  # int32 words of one partial entry
        # warp roles and register budgets (setmaxnreg, fwd_helpers.register_split)
        self.threads_per_wg = 128
        self.num_consumer_wg = config.num_consumer_warpgroups
        self.num_consumer_threads = self.threads_per_wg * self.num_consumer_wg
        self.num_threads = self.threads_per_wg * (1 + self.num_consumer_wg)
        self.producer_warp = 0
        self.producer_regs, self.consumer_regs = register_split(self.num_consumer_wg, 24, 240)
        self.sched_stages = 2
        assert layout.threads == self.num_consumer_threads

    # -- host entry: FwdHostEntry.from_pointers ----------------------------------------------------
    def io_head_dims(self) -> tuple[int, int]:
        """The tensors' head dims (:attr:`Sm90FwdConfig.io_head_dims`): TMA zero-fills the tiles'
        columns past them and the O stores leave those out."""
        return self.config.io_head_dims

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (total_q, Hq, Dqk)
        mK: cute.Tensor,  # (total_k, Hkv, Dqk)
        mV: cute.Tensor,  # (total_k, Hkv, Dv)
        mO: cute.Tensor,  # (total_q, Hq, Dv)
        mLSE: cute.Tensor,  # (Hq, total_q) fp32
        mMaxLogit: cute.Tensor | None,  # (Hq,) fp32, -inf at launch; None: not computed
        plan: FwdPlanTensors,
        tile_counter: cute.Tensor,  # (1,) int32, zero at launch and again at exit (next_task)
        softmax_scale: Float32,
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        if const_expr(mQ.element_type != self.dtype or mK.element_type != self.dtype):
            raise TypeError(f"q/k/v/o must be {self.dtype}")
        # TMA views: (rows, d, heads)
        mQ_t, mK_t, mV_t = (select_modes(t, [0, 2, 1]) for t in (mQ, mK, mV))
        # (tile_m, Dqk, q_buffers) / (tile_n, Dqk, stages) / (tile_n, Dv, stages)
        sQ_layout = smem_layout_row_major(self.dtype, self.tile_m, self.head_dim_qk, self.q_buffers)
        sK_layout = smem_layout_row_major(self.dtype, self.tile_n, self.head_dim_qk, self.kv_stages)
        sV_layout = smem_layout_row_major(self.dtype, self.tile_n, self.head_dim_v, self.kv_stages)
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        if const_expr(self.pack_gqa):
            # one (G, P, D) box of ((heads, positions), D), then mode 2 = kv head: ((G, total_q), D, Hkv)
            tma_q, tma_mQ = cpasync.make_tiled_tma_atom(
                load_op,
                heads_rows(mQ),
                cute.select(sQ_layout, mode=[0, 1]),
                ((self.pack_group, self.tile_positions), self.head_dim_qk),
            )
            tma_mQ = group_heads(tma_mQ, self.pack_group)
            mO = group_heads(heads_rows(mO), self.pack_group)  # ((G, total_q), Dv, Hkv)
        else:
            tma_q, tma_mQ = cpasync.make_tiled_tma_atom(
                load_op, mQ_t, cute.select(sQ_layout, mode=[0, 1]), (self.tile_m, self.head_dim_qk)
            )
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(
            load_op, mK_t, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, self.head_dim_qk)
        )
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(
            load_op, mV_t, cute.select(sV_layout, mode=[0, 1]), (self.tile_n, self.head_dim_v)
        )
        self.bytes_q = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1]))
        self.bytes_k = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))
        self.bytes_v = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1]))
        # S = Q K^T: (tile_m, tile_n), both K-major; O = P V: P from registers, V^T MN-major
        MN = cute.nvgpu.OperandMajorMode.MN
        mma_qk = self.tiled_mma(self.tile_n, cute.nvgpu.OperandMajorMode.K, warpgroup.OperandSource.SMEM)
        mma_pv = self.tiled_mma(self.head_dim_v, MN, warpgroup.OperandSource.RMEM)
        assert mma_qk.size == self.num_consumer_threads
        # the epilogue's O staging: (tile_m, o_chunk) and the WGMMA C ownership of such a chunk
        sO_layout = smem_layout_row_major(self.dtype, self.tile_m, self.o_chunk)
        mma_o = self.tiled_mma(self.o_chunk, MN, warpgroup.OperandSource.RMEM)
        self.shared_storage = self._shared_storage(sQ_layout, sK_layout, sV_layout, sO_layout)
        if const_expr(self.shared_storage.size_in_bytes() > SMEM_LIMIT):
            raise ValueError(
                f"the forward's SMEM ({self.shared_storage.size_in_bytes()} bytes) exceeds the "
                f"{SMEM_LIMIT} bytes of an SM90 CTA"
            )
        self.kernel(
            tma_q,
            tma_mQ,
            tma_k,
            tma_mK,
            tma_v,
            tma_mV,
            mO,
            mLSE,
            mMaxLogit,
            plan,
            tile_counter,
            softmax_scale,
            sQ_layout,
            sK_layout,
            sV_layout,
            sO_layout,
            mma_qk,
            mma_pv,
            mma_o,
        ).launch(
            grid=[num_ctas, 1, 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
            **PDL,
        )

    def tiled_mma(self, cols: int, b_major, a_source) -> cute.TiledMma:
        """A ``tile_m x cols`` WGMMA of the consumer warpgroups (one m64 slab each), A K-major:
        S = Q K^T (B K-major, A from SMEM), O = P V and an O chunk's C ownership (B = V^T MN-major,
        A = P from registers)."""
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            cute.nvgpu.OperandMajorMode.K,
            b_major,
            Float32,
            (self.num_consumer_wg, 1, 1),
            (64, cols),
            a_source,
        )

    def _shared_storage(self, sQ_layout, sK_layout, sV_layout, sO_layout):
        mask_words = self.mask_stages * self.payload_plane if self.mask_via_smem else 4

        # the 1024-byte aligned tiles first: the small fields after them add no alignment padding
        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sO_layout)], 1024]
            mask: cute.struct.Align[cute.struct.MemRange[Int32, mask_words], 128]
            task: cute.struct.Align[cute.struct.MemRange[Int32, TASK_WORDS * self.sched_stages], 16]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_buffers]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            mbar_mask: cute.struct.MemRange[cutlass.Int64, 2 * self.mask_stages]
            mbar_sched: cute.struct.MemRange[cutlass.Int64, 2 * self.sched_stages]
            mbar_tail: cute.struct.MemRange[cutlass.Int64, 1]  # a tail V block lands here (producer)

        return SharedStorage

    # -- device entry -----------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mMaxLogit: cute.Tensor | None,
        plan: FwdPlanTensors,
        tile_counter: cute.Tensor,
        softmax_scale: Float32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        mma_o: cute.TiledMma,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == self.producer_warp:
            for atom in (tma_q, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        pipes = self._make_pipelines(storage)
        mbar_tail = storage.mbar_tail.data_ptr()
        if warp_idx == self.producer_warp:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(mbar_tail, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        after_predecessor()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        # (TASK_WORDS, stages): the decoded task the producer hands to the consumers
        sTask = storage.task.get_tensor(cute.make_layout((TASK_WORDS, self.sched_stages)))
        # (words, groups, stages): one payload plane per stage
        sMask = storage.mask.get_tensor(
            cute.make_layout((self.payload_words, self.payload_groups, self.mask_stages))
            if const_expr(self.mask_via_smem)
            else cute.make_layout(4)
        )

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == self.producer_warp:
                self.producer(
                    tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV, sTask, sMask, plan, tile_counter, pipes,
                    mbar_tail,
                )  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consumer(
                mma_qk,
                mma_pv,
                mma_o,
                mO,
                mLSE,
                mMaxLogit,
                sQ,
                sK,
                sV,
                sO,
                sTask,
                sMask,
                plan,
                softmax_scale,
                pipes,
                tidx - self.threads_per_wg,
            )

    def _make_pipelines(self, storage):
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads // 32)
        consumer_threads = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads)

        def tma_pipe(mbar, stages, nbytes):
            return pipeline.PipelineTmaAsync.create(
                barrier_storage=mbar.data_ptr(),
                num_stages=stages,
                producer_group=one_thread,
                consumer_group=consumer_warps,
                tx_count=nbytes,
                defer_sync=True,
            )

        pipe_mask = None
        if const_expr(self.mask_via_smem):
            # every consumer thread releases (it read its own words; tidx=0 makes all lanes signal)
            pipe_mask = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_mask.data_ptr(),
                num_stages=self.mask_stages,
                producer_group=one_thread,
                consumer_group=consumer_threads,
                tx_count=self.payload_plane * 4,
                tidx=Int32(0),
                defer_sync=True,
            )
        return (
            tma_pipe(storage.mbar_q, self.q_buffers, self.bytes_q),
            tma_pipe(storage.mbar_k, self.kv_stages, self.bytes_k),
            tma_pipe(storage.mbar_v, self.kv_stages, self.bytes_v),
            pipe_mask,
            record_pipeline(storage.mbar_sched.data_ptr(), self.sched_stages, self.num_consumer_threads),
        )

    # -- producer warp ----------------------------------------------------------------------------
    @cute.jit
    def producer(
        self,
        tma_q,
        mQ,
        tma_k,
        mK,
        tma_v,
        mV,
        sQ,
        sK,
        sV,
        sTask,
        sMask,
        plan: FwdPlanTensors,
        tile_counter: cute.Tensor,
        pipes,
        mbar_tail: cute.Pointer,
    ):
        pipe_q, pipe_k, pipe_v, pipe_mask, pipe_sched = pipes
        lane = cute.arch.lane_idx()
        num_tasks = plan.fwd_work_desc.shape[0]
        qhead_per_kvhead = mQ.shape[2] // mK.shape[2]
        sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.sched_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_buffers)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        mask_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.mask_stages)
        bulk_atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Int32)

        task = Int32(cute.arch.block_idx()[0])
        while task < num_tasks:
            # PackGQA: the task's head is the kv head
            t = decode_task(plan, task, 1 if const_expr(self.pack_gqa) else qhead_per_kvhead)
            sched_state = publish_task(pipe_sched, sched_state, sTask, t, Int32(1), lane)
            # Q tile: (tile_m, Dqk) from position q_offset + m_block * tile_positions
            gQ = cute.local_tile(
                self.sample_rows(mQ[None, None, t.head], t.batch, t.q_offset, self.pack_gqa),
                (self.tile_m, self.head_dim_qk),
                (t.m_block, 0),
            )
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
            )
            q_due = Int32(0)  # a task without blocks loads no Q: it writes O = 0, LSE = -inf only
            if t.partial_cnt + t.full_cnt > 0:
                q_due = Int32(1)
            if const_expr(not self.q_after_first_kv):
                q_state, q_due = self.load_q(q_due, pipe_q, q_state, tma_q, tQgQ, tQsQ)
            # K/V tiles of this sample and kv head: (tile_n, D, n_blocks)
            gK = cute.local_tile(
                self.sample_rows(mK[None, None, t.kv_head], t.batch, t.k_offset),
                (self.tile_n, self.head_dim_qk),
                (None, 0),
            )
            gV = cute.local_tile(
                self.sample_rows(mV[None, None, t.kv_head], t.batch, t.k_offset),
                (self.tile_n, self.head_dim_v),
                (None, 0),
            )
            tKsK, tKgK = cpasync.tma_partition(
                tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
            )
            tVsV, tVgV = cpasync.tma_partition(
                tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
            )
            # the block index of iteration i + 1 is loaded before iteration i waits for a free stage
            idx, last = plan.mask_block_idx, cute.size(plan.mask_block_idx) - 1
            n_block = Int32(0)
            if t.partial_cnt > 0:
                n_block = idx[t.partial_off]
            for i in cutlass.range(t.partial_cnt, unroll=1):
                entry = t.partial_off + i
                n_next = idx[cutlass.min(entry + 1, last)]
                if const_expr(self.mask_via_smem):
                    mask_state = load_payload_plane(
                        pipe_mask, mask_state, bulk_atom, plan.mask_block_masks, sMask, entry,
                        self.payload_plane,
                    )  # fmt: skip
                kv_state = self.load_kv(
                    n_block, pipe_k, pipe_v, kv_state, tma_k, tKgK, tKsK, tma_v, tVgV, tVsV,
                    (t.k_len - n_block * self.tile_n, sV, mbar_tail),
                )  # fmt: skip
                if const_expr(self.q_after_first_kv):
                    q_state, q_due = self.load_q(q_due, pipe_q, q_state, tma_q, tQgQ, tQsQ)
                n_block = n_next
            idx, last = plan.full_block_idx, cute.size(plan.full_block_idx) - 1
            if t.full_cnt > 0:
                n_block = idx[t.full_off]
            for i in cutlass.range(t.full_cnt, unroll=1):
                n_next = idx[cutlass.min(t.full_off + i + 1, last)]
                kv_state = self.load_kv(
                    n_block, pipe_k, pipe_v, kv_state, tma_k, tKgK, tKsK, tma_v, tVgV, tVsV, None
                )
                if const_expr(self.q_after_first_kv):
                    q_state, q_due = self.load_q(q_due, pipe_q, q_state, tma_q, tQgQ, tQsQ)
                n_block = n_next
            task = self.next_task(tile_counter, num_tasks, lane)
        # tell the consumers there is no more work
        sched_state = publish_task(pipe_sched, sched_state, sTask, None, Int32(0), lane)

    @cute.jit
    def next_task(self, tile_counter: cute.Tensor, num_tasks: Int32, lane: Int32) -> Int32:
        """The next task index: ``gridDim.x + atomicAdd(counter, 1)`` (the first task is blockIdx.x).
        Each CTA fetches until it gets no task, so a launch takes exactly ``num_tasks`` tickets
        (``num_tasks - gridDim.x`` tasks and one miss per CTA). The last one is taken after every
        other: its holder sets the counter back to zero for the next launch on the stream
        (fwd_launch.scheduler_counter)."""
        ticket = take_ticket(tile_counter, lane)
        if lane == 0:
            if ticket == num_tasks - 1:
                cute.arch.atomic_add(tile_counter.iterator, -num_tasks)
        return ticket + Int32(cute.arch.grid_dim()[0])

    @cute.jit
    def load_q(self, due: Int32, pipe_q, state, tma_q, tQgQ, tQsQ):
        """The task's Q tile into the next Q buffer if ``due``; returns ``(state, 0)``."""
        if due != 0:
            fill_stage(pipe_q, state, ((tma_q, tQgQ, tQsQ[None, state.index]),))
            state.advance()
        return state, Int32(0)

    @cute.jit
    def load_kv(self, n_block: Int32, pipe_k, pipe_v, state, tma_k, tKgK, tKsK, tma_v, tVgV, tVsV, tail):
        """K and V block ``n_block`` into stage ``state``; returns the next state. ``tail`` is None on
        full blocks (never past the sample), else ``(valid_rows, sV, mbar_tail)``: where fewer than
        ``tile_n`` rows belong to the sample, V takes the zeroing path of the module docstring."""
        fill_stage(pipe_k, state, ((tma_k, tKgK[None, n_block], tKsK[None, state.index]),))
        v_tail = None
        if const_expr(tail is not None):
            valid_rows, sV, mbar_tail = tail
            v_tail = (valid_rows, (sV[None, None, state.index],), mbar_tail)
        fill_stage(pipe_v, state, ((tma_v, tVgV[None, n_block], tVsV[None, state.index]),), tail=v_tail)
        state.advance()
        return state

