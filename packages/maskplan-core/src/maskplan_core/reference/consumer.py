"""The reference consumer: row-major payload bits, 128x128 tiles, pure-torch attention.

The facade uses it for CPU tensors; it is also the executable spec every kernel is tested against.
"""

from __future__ import annotations

from ..consumer import AttentionOutputs, Consumer, ViewConfig, ViewRequest
from ..errors import UnsupportedConfigError
from ..payload import RowMajorLayout
from ..schema import PlanSignature, Topology
from .attention import attention_backward, attention_forward

TILE = 128


class ReferenceConsumer(Consumer):
    name = "maskplan-reference"
    arch_families = ("reference",)

    def resolve(self, request: ViewRequest) -> ViewConfig:
        if request.pack_gqa:
            raise UnsupportedConfigError(
                "pack_gqa=True is a kernel layout option; the reference consumer has none"
            )
        backward = request.direction == "backward"
        signature = PlanSignature(
            arch_family="reference",
            direction=request.direction,
            kernel_family="reference-torch-v1",
            topology=Topology(
                tile_m=TILE, tile_n=TILE, qhead_per_kvhead=request.num_heads_q // request.num_heads_kv
            ),
            mma_layout="none",
            payload=RowMajorLayout(TILE, TILE).spec,
            scheduler_layout="k-major" if backward else "plan-fwd-work-desc-v1",
            dq_order_format="rank_int32" if backward else "none",
        )
        return ViewConfig(signature, RowMajorLayout(TILE, TILE))

    def forward(self, plan, q, k, v, *, softmax_scale, return_max_logit):
        out, lse, max_logit = attention_forward(
            plan.view("forward"), q, k, v, softmax_scale=softmax_scale, return_max_logit=return_max_logit
        )
        return AttentionOutputs(out.to(q.dtype), lse, max_logit)

    def backward(self, plan, q, k, v, out, lse, dout, dlse, *, softmax_scale, deterministic):
        return attention_backward(
            plan.view("backward"), q, k, v, out, lse, dout, dlse, softmax_scale=softmax_scale
        )
