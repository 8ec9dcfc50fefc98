"""SM90 (Hopper) K-major attention backward that consumes a MaskPlan's K2Q backward view (spec 6.3).

Persistent: one CTA per SM takes work items, (K plan row = K block of ``tile_n`` keys, kv head),
from a ticket counter (``consumer_k2q.take_ticket``) until none is left. Per item it loads the
K/V tile once and accumulates dK/dV in registers over the Q heads of its kv head, while each
visited Q block's dQ contribution goes to an fp32 accumulator in GMEM. Where the (K row, kv head)
items are too few for the GPU (MQA, high GQA ratios: ``maskplan_kernels.kv_head_split``), each kv
head's ``G`` Q heads are split over ``s`` items: item kv head ``hk * s + j`` (a kv head of its own
for the kernel, of ``Hkv * s``, but for its K / V: ``Items.kv_split``) takes Q heads ``hk * G + j *
G / s ..`` and writes its part of dK / dV at its own head, which ``consumer_launch.launch_backward``
sums after the kernel. Without a split (``s = 1``) GQA needs no later reduction.
384 threads::

    warp 0 (WG0)      producer: takes the tickets and hands them to the other roles (a 2-stage
                      SMEM record); TMA loads of K, V (once per item), Q + LSE and dO + D (per Q block; 2
                      stages each, dO 1 from (192, 128) on), bulk copy of the partial payloads (2-stage SMEM
                      mask pipeline)
    warp 1 (WG0)      dQ writer: bulk fp32 reduce-add (cp.reduce.async.bulk) of each Q block's dQ
                      from SMEM into the accumulator, or store of its first one (first_dq_stored),
                      after the block's turnstile where there is one
    warp 2 (WG0)      with first_dq_stored: a second dQ writer, which takes the odd steps
                      (write_dq_block says why)
    warps 2-3         otherwise idle (give their registers back and exit)
    WG1, WG2          MMA warpgroups (bwd_mainloop.py):
                        S^T = K Q^T, dP^T = V dO^T        (SS, tile_n x tile_m, K rows on WGMMA M)
                        P^T = exp2(S^T scale log2e - LSE log2e)  [packed predicate: bit 0 -> P = 0]
                        dS^T = P^T (dP^T - D)             (D = rowsum(dO O) - dlse, preprocess)
                        dV += P^T dO, dK += dS^T Q
                        dQ = dS K                         (dS^T stored transposed to SMEM, SS)

Four tiles (heuristics.bwd_tile)::

    128 x 128 (D <= 64)      as 64 x 128, with S^T m64n128 per warpgroup; dQ's warpgroups split its
    64 x 128 (D <= 128)      rows (64 x 128: its head dim, 40 columns each at D = 80). Each
                             warpgroup: 64 K rows of S^T, of dK and of dV; dK / dV are RS (P^T /
                             dS^T straight from its registers)
    64 x 64  (256)           each warpgroup: 32 Q columns of S^T, D/2 columns of dK and dV (the
                             accumulators of a whole-D 64-row slab do not fit 240 registers); P^T and
                             dS^T meet in SMEM and dK / dV are SS. 2 Q / 1 dO stages and SMEM for
                             one dQ chunk, which the warpgroups fill in turn.
    64 x 96  (192/128), S    not transposed: S = Q K^T and dP = dO V^T with Q rows on WGMMA M, each
                             warpgroup m64n48 on its 48 K columns; dK^T += Q^T dS and dV^T += dO^T P
                             (SS, D x 48 per warpgroup: 72 + 48 accumulator registers), P and dS
                             meet in SMEM; 1 dO stage. A 96-row K block per CTA moves each
                             Q block's Q, dO and dQ through L2 for 1.5x the K rows of a 64-row one.

Except at 64 x 96, the score tile is computed transposed, so the accumulator rows are K rows:
exactly the ownership ``WgmmaAccumulatorLayout(tile_m, tile_n, 2, transposed=True)``
(payload_layout.py) describes (its warpgroup tiling is the S^T MMA's); at 64 x 96 it is
``transposed=False``, S's. Either way the packed predicate's bit ``e`` guards accumulator register
``e`` of each thread.

Per item ``(r, hk)`` (``hk`` of ``Hkv * s`` item kv heads) with ``b = k_row_batch[r]``,
``n = r - sequence_desc[b].row_begin``::

    for hq in hk * G .. hk * G + G - 1:                   # G = Hq / (Hkv * s)
        h = hq if Hmask > 1 else 0
        # the partial and the full list of (h, r), merged by DESCENDING Q block (walk_row;
        # ascending in the mirrored order, whose ranks are mirrored_view_args')
        for e in partial entries:  m = mask_block_idx[e]
                                   step(m, payload = mask_block_masks[e], rank = dq_write_order[e])
        for e in full entries:     m = full_block_idx[e]
                                   step(m, no payload, rank = dq_write_order_full[e])
    dK = scale * dK, dV stored (rows < k_len of the sample); a K block without any entry stores 0

Between items nothing waits for a whole CTA to finish: the MMA warpgroups release sK / sV after
their last GEMMs of an item, so the next item's K / V (and its first Q / dO blocks) load while
dK / dV leave through the SMEM of dS [, P] and the dQ chunks (``BwdMainloop.epilogue``; the
epilogue takes the dQ chunks from the dQ writer as a step does). Short K2Q rows (documents: ~12
steps per item) paid that per-CTA start and drain on every K block (benchmarks/RESULTS.md,
session 27).

dQ accumulator, LSE and D are per (q head, padded Q block): Q block ``m`` of sample ``b`` is
global block ``q_block_begin[b] + m``; each holds ``tile_m`` rows, padding rows carry LSE = +inf
(P = 0) and D = 0, so they contribute nothing. ``first_dq_stored`` (always in deterministic mode,
in atomic mode on sparse K2Q rows: ``BackwardCompiler.first_dq_stored``): nothing zeroes the
accumulator; the contribution of rank 0 (the block's lowest K block in ``dq_write_order``, its
highest in the mirrored order below) is stored and counted on the block's turnstile
``dq_semaphore[hq, block]``, and the postprocess writes dQ = 0 where the count stayed 0.
``deterministic=True``: the dQ writer of the CTA whose entry has rank ``k`` waits until the count
is ``k``, stores or adds, waits for the copy to complete and increments it: every run adds the
contributions in ``dq_write_order`` (ascending K block), or in its reverse (the mirrored order).
Atomic mode with ``first_dq_stored``: the other ranks wait only for a count of 1, then add in any
order; without it the preprocess zeroes the accumulator and every rank adds at once. Waiting only
on the ranks below its own, which K blocks of the same (sample, item kv head) launched before it
hold (lower K blocks, or higher ones in the mirrored order), i.e. lower tickets
(``consumer_k2q.grouped_launch_slot``), which running CTAs hold (every ticket comes from the
counter), a writer cannot deadlock.
Walking its Q blocks downwards, a CTA reaches each one no earlier than the CTA of the K block
below it on causal, sliding-window and document masks (``consumer_k2q.walk_row``), so
the turnstile rarely waits, except where K rows end together and are short (documents): CTAs
started together then reach a document's last Q block at one step and queue on its turnstile.
On sparse K2Q rows (``BwdViewArgs.sparse_rows``; documents, sliding windows) deterministic mode
therefore takes the *mirrored* order where it pays (``mirrored``, from (192, 128) on:
``LaunchOrder.mirrors_sparse_rows``; K rows launched descending, walks ascending, ranks by
descending K block from ``consumer_launch.mirrored_view_args``), in which K block ``j`` reaches
Q block ``i`` at step ``i - j``: a Q block's writers arrive one step apart, in rank order. Deterministic
mode also launches the CTAs kv heads first, so the resident ones form many short chains (one per
head). Where K blocks visit nearly all of their sample's Q blocks (random intervals, full), that
order streams every head's Q, dO and dQ through L2 at once and spills to DRAM; there the launch
order takes ``DENSE_HEAD_GROUP`` kv heads at a time, ``HALF_FULL_HEAD_CAP`` on half-full rows
(causal's) at (256, 256) and ``SPARSE_HEAD_CAP`` on sparse or half-full rows with staggered ends
(sliding windows') from (192, 128) on (:meth:`Sm90BwdKernel.launch_head_group`).

The item order (tickets, ``consumer_k2q.grouped_launch_slot``) and how many kv heads it takes
at a time: bwd_launch_order.py.
"""

