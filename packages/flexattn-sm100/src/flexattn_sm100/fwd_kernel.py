"""SM100 (Blackwell) attention forward that consumes a MaskPlan's forward view (spec 6.1, 6.2): the
generic qstage1 + 1CTA, qstage2 + 1CTA and qstage1 + 2CTA variants and the D256 one, one class
configured by the variant and the head dims (q stages, CTA group size, payload delivery, K/V
pipeline depth are constructor facts). Compile-verified for sm_100a only: it has NEVER run on SM100
hardware.

``qstage1-1cta``: one CTA = one 128 x 128 plan block. ``qstage1-2cta``: a cluster of two CTAs = one
256 x 128 plan block computed by tcgen05 ``cta_group::2`` MMAs (M = 256) that the leader CTA (rank
0) issues; CTA rank r holds Q rows ``128 r .. 128 r + 127`` of the block, half of every K tile (64
rows) and of every V^T tile (Dv / 2 columns) in SMEM, and its own 128 rows of S, P and O in its own
TMEM; payload subtile r is CTA r's plane (payload_layout.py). Each CTA has six warps, 192 threads::

    warps 0-3 (softmax WG)  thread t owns score row 128 r + t (TMEM lane t, tcgen05.ld 32x32b):
                            packed predicate (1CTA: payload words GMEM -> registers; 2CTA: from the
                            CTA's two-stage SMEM payload ring, spec 6.2), online softmax in the log2
                            domain, P -> TMEM, O rescale in TMEM, epilogue (O / rowsum -> GMEM,
                            LSE); allocates and frees TMEM (2CTA: both CTAs, cta_group::2)
    warp 4   (MMA)          one thread issues tcgen05.mma: S_j = Q K_j^T (SS, into TMEM),
                            O += P_j V_j (TS: P from TMEM, V from SMEM); 2CTA: the leader's only
                            (the peer's MMA warp only drains its task records)
    warp 5   (load)         hardware CLC queue over ``fwd_work_desc`` (task = cluster id; a cluster
                            that is done cancels a not-yet-launched one and takes its task; 2CTA:
                            the leader queries, the response is multicast to both CTAs), task
                            decode, TMA loads of Q, K, V (2CTA: each CTA its share, completing on
                            the leader's barriers), 2CTA: bulk copy of the CTA's payload plane of
                            each partial block into the SMEM ring

``qstage2-1cta``: one CTA = one 256 x 128 plan block as two 128-row Q tiles (q stages 0 and 1),
payload subtile q = q stage q, direct payload loads. Twelve warps, 384 threads: warps 0-3 and 4-7 are
the softmax warpgroups of q stages 0 and 1 (thread t of stage q owns row 128 q + t, as above), warp 8
the MMA warp, warp 9 the load warp (both Q tiles on the one Q barrier), warps 10-11 idle; setmaxnreg
gives the softmax warpgroups 200 registers and the rest 104. Per K block the MMA warp alternates
the stages, so one stage's softmax overlaps the other stage's GEMMs (``mma_role_qstage2``).

``d256``: the qstage1 + 1CTA kernel with (Dqk, Dv) = (256, 256): O fills TMEM columns 256..511, and
SMEM holds Q and ONE K/V stage (64 + 64 + 64 KB; two stages would need 320 KB, :func:`kv_stages_for`).
With one stage the K and V pipelines still overlap each other: K_{j+1} is loaded (and S_{j+1}
computed) while V_j waits for P_j.

TMEM (512 columns, fp32). P (tile_n 16-bit values a row, packed two per column) is written over the
first 64 columns of the S stage it was computed from, once the softmax has read that S::

    column      0 ....... 63 64 ...... 127 128 ..... 191 192 ..... 255 256 ................... 511
    qstage1   [ S stage 0                 ][ S stage 1                 ][ O: Dv columns (d256: 256) ]
              [ P (from 0) ]               [ P (from 1) ]
    qstage2   [ S_0                       ][ S_1                       ][ O_0: Dv <= 128 ][ O_1     ]
              [ P_0        ]               [ P_1        ]

P over S is safe because the tcgen05.mma instructions one thread issues execute in issue order, and
the MMA warp issues the next MMA into P_j's columns only after the P_j V_j that reads them (blocks
counted over the CTA's tasks, the S stages alternating with them)::

    qstage1   S_0 ; for j: [S_{j+1} into the other stage] ; wait P_j ; P_j V_j
              S_{j+2}, the next S into P_j's stage, is issued in iteration j + 1: after the wait for
              P_j (so after the softmax stored it) and after P_j V_j. The softmax releases S_j's
              stage right after its tcgen05.ld; that only lets the MMA warp acquire it for S_{j+2}.
    qstage2   per q stage and j: wait P_q ; P_q V_j ; S_q = Q_q K_{j+1}^T (one S stage per q stage)

Per task ``(m_block, head, batch, q_valid_rows)`` (the walk of flexattn_sm90, spec 6.1)::

    row = sequence_desc[batch].row_begin + m_block,   h = head if Hmask > 1 else 0
    for e in mask_block_offset[h, row] + [0, mask_block_cnt[h, row]):   # partial blocks
        S = Q K[mask_block_idx[e]]^T ; S[bit == 0] = -inf ; softmax step ; O += P V
    for e in full_block_offset[h, row] + [0, full_block_cnt[h, row]):   # full blocks, no mask work
        S = Q K[full_block_idx[e]]^T ; softmax step ; O += P V
    O /= rowsum, LSE = max*scale + ln(rowsum); rows with no visible key: O = 0, LSE = -inf

Pipelines (mbarriers; with a CTA pair the full barriers of Q/K/V/P and the empty barriers of S/O are
the leader's: both CTAs' TMA bytes and softmax arrivals land there, and the leader's tcgen05.commit
multicasts to both CTAs)::

    sched  2 stages   load lane 0 -> MMA warp + softmax WG     decoded task record in SMEM (CTA-local)
    Q      1 stage    TMA -> MMA                               released by tcgen05.commit
    K, V   kv_stages  TMA -> MMA                               released by tcgen05.commit (d256: 1)
    S      2 stages   MMA (commit) -> softmax WG(s)            released after tcgen05.ld (P_j is then
           (qstage2: 1 stage per q stage)                      written over S_j: see the TMEM picture)
    P      1 stage    softmax WG(s) -> MMA                     released by the commit of P V, so
                                                               acquiring P = "O is stable"
    O      1 stage    MMA (commit after the last P V) -> softmax WG(s) epilogue
           (S, P and O: one pipeline per q stage)
    mask   2 stages   cp.async.bulk -> softmax WG              2CTA only, CTA-local (spec 6.2):
                                                               advances once per partial block;
                                                               full blocks never touch it

Physical rows are ``q_offset/k_offset + sample-local position``; Q/K/V tiles past the tensor end
are zero-filled by TMA, partial payloads carry the K tail (bit 0), and output rows past
``q_valid_rows`` (of the whole plan block) are never stored. A sample's tail K block (always
partial) also holds the next sample's first rows: their scores are masked, but their V rows meet
zero probabilities in P V (0 * inf = nan), so without a CTA pair the load warp lands such a V block
on a barrier of its own, zeroes V^T's columns past the sample and only then signals the stage
(``stage_fill.land_zeroing_tail``; V^T's stage seen as key rows through ``stage_fill.row_view``)::

    V^T stage (Dv x tile_n)    TMA -> mbar_tail; load warp waits, zeroes keys >= k_len - n_block * tile_n,
    [ k_len keys | next sample ]      fence.proxy.async, then a plain arrive on the stage's full barrier

The ``qstage1-2cta`` pair does not zero yet (each CTA's V share completes on the leader's barrier).
"""

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync

