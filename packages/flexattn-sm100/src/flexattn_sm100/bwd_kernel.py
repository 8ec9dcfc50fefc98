"""SM100 (Blackwell) K-major attention backward over a MaskPlan's K2Q backward view (spec 4.7, 6.3):
the ``k2q-1cta`` variant (one CTA per K block, no cluster) for (Dqk, Dv) up to (192, 128), the
``k2q-2cta`` variant (the same CTA, paired along K in a cluster; same head dims) and the ``d256``
variant (two CTAs per K block, 64-row Q blocks) for (256, 256).
Compile-verified for sm_100a only: it has NEVER run on SM100 hardware.

One CTA per (K plan row = K block of ``tile_n = 128`` keys, kv head[, head-dim half]). It loads K
and V once and visits, for every Q head of its kv group, the K2Q partial entries then the full
entries (the traversal of the SM90 backward); dK and dV accumulate in TMEM over the whole group,
each visited Q block's dQ goes to an fp32 accumulator in GMEM. Where the (K row, kv head) items are
too few for the GPU (``maskplan_kernels.kv_head_split``, SM90's rule), the k2q-1cta and d256 kernels
split each kv head's ``G`` q heads over ``s`` items as the SM90 backward does: item kv head ``hk * s
+ j`` (a kv head of its own for the grid and dK / dV, ``Hkv * s`` of them, but ``hk`` for K / V)
takes q heads ``hk * G + j * G / s ..`` and writes its part of dK / dV, which
``consumer_launch.launch_backward`` sums. k2q-2cta does not (its load warp, at the launch's 128
registers, spilled with the division; ``bwd_launch.COMPILER.splits_kv_heads``).
k2q-1cta: 14 warps, 448 threads::

    warps 0-7   (compute, 2 WGs)  thread t = 128 wg + r owns K row r (TMEM lane r) and Q columns
                                  64 wg .. 64 wg + 63 of S^T / dP^T: exactly TmemLoadLayout(128,
                                  128, 2, transposed=True), so payload bit e of group t guards
                                  register e. P^T = exp2(S^T scale log2e - LSE2), bit 0 -> P^T = 0;
                                  P^T -> TMEM (16-bit); dS^T = P^T (dP^T - D) -> SMEM; at the end
                                  dK (times softmax_scale) and dV TMEM -> GMEM (rows < k_valid)
    warps 8-11  (dQ)              thread t owns dQ row t: TMEM -> SMEM run -> bulk fp32 reduce-add
                                  into the accumulator (cp.reduce.async.bulk); deterministic mode
                                  takes the (q head, Q block) turnstile in dq_write_order first
    warp 12     (MMA)             one thread issues tcgen05.mma (below)
    warp 13     (load)            TMA: K, V once; Q and dO per step; LSE2 + D per step (bulk copy)

TMEM (fp32 columns), overlapped plan (Dqk + Dv <= 256: (32, 32), (64, 64), (96, 96), (128, 128))::

    S^T   [0, 128)        P^T (16-bit, packed): [32, 96)  WG w's P columns lie inside its own S
                          columns [64 w, 64 w + 64), so no thread overwrites S another still reads
    dP^T  [128, 256)      dQ [128, 128 + Dqk) once dP^T is consumed
    dV    [256, 256 + Dv)   dK [256 + Dv, 256 + Dv + Dqk)

MMA issue order (n steps over all heads' partial then full entries; tcgen05.mma execute in order)::

    S_0 ; dP_0
    for j < n:  [P_j stored] dV += P_j^T dO_j -> dO_j free
                S_{j+1}                                      (S_j was read before P_j was stored)
                [dS_j in SMEM] dK += dS_j^T Q_j -> Q_j free ;  dQ_j = dS_j K -> dQ ready, dS free
                [dQ_j read out] dP_{j+1}                     (dQ_j shares dP's columns)
    -> dK, dV final

Serial plan ((192, 128): dV and dK take 320 columns, so S^T, P^T, dP^T and dQ share the other 192;
one Q stage, as S_{j+1} waits for dQ_j anyway; nothing of step j + 1 overlaps step j's MMAs)::

    column   0 ............ 127 128 ..... 191 192 ...... 319 320 ........ 511
             [ S^T_j         ][ P^T_j      ][ dV            ][ dK           ]
             [ dP^T_j        ]
             [ dQ_j (Dqk = 192)           ]

    S_0
    for j < n:  [P_j stored: S_j read] dP_j ; dV += P_j^T dO_j -> dO_j free
                [dS_j in SMEM: dP_j read] dK += dS_j^T Q_j -> Q_j free ; dQ_j (over P_j: after dV_j)
                [dQ_j read out] S_{j+1}

Partial entries apply the packed predicate after the exponential (P^T = 0 where the bit is 0), so a
masked element contributes nothing whatever its score (keys past the sample's end, padding Q rows).
Padding Q rows also carry LSE2 = +inf and D = 0 (preprocess). dK/dV rows past the sample's K length
and dQ rows past its Q length are never stored.

Per CTA ``(r, hk)`` with ``b = k_row_batch[r]``, ``n_block = r - sequence_desc[b].row_begin``::

    for hq in hk * G .. hk * G + G - 1:                   # G = Hq / Hkv (split: G / s of them)
        h = hq if Hmask > 1 else 0
        for e in mask_block_offset[h, r] + [0, mask_block_cnt[h, r]):   # partial Q blocks
            step(mask_block_idx[e], payload words of entry e, rank = dq_write_order[e])
        for e in full_block_offset[h, r] + [0, full_block_cnt[h, r]):   # full Q blocks
            step(full_block_idx[e], no payload, rank = dq_write_order_full[e])

Launch order (as SM90, ``consumer_k2q.decode_work`` on a 1-D grid): deterministic mode takes all
kv heads at a time (resident CTAs form many short turnstile chains), atomic mode
``consumer_k2q.atomic_head_group`` (the SM90 measurement; not measured on SM100).

K2Q-2CTA (variant ``k2q-2cta``): the plan block is 128 Q x 256 K rows, run by a cluster of two CTAs
along K (cluster (2, 1, 1) over grid x, the pair adjacent in x: decode_work with ``splits = 2``).
Rank ``c`` is a k2q-1cta CTA for K rows ``128 c .. 128 c + 127`` of the block: its own K, V, TMEM
(the same column map as k2q-1cta), MMAs (cta_group::1, the same shapes and issue order), dK and dV
rows, and payload subtile ``c`` (``TmemLoadLayout(128, 256, 2, transposed=True)``:
``mask_block_masks[entry, c]``, 256 groups x 2 words). Both ranks walk the same K2Q row, so their
step sequences are identical::

    plan block: 128 Q x 256 K          rank 0 (cluster rank 0)             rank 1
    K rows   0..127 | subtile 0  ->    TMEM lanes = K rows 0..127          -
    K rows 128..255 | subtile 1  ->    -                                   TMEM lanes = K rows 128..255
    TMEM columns (each CTA, as k2q-1cta): S^T [0, 128), P^T [32, 96), dP^T / dQ [128, ...), dV from 256,
    dK after it (overlapped: 320 / 384 / 448 / 512 of 512 columns for D = 32 / 64 / 96 / 128);
    serial (192, 128): S^T, dP^T [0, 128), dQ [0, 192), P^T [128, 192), dV [192, 320), dK [320, 512)

MMA issue order: each MMA warp issues k2q-1cta's sequence on its own TMEM; the two warps are coupled
only through the shared Q / dO stages (a stage is refilled once dK_j (Q) and dV_j (dO) of BOTH ranks
completed) and through the dQ handoff (rank 1's dQ warps release dQ_j's columns only after rank 0
freed its run for their chunks). What the pair shares::

    Q_j, dO_j   rank c TMA-loads half c of each tile and multicasts it to both CTAs (mask 0b11): each
                CTA's full barrier expects the whole tile (its half + the peer's); each CTA's empty
                barrier takes 2 arrivals, the commits of BOTH MMA warps (tcgen05.commit multicast to
                the pair), so neither half is overwritten before both CTAs' dK_j / dV_j read it.
                L2 -> SMEM traffic of Q and dO per K row: half of two k2q-1cta CTAs'
    dQ_j        = dS_j K over the 256 rows = (rank 0's dQ_j) + (rank 1's dQ_j), reduced in the pair:
                the dQ warps of rank 1 st.async their chunk into the same slot of rank 0's staging
                run (DSMEM), rank 0's add their own chunk to it and bulk-add the sum: ONE fp32
                reduction per (Q block, pair) instead of two; deterministic mode takes the turnstile
                (one writer per pair, the plan's dq_write_order rank) on rank 0 only
    LSE2, D     rank 0 bulk-copies LSE2_j, rank 1 D_j, each multicast to both CTAs (the stats stage's
                full barrier expects both); each compute warp releases the stage after a warp sync,
                its lane c arriving on rank c's empty barrier (8 warps x 2 CTAs = 16 arrivals)

dQ handoff, per dQ warp w and chunk k (32 rows x 32 columns, 4 KB; parity k & 1)::

    rank 0 (leader) warp w                           rank 1 (peer) warp w
    tcgen05.ld dQ chunk -> regs                      tcgen05.ld dQ chunk -> regs
    [bulk add k-1 has read run w]
    full[w]: arrive.expect_tx(4 KB) ---------.
    remote arrive peer's empty[w] ------------+--->  wait empty[w]
                                              |      8 x st.async.v4 -> leader's run w (same slot),
    wait full[w] <----------------------------'----  completing on leader's full[w]
    run w slot += regs ; bulk add run w -> GMEM

Barriers: Q / dO / stats stages as above; rank 0's full[w] (1 arrival + 4 KB of transactions) and
rank 1's empty[w] (1 remote arrival) exist in both CTAs' SMEM (the struct is one); all are
initialised before a cluster-wide barrier, and the kernel ends with another, so neither CTA exits
while the peer may still commit to, multicast into or st.async into its SMEM.

SMEM is k2q-1cta's (the peer's chunk lands in the leader's existing run: no extra buffer) plus 8
mbarriers (64 B): K, V + Q, dO stages + dS^T + LSE2 / D + dQ runs = 90 / 130 / 170 / 210 / 209 KB for
D = 32 / 64 / 96 / 128 / (192, 128) (two Q stages; (192, 128) one), plus under 2 KB of barriers and
alignment, of the 227 KB.

Cost: each rank still computes S^T, dP^T, dV, dK and a 128 x Dqk dQ for its rows (the same MMA work as
two k2q-1cta CTAs); the pair saves half the Q / dO / LSE2 / D loads and half the GMEM dQ reductions,
and rank 0's dQ warps wait for rank 1's chunks.

D256 (variant ``d256``, (256, 256)): dV and dK alone (128 lanes x 256 fp32 columns each) would fill
all 512 TMEM columns, so the OUTPUT head dim is split across two CTAs. CTA ``(K block, kv head, h)``,
``h`` in {0, 1}, recomputes S^T = K Q^T and dP^T = V dO^T over the full 256-deep reductions but
accumulates only dV[:, 128 h : 128 h + 128] and dK[:, 128 h : ...] and emits only dQ[:, 128 h : ...].
The Q block has 64 rows (plan block 64 x 128): S^T and dP^T are M128 x N64 MMAs, read by ONE compute
warpgroup (thread t = K row t, Q columns 0..63: TmemLoadLayout(64, 128, 1, transposed=True)). dQ is
computed transposed, dQ^T[:, q] = K[:, 128 h ..]^T dS^T (M = 128 head-dim columns, N = 64 Q rows), so
its accumulator uses all 128 lanes; dQ thread t owns dQ column 128 h + t (bwd_helpers: dQ^T order).
10 warps, 320 threads: compute 0-3, dQ 4-7, MMA 8, load 9. Cost: per (Q block, K block) an unsplit
kernel would run 5 equal GEMMs (S^T, dP^T, dV, dK, dQ: 64 x 128 x 256 multiply-adds each); split,
S^T and dP^T run in both CTAs (4) and the halves of dV, dK and dQ add up to 3: 7 / 5 = 1.4x the MMA
work, and both CTAs load K, V, Q and dO (they are adjacent in the grid, so mostly from L2).

TMEM (fp32 columns), separate plan: every accumulator in its own columns, 480 of 512::

    column   0 ..... 63 64 .... 127 128 . 159 160 .. 223 224 ....... 351 352 ....... 479
             [ S^T_j    ][ dP^T_j    ][ P^T_j ][ dQ^T_j  ][ dV half     ][ dK half     ]

SMEM: K and V (128 x 256, 64 KB each) + one Q and one dO stage (64 x 256, 32 KB each) + dS^T (128 x
64, 16 KB) + the dQ warps' runs (16 KB) + LSE2 / D (512 B) = 224.5 KB of the 227 KB: no room for a
second Q stage, so S_{j+1} waits until dK_j released Q_j (and the load of Q_{j+1}). The own columns
let dP^T_j run while the compute warps exponentiate S^T_j, and S_{j+1} / dP_{j+1} go ahead while the
dQ warps read dQ^T_j out (only dQ^T_{j+1} waits for that)::

    S_0 ; dP_0
    for j < n:  [P_j stored] dV += P_j^T dO_j -> dO_j free
                [dS_j in SMEM] dK += dS_j^T Q_j -> Q_j free ; [dQ_{j-1} read out] dQ^T_j
                S_{j+1} (waits for Q_{j+1}) ; dP_{j+1}
Deterministic dQ: the two CTAs of a K block write disjoint columns, but they share the Q block's
turnstile: half h of the writer of rank r takes ticket ``2 r + h`` (the halves are adjacent in grid
x, so each waits only for CTAs launched before it).
"""

