"""``torch.autocast`` (flexattn.autocast): attention takes q, k, v in the region's dtype, as SDPA does."""

from __future__ import annotations

import contextlib

import pytest
import torch

import flexattn
from flexattn import PlanBindingError, masks
from maskplan_core.testing import cuda_arch_major

B, S, H, D = 2, 48, 2, 16


def leaves(dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(B, S, H, D, generator=gen, dtype=dtype).to(device).requires_grad_() for _ in range(3)]


def rope_then_attention(q, k, v, plan, promoted):
    """A model's attention inside autocast: v out of a projection (autocast's bfloat16), q and k
    (or all three) multiplied by float32 RoPE tables, which autocast leaves in float32."""
    table = torch.ones(D, device=q.device)
    v = torch.nn.functional.linear(v, torch.eye(D, device=q.device))
    q, k = q * table, k * table
    v = v * table if promoted == "qkv" else v
    return flexattn.flex_attn_func(q, k, v, mask_plan=plan)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(cuda_arch_major() != 9, reason="needs an SM90 GPU")],
        ),
    ],
)
@pytest.mark.parametrize("promoted", ["qk", "qkv"])
def test_autocast_runs_attention_in_its_dtype(promoted, device):
    """Under autocast q, k, v reach attention in the region's dtype whatever a float32 op left them
    in, and a plan built there is for that dtype (with a backward view where they require grad):
    the same bits as the call on inputs cast by hand, out in bfloat16 as SDPA's, and gradients of
    the float32 leaves in float32."""
    mask = masks.causal(S, batch=B, device=device)
    q, k, v = leaves(device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        plan = flexattn.create_mask_plan(mask, q, k, v)
        out = rope_then_attention(q, k, v, plan, promoted)
    assert plan.geometry.dtype == torch.bfloat16 and plan.has_backward
    assert out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    assert all(g.dtype == torch.float32 for g in grads)

    by_hand = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    expected = flexattn.flex_attn_func(*by_hand, mask_plan=plan)
    assert torch.equal(out, expected)
    expected_grads = torch.autograd.grad(expected.float().square().sum(), by_hand)
    for got, want in zip(grads, expected_grads, strict=True):
        assert torch.equal(got, want.float())


def _untraceable_on_torch_2_11(device_type):
    raise AssertionError("torch 2.11's Dynamo cannot trace torch.amp.is_autocast_available (a graph break)")


@pytest.mark.parametrize("region", ["inside", "outside"])
def test_autocast_under_torch_compile_gives_the_eager_bits(region, monkeypatch):
    """The region entered inside the compiled function, or around its call (where the GPU machine's
    torch 2.11 traces it: without torch.amp.is_autocast_available)."""
    monkeypatch.setattr(torch.amp, "is_autocast_available", _untraceable_on_torch_2_11)
    mask = masks.causal(S, batch=B)
    q, k, v = leaves()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = flexattn.create_mask_plan(mask, q, k, v)

    def step(q, k, v, plan):
        with torch.autocast("cpu", dtype=torch.bfloat16) if region == "inside" else contextlib.nullcontext():
            return rope_then_attention(q, k, v, plan, "qk")

    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=region == "outside"):
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v, plan)
        eager = step(q, k, v, plan)
    assert compiled.dtype == torch.bfloat16 and torch.equal(compiled, eager)
    grads = torch.autograd.grad(compiled.sum(), (q, k)), torch.autograd.grad(eager.sum(), (q, k))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_a_plan_built_in_the_region_under_torch_func_grad():
    """create_mask_plan reads q, k, v's dtypes, shapes and devices in the region: nothing it does
    to them (no stand-in made to require grad) is refused under a functorch transform."""
    mask = masks.causal(S, batch=B)

    def loss(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plan = flexattn.create_mask_plan(mask, q, k, v, build_backward=True)
            return flexattn.flex_attn_func(q, k, v, mask_plan=plan).float().sum()

    q, k, v = (t.detach() for t in leaves())
    got = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    q, k, v = leaves()
    expected = torch.autograd.grad(loss(q, k, v), (q, k, v))
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_the_region_does_not_hide_what_validation_refuses():
    """Inputs that are not dense tensors, or no tensors, are named as they are outside a region."""
    mask = masks.causal(S, batch=B)
    q, k, v = (t.detach() for t in leaves())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(TypeError, match="k must be a torch.Tensor, got NoneType"):
            flexattn.create_mask_plan(mask, q, None, v)
        plan = flexattn.create_mask_plan(mask, q, k, v)
        with pytest.raises(TypeError, match="v must be a torch.Tensor, got list"):
            flexattn.flex_attn_func(q, k, [0.0], mask_plan=plan)
        with pytest.raises(TypeError, match=r"q must be a dense \(strided\) tensor, got layout torch.sparse"):
            flexattn.create_mask_plan(mask, q.to_sparse(), k, v)
        with pytest.raises(TypeError, match="k is a nested tensor"):
            jagged = torch.nested.nested_tensor([k[0], k[1]], layout=torch.jagged)
            flexattn.create_mask_plan(mask, q, jagged, v)


def test_autocast_leaves_float64_alone():
    """As autocast's own casts: float64 inputs keep their dtype, and a disabled region casts nothing."""
    mask = masks.causal(S, batch=B)
    q, k, v = leaves(torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = flexattn.create_mask_plan(mask, q, k, v)
        out = flexattn.flex_attn_func(q, k, v, mask_plan=plan)
    assert plan.geometry.dtype == torch.float64 and out.dtype == torch.float64
    q, k, v = leaves()
    plan = flexattn.create_mask_plan(mask, q, k, v)
    with torch.autocast("cpu", enabled=False):
        assert flexattn.flex_attn_func(q, k, v, mask_plan=plan).dtype == torch.float32


def test_a_plan_of_another_dtype_under_autocast_names_the_dtype_that_reaches_attention(monkeypatch):
    """A plan built outside the region from float32 tensors does not take the region's bfloat16
    inputs (SDPA's would run in bfloat16 there too): the refusal says which dtype to build it for;
    outside autocast the message has no such hint, but one built inside the region and used
    outside it is told where it was built."""
    monkeypatch.setattr(torch.amp, "is_autocast_available", _untraceable_on_torch_2_11)
    mask = masks.causal(S, batch=B)
    q, k, v = leaves()
    plan = flexattn.create_mask_plan(mask, q, k, v, build_backward=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(PlanBindingError, match="torch.autocast is on.*build the plan.*bfloat16"):
            flexattn.flex_attn_func(q, k, v, mask_plan=plan)
    with pytest.raises(PlanBindingError) as refused:
        flexattn.flex_attn_func(*(t.bfloat16() for t in (q, k, v)), mask_plan=plan)
    assert "autocast" not in str(refused.value)
    # a TypeError too, as cudnn.flex_attention raises for a dtype mismatch (code catching that works)
    assert isinstance(refused.value, TypeError) and isinstance(refused.value, flexattn.PlanDtypeError)
    on_meta = [torch.empty_like(t, device="meta", dtype=torch.bfloat16) for t in (q, k, v)]
    with pytest.raises(PlanBindingError, match="is on meta") as refused:  # the device first, then dtype
        flexattn.flex_attn_func(*on_meta, mask_plan=plan)
    assert "autocast" not in str(refused.value)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = flexattn.create_mask_plan(mask, q, k, v)
    with pytest.raises(PlanBindingError, match="or call inside the torch.autocast region of torch.bfloat16"):
        flexattn.flex_attn_func(q, k, v, mask_plan=inside)


def test_the_explicit_api_casts_nothing_and_says_to_cast():
    """FlexAttentionFwd writes into the caller's buffers of the caller's dtypes (as cuDNN's API), so
    autocast does not reach it: q and k promoted to float32 by RoPE are told to cast, which
    flex_attn_func does itself."""
    q, k, v = (t.detach().bfloat16() for t in leaves())
    plan = flexattn.create_mask_plan(masks.causal(S, batch=B), q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k = q.float(), k.float()
        o = torch.empty_like(v)
        refusal = "autocast is on.*cast them to torch.bfloat16.*flex_attn_func"
        with pytest.raises(PlanBindingError, match=refusal):
            call = flexattn.FlexAttentionFwd(q, k, v, o, plan)
            call.check_support()
            call.execute(q, k, v, o, plan)
