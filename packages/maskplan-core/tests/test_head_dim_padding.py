"""maskplan_core.head_dim_padding: which kernel holds a head-dim pair, and running a launcher on
zero-padded tensors gives the unpadded problem's outputs and gradients, in the caller's buffers.

The launcher stood in for a kernel here is the reference attention on the padded view (a kernel
built for the larger head dims computes the same thing); the result must be the reference on the
caller's own tensors.
"""

from __future__ import annotations

import pytest
import torch

from maskplan_core import masks
from maskplan_core.consumer import ViewRequest
from maskplan_core.errors import UnsupportedConfigError
from maskplan_core.head_dim_padding import (
    holding_head_dims,
    kernel_view,
    run_padded_backward,
    run_padded_forward,
    warn_held,
)
from maskplan_core.reference import attention_backward, attention_forward
from maskplan_core.reference.consumer import ReferenceConsumer
from maskplan_core.testing import reference_plan

KERNELS = ((32, 32), (64, 64), (96, 96), (128, 128), (192, 128), (256, 256))


@pytest.mark.parametrize(
    "dims, kernel",
    [((80, 80), (96, 96)), ((8, 8), (32, 32)), ((33, 16), (64, 64)), ((64, 128), (128, 128)),
     ((128, 64), (128, 128)), ((160, 128), (192, 128)), ((192, 192), (256, 256)), ((96, 96), (96, 96))],
)  # fmt: skip
def test_the_cheapest_kernel_that_holds_the_pair(dims, kernel):
    assert holding_head_dims(*dims, KERNELS, "k") == kernel


@pytest.mark.parametrize("dims", [(257, 16), (64, 300)])
def test_a_pair_no_kernel_holds_is_refused_by_name(dims):
    refusal = rf"\({dims[0]}, {dims[1]}\) is not supported by my-kernels"
    with pytest.raises(UnsupportedConfigError, match=refusal):
        holding_head_dims(*dims, KERNELS, "my-kernels")


def test_the_warning_names_the_kernel_and_any_copy():
    said = r"k has no kernel for .*\(80, 80\): they run on the \(96, 96\) kernels"
    with pytest.warns(UserWarning, match=said) as w:
        warn_held("k", (80, 80), (96, 96), None)
    assert "copied" not in str(w[0].message)
    assert w[0].filename == __file__  # the caller's line, past the library's frames
    with pytest.warns(UserWarning, match=r"copied per call, zero-padded to a multiple of 8"):
        warn_held("k", (36, 60), (64, 64), "a multiple of 8")


def _plan(dims, total=150, hq=4, hkv=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dqk, dv = dims
    q, k = (torch.randn(total, h, dqk, generator=gen, dtype=torch.float64) for h in (hq, hkv))
    v = torch.randn(total, hkv, dv, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, 100, 100, total], dtype=torch.int32)  # an empty sample in the middle
    consumer = ReferenceConsumer()
    plan = reference_plan(
        masks.sliding_window(cu_seqlens_q=cu, cu_seqlens_k=cu, window_left=40), q, k, v,
        consumer=consumer.name,
        forward=lambda g: consumer.resolve(_request(g, "forward")),
        backward=lambda g: consumer.resolve(_request(g, "backward")),
        cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=100, max_seqlen_k=100,
    )  # fmt: skip
    return plan, q, k, v


def _request(g, direction):
    return ViewRequest(
        arch_family="reference", direction=direction, head_dim_qk=g.head_dim_qk, head_dim_v=g.head_dim_v,
        num_heads_q=g.num_heads_q, num_heads_kv=g.num_heads_kv, mask_heads=g.mask_heads, dtype="float64",
        varlen=g.varlen,
    )  # fmt: skip


def _at(head_dims):
    """A consumer's head-dim rule that takes every pair to ``head_dims``."""
    return lambda head_dim_qk, head_dim_v: head_dims


def test_kernel_view_is_one_view_per_plan_view_at_the_kernels_head_dims():
    plan, *_ = _plan((36, 52))
    view = plan.view("forward")
    assert kernel_view(view, _at((36, 52))) is view
    padded = kernel_view(view, _at((64, 64)))
    assert (padded.geometry.head_dim_qk, padded.geometry.head_dim_v) == (64, 64)
    assert padded.tensors == view.tensors and padded.signature == view.signature and padded.role == "forward"
    assert kernel_view(view, _at((64, 64))) is padded
    wider = kernel_view(view, _at((96, 96)))  # asked at other head dims: never a stale view
    assert (wider.geometry.head_dim_qk, wider.geometry.head_dim_v) == (96, 96)


@pytest.mark.parametrize("dims, kernel", [((36, 52), (64, 64)), ((64, 40), (64, 64)), ((40, 64), (64, 64))])
def test_a_launcher_on_padded_tensors_gives_the_callers_problem(dims, kernel):
    plan, q, k, v = _plan(dims)
    scale = 0.2
    seen = {}

    def launcher(run, name):  # a kernel at the padded head dims: what it got, and its outputs
        def launch(view, *tensors, out=None, dq=None, dk=None, dv=None, **options):
            seen[name] = view, tensors, (out, dq, dk, dv)
            assert all(t.shape[-1] in kernel for t in tensors if t is not None and t.dim() == 3)
            return run(view, *tensors, **options)

        return launch

    fwd_view = kernel_view(plan.view("forward"), _at(kernel))
    got = run_padded_forward(
        launcher(attention_forward, "forward"), fwd_view, q, k, v, softmax_scale=scale, return_max_logit=True
    )
    want = attention_forward(plan.view("forward"), q, k, v, softmax_scale=scale, return_max_logit=True)
    assert got.out.shape == v.shape[:1] + (4, dims[1]) and got.out.is_contiguous()
    for a, b in zip((got.out, got.lse, got.max_logit), want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    view, given, _ = seen["forward"]
    assert view is fwd_view
    for t, p, d in zip((q, k, v), given, (kernel[0], kernel[0], kernel[1]), strict=True):
        assert p.shape[-1] == d and torch.equal(p[..., : t.shape[-1]], t) and not p[..., t.shape[-1] :].any()
        assert (p is t) == (d == t.shape[-1])  # copied only where padded

    out = torch.full_like(got.out, float("nan"))
    assert run_padded_forward(
        launcher(attention_forward, "forward"), fwd_view, q, k, v, out=out, softmax_scale=scale
    ).out is out  # fmt: skip
    assert torch.equal(out, got.out)
    # the kernel writes out where Dv is its own
    assert (seen["forward"][2][0] is out) == (dims[1] == kernel[1])

    dout = torch.randn_like(got.out)
    bwd_view = kernel_view(plan.view("backward"), _at(kernel))
    call = (bwd_view, q, k, v, got.out, got.lse, dout, None)
    grads = run_padded_backward(launcher(attention_backward, "backward"), *call, softmax_scale=scale)
    expected = attention_backward(
        plan.view("backward"), q, k, v, got.out, got.lse, dout, None, softmax_scale=scale
    )
    for g, e, t in zip(grads, expected, (q, k, v), strict=True):
        assert g.shape == t.shape
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    buffers = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    into = run_padded_backward(
        launcher(attention_backward, "backward"), *call, softmax_scale=scale, dq=buffers[0], dk=buffers[1],
        dv=buffers[2],
    )  # fmt: skip
    assert all(i is b and torch.equal(b, g) for i, b, g in zip(into, buffers, grads, strict=True))
    native = (dims[0] == kernel[0],) * 2 + (dims[1] == kernel[1],)
    assert [b is g for b, g in zip(buffers, seen["backward"][2][1:], strict=True)] == list(native)