from maskplan_kernels.consumer_entry import FwdHostEntry
from maskplan_kernels.consumer_inputs import check_register_split, max_launch_registers
from maskplan_kernels.consumer_plan import (
    CUTE_DTYPES,
    TASK_WORDS,
    FwdPlanTensors,
    Task,
    decode_task,
    load_payload_plane,
    publish_task,
    record_pipeline,
    select_modes,
)
from maskplan_kernels.stage_fill import fill_stage, row_view

from .config import Sm100FwdConfig
from .fwd_helpers import (
    cta_group_of,
    make_pv_mma,
    make_qk_mma,
    set_max_registers,
    thread_group,
    tma_umma_pipeline,
)
from .fwd_mma import MmaRole
from .fwd_softmax import SoftmaxRole

#: the variants this kernel implements (every forward variant ``config.FWD_VARIANTS`` defines)
IMPLEMENTED_VARIANTS = ("qstage1-1cta", "qstage2-1cta", "qstage1-2cta", "d256")
#: SMEM the Q/K/V stages may take for a deeper K/V pipeline than two stages
_SMEM_BUDGET = 200 * 1024
#: SMEM the Q/K/V stages may take at all: an SM's 227 KB less the rest (barriers, task records, CLC
#: response, the 2CTA payload ring of 4 KB, up to 1 KB of alignment before Q)
_SMEM_LIMIT = 220 * 1024
_MAX_KV_STAGES = 4
#: half of an SM's 227 KB of SMEM: a CTA above it never shares its SM
_HALF_SM_SMEM = 114 * 1024
#: TMEM columns (32-bit) of a CTA, and those its S tiles take: two S stages (qstage1) or one S per q
#: stage (qstage2) of tile_n = 128 columns; O gets the rest
_TMEM_COLS, _TMEM_S_COLS = 512, 256
#: qstage2 setmaxnreg split: the two softmax warpgroups, and the MMA/load warpgroup (8 x 200 + 4 x 104
#: = 12 x 168, the launch's registers). ptxas: no spills but 4 bytes for fp16 at D128; 224/56 and
#: 208/88 spill in the MMA/load warps, 168 for all spills in the softmax)
_QSTAGE2_SOFTMAX_REGS, _QSTAGE2_OTHER_REGS = 200, 104
#: qstage2 keeps two Q tiles and two K/V stages in SMEM: Dqk 192 does not fit 227 KB
QSTAGE2_MAX_HEAD_DIM_QK = 128