from dataclasses import dataclass
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05

from maskplan_kernels.consumer_entry import BwdHostEntry
from maskplan_kernels.consumer_inputs import check_register_split, max_launch_registers
from maskplan_kernels.consumer_k2q import atomic_head_group, decode_work, launch_grid, total_steps
from maskplan_kernels.consumer_plan import CUTE_DTYPES, BwdPlanTensors, select_modes
from maskplan_kernels.consumer_softmax import LOG2_E

from .bwd_compute import ComputeRoles
from .bwd_helpers import BwdGeometry, make_mmas, mma_operand, mma_tilers, smem_views
from .bwd_load import LoadRole
from .config import Sm100BwdConfig
from .fwd_helpers import set_max_registers, tcgen05_fence_after, thread_group, tma_umma_pipeline, tmem_acc

#: the backward variants this kernel implements; heuristics.py selects k2q-1cta and d256 by default for
#: their HEAD_DIMS, k2q-2cta only when a view is planned for it explicitly
IMPLEMENTED_VARIANTS = ("k2q-1cta", "k2q-2cta", "d256")
#: (head_dim_qk, head_dim_v) per variant: k2q-1cta / k2q-2cta (the same CTA, paired) with Dqk + Dv <= 256
#: the overlapped TMEM plan, with Dqk + Dv <= 320 (192, 128) the serial one; d256 the separate one over
#: half the head dim (docstring)
_K2Q_HEAD_DIMS = ((32, 32), (64, 64), (96, 96), (128, 128), (192, 128))
HEAD_DIMS = {"k2q-1cta": _K2Q_HEAD_DIMS, "k2q-2cta": _K2Q_HEAD_DIMS, "d256": ((256, 256),)}
#: Dqk + Dv up to which S^T, dP^T, dV and dK get their own TMEM columns (256 + Dv + Dqk <= 512)
OVERLAPPED_MAX_DQK_PLUS_DV = 256
_SMEM_LIMIT = 227 * 1024
#: SMEM beyond smem_bytes(): mbarriers and the TMEM address (< 256 B), the padding before the
#: 128-byte-aligned statistics / dQ runs (< 384 B) and before the 1024-byte-aligned tiles (< 1 KB);
#: __call__ checks the real struct size too
SMEM_OVERHEAD = 2048
#: setmaxnreg budgets (compute, dQ) per number of compute warpgroups; the MMA and load warps share
#: one warpgroup, which every warp of must give the same setmaxnreg (PTX ISA), so they keep the
#: registers the CTA launches with (``launch_regs``, ptxas -v: 128 for 448 threads, 168 for 320).
#: The split must fit those, or setmaxnreg.inc waits forever (the lesson of the SM90 backward).
REGISTER_SPLITS = {2: (152, 80), 1: (200, 120)}