from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from maskplan_kernels.consumer_dq import bulk_reduce_add_f32, bulk_store, turnstile_advance, turnstile_wait
from maskplan_kernels.consumer_entry import BwdHostEntry, rows_from
from maskplan_kernels.consumer_k2q import (
    Work,
    decode_work,
    head_range,
    launch_grid,
    take_ticket,
    ticket_counter,
    walk_row,
)
from maskplan_kernels.consumer_plan import (
    CUTE_DTYPES,
    BwdPlanTensors,
    desc_field,
    element_ptr,
    fetch_record,
    load_payload_plane,
    publish_record,
    record_pipeline,
    select_modes,
)
from maskplan_kernels.consumer_softmax import LOG2_E
from maskplan_kernels.geometry import DESC_Q_LEN
from maskplan_kernels.stage_fill import fill_stage

from .bwd_helpers import common_major, dq_warpgroup_tile, item_state, make_dq_tiled_mma, smem_layout
from .bwd_launch_order import LaunchOrder
from .bwd_mainloop import BwdMainloop
from .config import SMEM_LIMIT, SMEM_RESERVE, Sm90BwdConfig
from .fwd_helpers import register_split

#: the fields of a work item the producer hands to the MMA warpgroups and dQ writers, decoded once
#: (``Sm90BwdKernel.next_work``); the sample's ``q_len`` follows them
ITEM_FIELDS = ("row", "n_block", "kv_head", "k_offset", "k_valid", "qblk_base")


class Items(NamedTuple):
    """How the roles share the CTA's work items: the producer takes tickets and publishes each
    decoded item through ``pipe`` (``sWork``: ``(1 + len(ITEM_FIELDS) + 1, stages)``, valid flag,
    :data:`ITEM_FIELDS`, ``q_len``)."""

    q_per_kv: Int32  # q heads per item's kv head
    kv_heads: Int32  # the items' kv heads (dK's): Hkv x kv_split
    kv_split: Int32  # items per (K row, kv head) of K / V (consumer_launch.launch_backward)
    mask_heads: Int32
    pipe: object
    sWork: cute.Tensor


