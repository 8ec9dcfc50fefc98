"""The SM100/SM103 (Blackwell) consumer: resolves plan views; no kernel exists and none has run.

``resolve`` is complete: a plan built for SM100 carries the signature and TMEM payload layout the
kernels are specified to consume. ``hardware_verified`` is False: this consumer has never run on
SM100 hardware. ``forward``/``backward`` raise :class:`ConsumerNotFoundError`; they never fall back
to a computation of their own.
"""

from __future__ import annotations

from maskplan_core.consumer import KernelConsumer
from maskplan_core.errors import ConsumerNotFoundError

from ._version import __version__
from .heuristics import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, select_bwd_config, select_fwd_config


class Sm100Consumer(KernelConsumer):
    """Blackwell consumer: tcgen05/TMEM payloads, CLC persistent forward, K-major backward."""

    name = "flexattn-sm100"
    arch_families = ("sm100",)
    hardware_verified = False

    compute_capabilities = ((10, 0), (10, 3))
    supported_dtypes = SUPPORTED_DTYPES
    supported_head_dims = SUPPORTED_HEAD_DIMS
    select_forward = staticmethod(select_fwd_config)
    select_backward = staticmethod(select_bwd_config)

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

