"""The SM90 (Hopper) consumer: resolves plan views and runs the persistent forward kernel.

A plan built for SM90 carries the signature and WGMMA payload layout its kernels consume.
``backward`` raises :class:`ConsumerNotFoundError` until the K2Q backward kernel lands; it never
falls back to a computation of its own.
"""

from __future__ import annotations

from maskplan_core.consumer import AttentionOutputs, Consumer, ViewConfig, ViewRequest
from maskplan_core.errors import ConsumerNotFoundError, UnsupportedConfigError

from ._version import __version__
from .config import ARCH_FAMILY
from .heuristics import check_dtype, check_head_dims, select_bwd_config, select_fwd_config


class Sm90Consumer(Consumer):
    """Hopper consumer: WGMMA accumulator payloads, persistent forward, K-major backward."""

    name = "flexattn-sm90"
    arch_families = ("sm90",)
    hardware_verified = True  # the forward kernel's GPU tests run on an H200

    def resolve(self, request: ViewRequest) -> ViewConfig:
        _check_request(request)
        qhead_per_kvhead = request.num_heads_q // request.num_heads_kv
        if request.direction == "forward":
            config = select_fwd_config(
                head_dim_qk=request.head_dim_qk,
                head_dim_v=request.head_dim_v,
                dtype=request.dtype,
                pack_gqa=False,
                qhead_per_kvhead=qhead_per_kvhead,
                varlen=request.varlen,
            )
        else:
            config = select_bwd_config(
                head_dim_qk=request.head_dim_qk,
                head_dim_v=request.head_dim_v,
                dtype=request.dtype,
                qhead_per_kvhead=qhead_per_kvhead,
                varlen=request.varlen,
            )
        return ViewConfig(signature=config.plan_signature(), layout=config.payload_layout)

    def build_plan(self, mask_func, geometry, forward: ViewConfig, backward: ViewConfig | None):
        """CUDA tensors plan with the GPU planner kernels; CPU tensors (``target="sm90"`` on a
        machine without a GPU) with the reference planner, which builds the same tensors."""
        if mask_func.device.type != "cuda":
            return super().build_plan(mask_func, geometry, forward, backward)
        from maskplan_kernels import build_plan_gpu  # CuTe DSL loads on first use

        return build_plan_gpu(mask_func, geometry, forward, backward, self.name)

    def forward(self, plan, q, k, v, *, softmax_scale: float, return_max_logit: bool):
        from .fwd_launch import run_forward  # CuTe DSL loads on first use, not on import

        out, lse, max_logit = run_forward(
            plan.view("forward"), q, k, v, softmax_scale=softmax_scale, return_max_logit=return_max_logit
        )
        return AttentionOutputs(out, lse, max_logit)

    def backward(self, plan, q, k, v, out, lse, dout, dlse, *, softmax_scale: float, deterministic: bool):
        raise ConsumerNotFoundError(_not_available("backward"))


def _not_available(direction: str) -> str:
    return (
        f"flexattn-sm90 {__version__} has no SM90 {direction} kernel yet: training on CUDA is not "
        "available in this release (inference runs the SM90 forward kernel). Run on CPU tensors for "
        "the reference path."
    )


def _check_request(request: ViewRequest) -> None:
    if request.arch_family != ARCH_FAMILY:
        raise UnsupportedConfigError(
            f"arch_family={request.arch_family!r}: flexattn-sm90 serves arch_family 'sm90' only"
        )
    if request.compute_capability is not None and tuple(request.compute_capability) != (9, 0):
        raise UnsupportedConfigError(
            f"compute_capability={tuple(request.compute_capability)}: flexattn-sm90 kernels target sm_90a, "
            "supported compute_capability: (9, 0)"
        )
    check_dtype(request.dtype)
    check_head_dims(request.head_dim_qk, request.head_dim_v)
    if request.num_heads_q % request.num_heads_kv:
        raise UnsupportedConfigError(
            f"num_heads_q={request.num_heads_q} is not a multiple of num_heads_kv={request.num_heads_kv}"
        )
    if request.pack_gqa:
        raise UnsupportedConfigError(
            "pack_gqa=True is not supported by flexattn-sm90 yet: PackGQA arrives with the SM90 forward "
            "kernel; supported pack_gqa values: None, False"
        )