def smem_bytes(geo: BwdGeometry, q_stages: int, do_stages: int) -> int:
    """SMEM of the operand tiles, statistics and dQ runs (2-byte elements), without barriers."""
    tm, tn = geo.tile_m, geo.tile_n
    k_v = tn * (geo.head_dim_qk + geo.head_dim_v) * 2
    q_do = tm * (q_stages * geo.head_dim_qk + do_stages * geo.head_dim_v) * 2
    ds = tm * tn * 2
    stats = 2 * q_stages * tm * 4
    dq_runs = 4 * 32 * 32 * 4
    return k_v + q_do + ds + stats + dq_runs


class Sm100BwdKernel(BwdHostEntry, ComputeRoles, LoadRole):
    """Static configuration of one compiled backward main kernel; see the module docstring."""

    def __init__(
        self, config: Sm100BwdConfig, *, deterministic: bool = False, first_dq_stored: bool = False
    ):  # fmt: skip
        variant = config.variant
        if first_dq_stored:  # BackwardCompiler.stores_first_dq is False for this consumer
            raise NotImplementedError("the SM100 backward kernel adds every dQ contribution: first_dq_stored")
        if variant.name not in IMPLEMENTED_VARIANTS:
            raise NotImplementedError(
                f"the SM100 backward kernel implements variants {IMPLEMENTED_VARIANTS}, not {variant.name!r}"
            )
        dims = (config.head_dim_qk, config.head_dim_v)
        if dims not in HEAD_DIMS[variant.name]:
            raise NotImplementedError(
                f"(head_dim_qk, head_dim_v)={dims}: the {variant.name} backward keeps dV and dK in TMEM "
                f"next to S^T / dP^T / dQ, which fits {HEAD_DIMS[variant.name]}"
            )
        self.config = config
        self.deterministic = deterministic
        self.dtype = CUTE_DTYPES[config.dtype]
        self.head_dim_qk, self.head_dim_v = dims
        self.tile_m, self.tile_n = config.tile_m, config.tile_n  # Q rows, K rows of a plan block
        # k2q-2cta: the plan block's K rows are split over a cluster of `pair` CTAs along K, rank c
        # taking rows [c cta_n, c cta_n + cta_n): each CTA is a k2q-1cta CTA for its 128 rows
        self.pair = variant.cta_group_size
        assert self.pair in (1, 2)  # a pair loads LSE2 (rank 0) and D (rank 1) for both (bwd_load)
        self.cta_n = self.tile_n // self.pair  # K rows of a CTA (its TMEM lanes)
        self.splits = variant.head_dim_splits  # CTAs per K block splitting the head dim (D256)
        self.ctas_per_block = self.splits * self.pair  # adjacent in grid x (decode_work)
        self.geometry = geo = BwdGeometry(self.tile_m, self.cta_n, *dims, self.splits)
        # TMEM plan (module docstring): which accumulators share columns orders the MMAs
        if self.splits > 1:
            self.tmem_plan = "separate"  # each in its own columns; one Q stage fits the SMEM
        elif sum(dims) > OVERLAPPED_MAX_DQK_PLUS_DV:
            self.tmem_plan = "serial"  # S_{j+1} waits for dQ_j, so one Q stage is all it uses
        else:
            self.tmem_plan = "overlapped"  # S_{j+1} is issued while Q_j feeds dK_j: two Q stages
        self.dp_over_s = self.tmem_plan == "serial"  # dP_j waits for P_j (S_j read)
        self.dq_over_dp = self.tmem_plan != "separate"  # S_{j+1} / dP_{j+1} wait for dQ_j's read-out
        self.q_stages = 2 if self.tmem_plan == "overlapped" else 1
        self.do_stages = 1
        assert smem_bytes(geo, self.q_stages, self.do_stages) + SMEM_OVERHEAD <= _SMEM_LIMIT
        # payload ABI (payload_layout.py is the one source of truth): one subtile per CTA of the
        # pair (its 128 K rows), W warpgroups
        layout = config.payload_layout
        wgs = variant.num_softmax_warpgroups
        assert layout.transposed and layout.subtiles == self.pair and layout.num_warpgroups == wgs
        self.payload_subtiles = layout.subtiles
        self.payload_plane = layout.words_per_tile  # int32 words of one partial entry (all subtiles)
        self.payload_groups = layout.groups  # = compute threads
        self.payload_words = layout.words_per_group
        self.payload_elements = layout.elements_per_thread  # Q columns per compute thread
        # warp roles: compute warpgroups, one dQ warpgroup, MMA, load
        self.compute_warps = tuple(range(4 * wgs))
        self.dq_warps = tuple(range(4 * wgs, 4 * wgs + 4))
        self.mma_warp = 4 * wgs + 4
        self.load_warp = self.mma_warp + 1
        self.num_compute_threads = 32 * len(self.compute_warps)
        self.num_dq_threads = 32 * len(self.dq_warps)
        self.num_threads = 32 * (self.load_warp + 1)
        assert self.payload_groups == self.num_compute_threads
        assert self.payload_elements == self.tile_m // wgs
        # register budgets (setmaxnreg, REGISTER_SPLITS): the CTA launches with the registers of its
        # threads rounded up to whole warpgroups
        self.launch_regs = max_launch_registers(-(-self.num_threads // 128) * 128)
        self.compute_regs, self.dq_regs = REGISTER_SPLITS[wgs]
        check_register_split(
            self.num_threads,
            ((self.compute_regs, 4 * wgs), (self.dq_regs, 4), (self.launch_regs, 2)),
            self.launch_regs,
        )
        # named barriers (0 is __syncthreads)
        self.tmem_alloc_barrier_id = 1  # compute + dQ + MMA warps wait for the TMEM address
        self.tmem_free_barrier_id = 2  # compute + dQ warps are done with TMEM
        self.dq_turn_barrier_id = 3  # dQ warps: the turnstile was passed / every add completed
        # TMEM columns (32-bit), see the module docstring; serial: S^T, P^T (tile_m / 2), dV, dK;
        # separate: S^T, dP^T, P^T, dQ, dV, dK
        self.tmem_cols = 512
        self.tmem_s = 0
        if self.tmem_plan == "serial":
            self.tmem_p, self.tmem_dp, self.tmem_dq = self.tile_m, 0, 0
            self.tmem_dv = self.tmem_p + self.tile_m // 2
        elif self.tmem_plan == "separate":
            self.tmem_dp, self.tmem_p = self.tile_m, 2 * self.tile_m
            self.tmem_dq = self.tmem_p + self.tile_m // 2
            self.tmem_dv = self.tmem_dq + geo.dq_acc[1]
        else:
            self.tmem_p, self.tmem_dp, self.tmem_dq, self.tmem_dv = 32, 128, 128, 256
        self.tmem_dk = self.tmem_dv + geo.dv_cols
        assert self.tmem_dk + geo.dk_cols <= self.tmem_cols
        assert geo.dq_acc[1] <= self.tmem_dv - self.tmem_dq

    # -- host entry: BwdHostEntry.from_pointers, then --------------------------------------------------
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
        mdQaccum: cute.Tensor,  # (Hq, n_qblk * tile_m * Dqk) fp32 (bwd_helpers: dQ accumulator order)
        mdQsem: cute.Tensor,  # (Hq, n_qblk) int32
        plan: BwdPlanTensors,
        softmax_scale: Float32,
        stream: cuda.CUstream,
    ):
        if const_expr(mQ.element_type != self.dtype or mK.element_type != self.dtype):
            raise TypeError(f"q/k/v/dout/dk/dv must be {self.dtype}")
        mmas = make_mmas(self.dtype, self.geometry)
        tilers = mma_tilers(self.geometry)
        views = smem_views(mmas, self.geometry, self.dtype, self.q_stages, self.do_stages)
        # TMA views (rows, D, heads)
        mQ_t, mK_t, mV_t, mdO_t = (select_modes(t, [0, 2, 1]) for t in (mQ, mK, mV, mdO))
        # the pair's CTAs differ in the M (K rows) tile of S^T / dP^T and share its B (Q, dO): B loads
        # are multicast along the cluster's M mode, each CTA issuing 1 / pair of the tile
        cluster_vmnk = self.cta_layout_vmnk().shape
        load_op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        b_op = cpasync.CopyBulkTensorTileG2SMulticastOp(tcgen05.CtaGroup.ONE) if self.pair > 1 else load_op
        one = [0, 1, 2]
        tma_k, tma_mK = cute.nvgpu.make_tiled_tma_atom_A(
            load_op, mK_t, cute.select(views["k"], mode=one), tilers["s"], mmas["s"], cluster_vmnk
        )
        tma_v, tma_mV = cute.nvgpu.make_tiled_tma_atom_A(
            load_op, mV_t, cute.select(views["v"], mode=one), tilers["dp"], mmas["dp"], cluster_vmnk
        )
        tma_q, tma_mQ = cute.nvgpu.make_tiled_tma_atom_B(
            b_op, mQ_t, cute.select(views["q"], mode=one), tilers["s"], mmas["s"], cluster_vmnk
        )
        tma_do, tma_mdO = cute.nvgpu.make_tiled_tma_atom_B(
            b_op, mdO_t, cute.select(views["do"], mode=one), tilers["dp"], mmas["dp"], cluster_vmnk
        )
        self.bytes_kv = cute.size_in_bytes(
            self.dtype, cute.select(views["k"], mode=one)
        ) + cute.size_in_bytes(self.dtype, cute.select(views["v"], mode=one))
        self.bytes_q = cute.size_in_bytes(self.dtype, cute.select(views["q"], mode=one))
        self.bytes_do = cute.size_in_bytes(self.dtype, cute.select(views["do"], mode=one))
        self.bytes_stats = 2 * self.tile_m * 4  # LSE2 and D of one Q block
        # the swizzle of each buffer whose rows are sequence positions (the load warp's tail zeroing)
        self.swizzle_bits = {name: views[name].inner.num_bits for name in ("k", "v", "q", "do")}
        self.shared_storage = self._shared_storage(views)
        assert self.shared_storage.size_in_bytes() <= _SMEM_LIMIT
        self.kernel(
            mmas["s"], mmas["dp"], mmas["dv"], mmas["dk"], mmas["dq"],
            tma_k, tma_mK, tma_v, tma_mV, tma_q, tma_mQ, tma_do, tma_mdO,
            mdK, mdV, mLSE, mDsum, mdQaccum, mdQsem, plan,
            softmax_scale * Float32(LOG2_E), softmax_scale,
            views["k"], views["kt"], views["v"], views["q"], views["qt"], views["do"], views["dot"],
            views["ds"], views["dsq"], views["tp"],
        ).launch(
            grid=launch_grid(cute.size(plan.k_row_batch), cute.size(mdK, mode=[1]), self.ctas_per_block),
            block=[self.num_threads, 1, 1],
            cluster=[self.pair, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )  # fmt: skip

    def cta_layout_vmnk(self):
        """The cluster as ``((cta_group), M, N, K)``: one CTA per (cta_group::1) MMA, the pair along M
        (K rows)."""
        return cute.tiled_divide(cute.make_layout((self.pair, 1, 1)), (1,))

    def payload_offset(self, entry, cta_rank, group):
        """First int32 word of payload group ``group`` of CTA ``cta_rank``'s subtile (its plane) of
        partial entry ``entry``: ``mask_block_masks[entry, cta_rank, group, :]``."""
        return ((entry * self.payload_subtiles + cta_rank) * self.payload_groups + group) * self.payload_words

    def cta_k_rows(self, cta_rank):
        """The CTA's first K row inside its plan block (rank ``c`` of the pair owns subtile ``c``)."""
        return cta_rank * self.cta_n

    def _shared_storage(self, views: dict):
        stats = self.tile_m * self.q_stages
        dq_runs = len(self.dq_warps) * 32 * 32
        pair = self.pair > 1

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.do_stages]
            mbar_stats: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            # MMA <-> compute / dQ handshakes (one completion per step each)
            mbar_s: cute.struct.MemRange[cutlass.Int64, 1]  # S^T_j in TMEM (tcgen05.commit)
            mbar_p: cute.struct.MemRange[cutlass.Int64, 1]  # P^T_j in TMEM (compute threads)
            mbar_dp: cute.struct.MemRange[cutlass.Int64, 1]  # dP^T_j in TMEM (commit)
            mbar_ds: cute.struct.MemRange[cutlass.Int64, 1]  # dS_j in SMEM (compute threads)
            mbar_dq: cute.struct.MemRange[cutlass.Int64, 1]  # dK_j, dQ_j done (commit)
            mbar_dq_empty: cute.struct.MemRange[cutlass.Int64, 1]  # dQ_j read out (dQ threads)
            mbar_dkv: cute.struct.MemRange[cutlass.Int64, 1]  # dK, dV final (commit)
            mbar_tail: cute.struct.MemRange[cutlass.Int64, 1]  # 1 CTA: tiles past the sample land here
            if pair:  # the dQ handoff per dQ warp (dq_step): the peer's chunk is in the leader's run
                # (st.async bytes); the leader's run is free for the peer's next chunk (remote arrive)
                mbar_dq_peer_full: cute.struct.MemRange[cutlass.Int64, len(self.dq_warps)]
                mbar_dq_peer_empty: cute.struct.MemRange[cutlass.Int64, len(self.dq_warps)]
            tmem_holding: Int32
            lse: cute.struct.Align[cute.struct.MemRange[Float32, stats], 128]
            dsum: cute.struct.Align[cute.struct.MemRange[Float32, stats], 128]
            dq_run: cute.struct.Align[cute.struct.MemRange[Float32, dq_runs], 128]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(views["k"])], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(views["v"])], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(views["q"])], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(views["do"])], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(views["ds"])], 1024]

        return SharedStorage

    # -- device entry ---------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mma_s: cute.TiledMma,
        mma_dp: cute.TiledMma,
        mma_dv: cute.TiledMma,
        mma_dk: cute.TiledMma,
        mma_dq: cute.TiledMma,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV: cute.Tensor,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_do: cute.CopyAtom,
        mdO: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mLSE: cute.Tensor,
        mDsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdQsem: cute.Tensor,
        plan: BwdPlanTensors,
        scale_log2: Float32,
        softmax_scale: Float32,
        sK_layout: cute.ComposedLayout,
        sKt_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sQ_layout: cute.ComposedLayout,
        sQt_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sdOt_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        sdSq_layout: cute.ComposedLayout,
        tP_layout: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == self.load_warp:
            for atom in (tma_k, tma_v, tma_q, tma_do):
                cpasync.prefetch_descriptor(atom)

        pair = self.pair > 1
        # rank c of the pair: K rows c cta_n .. of the plan block, payload subtile c; 0 writes dQ
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()) if pair else 0
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        pipes = self._make_pipelines(storage)
        bars = Handshakes(
            storage.mbar_s.data_ptr(),
            storage.mbar_p.data_ptr(),
            storage.mbar_dp.data_ptr(),
            storage.mbar_ds.data_ptr(),
            storage.mbar_dq.data_ptr(),
            storage.mbar_dq_empty.data_ptr(),
            storage.mbar_dkv.data_ptr(),
            storage.mbar_dq_peer_full.data_ptr() if pair else None,
            storage.mbar_dq_peer_empty.data_ptr() if pair else None,
        )
        self.init_handshakes(bars, storage.mbar_tail.data_ptr(), warp_idx)

        # operand tiles; the second role of a buffer is the same memory through its other layout
        def tile(buf, layout):
            return cute.make_tensor(
                cute.recast_ptr(buf.data_ptr(), layout.inner, dtype=self.dtype), layout.outer
            )

        s = {
            "sK": tile(storage.sK, sK_layout),
            "sKt": tile(storage.sK, sKt_layout),
            "sV": tile(storage.sV, sV_layout),
            "sQ": tile(storage.sQ, sQ_layout),
            "sQt": tile(storage.sQ, sQt_layout),
            "sdO": tile(storage.sdO, sdO_layout),
            "sdOt": tile(storage.sdO, sdOt_layout),
            "sdS": tile(storage.sdS, sdS_layout),
            "sdSq": tile(storage.sdS, sdSq_layout),
            # (tile_m, q_stages): LSE2 / D of the staged Q block
            "sLSE": storage.lse.get_tensor(cute.make_layout((self.tile_m, self.q_stages))),
            "sDsum": storage.dsum.get_tensor(cute.make_layout((self.tile_m, self.q_stages))),
            # (32 * 32, dQ warps): one staging run per dQ warp
            "sdQ": storage.dq_run.get_tensor(cute.make_layout((32 * 32, len(self.dq_warps)))),
        }
        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_holding.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(
                self.tmem_alloc_barrier_id, self.num_compute_threads + self.num_dq_threads + 32
            ),
            allocator_warp_id=self.compute_warps[0],
        )
        kv_heads = mdK.shape[1]  # a split kv head's items are kv heads of their own but for K / V
        group = kv_heads
        if const_expr(not self.deterministic):
            group = atomic_head_group(plan, mdQsem.shape[1], kv_heads)
        work = decode_work(plan, mQ.shape[2] // kv_heads, self.tile_n, kv_heads, group, self.ctas_per_block)
        if const_expr(pair):  # from here on the CTA's own 128-row K block, as a k2q-1cta CTA sees it
            work = work._replace(
                n_block=(work.n_block * self.tile_n + self.cta_k_rows(cta_rank)) // self.cta_n,
                k_valid=work.k_valid - self.cta_k_rows(cta_rank),
                split=Int32(0),
            )
        thr = {k: m.get_slice(0) for k, m in (("s", mma_s), ("dp", mma_dp), ("dv", mma_dv), ("dk", mma_dk),
                                             ("dq", mma_dq))}  # fmt: skip
        free = pipeline.NamedBarrier(
            self.tmem_free_barrier_id, self.num_compute_threads + self.num_dq_threads
        )

        if warp_idx == self.load_warp:
            self.load_role(
                thr, tma_k, mK, tma_v, mV, tma_q, mQ, tma_do, mdO, mLSE, mDsum, s, plan, work, kv_heads,
                pipes, cta_rank, storage.mbar_tail.data_ptr(),
            )  # fmt: skip
        elif warp_idx < len(self.compute_warps):
            set_max_registers(self.compute_regs, self.launch_regs)
            tmem.allocate(self.tmem_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.compute_role(
                thr, tmem_ptr, s, plan, work, pipes, bars, mdK, mdV, scale_log2, softmax_scale, tidx, cta_rank
            )
            free.arrive_and_wait()  # the dQ warps' last TMEM loads are done
            tmem.relinquish_alloc_permit()
            tmem.free(tmem_ptr, self.tmem_cols)
        elif warp_idx < self.mma_warp:
            set_max_registers(self.dq_regs, self.launch_regs)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            t = tidx - self.num_compute_threads
            self.dq_role(thr, tmem_ptr, s, plan, work, bars, mdQaccum, mdQsem, t, cta_rank)
            free.arrive()
        else:  # the MMA warp; traced last: its tcgen05 MMA set() calls rebind the tiled MMAs' atoms
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.mma_role(
                mma_s, mma_dp, mma_dv, mma_dk, mma_dq, thr, s, tP_layout, tmem_ptr, plan, work, pipes, bars
            )
        if const_expr(pair):
            # neither CTA exits while the other may still arrive on its barriers (the last Q / dO
            # releases are multicast commits) or write its SMEM
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def init_handshakes(self, bars, tail_bar, warp_idx: Int32):
        """The MMA warp initialises the handshake barriers (:class:`Handshakes`; ``tail_bar`` is the
        load warp's own); no role uses one before both CTAs of a pair have them."""
        pair = self.pair > 1
        if warp_idx == self.mma_warp:
            with cute.arch.elect_one():
                for bar in (bars.s, bars.dp, bars.dq, bars.dkv):
                    cute.arch.mbarrier_init(bar, 1)
                cute.arch.mbarrier_init(bars.p, self.num_compute_threads)
                cute.arch.mbarrier_init(bars.ds, self.num_compute_threads)
                cute.arch.mbarrier_init(bars.dq_empty, self.num_dq_threads)
                cute.arch.mbarrier_init(tail_bar, 1)
                if const_expr(pair):  # one arrival each: the leader warp's lane 0 (dq_step)
                    for w in cutlass.range_constexpr(len(self.dq_warps)):
                        cute.arch.mbarrier_init(bars.dq_peer_full + w, 1)
                        cute.arch.mbarrier_init(bars.dq_peer_empty + w, 1)
        cute.arch.mbarrier_init_fence()
        if const_expr(pair):  # the peer multicasts into, commits and arrives on this CTA's barriers
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

    def _make_pipelines(self, storage):
        # Q and dO stages are filled by both CTAs of a pair (multicast halves) and released by both
        # MMA warps (multicast commits): a stage's empty barrier takes `pair` arrivals. LSE2 + D
        # (one per rank, multicast) are read by generic loads of every compute thread: each compute
        # warp releases the stage after a warp sync, lane c arriving on rank c's empty barrier
        # (compute warps x pair arrivals)
        cluster = self.cta_layout_vmnk() if self.pair > 1 else None
        return Pipes(
            kv=tma_umma_pipeline(storage.mbar_kv.data_ptr(), 1, self.bytes_kv),
            q=tma_umma_pipeline(storage.mbar_q.data_ptr(), self.q_stages, self.bytes_q, cluster),
            do=tma_umma_pipeline(storage.mbar_do.data_ptr(), self.do_stages, self.bytes_do, cluster),
            stats=pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_stats.data_ptr(),
                num_stages=self.q_stages,
                producer_group=thread_group(1),
                consumer_group=thread_group(self.num_compute_threads),
                tx_count=self.bytes_stats,
                cta_layout_vmnk=cluster,
                enable_multicast_signaling=True,
                defer_sync=True,
            ),
        )

    # -- MMA warp -------------------------------------------------------------------------------------
    @cute.jit
    def mma_role(
        self, mma_s, mma_dp, mma_dv, mma_dk, mma_dq, thr, s, tP_layout, tmem_ptr, plan, work, pipes, bars
    ):
        geo, tm, tn = self.geometry, self.tile_m, self.cta_n
        h = work.split  # the CTA's head-dim slice of dV, dK, dQ (0 without a split)
        # SMEM descriptors: (MMA, MMA_K[, stages]); the MN-major views of Q, dO and K span the full
        # head dim, one MMA_MN entry per split (bwd_helpers.mma_operand)
        tSrK = mma_operand(thr["s"].make_fragment_A(s["sK"]), 0, 0)
        tSrQ = mma_operand(thr["s"].make_fragment_B(s["sQ"]))
        tPrV = mma_operand(thr["dp"].make_fragment_A(s["sV"]), 0, 0)
        tPrdO = mma_operand(thr["dp"].make_fragment_B(s["sdO"]))
        tVrdO = mma_operand(thr["dv"].make_fragment_B(s["sdOt"]), h)
        tKrdS = mma_operand(thr["dk"].make_fragment_A(s["sdS"]), 0, 0)
        tKrQ = mma_operand(thr["dk"].make_fragment_B(s["sQt"]), h)
        if const_expr(geo.dq_transposed):  # dQ^T = K^T dS^T: K^T is A, sliced
            tQrA = mma_operand(thr["dq"].make_fragment_A(s["sKt"]), h, 0)
            tQrB = mma_operand(thr["dq"].make_fragment_B(s["sdSq"]), 0, 0)
        else:  # dQ = dS K
            tQrA = mma_operand(thr["dq"].make_fragment_A(s["sdSq"]), 0, 0)
            tQrB = mma_operand(thr["dq"].make_fragment_B(s["sKt"]), 0, 0)
        # the P^T operand in TMEM (16-bit, packed two per column)
        tVrP_proto = mma_operand(thr["dv"].make_fragment_A(cute.make_tensor(tmem_ptr, tP_layout.outer)), 0, 0)
        tVrP = cute.make_tensor(
            cute.recast_ptr(tmem_ptr + self.tmem_p, dtype=tVrP_proto.element_type), tVrP_proto.layout
        )
        # accumulators
        tStS = tmem_acc(thr["s"], (tn, tm), tmem_ptr + self.tmem_s)
        tPtdP = tmem_acc(thr["dp"], (tn, tm), tmem_ptr + self.tmem_dp)
        tVtdV = tmem_acc(thr["dv"], (tn, geo.dv_cols), tmem_ptr + self.tmem_dv)
        tKtdK = tmem_acc(thr["dk"], (tn, geo.dk_cols), tmem_ptr + self.tmem_dk)
        tQtdQ = tmem_acc(thr["dq"], geo.dq_acc, tmem_ptr + self.tmem_dq)

        n = total_steps(plan, work)
        if n > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
            q_next = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
            do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.do_stages)
            pipes.kv.consumer_wait(kv_state)
            # S_0 (unless dP shares S's columns: and dP_0)
            q_next = self.issue_s(mma_s, tStS, tSrK, tSrQ, pipes.q, q_next, bars.s)
            if const_expr(not self.dp_over_s):
                self.issue_dp(mma_dp, tPtdP, tPrV, tPrdO, pipes.do, do_state, bars.dp)
            for j in cutlass.range(n, unroll=1):
                phase = j & 1
                cute.arch.mbarrier_wait(bars.p, phase)  # P_j stored (so S_j was read)
                tcgen05_fence_after()
                if const_expr(self.dp_over_s):  # dP_j over S_j's columns
                    self.issue_dp(mma_dp, tPtdP, tPrV, tPrdO, pipes.do, do_state, bars.dp)
                # dV += P_j^T dO_j, then dO_j is free
                self.gemm(mma_dv, tVtdV, tVrP, tVrdO[None, None, do_state.index], j > 0)
                pipes.do.consumer_release(do_state)
                do_state.advance()
                # two Q stages: S_{j+1} now; tcgen05.mma run in issue order, so it overwrites P_j
                # after dV_j read it
                if const_expr(self.q_stages == 2):
                    if j + 1 < n:
                        q_next = self.issue_s(mma_s, tStS, tSrK, tSrQ, pipes.q, q_next, bars.s)
                # dK += dS_j^T Q_j (then Q_j is free), dQ_j = dS_j K or dQ^T_j = K^T dS^T_j (serial: over
                # dP_j, and for Dqk = 192 P_j; separate: once dQ_{j-1} was read out)
                cute.arch.mbarrier_wait(bars.ds, phase)
                tcgen05_fence_after()
                self.gemm(mma_dk, tKtdK, tKrdS, tKrQ[None, None, q_state.index], j > 0)
                pipes.q.consumer_release(q_state)
                q_state.advance()
                if const_expr(not self.dq_over_dp):
                    if j > 0:
                        cute.arch.mbarrier_wait(bars.dq_empty, (j - 1) & 1)
                        tcgen05_fence_after()
                self.gemm(mma_dq, tQtdQ, tQrA, tQrB, False)
                self.commit(bars.dq)
                if j + 1 < n:
                    # into the columns dQ_j leaves once read out: dP_{j+1} (overlapped), S_{j+1} (serial)
                    if const_expr(self.dq_over_dp):
                        cute.arch.mbarrier_wait(bars.dq_empty, phase)
                        tcgen05_fence_after()
                    # one Q stage: S_{j+1} once dK_j released Q_j; dP_{j+1} in its own columns
                    if const_expr(self.q_stages == 1):
                        q_next = self.issue_s(mma_s, tStS, tSrK, tSrQ, pipes.q, q_next, bars.s)
                    if const_expr(not self.dp_over_s):
                        self.issue_dp(mma_dp, tPtdP, tPrV, tPrdO, pipes.do, do_state, bars.dp)
            self.commit(bars.dkv)

    @cute.jit
    def issue_s(self, mma_s, tStS, tSrK, tSrQ, pipe_q, q_next, bar):
        """S^T = K Q^T of the next staged Q block (waits for it), committed to ``bar``; returns the
        advanced Q state."""
        pipe_q.consumer_wait(q_next)
        self.gemm(mma_s, tStS, tSrK, tSrQ[None, None, q_next.index], False)
        self.commit(bar)
        q_next.advance()
        return q_next

    @cute.jit
    def issue_dp(self, mma_dp, tPtdP, tPrV, tPrdO, pipe_do, do_state, bar):
        """dP^T = V dO^T of the staged dO block (waits for it; released after dV), committed to ``bar``."""
        pipe_do.consumer_wait(do_state)
        self.gemm(mma_dp, tPtdP, tPrV, tPrdO[None, None, do_state.index], False)
        self.commit(bar)

    @cute.jit
    def gemm(
        self, mma: cute.TiledMma, acc: cute.Tensor, frag_a: cute.Tensor, frag_b: cute.Tensor, accumulate
    ):
        """acc (+)= A B over every k-block of the ``(MMA, MMA_K)`` fragments; ``accumulate`` (runtime)
        applies to the first k-block."""
        d = acc[None, 0, 0]  # the one (MMA) accumulator tile
        for kb in cutlass.range_constexpr(cute.size(frag_a, mode=[1])):
            if const_expr(kb == 0):
                mma.set(tcgen05.Field.ACCUMULATE, accumulate)
            else:
                mma.set(tcgen05.Field.ACCUMULATE, True)
            cute.gemm(mma, d, frag_a[None, kb], frag_b[None, kb], d)

    @cute.jit
    def commit(self, mbar):
        """Arrive on ``mbar`` once every tcgen05.mma issued so far has completed."""
        with cute.arch.elect_one():
            tcgen05.commit(mbar)


class Handshakes(NamedTuple):
    """mbarriers between the MMA warp and the compute / dQ warps (one completion per step)."""

    s: cute.Pointer
    p: cute.Pointer
    dp: cute.Pointer
    ds: cute.Pointer
    dq: cute.Pointer
    dq_empty: cute.Pointer
    dkv: cute.Pointer
    dq_peer_full: cute.Pointer | None = None  # the pair's dQ handoff, one per dQ warp (dq_step)
    dq_peer_empty: cute.Pointer | None = None


@dataclass(frozen=True)
class Pipes:
    """The CTA's TMA pipelines (a frozen dataclass: the DSL passes it through loops as read-only)."""

    kv: object
    q: object
    do: object
    stats: object