class Sm90BwdKernel(BwdHostEntry, BwdMainloop, LaunchOrder):
    """Static configuration of one compiled backward main kernel; see the module docstring. Its host
    entry ``from_pointers`` is :class:`maskplan_kernels.consumer_entry.BwdHostEntry` (shared with SM100)."""

    #: named barriers (0 is __syncthreads)
    BAR_PDS = 1  # both MMA warpgroups: dS of a step is in SMEM, or a tail is zeroed (zero_tail)
    BAR_DQ_FULL = 2  # + wg + 2 * writer: MMA warpgroup wg -> dQ writer, its dQ chunk is in SMEM
    BAR_DQ_EMPTY = 6  # + wg: dQ writer -> MMA warpgroup wg, the chunk may be overwritten
    #: CTAs take their (K row, kv head) items from a ticket counter (BwdHostEntry.persistent)
    persistent = True
    #: stages of the item record (producer -> MMA warpgroups and dQ writers) and its int32 words
    SCHED_STAGES = 2
    ITEM_WORDS = 2 + len(ITEM_FIELDS)

    def __init__(
        self, config: Sm90BwdConfig, *, deterministic: bool = False, per_sample: bool = False,
        first_dq_stored: bool | None = None, mirrored: bool = False,
    ):  # fmt: skip
        # first_dq_stored (the module docstring): deterministic mode's turnstile needs it; in atomic
        # mode it saves zeroing the accumulator, which pays where K2Q rows are sparse (None: as
        # deterministic)
        first_dq_stored = deterministic if first_dq_stored is None else first_dq_stored
        if deterministic and not first_dq_stored:
            raise ValueError(
                "first_dq_stored=False: the deterministic SM90 backward stores each Q block's first dQ"
            )
        if mirrored and not first_dq_stored:
            raise ValueError(
                "mirrored=True orders the writers of a Q block for its turnstile, which only a kernel "
                "with first_dq_stored=True has"
            )
        self.row_granule = config.row_granule if per_sample else 0  # q, k, v rows per sample
        layout = config.payload_layout  # payload ABI: payload_layout.py is the one source of truth
        widest = max(config.head_dim_qk, config.head_dim_v)
        q_rows_ok = config.tile_m == 64 or (config.tile_m == 128 and widest <= 64)
        if not q_rows_ok or config.num_consumer_warpgroups != 2 or layout.wg_m * layout.wg_n != 2:
            raise NotImplementedError(
                f"the SM90 backward kernel implements 64-row Q blocks on 2 warpgroups (128-row ones up to "
                f"head dim 64); (head_dim_qk, head_dim_v)=({config.head_dim_qk}, {config.head_dim_v}) "
                f"selects {config.tile_m}x{config.tile_n} on {config.num_consumer_warpgroups}, which has no "
                "SM90 backward kernel"
            )
        # 64 x 128: the warpgroups split S^T's K rows and keep P^T / dS^T in registers for dK / dV.
        # 64 x 64: they split S^T's Q columns, so dK / dV (SS, the warpgroups split the head dim)
        # read P^T and dS^T back from SMEM, where both warpgroups' halves meet. 64 x 96 as S (not
        # transposed): they split S's K columns, and dK^T / dV^T (SS, each warpgroup its K columns)
        # read P and dS from SMEM too.
        self.pds_in_smem = config.scores_in_smem
        self.q_rows_on_m = not layout.transposed
        if self.q_rows_on_m and not self.pds_in_smem:
            raise NotImplementedError(
                f"the SM90 backward kernel computes S (transposed_scores=False) only with the warpgroups "
                f"on its K columns; {config.tile_m}x{config.tile_n} on {config.num_consumer_warpgroups} "
                "warpgroups puts them on its Q rows"
            )
        head_dims = (config.head_dim_qk, config.head_dim_v)
        # dQ's head dim is split between the two warpgroups (m64n(D/2)): each half a whole number of
        # 8-column N steps. Where they split the score tile's columns instead (64 x 64: S^T's Q
        # columns, and dK's / dV's head dim, at (256, 256); 64 x 96: S's K columns at (192, 128)),
        # the tiles are built for multiples of 64
        multiple = 16 if layout.wg_n == 1 else 64
        if any(d % multiple for d in head_dims) or (
            not self.pds_in_smem and head_dims[0] != head_dims[1]
        ):
            raise NotImplementedError(
                f"(head_dim_qk, head_dim_v)=({config.head_dim_qk}, {config.head_dim_v}): the SM90 backward "
                f"kernel's {config.tile_m}x{config.tile_n} tile takes head dims that are multiples of "
                f"{multiple}" + ("" if self.pds_in_smem else ", equal (32, 64, 80, 96, 128)")
            )
        self.config = config
        self.deterministic = deterministic
        self.first_dq_stored = first_dq_stored
        # K rows launched descending, walks ascending, ranks mirrored (consumer_k2q.walk_row says why)
        self.mirrored = mirrored
        self.dtype = CUTE_DTYPES[config.dtype]
        self.head_dim_qk, self.head_dim_v = head_dims
        self.tile_m, self.tile_n = config.tile_m, config.tile_n  # Q rows, K rows of a block
        self.do_stages, self.q_stages = config.do_stages, config.q_stages
        # with turnstiles: two dQ writers on alternate steps (write_dq_block); in deterministic mode
        # 7-10% faster than one at D=128 sliding, (256, 256) and 26% at (192, 128) (RESULTS,
        # sessions 13-14); without, two were no faster (session 48)
        self.dq_writers = 2 if first_dq_stored else 1
        self.mask_stages = config.mask_pipeline_stages
        # what every step streams through L2 per Q block: Q, dO and the fp32 dQ
        self.init_launch_order(self.q_block_bytes(config))
        self.payload_layout = layout
        self.payload_groups = layout.groups
        self.payload_words = layout.words_per_group
        self.payload_elements = layout.elements_per_thread
        self.payload_plane = layout.words_per_tile
        # warp roles and register budgets (setmaxnreg, fwd_helpers.register_split)
        self.threads_per_wg = 128
        self.num_mma_wg = config.num_consumer_warpgroups
        self.num_mma_threads = self.threads_per_wg * self.num_mma_wg
        self.num_threads = self.threads_per_wg * (1 + self.num_mma_wg)
        self.producer_warp, self.dq_warp = 0, 1
        # D = 64: the producer's TMA bookkeeping spills at 24 and the MMA warpgroups fit in 232
        split = (40, 232) if max(head_dims) <= 64 else (24, 240)
        self.producer_regs, self.mma_regs = register_split(self.num_mma_wg, *split)
        # dQ = dS K: each MMA warpgroup owns one contiguous chunk (its rows x cols of the Q block)
        dq_rows, self.dq_cols = dq_warpgroup_tile(self.tile_m, self.head_dim_qk, self.num_mma_wg)
        self.dq_chunk = dq_rows * self.dq_cols  # fp32 values of one warpgroup's chunk
        self.dq_elements = self.dq_chunk // self.threads_per_wg  # per thread
        self.dq_block = self.tile_m * self.head_dim_qk  # fp32 values of one Q block
        # dQ leaves through SMEM chunks that the dQ writer bulk-adds into the accumulator, in both
        # modes: at (192, 128) and (256, 256) that beat each MMA thread's own red.global.add.v4 of
        # its fragment by 11-19% and 4-5% fwd+bwd on the H200 (benchmarks/RESULTS.md, sessions 12
        # and 13). One chunk per warpgroup; or, where the other tiles leave SMEM for one chunk only
        # ((256, 256)), one that the warpgroups fill in turn (the second waits until the dQ writer's
        # bulk add has read the first) rather than giving up Q's second stage (deterministic D=256:
        # 1.2x slower than atomic with one Q stage)
        two_chunks = config.operand_smem_bytes + self.num_mma_wg * 4 * self.dq_chunk
        self.dq_chunks = self.num_mma_wg if two_chunks <= SMEM_LIMIT - SMEM_RESERVE else 1
        # threads of a dQ FULL / EMPTY barrier: one MMA warpgroup and one dQ writer warp
        self.dq_pair_threads = self.threads_per_wg + 32
        assert self.payload_groups == self.num_mma_threads

    def io_head_dims(self) -> tuple[int, int]:
        """The tensors' head dims (:attr:`Sm90BwdConfig.io_head_dims`): TMA zero-fills the tiles'
        columns past them, and dK / dV leave them out."""
        return self.config.io_head_dims

    def dq_writer_of(self, step):
        """The dQ writer of step ``step`` (the dQ writers and the MMA warpgroups both count steps
        over the same K2Q walk): the writers take the steps in turn."""
        return step % self.dq_writers

    def dq_full_barrier(self, wg, writer):
        """``BAR_DQ_FULL`` of MMA warpgroup ``wg`` -> dQ writer ``writer``: one per pair, so a
        writer never completes the other one's instance."""
        return self.BAR_DQ_FULL + wg + 2 * writer

    def dq_chunk_empty(self, wg):
        """dQ writer -> MMA warpgroup ``wg`` (``BAR_DQ_EMPTY + wg``): its chunk may be overwritten."""
        cute.arch.barrier_arrive(barrier_id=self.BAR_DQ_EMPTY + wg, number_of_threads=self.dq_pair_threads)

    def dq_chunk_offset(self, wg) -> int:
        """First fp32 value of warpgroup ``wg``'s dQ chunk in SMEM: its own, or the shared one."""
        return 0 if self.dq_chunks == 1 else wg * self.dq_chunk

    # -- host entry: BwdHostEntry.from_pointers, then ------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mLSE: cute.Tensor,  # (Hq, n_qblk * tile_m) fp32, log2 domain, +inf for rows without keys
        mDsum: cute.Tensor,  # (Hq, n_qblk * tile_m) fp32
        mdQaccum: cute.Tensor,  # (Hq, n_qblk * tile_m * D) fp32, fragment-ordered chunks
        mdQsem: cute.Tensor,  # (Hq, n_qblk) int32
        plan: BwdPlanTensors,
        max_ctas: Int32,
        softmax_scale: Float32,
        stream: cuda.CUstream,
    ):
        if const_expr(mQ.element_type != self.dtype or mK.element_type != self.dtype):
            raise TypeError(f"q/k/v/dout/dk/dv must be {self.dtype}")
        dqk, dv, tm, tn = self.head_dim_qk, self.head_dim_v, self.tile_m, self.tile_n
        # TMA views: (rows, d, heads)
        mQ_t, mK_t, mV_t, mdO_t = (select_modes(t, [0, 2, 1]) for t in (mQ, mK, mV, mdO))
        # Q / dO as the MN-major operand of dK / dV: B with all D columns per warpgroup, or D / 2 when
        # they split the head dim; as dK^T / dV^T's A (S orientation), in 64-row WGMMA atoms
        def dkv_run(d):
            return 64 if self.q_rows_on_m else d // (self.num_mma_wg if self.pds_in_smem else 1)

        # (tile_m, D, q_stages): the operand of S / dP (K-major) and of dK / dV
        sQ_layout = smem_layout(self.dtype, tm, dqk, self.q_stages, major=common_major(dqk, dkv_run(dqk)))
        sdO_layout = smem_layout(self.dtype, tm, dv, self.do_stages, major=common_major(dv, dkv_run(dv)))
        # (tile_n, D): the operand of S (K-major) and B of dQ (MN-major, D / 2 columns per warpgroup)
        sK_layout = smem_layout(self.dtype, tn, dqk, major=common_major(dqk, self.dq_cols))
        sV_layout = smem_layout(self.dtype, tn, dv)
        # (tile_m, tile_n, q_stages): dS, A of dQ (K-major) [and, as dS^T, of dK (MN-major)]; P likewise
        # for dV when P / dS go through SMEM; in S orientation dK^T / dV^T take tile_n / 2 columns each
        k_run = tn // self.num_mma_wg if self.q_rows_on_m else tn
        sdS_layout = smem_layout(self.dtype, tm, tn, self.q_stages, major=common_major(tn, k_run))
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(
            load_op, mQ_t, cute.select(sQ_layout, mode=[0, 1]), (tm, dqk)
        )
        tma_do, tma_mdO = cpasync.make_tiled_tma_atom(
            load_op, mdO_t, cute.select(sdO_layout, mode=[0, 1]), (tm, dv)
        )
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(load_op, mK_t, sK_layout, (tn, dqk))
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(load_op, mV_t, sV_layout, (tn, dv))
        self.bytes_q = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1]))
        self.bytes_do = cute.size_in_bytes(self.dtype, cute.select(sdO_layout, mode=[0, 1]))
        self.bytes_kv = cute.size_in_bytes(self.dtype, sK_layout) + cute.size_in_bytes(self.dtype, sV_layout)
        self.bytes_row_stats = tm * 4  # LSE or D of one Q block
        mmas = self._tiled_mmas()
        self.shared_storage = self._shared_storage(sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout)
        smem = self.shared_storage.size_in_bytes()
        # dK / dV leave through dS [, P] and the dQ chunks (kernel: sdK, sdV): buffers of whole 1024-byte
        # multiples, so contiguous in _shared_storage, that hold both tiles
        width = self.dtype.width // 8
        room = (cute.cosize(sdS_layout) * width, cute.cosize(sdS_layout) * width * self.pds_in_smem,
                4 * self.dq_chunks * self.dq_chunk)  # fmt: skip
        staged = (cute.cosize(sK_layout) + cute.cosize(sV_layout)) * width
        assert all(b % 1024 == 0 for b in (*room, cute.cosize(sK_layout) * width)) and staged <= sum(room)
        # the chunk count was chosen from the config's arithmetic: it must not miss the real layout
        # (barriers, alignment) by more than the reserve
        assert smem <= self.config.operand_smem_bytes + self.dq_chunks * 4 * self.dq_chunk + SMEM_RESERVE
        if const_expr(smem > SMEM_LIMIT):
            raise ValueError(
                f"the backward's SMEM ({smem} bytes at "
                f"q_stages={self.q_stages}) exceeds the {SMEM_LIMIT} bytes of an SM90 CTA"
            )
        # the ticket counter: the int32 after the turnstiles (BwdHostEntry), zeroed by the preprocess
        counter = ticket_counter(mdQsem)
        num_items = launch_grid(cute.size(plan.k_row_batch), cute.size(mdK, mode=[1]))[0]
        self.kernel(
            tma_q, tma_mQ, tma_do, tma_mdO, tma_k, tma_mK, tma_v, tma_mV,
            mdK, mdV, mLSE, mDsum, mdQaccum, mdQsem, counter, plan,
            softmax_scale * Float32(LOG2_E), softmax_scale,
            sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, mmas,
        ).launch(
            grid=[cutlass.min(num_items, max_ctas), 1, 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )  # fmt: skip

    def _tiled_mmas(self):
        """``(sdp, dk, dv, dq)``: S^T / dP^T (tile_n x tile_m) or S / dP (tile_m x tile_n), the payload
        layout's warpgroup tiling; dK / dV (tile_n x D: A from registers with the warpgroups on K
        rows, or from SMEM with the warpgroups on D) or dK^T / dV^T (D x tile_n, SS, the warpgroups
        on K columns); dQ (tile_m x D, each warpgroup on its bwd_helpers.dq_warpgroup_tile)."""
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        dt, wg, lay = self.dtype, self.num_mma_wg, self.payload_layout
        sdp = sm90_utils.make_trivial_tiled_mma(
            dt, dt, K, K, Float32, (lay.wg_m, lay.wg_n, 1), (64, lay.wg_cols)
        )

        def dkv(d):
            if const_expr(self.pds_in_smem):  # dK / dV over D, or dK^T / dV^T over S's K columns
                n = lay.wg_cols if self.q_rows_on_m else d // wg
                return sm90_utils.make_trivial_tiled_mma(dt, dt, MN, MN, Float32, (1, wg, 1), (64, n))
            return sm90_utils.make_trivial_tiled_mma(
                dt, dt, K, MN, Float32, (wg, 1, 1), (64, d), warpgroup.OperandSource.RMEM
            )

        dq = make_dq_tiled_mma(dt, self.head_dim_qk, self.tile_m, wg)
        mmas = (sdp, dkv(self.head_dim_qk), dkv(self.head_dim_v), dq)
        assert all(m.size == self.num_mma_threads for m in mmas)
        return mmas

    def _shared_storage(self, sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout):
        q_stats, do_stats = self.tile_m * self.q_stages, self.tile_m * self.do_stages
        dq_smem = self.dq_chunks * self.dq_chunk
        p_elems = cute.cosize(sdS_layout) if self.pds_in_smem else 0

        @cute.struct
        class SharedStorage:
            mbar_sched: cute.struct.MemRange[cutlass.Int64, 2 * self.SCHED_STAGES]
            work: cute.struct.Align[cute.struct.MemRange[Int32, self.ITEM_WORDS * self.SCHED_STAGES], 16]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.do_stages]
            mbar_mask: cute.struct.MemRange[cutlass.Int64, 2 * self.mask_stages]
            lse: cute.struct.Align[cute.struct.MemRange[Float32, q_stats], 128]
            dsum: cute.struct.Align[cute.struct.MemRange[Float32, do_stats], 128]
            mask: cute.struct.Align[cute.struct.MemRange[Int32, self.mask_stages * self.payload_plane], 128]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, p_elems], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, dq_smem], 1024]

        return SharedStorage

    # -- device entry -------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_do: cute.CopyAtom,
        mdO: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mLSE: cute.Tensor,
        mDsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdQsem: cute.Tensor,
        counter: cute.Tensor,
        plan: BwdPlanTensors,
        scale_log2: Float32,
        softmax_scale: Float32,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        mmas: tuple,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == self.producer_warp:
            for atom in (tma_q, tma_do, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        pipes = self._make_pipelines(storage)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        s = {
            "sQ": storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
            "sdO": storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner),
            "sK": storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
            "sV": storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner),
            "sdS": storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner),
            "sP": storage.sP.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
            if self.pds_in_smem
            else None,
            # (tile_m, q_stages / do_stages): LSE (log2) / D of the staged Q / dO block
            "sLSE": storage.lse.get_tensor(cute.make_layout((self.tile_m, self.q_stages))),
            "sDsum": storage.dsum.get_tensor(cute.make_layout((self.tile_m, self.do_stages))),
            # (words, groups, stages): one payload plane per stage
            "sMask": storage.mask.get_tensor(
                cute.make_layout((self.payload_words, self.payload_groups, self.mask_stages))
            ),
            # fragment-ordered warpgroup chunks of dQ, dq_chunks of them
            "sdQ": storage.sdQ.get_tensor(cute.make_layout(self.dq_chunks * self.dq_chunk)),
            # (ITEM_WORDS, stages): the item record (Items)
            "sWork": storage.work.get_tensor(cute.make_layout((self.ITEM_WORDS, self.SCHED_STAGES))),
        }
        # dK / dV leave through the SMEM of dS [, P] and dQ (contiguous, see _shared_storage), so
        # the next item's K / V may load into sK / sV meanwhile
        s["sdK"] = storage.sdS.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        dv_ptr = storage.sdS.data_ptr() + cute.cosize(sK_layout)
        s["sdV"] = cute.make_tensor(
            cute.recast_ptr(dv_ptr, sV_layout.inner, dtype=self.dtype), sV_layout.outer
        )
        kv_heads = mdK.shape[1]  # a split kv head's items are kv heads of their own but for K / V
        items = Items(
            mQ.shape[2] // kv_heads, kv_heads, kv_heads // mK.shape[2], plan.mask_block_cnt.shape[0],
            pipes[-1], s["sWork"],
        )  # fmt: skip

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == self.producer_warp:
                group = self.launch_head_group(plan, mdQsem.shape[1], kv_heads)  # tickets -> items
                self.producer(
                    tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, mLSE, mDsum, s, plan, items, group, counter,
                    pipes,
                )  # fmt: skip
            for writer in cutlass.range_constexpr(self.dq_writers):
                if warp_idx == self.dq_warp + writer:
                    self.dq_writer(s["sdQ"], mdQaccum, mdQsem, plan, items, writer)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.mma_warpgroups(mmas, mdK, mdV, s, plan, items, scale_log2, softmax_scale, pipes,
                                tidx - self.threads_per_wg)  # fmt: skip

    def _make_pipelines(self, storage):
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        mma_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads // 32)
        mma_threads = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads)

        def tma_pipe(mbar, stages, nbytes, every_thread=False):
            # every_thread: each MMA thread releases the stage itself, after its own generic-proxy
            # reads of it (payload words, LSE, D); stages read only by WGMMA release per warp
            return pipeline.PipelineTmaAsync.create(
                barrier_storage=mbar.data_ptr(),
                num_stages=stages,
                producer_group=one_thread,
                consumer_group=mma_threads if every_thread else mma_warps,
                tx_count=nbytes,
                tidx=Int32(0) if every_thread else None,
                defer_sync=True,
            )

        stats = self.bytes_row_stats
        return (
            tma_pipe(storage.mbar_kv, 1, self.bytes_kv),
            tma_pipe(storage.mbar_q, self.q_stages, self.bytes_q + stats, every_thread=True),
            tma_pipe(storage.mbar_do, self.do_stages, self.bytes_do + stats, every_thread=True),
            tma_pipe(storage.mbar_mask, self.mask_stages, self.payload_plane * 4, every_thread=True),
            # the item record, read by every MMA thread and every dQ writer lane
            record_pipeline(
                storage.mbar_sched.data_ptr(), self.SCHED_STAGES, self.num_mma_threads + 32 * self.dq_writers
            ),
        )

    # -- work items -------------------------------------------------------------------------------
    @cute.jit
    def next_work(self, items: Items, item: Int32):
        """``(valid, work, q_len)``: the ``item``-th item the producer published (``valid == 0``:
        none), as ``consumer_k2q.Work`` (its fields outside :data:`ITEM_FIELDS` but ``q_per_kv``
        and ``mask_heads`` are 0: the producer's alone) and its sample's ``q_len``."""
        state = item_state(self.SCHED_STAGES, item, pipeline.PipelineUserType.Consumer)
        valid, values, _ = fetch_record(items.pipe, state, items.sWork, len(ITEM_FIELDS) + 1)
        # every thread reads the same record: said so to the compiler (as of ``wg`` in mma_warpgroups),
        # the loops these values bound may stay on the uniform datapath
        valid = cute.arch.make_warp_uniform(valid)
        values = [cute.arch.make_warp_uniform(v) for v in values]
        fields = dict(zip(ITEM_FIELDS, values[:-1], strict=True))
        fields.update(q_per_kv=items.q_per_kv, mask_heads=items.mask_heads)
        return valid, Work(**{f: fields.get(f, Int32(0)) for f in Work._fields}), values[-1]

    # -- producer warp ------------------------------------------------------------------------------
    @cute.jit
    def producer(
        self, tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, mLSE, mDsum, s, plan, items, head_group, counter,
        pipes,
    ):  # fmt: skip
        """Takes the CTA's items (tickets, in the order of ``consumer_k2q.decode_work`` with
        ``head_group`` kv heads at a time) and publishes them decoded; per item, TMA loads
        of K / V once and of each step's Q / dO (+ LSE / D), the partial payloads. Rows of a tile past
        the sample land as they are: the MMA warpgroups zero them (``BwdMainloop.zero_tail``). The
        next item's K / V load waits only for the MMA warpgroups' last GEMMs of the current one."""
        pipe_kv, pipe_q, pipe_do, pipe_mask = pipes[:4]
        tm, tn = self.tile_m, self.tile_n
        lane = cute.arch.lane_idx()
        producer = pipeline.PipelineUserType.Producer
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.do_stages)
        mask_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.mask_stages)
        bulk_i32 = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Int32)
        bulk_f32 = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Float32)
        kv_heads = items.kv_heads
        num_items = launch_grid(cute.size(plan.k_row_batch), kv_heads)[0]
        item = Int32(0)
        ticket = take_ticket(counter, lane)
        while ticket < num_items:
            work = decode_work(
                plan, items.q_per_kv, tn, kv_heads, head_group, ticket=ticket, rows_descending=self.mirrored
            )
            q_len = desc_field(plan.sequence_desc, plan.k_row_batch[work.row], DESC_Q_LEN)
            record = (*(getattr(work, f) for f in ITEM_FIELDS), q_len)
            publish_record(items.pipe, item_state(self.SCHED_STAGES, item, producer), items.sWork, record,
                           Int32(1), lane)  # fmt: skip
            # K and V of this block, once (also for an item without steps, rare: one wait per item)
            kv_copies = []
            kv_head = work.kv_head // items.kv_split
            for kv_atom, m_kv, s_kv, d_kv in (
                (tma_k, mK, s["sK"], self.head_dim_qk),
                (tma_v, mV, s["sV"], self.head_dim_v),
            ):
                g_kv = cute.local_tile(
                    self.sample_rows(m_kv[None, None, kv_head], work.batch, work.k_offset),
                    (tn, d_kv),
                    (work.n_block, 0),
                )
                t_s, t_g = cpasync.tma_partition(
                    kv_atom, 0, cute.make_layout(1), cute.group_modes(s_kv, 0, 2),
                    cute.group_modes(g_kv, 0, 2),
                )  # fmt: skip
                kv_copies.append((kv_atom, t_g, t_s))
            kv_state = item_state(1, item, producer)
            fill_stage(pipe_kv, kv_state, kv_copies)
            for g in cutlass.range(work.q_per_kv, unroll=1):
                hr = head_range(plan, work, g)
                # (tile_m, D, n_q_blocks) of this sample and head
                tiles = []
                # q may be read per sample (sample_rows); dO, the kernels' own THD tensor, never is
                for atom, rows, s_x, d in (
                    (tma_q, self.sample_rows(mQ[None, None, hr.q_head], work.batch, work.q_offset),
                     s["sQ"], self.head_dim_qk),
                    (tma_do, rows_from(mdO[None, None, hr.q_head], work.q_offset),
                     s["sdO"], self.head_dim_v),
                ):  # fmt: skip
                    g_x = cute.local_tile(rows, (tm, d), (None, 0))
                    tiles.append(cpasync.tma_partition(
                        atom, 0, cute.make_layout(1), cute.group_modes(s_x, 0, 2), cute.group_modes(g_x, 0, 2)
                    ))  # fmt: skip
                tQsQ, tQgQ = tiles[0]
                tdOsdO, tdOgdO = tiles[1]
                stats_row = hr.q_head * mLSE.shape[1]
                left_p, left_f = hr.partial_cnt, hr.full_cnt
                for _ in cutlass.range(hr.partial_cnt + hr.full_cnt, unroll=1):
                    nxt = walk_row(plan, hr, left_p, left_f, not self.mirrored)
                    if nxt.partial != 0:
                        mask_state = load_payload_plane(
                            pipe_mask, mask_state, bulk_i32, plan.mask_block_masks, s["sMask"], nxt.entry,
                            self.payload_plane,
                        )  # fmt: skip
                    q_state, do_state = self.load_q_block(
                        nxt.q_block, work, stats_row, pipe_q, pipe_do, q_state, do_state, tma_q, tQgQ, tQsQ,
                        tma_do, tdOgdO, tdOsdO, bulk_f32, mLSE, mDsum, s,
                    )  # fmt: skip
                    left_p, left_f = nxt.partial_left, nxt.full_left
            item += 1
            ticket = take_ticket(counter, lane)
        # the end of work
        end = item_state(self.SCHED_STAGES, item, producer)
        publish_record(items.pipe, end, items.sWork, (), Int32(0), lane)

    @cute.jit
    def load_q_block(
        self, m_block, work, stats_row, pipe_q, pipe_do, q_state, do_state, tma_q, tQgQ, tQsQ, tma_do,
        tdOgdO, tdOsdO, bulk_f32, mLSE, mDsum, s,
    ):  # fmt: skip
        """Q + its LSE into a stage of the Q pipeline, dO + its D into a stage of dO's. Returns the
        two states."""
        stats = cute.make_layout(self.tile_m)
        first = stats_row + (work.qblk_base + m_block) * self.tile_m
        for pipe, state, atom, t_g, t_s, m_stat, s_stat in (
            (pipe_q, q_state, tma_q, tQgQ, tQsQ, mLSE, s["sLSE"]),
            (pipe_do, do_state, tma_do, tdOgdO, tdOsdO, mDsum, s["sDsum"]),
        ):
            tile = ((atom, t_g[None, m_block], t_s[None, state.index]),)
            src = cute.make_tensor(element_ptr(m_stat, first), stats)
            row_stats = ((bulk_f32, src, cute.make_tensor(s_stat[None, state.index].iterator, stats)),)
            fill_stage(pipe, state, tile, row_stats)
            state.advance()
        return q_state, do_state

    # -- dQ writer warp -----------------------------------------------------------------------------
    @cute.jit
    def dq_writer(
        self, sdQ: cute.Tensor, mdQaccum: cute.Tensor, mdQsem: cute.Tensor, plan: BwdPlanTensors, items,
        writer: cutlass.Constexpr[int],
    ):  # fmt: skip
        """Per step (of ``dq_writers``, every ``writer``-th) of every item: [wait for this entry's
        turn,] bulk-add (or store: the block's first, ``first_dq_stored``) each chunk into the GMEM
        accumulator once its warpgroup has written it, then hand the chunks back. With one shared
        chunk (``dq_chunks == 1``) warpgroup 0 gets it first and warpgroup 1 once the first add has
        read it, so warpgroup 1's dQ store also waits for the turnstile."""
        lane = cute.arch.lane_idx()
        step = Int32(0)
        item = Int32(0)
        if const_expr(writer == 0):
            for wg in cutlass.range_constexpr(self.dq_chunks):
                self.dq_chunk_empty(wg)  # the chunks start empty
        valid, work, _ = self.next_work(items, item)
        while valid != 0:
            for g in cutlass.range(work.q_per_kv, unroll=1):
                hr = head_range(plan, work, g)
                left_p, left_f = hr.partial_cnt, hr.full_cnt
                for _ in cutlass.range(hr.partial_cnt + hr.full_cnt, unroll=1):
                    nxt = walk_row(plan, hr, left_p, left_f, not self.mirrored)
                    if self.dq_writer_of(step) == writer:
                        rank = Int32(0)
                        if nxt.partial != 0:
                            rank = plan.dq_write_order[nxt.entry]
                        else:
                            rank = plan.dq_write_order_full[nxt.entry]
                        q_block = work.qblk_base + nxt.q_block
                        self.write_dq_block(sdQ, mdQaccum, mdQsem, hr.q_head, q_block, rank, lane, writer)
                    left_p, left_f = nxt.partial_left, nxt.full_left
                    step += 1
            item += 1
            valid, work, _ = self.next_work(items, item)
        cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def write_dq_block(
        self, sdQ, mdQaccum, mdQsem, q_head: Int32, q_block: Int32, rank: Int32, lane: Int32,
        writer: cutlass.Constexpr[int],
    ):  # fmt: skip
        """One step's dQ. With ``first_dq_stored`` the block's first contribution (``rank`` 0)
        is stored and counted on the block's turnstile; deterministic mode adds the others in rank
        order (each waits for its rank), atomic mode in any order once the first is stored (each
        waits for a count of 1). Two writers then take alternate steps, so one step's turnstile
        chain (store or adds complete, release, the next acquire: dependent L2 round trips)
        overlaps the next step's: a writer hands the chunks back (to the next step, the other
        writer's, or to the item's epilogue, which stages dV there) as soon as its bulk copies
        have read them, then completes its turn."""
        shared = self.dq_chunks == 1  # one SMEM chunk, filled by the warpgroups in turn
        counter = element_ptr(mdQsem, q_head * mdQsem.shape[1] + q_block, 4)
        if const_expr(self.first_dq_stored):
            turn = rank
            if const_expr(not self.deterministic):
                turn = cutlass.min(rank, Int32(1))
            turnstile_wait(counter, turn, lane)
        base = q_head * mdQaccum.shape[1] + q_block * self.dq_block
        for wg in cutlass.range_constexpr(self.num_mma_wg):
            if const_expr(shared and wg > 0):
                # the add of the previous warpgroup's chunk has read it: the chunk is this one's
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                self.dq_chunk_empty(wg)
            full = self.dq_full_barrier(wg, writer)
            cute.arch.barrier(barrier_id=full, number_of_threads=self.dq_pair_threads)
            if lane == 0:
                dst = element_ptr(mdQaccum, base + wg * self.dq_chunk)
                src = sdQ.iterator + self.dq_chunk_offset(wg)
                if const_expr(self.first_dq_stored):
                    if rank == 0:  # the block's first contribution; its accumulator was not zeroed
                        bulk_store(src, dst, self.dq_chunk * 4)
                    else:
                        bulk_reduce_add_f32(src, dst, self.dq_chunk * 4)
                else:
                    bulk_reduce_add_f32(src, dst, self.dq_chunk * 4)
            cute.arch.cp_async_bulk_commit_group()
        # chunk wg is free once its add has read it (with two chunks, the second add stays in flight)
        for wg in cutlass.range_constexpr(self.dq_chunks):
            cute.arch.cp_async_bulk_wait_group(self.dq_chunks - 1 - wg, read=True)
            self.dq_chunk_empty(wg)
        if const_expr(self.first_dq_stored):
            if self.deterministic or rank == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=False)  # the copies are complete in GMEM
                turnstile_advance(counter, lane)
