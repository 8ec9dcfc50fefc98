"""Static configurations of the SM100/SM103 forward and backward kernels (the forward kernels written are
qstage1 + 1CTA, qstage2 + 1CTA, qstage1 + 2CTA and D256, all ``fwd_kernel.py``; the backward ones are
k2q + 1CTA, k2q + 2CTA (a cluster of two k2q + 1CTA CTAs along a 256-row K block, sharing Q / dO / LSE / D
loads and the block's dQ reduction) and D256 (two CTAs per K block, each owning half of the gradients'
head-dim columns), all ``bwd_kernel.py``; compile-verified, never run).

A *variant* is one kernel topology (q stages, CTA group, cluster axis, plan block, mask delivery);
a config is a variant plus the problem's compile-time facts. Every config field marked
``field.metadata["constexpr"]`` is compile-time (:meth:`compile_key` lists them all; a launcher's
compile key names those its kernel reads, ``fwd_launch``, ``maskplan_kernels.consumer_launch``);
runtime values (softmax scale, sequence lengths, the plan's tensors) are launch arguments. Selection is
:mod:`flexattn_sm100.heuristics`.

``tile_m x tile_n`` is always the plan block the planner classifies: the union over q stages
(qstage2) or over the CTA pair (2CTA). One 128-row TMEM slab of it is one payload subtile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from maskplan_core.consumer import CONSTEXPR, KernelConfig
from maskplan_core.schema import Topology

from .payload_layout import TmemLoadLayout, tmem_layout

ARCH_FAMILY = "sm100"
MMA_LAYOUT = "tcgen05-tmem-ld32x32b"
FWD_SCHEDULER_LAYOUT = "plan-clc-persistent-v1"
BWD_SCHEDULER_LAYOUT = "k-major-grid-v1"

DType = Literal["float16", "bfloat16"]


@dataclass(frozen=True)
class Sm100Variant:
    """One kernel topology. ``mask_pipeline_stages == 0`` means direct GMEM-to-register payload loads."""

    name: str
    kernel_family: str
    tile_m: int
    tile_n: int
    q_stage: int = 1
    cta_group_size: int = 1
    cluster_axis: Literal["none", "m", "n"] = "none"
    num_softmax_warpgroups: int = 1  # warpgroups splitting one 128-lane subtile's columns
    mask_pipeline_stages: int = 0
    #: backward: CTAs per K block, each accumulating 1/n of dV's, dK's and dQ's head-dim columns
    head_dim_splits: int = 1


#: Forward variants (spec 6.2: only qstage1 + 2CTA stages payloads through SMEM).
FWD_VARIANTS: dict[str, Sm100Variant] = {
    v.name: v
    for v in (
        Sm100Variant("qstage1-1cta", "sm100-fwd-qstage1-1cta-v1", tile_m=128, tile_n=128),
        Sm100Variant("qstage2-1cta", "sm100-fwd-qstage2-1cta-v1", tile_m=256, tile_n=128, q_stage=2),
        Sm100Variant(
            "qstage1-2cta",
            "sm100-fwd-qstage1-2cta-v1",
            tile_m=256,
            tile_n=128,
            cta_group_size=2,
            cluster_axis="m",
            mask_pipeline_stages=2,
        ),
        Sm100Variant("d256", "sm100-fwd-d256-v1", tile_m=128, tile_n=128),
    )
}

#: Backward variants: the dK/dV kernel holds S^T (K rows in TMEM lanes); 2CTA pairs along K.
BWD_VARIANTS: dict[str, Sm100Variant] = {
    v.name: v
    for v in (
        Sm100Variant("k2q-1cta", "sm100-bwd-k2q-v1", tile_m=128, tile_n=128, num_softmax_warpgroups=2),
        Sm100Variant(
            "k2q-2cta",
            "sm100-bwd-k2q-v1",
            tile_m=128,
            tile_n=256,
            cta_group_size=2,
            cluster_axis="n",
            num_softmax_warpgroups=2,
        ),
        Sm100Variant("d256", "sm100-bwd-d256-k2q-v1", tile_m=64, tile_n=128, head_dim_splits=2),
    )
}


class _KernelConfig(KernelConfig):
    arch_family = ARCH_FAMILY
    mma_layout = MMA_LAYOUT
    variant: Sm100Variant

    @property
    def kernel_family(self) -> str:
        return self.variant.kernel_family

    @property
    def tile_m(self) -> int:
        return self.variant.tile_m

    @property
    def tile_n(self) -> int:
        return self.variant.tile_n

    def topology(self) -> Topology:
        v = self.variant
        return Topology(
            tile_m=v.tile_m,
            tile_n=v.tile_n,
            q_stage=v.q_stage,
            cta_group_size=v.cta_group_size,
            cluster_axis=v.cluster_axis,
            pack_gqa=getattr(self, "pack_gqa", False),
            qhead_per_kvhead=self.qhead_per_kvhead,
        )

    def _check_common(self, variants: dict[str, Sm100Variant]) -> None:
        if self.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r}: SM100 kernels take 'float16' or 'bfloat16'")
        if variants.get(self.variant.name) != self.variant:
            raise ValueError(f"variant={self.variant.name!r} is not one of {sorted(variants)}")


@dataclass(frozen=True)
class Sm100FwdConfig(_KernelConfig):
    direction = "forward"
    scheduler_layout = FWD_SCHEDULER_LAYOUT
    dq_order_format = "none"

    head_dim_qk: int = field(metadata=CONSTEXPR)
    head_dim_v: int = field(metadata=CONSTEXPR)
    dtype: DType = field(metadata=CONSTEXPR)
    variant: Sm100Variant = field(metadata=CONSTEXPR)
    pack_gqa: bool = field(default=False, metadata=CONSTEXPR)
    qhead_per_kvhead: int = field(default=1, metadata=CONSTEXPR)
    varlen: bool = field(default=False, metadata=CONSTEXPR)

    def __post_init__(self) -> None:
        self._check_common(FWD_VARIANTS)

    @property
    def payload_layout(self) -> TmemLoadLayout:
        v = self.variant
        return tmem_layout(v.tile_m, v.tile_n, v.num_softmax_warpgroups, False)

    @property
    def mask_smem_bytes_per_cta(self) -> int:
        """SMEM of the packed-mask pipeline per CTA (one CTA-native subtile plane per stage); 0 when
        payloads go GMEM -> registers directly."""
        layout = self.payload_layout
        return self.variant.mask_pipeline_stages * layout.groups * layout.words_per_group * 4


@dataclass(frozen=True)
class Sm100BwdConfig(_KernelConfig):
    direction = "backward"
    scheduler_layout = BWD_SCHEDULER_LAYOUT
    dq_order_format = "rank_int32"

    head_dim_qk: int = field(metadata=CONSTEXPR)
    head_dim_v: int = field(metadata=CONSTEXPR)
    dtype: DType = field(metadata=CONSTEXPR)
    variant: Sm100Variant = field(metadata=CONSTEXPR)
    qhead_per_kvhead: int = field(default=1, metadata=CONSTEXPR)
    varlen: bool = field(default=False, metadata=CONSTEXPR)

    def __post_init__(self) -> None:
        self._check_common(BWD_VARIANTS)

    @property
    def payload_layout(self) -> TmemLoadLayout:
        v = self.variant
        return tmem_layout(v.tile_m, v.tile_n, v.num_softmax_warpgroups, True)
