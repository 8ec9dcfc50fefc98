"""The reference consumer: row-major payload bits, 128x128 tiles, pure-torch attention.

The facade uses it for CPU tensors; it is also the executable spec every kernel is tested against,
so its attention reads any consumer's view (it decodes payloads through the view's own layout) and
checks no signature: the facade refuses a plan made for another consumer before dispatching here.
"""

from __future__ import annotations

from ..consumer import (
    AttentionOutputs,
    Consumer,
    ViewConfig,
    ViewRequest,
    require_pack_gqa_ratio,
    require_shared_mask_for_pack_gqa,
    thd,
)
from ..errors import warn_caller
from ..payload import RowMajorLayout
from ..schema import PlanSignature, Topology
from .attention import attention_backward, attention_forward, heads_per_tile

TILE = 128
#: a CPU forward of this many FLOPs (2 x scores of the visited tiles x (Dqk + Dv)) or more warns,
#: once a process: about 10 s on two cores (causal, S = 32768, 4 heads, D = 64: 5.5e11, 17 s),
#: a second or two on many
SLOW_CPU_FLOPS = 3e11
_warned_slow = False


class ReferenceConsumer(Consumer):
    name = "maskplan-reference"
    arch_families = ("reference",)

    def resolve(self, request: ViewRequest) -> ViewConfig:
        """128 x 128 tiles; with ``pack_gqa`` the forward view is planned as a packing kernel's
        would be (the ``G`` q heads of a kv head share a 128-row tile: Q blocks of ``128 / G``
        positions, one work item per kv head), so CPU code with PackGQA runs unchanged and shows
        the packed plan. The reference computes the same attention either way."""
        group = request.num_heads_q // request.num_heads_kv
        backward = request.direction == "backward"
        pack = bool(request.pack_gqa) and not backward  # a K-major backward view is the same either way
        if request.pack_gqa:
            require_shared_mask_for_pack_gqa(request)
            require_pack_gqa_ratio(group, TILE)
        layout = RowMajorLayout(TILE // group if pack else TILE, TILE)
        signature = PlanSignature(
            arch_family="reference",
            direction=request.direction,
            kernel_family="reference-torch-v1",
            topology=Topology(tile_m=layout.tile_m, tile_n=TILE, pack_gqa=pack, qhead_per_kvhead=group),
            mma_layout="none",
            payload=layout.spec,
            scheduler_layout="k-major" if backward else "plan-fwd-work-desc-v1",
            dq_order_format="rank_int32" if backward else "none",
        )
        return ViewConfig(signature, layout)

    def forward(
        self, plan, q, k, v, *, softmax_scale, return_max_logit, out=None, lse=None, payload_via_smem=None
    ):  # payload_via_smem: a kernel delivery hint, nothing to choose here
        q, k, v = thd(q), thd(k), thd(v)
        if q.device.type == "cpu":
            _warn_if_slow(plan.view("forward"))
        o, stats, max_logit = attention_forward(
            plan.view("forward"), q, k, v, softmax_scale=softmax_scale, return_max_logit=return_max_logit
        )
        return AttentionOutputs(_into(out, o.to(q.dtype)), _into(lse, stats), max_logit)

    def backward(
        self, plan, q, k, v, out, lse, dout, dlse, *, softmax_scale, deterministic, dq=None, dk=None, dv=None
    ):
        grads = attention_backward(
            plan.view("backward"), thd(q), thd(k), thd(v), out, lse, dout, dlse, softmax_scale=softmax_scale
        )
        return tuple(_into(dst, g) for dst, g in zip((dq, dk, dv), grads, strict=True))


def _warn_if_slow(view) -> None:
    """Say once, before it starts, that a CPU forward will take long: it runs for seconds to
    minutes with nothing to show for it otherwise."""
    global _warned_slow
    if _warned_slow:
        return
    g, (tm, tn) = view.geometry, view.block_size
    tiles = view.tensors["mask_block_idx"].numel() + view.tensors["full_block_idx"].numel()
    scores = tiles * tm * tn * heads_per_tile(g)
    flops = 2 * scores * (g.head_dim_qk + g.head_dim_v)
    if flops >= SLOW_CPU_FLOPS:
        warn_caller(
            f"this CPU forward computes {scores:.3g} scores ({flops / 1e9:.0f} GFLOP; the backward "
            "about 2.5 times that) in the exact torch reference, which is slow: causal attention at "
            "S=32768 with 4 heads of 64 took 17 s on two cores. The CUDA kernels run it on a GPU. "
            "(Said once a process.)"
        )
        _warned_slow = True  # once shown: where a filter makes it an error, every such call raises


def _into(dst, value):
    """``value``, copied into ``dst`` when the caller gave one (the reference computes in fp32/fp64)."""
    return value if dst is None else dst.copy_(value)
