"""The SM90 (Hopper) consumer: resolves plan views, runs the persistent forward kernel and the
K-major backward kernel.

A plan built for SM90 carries the signature and WGMMA payload layouts its kernels consume; head
dims without a backward kernel are refused by the backward launcher (UnsupportedConfigError),
never computed another way.
"""

from __future__ import annotations

import warnings

from maskplan_core.consumer import AttentionOutputs, KernelConsumer

from .head_dim_padding import cut_head_dim, kernel_view, pad_head_dim
from .heuristics import (
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    check_head_dims,
    kernel_head_dims,
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

    def check_head_dims(self, head_dim_qk: int, head_dim_v: int) -> None:
        """:attr:`supported_head_dims` are the kernels'; any pair one of them holds runs on it (the
        tiles' columns past the tensors' head dims read as zeros), and a warning says so."""
        check_head_dims(head_dim_qk, head_dim_v)
        if (head_dim_qk, head_dim_v) not in SUPPORTED_HEAD_DIMS:
            _warn_padded(head_dim_qk, head_dim_v)

    def forward(
        self, plan, q, k, v, *, softmax_scale: float, return_max_logit: bool, out=None, lse=None,
        payload_via_smem: bool | None = None,
    ):  # fmt: skip
        from .fwd_launch import run_forward  # CuTe DSL loads on first use, not on import

        view = kernel_view(plan.view("forward"))
        dqk, dv = view.geometry.head_dim_qk, view.geometry.head_dim_v
        padded_v = pad_head_dim(v, dv)
        o, lse, max_logit = run_forward(
            view, pad_head_dim(q, dqk), pad_head_dim(k, dqk), padded_v,
            softmax_scale=softmax_scale, return_max_logit=return_max_logit, mask_via_smem=payload_via_smem,
            out=out if padded_v is v else None, lse=lse,
        )  # fmt: skip
        return AttentionOutputs(cut_head_dim(o, v.shape[-1], out), lse, max_logit)

    def backward(
        self, plan, q, k, v, out, lse, dout, dlse, *, softmax_scale: float, deterministic: bool,
        dq=None, dk=None, dv=None,
    ):  # fmt: skip
        from .bwd_launch import run_backward

        view = kernel_view(plan.view("backward"))
        dims_qk, dims_v = view.geometry.head_dim_qk, view.geometry.head_dim_v
        padded_q, padded_k = (pad_head_dim(t, dims_qk) for t in (q, k))
        padded_v, padded_out, padded_dout = (pad_head_dim(t, dims_v) for t in (v, out, dout))
        # a caller's buffer takes the kernels' writes where its head dim is not padded
        qk_native, v_native = padded_q is q, padded_v is v
        grads = run_backward(
            view, padded_q, padded_k, padded_v, padded_out, lse, padded_dout, dlse,
            softmax_scale=softmax_scale, deterministic=deterministic,
            dq=dq if qk_native else None, dk=dk if qk_native else None, dv=dv if v_native else None,
        )  # fmt: skip
        inputs, into = (q, k, v), (dq, dk, dv)
        return tuple(cut_head_dim(g, t.shape[-1], i) for g, t, i in zip(grads, inputs, into, strict=True))


def _warn_padded(head_dim_qk: int, head_dim_v: int) -> None:
    # once per pair: resolve is memoised per request, and Python's default filter shows a message
    # once per place
    kernel = kernel_head_dims(head_dim_qk, head_dim_v)
    warnings.warn(
        f"flexattn-sm90 has no kernel for (head_dim_qk, head_dim_v)=({head_dim_qk}, {head_dim_v}): they run "
        f"on the {kernel} kernels, at those head dims' cost"
        + ("" if head_dim_qk % 8 == 0 and head_dim_v % 8 == 0 else
           " and with q, k, v (and out, dout) copied per call, zero-padded to a multiple of 8"),
        stacklevel=2,
    )
