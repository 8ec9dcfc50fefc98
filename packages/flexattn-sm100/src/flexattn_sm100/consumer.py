"""The SM100/SM103 (Blackwell) consumer: resolves plan views; its forward kernel is compile-only.

``resolve`` is complete: a plan built for SM100 carries the signature and TMEM payload layout the
kernels are specified to consume; CUDA tensors are planned by the GPU planner kernels, which are
architecture-neutral (their SM100 views are tested on an H200 against the reference planner).
``hardware_verified`` is False: this consumer has never run on SM100 hardware. ``forward`` launches
the tcgen05 forward kernel (:mod:`flexattn_sm100.fwd_launch`, compiled for sm_100a, generic qstage1 +
1CTA, qstage2 + 1CTA, qstage1 + 2CTA or D256 variant) and ``backward`` the K-major backward
(:mod:`flexattn_sm100.bwd_launch`, k2q-1cta, k2q-2cta or d256 variant, compile-only too) only where
the tensors live on a compute-capability 10.x GPU and the caller has opted in to kernels that have
never run (``FLEXATTN_SM100_UNVERIFIED=1``); everywhere else it raises :class:`ConsumerNotFoundError`
saying which. It never falls back to a computation of its own."""

from __future__ import annotations

import os

from maskplan_core.consumer import KernelConsumer
from maskplan_core.errors import ConsumerNotFoundError
from maskplan_core.head_dim_padding import kernel_view, run_padded_backward, run_padded_forward, warn_held

from ._version import __version__
from .heuristics import (
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    kernel_head_dims,
    select_bwd_config,
    select_fwd_config,
)

#: set to 1 to run the kernels on a compute-capability 10.x GPU although no SM100 hardware has run them
UNVERIFIED_ENV = "FLEXATTN_SM100_UNVERIFIED"


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
    gpu_planner = "maskplan_kernels"  # its SM100 views are tested on an H200 against the reference

    def check_head_dims(self, head_dim_qk: int, head_dim_v: int) -> None:
        """:attr:`supported_head_dims` are the kernels'; any pair one of them holds runs on it, on
        zero-padded copies of the tensors, and a warning says so."""
        kernel = kernel_head_dims(head_dim_qk, head_dim_v)
        if kernel != (head_dim_qk, head_dim_v):
            warn_held(self.name, (head_dim_qk, head_dim_v), kernel, f"the kernels' {kernel}")

    def forward(
        self, plan, q, k, v, *, softmax_scale: float, return_max_logit: bool, out=None, lse=None,
        payload_via_smem: bool | None = None,  # TMEM-fed kernels: no choice to make
    ):  # fmt: skip
        if not _on_sm100(q):
            raise ConsumerNotFoundError(
                f"flexattn-sm100 {__version__} has an SM100 forward kernel compiled for sm_100a, but it has "
                "never run on SM100 hardware (hardware_verified=False) and runs only on a compute-capability "
                "10.x GPU; these tensors are not on one. Run on CPU tensors for the reference path."
            )
        _require_opt_in("forward")
        from .fwd_launch import run_forward  # CuTe DSL loads on first use, not on import

        return run_padded_forward(
            run_forward, kernel_view(plan.view("forward"), kernel_head_dims), q, k, v, out=out, lse=lse,
            softmax_scale=softmax_scale, return_max_logit=return_max_logit,
        )  # fmt: skip

    def backward(
        self, plan, q, k, v, out, lse, dout, dlse, *, softmax_scale: float, deterministic: bool,
        dq=None, dk=None, dv=None,
    ):  # fmt: skip
        if not _on_sm100(q):
            raise ConsumerNotFoundError(
                f"flexattn-sm100 {__version__} has an SM100 backward kernel (k2q-1cta, k2q-2cta, d256) "
                "compiled for sm_100a, but it has never run on SM100 hardware (hardware_verified=False) and "
                "runs only on a compute-capability 10.x GPU; these tensors are not on one. Run on CPU "
                "tensors for the reference path."
            )
        _require_opt_in("backward")
        from .bwd_launch import run_backward  # CuTe DSL loads on first use, not on import

        return run_padded_backward(
            run_backward, kernel_view(plan.view("backward"), kernel_head_dims), q, k, v, out, lse, dout, dlse,
            softmax_scale=softmax_scale, deterministic=deterministic, dq=dq, dk=dk, dv=dv,
        )  # fmt: skip


def _require_opt_in(direction: str) -> None:
    """Kernels nobody has run give a training run no reason to trust them: they run only when the
    caller says so, by name."""
    if os.environ.get(UNVERIFIED_ENV) != "1":
        raise ConsumerNotFoundError(
            f"flexattn-sm100 {__version__}'s {direction} kernel is compiled for sm_100a but has never run "
            f"on SM100 hardware (hardware_verified=False), so it does not run by default: set "
            f"{UNVERIFIED_ENV}=1 to run it anyway and check its results against CPU tensors (the reference)"
        )


def _on_sm100(t) -> bool:
    """Whether ``t`` is a CUDA tensor on a compute-capability 10.x device."""
    device = getattr(t, "device", None)
    if device is None or device.type != "cuda":
        return False
    import torch

    return torch.cuda.get_device_capability(device)[0] == 10

