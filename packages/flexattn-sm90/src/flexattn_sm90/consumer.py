"""The SM90 (Hopper) consumer: resolves plan views, runs the persistent forward kernel and the
K-major backward kernel.

A plan built for SM90 carries the signature and WGMMA payload layouts its kernels consume; head
dims without a backward kernel are refused by the backward launcher (UnsupportedConfigError),
never computed another way.
"""

from __future__ import annotations

from maskplan_core.consumer import AttentionOutputs, KernelConsumer, ViewConfig

from .heuristics import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, select_bwd_config, select_fwd_config


class Sm90Consumer(KernelConsumer):
    """Hopper consumer: WGMMA accumulator payloads, persistent forward, K-major backward."""

    name = "flexattn-sm90"
    arch_families = ("sm90",)
    hardware_verified = True  # the forward kernel's GPU tests run on an H200

    compute_capabilities = ((9, 0),)
    supported_dtypes = SUPPORTED_DTYPES
    supported_head_dims = SUPPORTED_HEAD_DIMS
    pack_gqa_forward = True
    select_forward = staticmethod(select_fwd_config)
    select_backward = staticmethod(select_bwd_config)

    def build_plan(self, mask_func, geometry, forward: ViewConfig, backward: ViewConfig | None):
        """CUDA tensors plan with the GPU planner kernels; CPU tensors (``target="sm90"`` on a
        machine without a GPU) with the reference planner, which builds the same tensors."""
        if mask_func.device.type != "cuda":
            return super().build_plan(mask_func, geometry, forward, backward)
        from maskplan_kernels import build_plan_gpu  # CuTe DSL loads on first use

        return build_plan_gpu(mask_func, geometry, forward, backward, self.name)

    def forward(
        self, plan, q, k, v, *, softmax_scale: float, return_max_logit: bool, out=None, lse=None,
        payload_via_smem: bool | None = None,
    ):  # fmt: skip
        from .fwd_launch import run_forward  # CuTe DSL loads on first use, not on import

        out, lse, max_logit = run_forward(
            plan.view("forward"), q, k, v, softmax_scale=softmax_scale, return_max_logit=return_max_logit,
            mask_via_smem=payload_via_smem, out=out, lse=lse,
        )
        return AttentionOutputs(out, lse, max_logit)

    def backward(
        self, plan, q, k, v, out, lse, dout, dlse, *, softmax_scale: float, deterministic: bool,
        dq=None, dk=None, dv=None,
    ):  # fmt: skip
        from .bwd_launch import run_backward

        return run_backward(
            plan.view("backward"), q, k, v, out, lse, dout, dlse,
            softmax_scale=softmax_scale, deterministic=deterministic, dq=dq, dk=dk, dv=dv,
        )  # fmt: skip

