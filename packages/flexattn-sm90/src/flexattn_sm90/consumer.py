"""The SM90 (Hopper) consumer: resolves plan views, runs the persistent forward kernel and the
K-major backward kernel.

A plan built for SM90 carries the signature and WGMMA payload layouts its kernels consume. Head
dims with no kernel of their own run on the smallest kernel pair that holds them (with a warning);
a pair none holds is refused with UnsupportedConfigError when the views are resolved.
"""

from __future__ import annotations

from maskplan_core.consumer import KernelConsumer
from maskplan_core.head_dim_padding import kernel_view, run_padded_backward, run_padded_forward, warn_held

from .heuristics import (
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    io_head_dims,
    kernel_head_dims,
    packs_by_default,
    select_bwd_config,
    select_fwd_config,
)


class Sm90Consumer(KernelConsumer):
    """Hopper consumer: WGMMA accumulator payloads, persistent forward, K-major backward."""

    name = "flexattn-sm90"
    arch_families = ("sm90",)
    hardware_verified = True  # the forward kernel's GPU tests run on an H200

    compute_capabilities = ((9, 0),)
    supported_dtypes = SUPPORTED_DTYPES
    supported_head_dims = SUPPORTED_HEAD_DIMS
    pack_gqa_forward = True
    gpu_planner = "maskplan_kernels"  # CPU tensors (target="sm90" on a laptop): the reference planner
    select_forward = staticmethod(select_fwd_config)
    select_backward = staticmethod(select_bwd_config)

    def default_pack_gqa(self, request) -> bool:
        g = request.num_heads_q // request.num_heads_kv
        return packs_by_default(request.head_dim_qk, request.head_dim_v, g, request.mask_heads)

    def check_head_dims(self, head_dim_qk: int, head_dim_v: int) -> None:
        """:attr:`supported_head_dims` are the kernels'; any pair one of them holds runs on it (the
        tiles' columns past the tensors' head dims read as zeros), and a warning says so."""
        kernel = kernel_head_dims(head_dim_qk, head_dim_v)
        if kernel != (head_dim_qk, head_dim_v):
            io = io_head_dims(head_dim_qk, head_dim_v)
            copied = io != (head_dim_qk, head_dim_v)
            warn_held(self.name, (head_dim_qk, head_dim_v), kernel, "a multiple of 8" if copied else None)

    def forward(
        self, plan, q, k, v, *, softmax_scale: float, return_max_logit: bool, out=None, lse=None,
        payload_via_smem: bool | None = None,
    ):  # fmt: skip
        from .fwd_launch import run_forward  # CuTe DSL loads on first use, not on import

        return run_padded_forward(
            run_forward, kernel_view(plan.view("forward"), io_head_dims), q, k, v, out=out, lse=lse,
            softmax_scale=softmax_scale, return_max_logit=return_max_logit, mask_via_smem=payload_via_smem,
        )  # fmt: skip

    def backward(
        self, plan, q, k, v, out, lse, dout, dlse, *, softmax_scale: float, deterministic: bool,
        dq=None, dk=None, dv=None,
    ):  # fmt: skip
        from .bwd_launch import run_backward

        return run_padded_backward(
            run_backward, kernel_view(plan.view("backward"), io_head_dims), q, k, v, out, lse, dout, dlse,
            softmax_scale=softmax_scale, deterministic=deterministic, dq=dq, dk=dk, dv=dv,
        )  # fmt: skip
