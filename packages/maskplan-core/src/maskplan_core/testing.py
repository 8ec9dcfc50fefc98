"""Test support shared by the consumers' GPU test suites (and usable by a third party's): problem
generators and the forward check against the fp32 reference. Torch only; importing it needs no GPU.

::

    q, k, v = qkv((B, S, H), (B, S, H), 128, 128, torch.bfloat16, seed=3, device=dev)
    ep = random_intervals(H, 5, torch.full((B * S,), S), seed=3, device=dev)
    plan = reference_plan(ep, q, k, v, consumer=c.name, forward=lambda g: resolve_view(c, g, "forward"))
    check_forward(run_forward, plan.view("forward"), q, k, v)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .consumer import KERNEL_DTYPE_NAMES, KernelConsumer, ViewConfig, ViewRequest
from .geometry import PlanGeometry
from .plan import MaskPlan, PlanView
from .reference import attention_forward, build_plan
from .validation import validate_plan_inputs

#: max |O - O_ref| of a kernel forward against the fp32 reference on random normal inputs
FWD_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


# -- problem generators ---------------------------------------------------------------------------
def qkv(shape_q, shape_k, dqk: int, dv: int, dtype: torch.dtype, seed: int = 0, *, device="cuda"):
    """Random normal ``q [*shape_q, dqk]``, ``k [*shape_k, dqk]``, ``v [*shape_k, dv]``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(*shape_q, dqk, device=device, dtype=dtype, generator=gen)
    k = torch.randn(*shape_k, dqk, device=device, dtype=dtype, generator=gen)
    v = torch.randn(*shape_k, dv, device=device, dtype=dtype, generator=gen)
    return q, k, v


def random_intervals(hmask: int, nfunc: int, row_k_len: torch.Tensor, seed: int = 0, *, device="cuda"):
    """Endpoints ``[hmask, nfunc, rows]``: sorted uniform draws in ``[0, k_len]`` of each row."""
    gen = torch.Generator(device=device).manual_seed(seed)
    k_len = row_k_len.to(device, torch.float64)
    u = torch.rand(hmask, nfunc, k_len.numel(), device=device, generator=gen, dtype=torch.float64)
    ep = torch.floor(u * (k_len + 1)).clamp(max=k_len).to(torch.int32)
    return ep.sort(dim=1).values.contiguous()


def varlen_causal(cu_q: torch.Tensor, cu_k: torch.Tensor) -> torch.Tensor:
    """Bottom-right causal endpoints for varlen samples: ``[1, 1, total_q]`` on ``cu_q``'s device."""
    rows = []
    for b in range(cu_q.numel() - 1):
        q_len, k_len = int(cu_q[b + 1] - cu_q[b]), int(cu_k[b + 1] - cu_k[b])
        i = torch.arange(q_len, device=cu_q.device)
        rows.append((i + 1 + k_len - q_len).clamp(0, k_len))
    return torch.cat(rows).to(torch.int32).view(1, 1, -1).contiguous()


def resolve_view(consumer: KernelConsumer, g: PlanGeometry, direction: str) -> ViewConfig:
    """``consumer.resolve`` of the request the facade makes for ``g`` on the consumer's first arch
    family and compute capability."""
    request = ViewRequest(
        arch_family=consumer.arch_families[0], compute_capability=consumer.compute_capabilities[0],
        direction=direction, head_dim_qk=g.head_dim_qk, head_dim_v=g.head_dim_v, num_heads_q=g.num_heads_q,
        num_heads_kv=g.num_heads_kv, mask_heads=g.mask_heads, dtype=KERNEL_DTYPE_NAMES[g.dtype],
        varlen=g.varlen,
    )  # fmt: skip
    return consumer.resolve(request)


def reference_plan(
    mask_func,
    q,
    k,
    v,
    *,
    consumer: str,
    forward: Callable[[PlanGeometry], ViewConfig],
    backward: Callable[[PlanGeometry], ViewConfig] | None = None,
    **varlen,
) -> MaskPlan:
    """A plan built by the reference planner (on the tensors' device) with the views a consumer
    resolves for the problem: ``forward(geometry)`` (and ``backward(geometry)``) give them."""
    g = validate_plan_inputs(mask_func, q, k, v, **varlen)
    return build_plan(mask_func, g, forward(g), backward(g) if backward else None, consumer)


# -- the forward check ----------------------------------------------------------------------------
def check_forward(run: Callable, view: PlanView, q, k, v, *, scale: float | None = None) -> None:
    """Run ``run(view, q, k, v, softmax_scale=, return_max_logit=True, out=, lse=)`` (a consumer's
    ``run_forward``; bind other options with ``functools.partial``) on THD views of ``q/k/v`` into
    NaN-poisoned outputs, and compare with the fp32 reference on the same view: every element
    written, O within :data:`FWD_TOLERANCE`, LSE = -inf exactly and O = 0 on rows with no visible
    key, LSE and max logit within 1e-2."""
    g = view.geometry
    q3, k3, v3 = (t.reshape(-1, *t.shape[-2:]) for t in (q, k, v))
    scale = 1.0 / math.sqrt(g.head_dim_qk) if scale is None else scale
    out = torch.full((g.total_q, g.num_heads_q, g.head_dim_v), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((g.num_heads_q, g.total_q), float("nan"), dtype=torch.float32, device=q.device)
    out, lse, max_logit = run(view, q3, k3, v3, softmax_scale=scale, return_max_logit=True, out=out, lse=lse)
    if q.is_cuda:
        torch.cuda.synchronize(q.device)
    ref_out, ref_lse, ref_max = attention_forward(
        view, q3, k3, v3, softmax_scale=scale, return_max_logit=True
    )

    assert not torch.isnan(out).any(), f"{int(torch.isnan(out).sum())} O elements unwritten or NaN"
    assert not torch.isnan(lse).any(), f"{int(torch.isnan(lse).sum())} LSE elements unwritten or NaN"
    tol = FWD_TOLERANCE[q.dtype]
    err = (out.float() - ref_out).abs().max().item()
    assert err <= tol, f"max |O - ref| = {err:.3e} > {tol}"
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty), "LSE = -inf exactly on rows with no visible key"
    assert (out.float()[empty.transpose(0, 1)] == 0).all(), "rows with no visible key must have O = 0"
    lse_err = (lse[~empty] - ref_lse[~empty]).abs().max().item() if (~empty).any() else 0.0
    assert lse_err <= 1e-2, f"max |LSE - ref| = {lse_err:.3e}"
    assert torch.allclose(max_logit, ref_max, atol=1e-2, rtol=1e-3, equal_nan=False), (max_logit, ref_max)


__all__ = [
    "FWD_TOLERANCE",
    "check_forward",
    "qkv",
    "random_intervals",
    "reference_plan",
    "resolve_view",
    "varlen_causal",
]
