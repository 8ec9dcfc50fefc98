"""The SM100/SM103 (Blackwell) consumer: resolves plan views; no kernel exists and none has run.

``resolve`` is complete: a plan built for SM100 carries the signature and TMEM payload layout the
kernels are specified to consume. ``hardware_verified`` is False: this consumer has never run on
SM100 hardware. ``forward``/``backward`` raise :class:`ConsumerNotFoundError`; they never fall back
to a computation of their own.
"""

from __future__ import annotations

from maskplan_core.consumer import Consumer, ViewConfig, ViewRequest
from maskplan_core.errors import ConsumerNotFoundError, UnsupportedConfigError

from ._version import __version__
from .config import ARCH_FAMILY
from .heuristics import check_dtype, check_head_dims, select_bwd_config, select_fwd_config

SUPPORTED_COMPUTE_CAPABILITIES = ((10, 0), (10, 3))


class Sm100Consumer(Consumer):
    """Blackwell consumer: tcgen05/TMEM payloads, CLC persistent forward, K-major backward."""

    name = "flexattn-sm100"
    arch_families = ("sm100",)
    hardware_verified = False

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

    def forward(self, plan, q, k, v, *, softmax_scale: float, return_max_logit: bool):
        raise ConsumerNotFoundError(_not_available("forward"))

    def backward(self, plan, q, k, v, out, lse, dout, dlse, *, softmax_scale: float, deterministic: bool):
        raise ConsumerNotFoundError(_not_available("backward"))


def _not_available(direction: str) -> str:
    return (
        f"flexattn-sm100 {__version__} has no SM100 {direction} kernel yet, and this consumer has never run "
        "on SM100 hardware (hardware_verified=False); plans can be built (reference planner) but attention "
        "on CUDA is not available in this release. Run on CPU tensors for the reference path."
    )


def _check_request(request: ViewRequest) -> None:
    if request.arch_family != ARCH_FAMILY:
        raise UnsupportedConfigError(
            f"arch_family={request.arch_family!r}: flexattn-sm100 serves arch_family 'sm100' only"
        )
    cc = request.compute_capability
    if cc is not None and tuple(cc) not in SUPPORTED_COMPUTE_CAPABILITIES:
        raise UnsupportedConfigError(
            f"compute_capability={tuple(cc)} is not served by flexattn-sm100; supported compute_capability: "
            + ", ".join(map(str, SUPPORTED_COMPUTE_CAPABILITIES))
        )
    check_dtype(request.dtype)
    check_head_dims(request.head_dim_qk, request.head_dim_v)
    if request.num_heads_q % request.num_heads_kv:
        raise UnsupportedConfigError(
            f"num_heads_q={request.num_heads_q} is not a multiple of num_heads_kv={request.num_heads_kv}"
        )
    if request.pack_gqa:
        raise UnsupportedConfigError(
            "pack_gqa=True is not supported by flexattn-sm100 yet: PackGQA arrives with the SM100 forward "
            "kernel; supported pack_gqa values: None, False"
        )