def kv_stages_for(
    head_dim_qk: int,
    head_dim_v: int,
    element_bytes: int = 2,
    tile: int = 128,
    cta_group_size: int = 1,
    q_tiles: int = 1,
) -> int:
    """K/V pipeline depth: up to 4 stages that fit next to the ``q_tiles`` Q tiles in
    :data:`_SMEM_BUDGET`, or more when 4 leave the CTA under half an SM's SMEM. Each CTA allocates
    all 512 TMEM columns, so a second CTA on the SM would only wait for them (and a CTA pair waiting
    on two SMs could deadlock). At least two stages where two fit :data:`_SMEM_LIMIT`, one where only
    one does (D256: Q + K + V = 192 KB), 0 where not even one does. With a CTA pair each CTA holds
    half of every K and V tile."""
    q_bytes = q_tiles * tile * head_dim_qk * element_bytes
    kv_bytes = tile * (head_dim_qk + head_dim_v) * element_bytes // cta_group_size
    most = max(0, (_SMEM_LIMIT - q_bytes) // kv_bytes)
    fit = (_SMEM_BUDGET - q_bytes) // kv_bytes
    above_half = -(-(_HALF_SM_SMEM + 1 - q_bytes) // kv_bytes)
    return max(min(2, most), min(fit, max(_MAX_KV_STAGES, above_half)))


def unsupported(config: Sm100FwdConfig) -> str | None:
    """Why :class:`Sm100FwdKernel` cannot be built for ``config`` (naming the values), or None."""
    v, dqk, dv = config.variant, config.head_dim_qk, config.head_dim_v
    dims = f"(head_dim_qk, head_dim_v)=({dqk}, {dv})"
    if v.name not in IMPLEMENTED_VARIANTS:
        return f"the SM100 forward kernel implements variants {IMPLEMENTED_VARIANTS}, not {v.name!r}"
    if config.pack_gqa:
        return "PackGQA is not implemented by the SM100 forward kernel"
    if dqk % 16 or dv % 32 or max(dqk, dv) > 256:
        return (
            f"{dims}: head_dim_qk must be a multiple of 16 (the K step of the S MMA), head_dim_v of 32 "
            "(the O columns one tcgen05.ld/st moves), both <= 256 (the largest compiled)"
        )
    if _TMEM_S_COLS + v.q_stage * dv > _TMEM_COLS:
        return (
            f"{dims}: TMEM ({_TMEM_COLS} columns) holds {_TMEM_S_COLS} S columns and q_stage={v.q_stage} "
            f"O tiles of head_dim_v columns, so head_dim_v <= {(_TMEM_COLS - _TMEM_S_COLS) // v.q_stage}"
        )
    if v.cta_group_size > 1 and dv > 128:
        return f"{dims}: the CTA pair is written for head_dim_v <= 128 (Dv 256 is the 'd256' variant)"
    if v.q_stage == 2 and dqk > QSTAGE2_MAX_HEAD_DIM_QK:
        return (
            f"head_dim_qk={dqk}: qstage2 keeps two Q tiles and two K/V stages in SMEM, which fits for "
            f"head_dim_qk <= {QSTAGE2_MAX_HEAD_DIM_QK} only"
        )
    if kv_stages_for(dqk, dv, cta_group_size=v.cta_group_size, q_tiles=v.q_stage) == 0:
        return f"{dims}: the Q tiles and one K/V stage exceed {_SMEM_LIMIT // 1024} KB of SMEM"
    return None


class Sm100FwdKernel(FwdHostEntry, SoftmaxRole, MmaRole):
    """Static configuration of one compiled forward kernel; see the module docstring."""

    def __init__(self, config: Sm100FwdConfig):
        reason = unsupported(config)
        if reason is not None:
            raise NotImplementedError(reason)
        variant = config.variant
        self.config = config
        self.dtype = CUTE_DTYPES[config.dtype]
        self.head_dim_qk, self.head_dim_v = config.head_dim_qk, config.head_dim_v
        self.tile_m, self.tile_n = config.tile_m, config.tile_n  # the plan block
        # CTA pair: cluster (2, 1, 1) along M, cta_group::2 MMAs issued by the leader (rank 0)
        self.cta_group_size = variant.cta_group_size
        self.cluster_shape = (self.cta_group_size, 1, 1)
        # qstage2: two Q tiles (q stages) of the plan block per CTA, one softmax warpgroup each
        self.q_stages = variant.q_stage
        self.mma_tile_m = self.tile_m // self.q_stages  # the M of one S = Q K^T MMA
        self.cta_tile_m = self.mma_tile_m // self.cta_group_size  # Q rows = TMEM lanes of one CTA
        assert (self.cta_tile_m, self.tile_n) == (128, 128) and self.cta_group_size in (1, 2)
        assert self.q_stages in (1, 2) and self.q_stages * self.cta_group_size <= 2
        self.kv_stages = kv_stages_for(
            self.head_dim_qk, self.head_dim_v, cta_group_size=self.cta_group_size, q_tiles=self.q_stages
        )
        self.sched_stages = 2
        # qstage1: S double-buffered (S_{j+1} overlaps softmax j); qstage2: one S per q stage (the
        # other stage's S overlaps); P_j is written over the S stage it came from
        self.s_stages = 2 if self.q_stages == 1 else 1
        # payload delivery (spec 6.2): 0 = direct GMEM -> registers, else the SMEM ring's depth
        self.mask_stages = variant.mask_pipeline_stages
        # payload ABI (payload_layout.py is the one source of truth): subtile = CTA rank or q stage
        layout = config.payload_layout
        assert layout.subtiles == self.cta_group_size * self.q_stages
        self.payload_subtiles = layout.subtiles
        self.payload_groups = layout.groups  # = threads of one softmax warpgroup
        self.payload_words = layout.words_per_group
        self.payload_elements = layout.elements_per_thread
        self.payload_plane = layout.groups * layout.words_per_group  # int32 words of one CTA's subtile
        self.payload_entry = layout.words_per_tile  # int32 words of one partial entry (all subtiles)
        assert self.payload_entry == self.payload_subtiles * self.payload_plane
        # warp roles: one softmax warpgroup per q stage, then the MMA and the load warp
        self.softmax_warps = tuple(range(4 * self.q_stages))
        self.mma_warp = len(self.softmax_warps)
        self.load_warp = self.mma_warp + 1
        self.num_softmax_threads = 32 * len(self.softmax_warps)
        # qstage2: 256 softmax threads need more registers than 320 threads launch with; setmaxnreg
        # moves them there, per warpgroup, so two idle warps complete the MMA/load warpgroup
        idle_warps = 2 if self.q_stages == 2 else 0
        self.num_threads = 32 * (len(self.softmax_warps) + 2 + idle_warps)
        self.register_split = None
        if self.q_stages == 2:
            self.register_split = (_QSTAGE2_SOFTMAX_REGS, _QSTAGE2_OTHER_REGS)
            check_register_split(
                self.num_threads,
                ((_QSTAGE2_SOFTMAX_REGS, len(self.softmax_warps)), (_QSTAGE2_OTHER_REGS, 2 + idle_warps)),
                max_launch_registers(self.num_threads),
            )
        assert self.payload_groups == self.cta_tile_m == 128
        # named barriers (0 is __syncthreads), CTA-local
        self.tmem_alloc_barrier_id = 1  # softmax WG + MMA warp wait for the TMEM address
        self.tmem_free_barrier_id = 2  # softmax WG done with TMEM before warp 0 frees it
        # TMEM columns (32-bit) per q stage, see the module docstring: the S tiles, each P_j over the
        # S stage it came from, then the O tiles
        self.tmem_cols = _TMEM_COLS
        self.tmem_s_stride = self.tile_n  # between the S stages of one q stage (qstage1)
        self.tmem_s_offsets = tuple(q * self.s_stages * self.tile_n for q in range(self.q_stages))
        self.tmem_o_offsets = tuple(_TMEM_S_COLS + q * self.head_dim_v for q in range(self.q_stages))
        assert self.q_stages * self.s_stages * self.tile_n == _TMEM_S_COLS
        assert self.tmem_o_offsets[-1] + self.head_dim_v <= self.tmem_cols

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
        softmax_scale: Float32,
        num_ctas: Int32,  # one CTA (cluster) per task: the view's task count
        stream: cuda.CUstream,
    ):
        if const_expr(mQ.element_type != self.dtype or mK.element_type != self.dtype):
            raise TypeError(f"q/k/v/o must be {self.dtype}")
        qk_mma = make_qk_mma(self.dtype, self.mma_tile_m, self.tile_n, self.cta_group_size)
        # qstage2: q stage 1 issues S through its own tiled MMA (see mma_role_qstage2)
        qk_mma_1 = make_qk_mma(self.dtype, self.mma_tile_m, self.tile_n, self.cta_group_size)
        pv_mma = make_pv_mma(self.dtype, self.mma_tile_m, self.head_dim_v, self.cta_group_size)
        qk_tiler = (self.mma_tile_m, self.tile_n, self.head_dim_qk)  # (M, N, K) of S = Q K^T
        pv_tiler = (self.mma_tile_m, self.head_dim_v, self.tile_n)  # (M, N, K) of O = P V
        # ((MMA), MMA_M, MMA_K, stages) UMMA-canonical SMEM layouts, one CTA's share of each tile
        # (Q: one stage per q stage)
        sQ_layout = sm100_utils.make_smem_layout_a(qk_mma, qk_tiler, self.dtype, self.q_stages)
        sK_layout = sm100_utils.make_smem_layout_b(qk_mma, qk_tiler, self.dtype, self.kv_stages)
        sV_layout = sm100_utils.make_smem_layout_b(pv_mma, pv_tiler, self.dtype, self.kv_stages)
        # V^T is MN-major: a key's Dv values lie in rows of the swizzle atom, which the tail zeroing
        # walks (stage_fill.row_view)
        self.v_swizzle_bits = sV_layout.inner.num_bits
        # the P operand (K-major A of P V) as it lies in TMEM
        tP_layout = sm100_utils.make_smem_layout_a(pv_mma, pv_tiler, self.dtype, 1)
        # TMA views: Q, K (rows, D, heads); V^T (Dv, rows, heads), MN-major for the PV B operand
        mQ_t, mK_t, mV_t = (
            select_modes(mQ, [0, 2, 1]),
            select_modes(mK, [0, 2, 1]),
            select_modes(mV, [2, 0, 1]),
        )
        # ((cta_group), 1, 1, 1): the CTAs of one MMA along V, nothing multicast along M/N
        cluster_vmnk = self.cta_layout_vmnk(qk_mma).shape
        load_op = cpasync.CopyBulkTensorTileG2SOp(cta_group_of(self.cta_group_size))
        one = [0, 1, 2]
        tma_q, tma_mQ = cute.nvgpu.make_tiled_tma_atom_A(
            load_op, mQ_t, cute.select(sQ_layout, mode=one), qk_tiler, qk_mma, cluster_vmnk
        )
        tma_k, tma_mK = cute.nvgpu.make_tiled_tma_atom_B(
            load_op, mK_t, cute.select(sK_layout, mode=one), qk_tiler, qk_mma, cluster_vmnk
        )
        tma_v, tma_mV = cute.nvgpu.make_tiled_tma_atom_B(
            load_op, mV_t, cute.select(sV_layout, mode=one), pv_tiler, pv_mma, cluster_vmnk
        )
        # bytes landing on one (the leader's) full barrier: every CTA's share of the tile (Q: of
        # every q stage's tile)
        self.bytes_q, self.bytes_k, self.bytes_v = (
            cute.size_in_bytes(self.dtype, cute.select(layout, mode=one)) * self.cta_group_size * copies
            for layout, copies in ((sQ_layout, self.q_stages), (sK_layout, 1), (sV_layout, 1))
        )
        self.shared_storage = self._shared_storage(sQ_layout, sK_layout, sV_layout)
        self.kernel(
            qk_mma,
            qk_mma_1,
            pv_mma,
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
            softmax_scale,
            sQ_layout,
            sK_layout,
            sV_layout,
            tP_layout,
        ).launch(  # fmt: skip
            # one cluster per task; CLC turns running clusters into persistent ones
            grid=[num_ctas * self.cta_group_size, 1, 1],
            block=[self.num_threads, 1, 1],
            cluster=list(self.cluster_shape),
            stream=stream,
            min_blocks_per_mp=1,
        )

    # -- payload addressing (payload_layout.py: plane = subtile = CTA rank) ------------------------
    def payload_plane_index(self, entry, cta_rank):
        """Plane of CTA ``cta_rank`` for partial entry ``entry``: ``mask_block_masks`` viewed as
        ``[partial_nnz * subtiles, groups, words]`` (the view's ``[partial_nnz, subtiles, groups,
        words]`` flattened); both deliveries read group ``t``'s words at ``plane * payload_plane +
        t * payload_words``."""
        return entry * self.payload_subtiles + cta_rank

    def mask_ring_layout(self) -> cute.Layout:
        """``(payload_words, payload_groups, mask_stages)``: one CTA plane per stage, in the GMEM
        plane's (group, word) order, so one bulk copy fills a stage."""
        return cute.make_layout((self.payload_words, self.payload_groups, self.mask_stages))

    def cta_layout_vmnk(self, qk_mma: cute.TiledMma) -> cute.Layout:
        """The cluster as ``((cta_group), M, N, K)``: the CTAs of one MMA, then the MMA tiles."""
        return cute.tiled_divide(cute.make_layout(self.cluster_shape), (qk_mma.thr_id.shape,))

    def _shared_storage(self, sQ_layout, sK_layout, sV_layout):
        mask_stages = max(1, self.mask_stages)
        mask_words = self.mask_stages * self.payload_plane if self.mask_stages else 4

        @cute.struct
        class SharedStorage:
            mbar_sched: cute.struct.MemRange[cutlass.Int64, 2 * self.sched_stages]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            mbar_s: cute.struct.MemRange[cutlass.Int64, 2 * self.s_stages * self.q_stages]
            mbar_p: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            mbar_o: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            mbar_mask: cute.struct.MemRange[cutlass.Int64, 2 * mask_stages]
            mbar_clc: cute.struct.MemRange[cutlass.Int64, 1]
            mbar_clc_read: cute.struct.MemRange[cutlass.Int64, 1]  # 2CTA: both CTAs read the response
            mbar_tmem_dealloc: cute.struct.MemRange[cutlass.Int64, 1]  # 2CTA TMEM free handshake
            mbar_tail: cute.struct.MemRange[cutlass.Int64, 1]  # 1CTA: a tail V block lands here
            clc_response: cute.struct.Align[cute.struct.MemRange[Int32, 4], 16]
            tmem_holding: Int32
            task: cute.struct.Align[cute.struct.MemRange[Int32, TASK_WORDS * self.sched_stages], 16]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            # (payload_words, payload_groups, mask_stages): the CTA's payload plane per stage
            mask: cute.struct.Align[cute.struct.MemRange[Int32, mask_words], 128]

        return SharedStorage

    # -- device entry -----------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        qk_mma_1: cute.TiledMma,
        pv_mma: cute.TiledMma,
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
        softmax_scale: Float32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        tP_layout: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        pair = const_expr(self.cta_group_size > 1)
        # rank in the CTA pair = payload subtile; 0 (the leader) issues the MMAs and the CLC queries
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()) if pair else 0
        if warp_idx == self.load_warp:
            for atom in (tma_q, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        pipes = self._make_pipelines(storage, self.cta_layout_vmnk(qk_mma))
        clc = ClcBarriers(storage.mbar_clc.data_ptr(), storage.mbar_clc_read.data_ptr(),
                          storage.clc_response.data_ptr())  # fmt: skip
        if warp_idx == self.load_warp:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(clc.full, 1)
                cute.arch.mbarrier_init(clc.read, self.cta_group_size)
                cute.arch.mbarrier_init(storage.mbar_tail.data_ptr(), 1)
        # 2CTA: the allocator warp inits the TMEM-free handshake barrier here, before the cluster sync
        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_holding.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(
                self.tmem_alloc_barrier_id, self.num_softmax_threads + 32
            ),
            allocator_warp_id=self.softmax_warps[0],
            is_two_cta=pair,
            two_cta_tmem_dealloc_mbar_ptr=storage.mbar_tmem_dealloc.data_ptr() if pair else None,
        )
        cute.arch.mbarrier_init_fence()
        if const_expr(pair):  # the peer's barriers are initialised before anyone signals them
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

        # (MMA, MMA_M, MMA_K, stages) operand tiles in SMEM
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        # (TASK_WORDS, stages): the decoded task the load warp hands to the MMA warp and softmax WG
        sTask = storage.task.get_tensor(cute.make_layout((TASK_WORDS, self.sched_stages)))
        # (payload_words, payload_groups, mask_stages): the payload ring (None: direct delivery)
        sMask = None
        if const_expr(self.mask_stages > 0):
            sMask = storage.mask.get_tensor(self.mask_ring_layout())

        qk_thr, pv_thr = qk_mma.get_slice(cta_rank), pv_mma.get_slice(cta_rank)
        if warp_idx == self.load_warp:
            self.set_registers(softmax=False)
            self.load_role(
                qk_thr, pv_thr, tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV, sTask, sMask, plan, pipes, clc,
                cta_rank, storage.mbar_tail.data_ptr(),
            )  # fmt: skip
        elif warp_idx < self.mma_warp:
            self.set_registers(softmax=True)
            tmem.allocate(self.tmem_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            # warpgroup w = q stage w; its payload subtile is the q stage, or the CTA rank of a pair
            thread = tidx % self.cta_tile_m
            args = (qk_thr, pv_thr, tmem_ptr, mO, mLSE, mMaxLogit, sTask, sMask, plan, softmax_scale)
            args = (*args, pipes, thread)
            if const_expr(self.q_stages == 1):
                self.softmax_role(*args, 0, cta_rank)
            elif warp_idx < 4:
                self.softmax_role(*args, 0, 0)
            else:
                self.softmax_role(*args, 1, 1)
            # every MMA completed before the last epilogue read O; all softmax threads are done
            pipeline.NamedBarrier(self.tmem_free_barrier_id, self.num_softmax_threads).arrive_and_wait()
            tmem.relinquish_alloc_permit()
            tmem.free(tmem_ptr, self.tmem_cols)  # 2CTA: after the peer is done with its TMEM too
        elif warp_idx == self.mma_warp:  # traced last: its tcgen05 MMA set() calls rebind the MMAs' atoms
            self.set_registers(softmax=False)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            operands = (qk_mma, pv_mma, qk_thr, pv_thr, sQ, sK, sV, tP_layout, tmem_ptr, sTask, pipes)
            if const_expr(self.q_stages == 2):
                self.mma_role_qstage2(operands[0], qk_mma_1, *operands[1:])
            elif cta_rank == 0:
                self.mma_role(*operands)
            else:  # the peer's MMA warp issues nothing; it consumes its task records
                self.skip_tasks(sTask, pipes)
        else:  # qstage2's idle warps: their registers go to the softmax warpgroups
            self.set_registers(softmax=False)
        if const_expr(pair):  # no CTA leaves while its peer may still signal its barriers
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    def set_registers(self, softmax: bool) -> None:
        """qstage2: setmaxnreg of the calling warp's role (softmax warpgroups up, the rest down)."""
        if const_expr(self.register_split is not None):
            regs = self.register_split[0] if softmax else self.register_split[1]
            set_max_registers(regs, max_launch_registers(self.num_threads))

    def _make_pipelines(self, storage, cta_layout_vmnk):
        """CTA-local pipelines, and the UMMA-bridging ones over the CTA pair (``cta_layout_vmnk``):
        with two CTAs their MMA-side barriers are the leader's, so every non-MMA count doubles. S, P
        and O have one pipeline per q stage, between the MMA warp and that stage's warpgroup."""
        pair_threads = self.cta_tile_m * self.cta_group_size  # one softmax warpgroup per CTA of the MMA

        def tma_umma(mbar, stages, nbytes):
            return tma_umma_pipeline(mbar.data_ptr(), stages, nbytes, cta_layout_vmnk)

        def umma_async(barriers, stages):
            return pipeline.PipelineUmmaAsync.create(
                barrier_storage=barriers,
                num_stages=stages,
                producer_group=thread_group(1),
                consumer_group=thread_group(pair_threads),
                cta_layout_vmnk=cta_layout_vmnk,
                defer_sync=True,
            )

        mask = None
        if const_expr(self.mask_stages > 0):
            # CTA-local: this CTA's load warp -> its 128 softmax threads, each releasing (tidx=0 makes
            # every thread a signalling one)
            mask = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_mask.data_ptr(),
                num_stages=self.mask_stages,
                producer_group=thread_group(1),
                consumer_group=thread_group(self.num_softmax_threads),
                tx_count=self.payload_plane * 4,
                tidx=Int32(0),
                defer_sync=True,
            )
        return Pipes(
            sched=record_pipeline(
                storage.mbar_sched.data_ptr(), self.sched_stages, self.num_softmax_threads + 32
            ),
            q=tma_umma(storage.mbar_q, 1, self.bytes_q),
            k=tma_umma(storage.mbar_k, self.kv_stages, self.bytes_k),
            v=tma_umma(storage.mbar_v, self.kv_stages, self.bytes_v),
            s=tuple(
                umma_async(storage.mbar_s.data_ptr() + 2 * self.s_stages * q, self.s_stages)
                for q in range(self.q_stages)
            ),
            p=tuple(
                pipeline.PipelineAsyncUmma.create(
                    barrier_storage=storage.mbar_p.data_ptr() + 2 * q,
                    num_stages=1,
                    producer_group=thread_group(pair_threads),
                    consumer_group=thread_group(1),
                    cta_layout_vmnk=cta_layout_vmnk,
                    defer_sync=True,
                )
                for q in range(self.q_stages)
            ),
            o=tuple(umma_async(storage.mbar_o.data_ptr() + 2 * q, 1) for q in range(self.q_stages)),
            mask=mask,
        )

    # -- hardware CLC queue -------------------------------------------------------------------------
    @cute.jit
    def request_task_clc(self, clc, query: Int32, cta_rank):
        """Ask the hardware queue for a cluster not yet launched (query number ``query``). Every CTA
        expects the 16-byte response on its own barrier; with a CTA pair the leader issues one query
        for the cluster, multicast to both CTAs, once both have read the previous response."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(clc.full, 16)
        if const_expr(self.cta_group_size == 1):
            with cute.arch.elect_one():
                cute.arch.issue_clc_query(clc.full, clc.response, multicast=False)
        else:
            if cta_rank == 0:
                if query > 0:
                    cute.arch.mbarrier_wait(clc.read, (query - 1) % 2)
                with cute.arch.elect_one():
                    cute.arch.issue_clc_query(clc.full, clc.response, multicast=True)

    @cute.jit
    def next_task_clc(self, clc, query: Int32) -> Int32:
        """Wait for the response to query ``query``: the task of the cancelled cluster, or -1 when
        none is left (no query may follow a failed one)."""
        cute.arch.mbarrier_wait(clc.full, query % 2)
        cta_x, _, _, valid = cute.arch.clc_response(clc.response)
        # generic reads of the response before the async proxy rewrites it
        cute.arch.fence_proxy("async.shared", space="cta")
        if const_expr(self.cta_group_size > 1):  # tell the leader this CTA has read it
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive(clc.read, 0, scope=nvvm.MemScopeKind.CLUSTER)
        return cta_x // self.cta_group_size if valid != 0 else Int32(-1)

    # -- load warp ----------------------------------------------------------------------------------
    @cute.jit
    def load_role(
        self, qk_thr, pv_thr, tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV, sTask, sMask, plan: FwdPlanTensors,
        pipes, clc, cta_rank, mbar_tail,
    ):  # fmt: skip
        lane = cute.arch.lane_idx()
        qhead_per_kvhead = mQ.shape[2] // mK.shape[2]
        sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.sched_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        mask_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Producer, max(1, self.mask_stages)
        )
        query = Int32(0)
        task = Int32(cute.arch.block_idx()[0]) // self.cta_group_size
        while task >= 0:
            # ask the hardware queue for the next task now; the answer is read after the loads
            self.request_task_clc(clc, query, cta_rank)
            t = decode_task(plan, task, qhead_per_kvhead)
            sched_state = publish_task(pipes.sched, sched_state, sTask, t, Int32(1), lane)
            if t.partial_cnt + t.full_cnt > 0:  # a task without blocks writes O = 0, LSE = -inf only
                q_state, kv_state, mask_state = self.load_task(
                    t, qk_thr, pv_thr, tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV, sMask, plan, pipes,
                    q_state, kv_state, mask_state, cta_rank, mbar_tail,
                )  # fmt: skip
            task = self.next_task_clc(clc, query)
            query += 1
        sched_state = publish_task(pipes.sched, sched_state, sTask, None, Int32(0), lane)

    @cute.jit
    def load_task(
        self, t: Task, qk_thr, pv_thr, tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV, sMask,
        plan: FwdPlanTensors, pipes, q_state, kv_state, mask_state, cta_rank, mbar_tail,
    ):  # fmt: skip
        no_mcast = cute.make_layout(1)
        # Q: (mma_tile_m, Dqk) tiles of this sample and head -> (MMA, MMA_M, MMA_K, m_tiles, 1); the
        # MMA slice of CTA rank r takes rows 128 r .. 128 r + 127 of each tile; plan block m_block is
        # tiles q_stages * m_block + [0, q_stages)
        gQ = cute.flat_divide(
            cute.domain_offset((t.q_offset, 0), mQ[None, None, t.head]), (self.mma_tile_m, self.head_dim_qk)
        )
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_q, 0, no_mcast, cute.group_modes(sQ, 0, 3), cute.group_modes(qk_thr.partition_A(gQ), 0, 3)
        )
        # K: (tile_n, Dqk, n_blocks, 1); V^T: (Dv, tile_n, 1, n_blocks) of this sample and kv head
        # (2CTA: each CTA's MMA slice is half of K's rows and half of V^T's Dv rows)
        gK = cute.flat_divide(
            cute.domain_offset((t.k_offset, 0), mK[None, None, t.kv_head]), (self.tile_n, self.head_dim_qk)
        )
        gV = cute.flat_divide(
            cute.domain_offset((0, t.k_offset), mV[None, None, t.kv_head]), (self.head_dim_v, self.tile_n)
        )
        tKsK, tKgK = cpasync.tma_partition(
            tma_k, 0, no_mcast, cute.group_modes(sK, 0, 3), cute.group_modes(qk_thr.partition_B(gK), 0, 3)
        )
        tVsV, tVgV = cpasync.tma_partition(
            tma_v, 0, no_mcast, cute.group_modes(sV, 0, 3), cute.group_modes(pv_thr.partition_B(gV), 0, 3)
        )
        first_q = t.m_block * self.q_stages  # every q stage's tile on the one Q barrier
        q_copies = tuple((tma_q, tQgQ[None, first_q + q, 0], tQsQ[None, q]) for q in range(self.q_stages))
        fill_stage(pipes.q, q_state, q_copies)
        q_state.advance()
        # partial blocks, then full blocks: the consumers walk the same order
        bulk_atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Int32)
        for i in cutlass.range(t.partial_cnt, unroll=1):
            entry = t.partial_off + i
            if const_expr(self.mask_stages > 0):  # spec 6.2: this CTA's plane = subtile cta_rank
                mask_state = load_payload_plane(
                    pipes.mask, mask_state, bulk_atom, plan.mask_block_masks, sMask,
                    self.payload_plane_index(entry, cta_rank), self.payload_plane,
                )  # fmt: skip
            n_block = plan.mask_block_idx[entry]
            tail = None
            if const_expr(self.cta_group_size == 1):
                tail = (t.k_len - n_block * self.tile_n, sV, mbar_tail)
            kv_state = self.load_kv(n_block, pipes, kv_state, tma_k, tKgK, tKsK, tma_v, tVgV, tVsV, tail)
        for i in cutlass.range(t.full_cnt, unroll=1):
            n_block = plan.full_block_idx[t.full_off + i]
            kv_state = self.load_kv(n_block, pipes, kv_state, tma_k, tKgK, tKsK, tma_v, tVgV, tVsV, None)
        return q_state, kv_state, mask_state

    @cute.jit
    def load_kv(self, n_block: Int32, pipes, state, tma_k, tKgK, tKsK, tma_v, tVgV, tVsV, tail):
        """K and V block ``n_block`` into stage ``state``; returns the next state. ``tail`` is None on
        full blocks (never past the sample) and with a CTA pair, else ``(valid_rows, sV, mbar_tail)``:
        where fewer than ``tile_n`` rows belong to the sample, V^T's columns past them are zeroed
        before the stage is signalled (``stage_fill.fill_stage``; module docstring)."""
        fill_stage(pipes.k, state, ((tma_k, tKgK[None, n_block, 0], tKsK[None, state.index]),))
        v_tail = None
        if const_expr(tail is not None):
            valid_rows, sV, mbar_tail = tail
            v_t = sV[None, None, None, state.index]
            rows = row_view(v_t, self.tile_n, self.head_dim_v, self.v_swizzle_bits)
            v_tail = (valid_rows, (rows,), mbar_tail)
        fill_stage(pipes.v, state, ((tma_v, tVgV[None, 0, n_block], tVsV[None, state.index]),), tail=v_tail)
        state.advance()
        return state

@dataclass(frozen=True)
class Pipes:
    """The CTA's pipelines (a frozen dataclass: the DSL passes it through loops as read-only)."""

    sched: object
    q: object
    k: object
    v: object
    s: tuple  # per q stage
    p: tuple  # per q stage
    o: tuple  # per q stage
    mask: object  # the payload ring (spec 6.2 SMEM delivery), None with direct delivery


@dataclass(frozen=True)
class ClcBarriers:
    """SMEM of the CLC queue: ``full`` (the response arrived), ``read`` (2CTA, the leader's: both CTAs
    read the response, so it may be overwritten) and the 16-byte ``response``."""

    full: cute.Pointer
    read: cute.Pointer
    response: cute.Pointer
