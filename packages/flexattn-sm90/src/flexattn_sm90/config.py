"""Static configurations of the SM90 forward and backward kernels.

Every field marked ``field.metadata["constexpr"]`` is compile-time: a ``cutlass.Constexpr`` of the
kernel (:meth:`compile_key` lists them all). A launcher's compile key names the fields its kernel
reads (``fwd_launch``, ``maskplan_kernels.consumer_launch``), leaving out ``varlen`` and, without
PackGQA, ``qhead_per_kvhead``: the kernels take those at run time.
Runtime values (softmax scale, sequence lengths, the plan's tensors, the scheduler counter) are
launch arguments, never config fields. Choosing a config from a problem is
:mod:`flexattn_sm90.heuristics`; turning one into a plan signature is :meth:`plan_signature`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from maskplan_core.consumer import CONSTEXPR, KernelConfig
from maskplan_core.schema import Topology

from .payload_layout import WgmmaAccumulatorLayout, wgmma_layout, wgmma_pack_gqa_layout

ARCH_FAMILY = "sm90"
MMA_LAYOUT = "wgmma-m64nNk16-acc"
FWD_KERNEL_FAMILY = "sm90-fwd-persistent-v1"
BWD_KERNEL_FAMILY = "sm90-bwd-k2q-v1"
FWD_SCHEDULER_LAYOUT = "plan-dynamic-persistent-atomic-v1"
BWD_SCHEDULER_LAYOUT = "k-major-grid-v1"

DType = Literal["float16", "bfloat16"]


class _KernelConfig(KernelConfig):
    arch_family = ARCH_FAMILY
    mma_layout = MMA_LAYOUT

    @property
    def plan_tile_m(self) -> int:
        """The plan's Q block in query positions (the score tile's M)."""
        return self.tile_m

    @property
    def row_granule(self) -> int:
        """The granule of a kernel that takes q, k, v rows per sample (``ThdHostEntry.row_granule``):
        a multiple of every tile of rows it takes from them (Q and K tiles; PackGQA's positions
        divide ``tile_m``)."""
        return math.lcm(self.tile_m, self.tile_n)

    @property
    def io_head_dims(self) -> tuple[int, int]:
        """``(Dqk, Dv)`` of the THD tensors the kernels read and write: :attr:`head_dim_qk` /
        :attr:`head_dim_v` (the tiles'), or narrower where ``io_head_dim_qk`` / ``io_head_dim_v``
        say so. TMA fills a tile's columns past a tensor's head dim with zeros (which change no
        score, probability or result column) and the stores leave them out."""
        return self.io_head_dim_qk or self.head_dim_qk, self.io_head_dim_v or self.head_dim_v

    def topology(self) -> Topology:
        return Topology(
            tile_m=self.plan_tile_m,
            tile_n=self.tile_n,
            q_stage=1,
            cta_group_size=1,
            cluster_axis="none",
            pack_gqa=getattr(self, "pack_gqa", False),
            qhead_per_kvhead=self.qhead_per_kvhead,
        )

    def _check_common(self) -> None:
        if self.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r}: SM90 kernels take 'float16' or 'bfloat16'")
        if self.tile_m <= 0 or self.tile_n <= 0 or self.num_consumer_warpgroups <= 0:
            raise ValueError(f"tile {self.tile_m}x{self.tile_n} / warpgroups must be positive")
        if self.mask_pipeline_stages < 1:
            raise ValueError(f"mask_pipeline_stages={self.mask_pipeline_stages} must be >= 1")
        for io, tile in zip(self.io_head_dims, (self.head_dim_qk, self.head_dim_v), strict=True):
            # a THD row of a head is 16-byte aligned for TMA: a multiple of 8 two-byte elements
            if not 0 < io <= tile or io % 8:
                raise ValueError(
                    f"io head dims {self.io_head_dims} must be multiples of 8 of at most the kernel's "
                    f"({self.head_dim_qk}, {self.head_dim_v})"
                )


#: dynamic SMEM one SM90 CTA may use
SMEM_LIMIT = 227 * 1024
#: SMEM kept for a kernel's barriers, task records and alignment next to its tiles
SMEM_RESERVE = 1024


@dataclass(frozen=True)
class Sm90FwdConfig(_KernelConfig):
    """Persistent warp-specialised forward: one producer warpgroup, ``num_consumer_warpgroups``
    MMA/softmax warpgroups, each owning 64 Q rows of the ``tile_m x tile_n`` score tile.

    ``pack_gqa``: the ``qhead_per_kvhead`` q heads of one kv head share the tile's rows (row ``R`` is
    position ``R // G`` of head ``R % G``), so the plan's Q block is ``tile_m / G`` positions
    (:attr:`plan_tile_m`) and each K/V tile is loaded once for the whole group.
    """

    direction = "forward"
    kernel_family = FWD_KERNEL_FAMILY
    scheduler_layout = FWD_SCHEDULER_LAYOUT
    dq_order_format = "none"

    head_dim_qk: int = field(metadata=CONSTEXPR)
    head_dim_v: int = field(metadata=CONSTEXPR)
    dtype: DType = field(metadata=CONSTEXPR)
    tile_m: int = field(default=128, metadata=CONSTEXPR)
    tile_n: int = field(default=128, metadata=CONSTEXPR)
    num_consumer_warpgroups: int = field(default=2, metadata=CONSTEXPR)
    pack_gqa: bool = field(default=False, metadata=CONSTEXPR)
    qhead_per_kvhead: int = field(default=1, metadata=CONSTEXPR)
    varlen: bool = field(default=False, metadata=CONSTEXPR)
    #: stages of the SMEM packed-mask pipeline (spec 6.2); each stage holds one CTA payload plane
    mask_pipeline_stages: int = field(default=2, metadata=CONSTEXPR)
    kv_stages: int = field(default=2, metadata=CONSTEXPR)
    #: SMEM buffers of the Q tile (its load pipeline's stages; not the plan topology's ``q_stage``,
    #: which is Q tiles per CTA): with two, the producer loads a task's Q while the previous task
    #: still holds its own, and goes on to the task's first K / V block
    q_buffers: int = field(default=1, metadata=CONSTEXPR)
    #: with one Q buffer, issue a task's Q load after its first K / V block instead of before it
    q_after_first_kv: bool = field(default=False, metadata=CONSTEXPR)
    #: the tensors' head dims where they are narrower than the kernel's (:attr:`io_head_dims`); None: equal
    io_head_dim_qk: int | None = field(default=None, metadata=CONSTEXPR)
    io_head_dim_v: int | None = field(default=None, metadata=CONSTEXPR)

    def __post_init__(self) -> None:
        self._check_common()
        if self.tile_m != 64 * self.num_consumer_warpgroups:
            raise ValueError(
                f"tile_m={self.tile_m} must equal 64 * num_consumer_warpgroups "
                f"({self.num_consumer_warpgroups}): each consumer warpgroup owns 64 Q rows"
            )
        if self.pack_gqa and (self.qhead_per_kvhead < 1 or self.tile_m % self.qhead_per_kvhead):
            raise ValueError(
                f"pack_gqa needs qhead_per_kvhead ({self.qhead_per_kvhead}) to divide tile_m ({self.tile_m})"
            )
        self.payload_layout  # noqa: B018 - validates the tile against the wgmma atom

    @property
    def plan_tile_m(self) -> int:
        return self.tile_m // self.qhead_per_kvhead if self.pack_gqa else self.tile_m

    @property
    def payload_layout(self) -> WgmmaAccumulatorLayout:
        if self.pack_gqa:
            return wgmma_pack_gqa_layout(self.tile_m, self.tile_n, self.qhead_per_kvhead)
        return wgmma_layout(self.tile_m, self.tile_n, self.num_consumer_warpgroups, False)

    @property
    def mask_smem_bytes(self) -> int:
        """SMEM of the packed-mask pipeline: stages x groups x words x 4 bytes."""
        layout = self.payload_layout
        return self.mask_pipeline_stages * layout.words_per_tile * 4

    @property
    def operand_smem_bytes(self) -> int:
        """SMEM of the Q buffers, the K/V stages and the mask pipeline (2-byte elements)."""
        kv = self.kv_stages * self.tile_n * (self.head_dim_qk + self.head_dim_v)
        return 2 * (self.q_buffers * self.tile_m * self.head_dim_qk + kv) + self.mask_smem_bytes

    @property
    def o_chunk_cols(self) -> int:
        """Columns of O the epilogue stages through SMEM at a time: the largest power of two that
        divides Dv and whose ``tile_m x cols`` tile fits the SMEM left next to the operands (64: 64,
        96: 32, 128: 64, (192, 128): 32, 256: 128). A power of two, so a warpgroup's 128 threads
        tile the chunk's rows in whole 16-byte pieces. PackGQA at Dv = 256 takes 64: each row of a
        packed tile has its own (head, position) address, and with 128-column chunks ptxas spilled
        there (the compile tests check every config for spills)."""
        free = SMEM_LIMIT - SMEM_RESERVE - self.operand_smem_bytes
        cols = self.head_dim_v & -self.head_dim_v
        if self.pack_gqa and self.head_dim_v > 128:
            cols = min(cols, 64)
        while 2 * self.tile_m * cols > free:
            cols //= 2
        if cols < 16:
            raise ValueError(
                f"(head_dim_qk, head_dim_v)=({self.head_dim_qk}, {self.head_dim_v}): no SMEM left to "
                "stage the O epilogue"
            )
        return cols


@dataclass(frozen=True)
class Sm90BwdConfig(_KernelConfig):
    """K-major backward (dK/dV per K block, dQ accumulated in ``dq_write_order``, or its reverse in
    deterministic mode on sparse K2Q rows from (192, 128) on: ``LaunchOrder.mirrors_sparse_rows``).

    ``tile_m`` Q rows x ``tile_n`` K columns is the score tile the planner classifies. With
    ``transposed_scores`` the kernel computes it transposed (``S^T``, K rows x Q columns on WGMMA
    M x N), otherwise as ``S`` (Q rows on M, each warpgroup owning ``tile_n / 2`` K columns, and
    dK / dV as dK^T / dV^T); its payload layout is ``WgmmaAccumulatorLayout(..., transposed=...)``
    of that orientation.
    """

    direction = "backward"
    kernel_family = BWD_KERNEL_FAMILY
    scheduler_layout = BWD_SCHEDULER_LAYOUT
    dq_order_format = "rank_int32"

    head_dim_qk: int = field(metadata=CONSTEXPR)
    head_dim_v: int = field(metadata=CONSTEXPR)
    dtype: DType = field(metadata=CONSTEXPR)
    tile_m: int = field(default=64, metadata=CONSTEXPR)
    tile_n: int = field(default=128, metadata=CONSTEXPR)
    num_consumer_warpgroups: int = field(default=2, metadata=CONSTEXPR)
    qhead_per_kvhead: int = field(default=1, metadata=CONSTEXPR)
    varlen: bool = field(default=False, metadata=CONSTEXPR)
    mask_pipeline_stages: int = field(default=2, metadata=CONSTEXPR)
    #: stages of Q (+ LSE) and of dO (+ D); Q is held for a whole step (S or S^T, and dK), dO is released
    #: after dV, so its next load already overlaps the step's second half
    q_stages: int = field(default=2, metadata=CONSTEXPR)
    do_stages: int = field(default=2, metadata=CONSTEXPR)
    #: S^T (K rows on WGMMA M) rather than S (Q rows on M): heuristics.bwd_tile says which tile takes which
    transposed_scores: bool = field(default=True, metadata=CONSTEXPR)
    #: the tensors' head dims where they are narrower than the kernel's (:attr:`io_head_dims`); None: equal
    io_head_dim_qk: int | None = field(default=None, metadata=CONSTEXPR)
    io_head_dim_v: int | None = field(default=None, metadata=CONSTEXPR)

    def __post_init__(self) -> None:
        self._check_common()
        self.payload_layout  # noqa: B018 - validates the warpgroup tiling of the score tile

    @property
    def payload_layout(self) -> WgmmaAccumulatorLayout:
        return wgmma_layout(self.tile_m, self.tile_n, self.num_consumer_warpgroups, self.transposed_scores)

    @property
    def scores_in_smem(self) -> bool:
        """The warpgroups split the score tile's N, so P meets dS in SMEM (both halves are needed
        there) instead of staying in registers as an operand of dV."""
        return self.payload_layout.wg_n > 1

    @property
    def operand_smem_bytes(self) -> int:
        """SMEM of the staged tiles (Q, dO, K, V, dS, and P where :attr:`scores_in_smem`), the
        payload planes and the row statistics: all but the dQ chunks."""
        tm, tn = self.tile_m, self.tile_n
        scores = self.q_stages * tm * tn * (2 if self.scores_in_smem else 1)
        tiles = (
            self.q_stages * tm * self.head_dim_qk + self.do_stages * tm * self.head_dim_v
            + tn * (self.head_dim_qk + self.head_dim_v) + scores
        )  # fmt: skip
        planes = self.mask_pipeline_stages * self.payload_layout.words_per_tile
        return 2 * tiles + 4 * planes + 4 * tm * (self.q_stages + self.do_stages)
