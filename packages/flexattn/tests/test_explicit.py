"""``FlexAttentionFwd`` / ``FlexAttentionBwd`` (cuDNN's explicit API) on the CPU reference: the
results ``flex_attn_func`` gives, written into the caller's tensors, and errors that name what
does not fit."""

from __future__ import annotations

import pytest
import torch
from consumer_spy import record_calls

import flexattn
from flexattn import FlexAttentionBwd, FlexAttentionFwd, masks

B, S, H, HKV, D, DV = 2, 50, 4, 2, 16, 8
CU = [0, 30, 30, 75]  # varlen: an empty sample


def fixed(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=gen, dtype=dtype)
    k = torch.randn(B, S, HKV, D, generator=gen, dtype=dtype)
    v = torch.randn(B, S, HKV, DV, generator=gen, dtype=dtype)
    return q, k, v


def fixed_plan(q, k, v, **kw):
    return flexattn.create_mask_plan(masks.sliding_window(S, window_left=11, batch=B), q, k, v, **kw)


def varlen(seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = CU[-1]
    q, k = (torch.randn(total, n, D, generator=gen) for n in (H, HKV))
    v = torch.randn(total, HKV, DV, generator=gen)
    cu = torch.tensor(CU, dtype=torch.int32)
    args = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=45, max_seqlen_k=45)
    mask = masks.causal(cu_seqlens_q=cu, cu_seqlens_k=cu)
    return (q, k, v), mask, args


def run_fwd(q, k, v, plan, lse_shape, **kw):
    o = torch.empty(*q.shape[:-1], DV)
    lse, max_logit = torch.empty(lse_shape), torch.empty(H)
    fwd = FlexAttentionFwd(q, k, v, o, plan, lse, sample_max_logit=max_logit)
    assert fwd.check_support() and fwd.workspace_size == 0
    fwd.compile()
    ptr = o.data_ptr()
    fwd.execute(q, k, v, o, plan, lse, max_logit_tensor=max_logit, **kw)
    assert o.data_ptr() == ptr
    return o, lse, max_logit


def test_forward_fixed_matches_flex_attn_func():
    q, k, v = fixed()
    plan = fixed_plan(q, k, v)
    got = run_fwd(q, k, v, plan, (B, H, S), softmax_scale=0.3)
    want = flexattn.flex_attn_func(
        q, k, v, mask_plan=plan, softmax_scale=0.3, return_lse=True, return_max_logit=True
    )
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_forward_varlen_and_a_new_plan_per_call():
    (q, k, v), mask, args = varlen()
    plans = [flexattn.create_mask_plan(mask, q, k, v, **args) for _ in range(2)]
    o, lse = torch.empty(CU[-1], H, DV), torch.empty(H, CU[-1])
    fwd = FlexAttentionFwd(q, k, v, o, plans[0], lse)
    for plan in plans:  # calling the object compiles it first, then executes
        o.zero_(), lse.zero_()
        fwd(q, k, v, o, plan, lse)
        want, want_lse = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True)
        assert torch.equal(o, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("with_dlse", [False, True])
@pytest.mark.parametrize("kind", ["fixed", "varlen"])
def test_backward_matches_autograd(kind, with_dlse):
    if kind == "fixed":
        q, k, v = fixed(1)
        plan = fixed_plan(q, k, v, build_backward=True)
        lse_shape = (B, H, S)
    else:
        (q, k, v), mask, args = varlen(1)
        plan = flexattn.create_mask_plan(mask, q, k, v, build_backward=True, **args)
        lse_shape = (H, CU[-1])
    gen = torch.Generator().manual_seed(2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = flexattn.flex_attn_func(*leaves, mask_plan=plan, return_lse=True, softmax_scale=0.2)
    do = torch.randn(o.shape, generator=gen)
    dlse = torch.randn(lse_shape, generator=gen) if with_dlse else None
    want = torch.autograd.grad((o, lse), leaves, (do, dlse if with_dlse else torch.zeros_like(lse)))
    o, lse = o.detach(), lse.detach()  # flex_attn_func's O and LSE, the explicit backward's inputs
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    bwd = FlexAttentionBwd(q, k, v, o, do, lse, dq, dk, dv, plan, dlse, deterministic=True)
    bwd.compile()
    bwd.execute(q, k, v, o, do, lse, dq, dk, dv, plan, dlse, softmax_scale=0.2)
    for name, got, ref in zip("qkv", (dq, dk, dv), want, strict=True):
        torch.testing.assert_close(got, ref, msg=f"d{name}")


def test_torch_deterministic_mode_reaches_the_explicit_backward(monkeypatch):
    """``torch.use_deterministic_algorithms(True)`` in force at ``execute`` makes the consumer's
    backward deterministic though the constructor said False (torch's rule for its own ops)."""
    q, k, v = fixed()
    plan = fixed_plan(q, k, v, build_backward=True)
    o, lse = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    bwd = FlexAttentionBwd(q, k, v, o, o, lse, dq, dk, dv, plan)
    bwd.compile()
    calls = record_calls(monkeypatch)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        for enabled in (False, True):
            torch.use_deterministic_algorithms(enabled)
            bwd.execute(q, k, v, o, o, lse, dq, dk, dv, plan)
    finally:
        torch.use_deterministic_algorithms(was)
    assert [kw["deterministic"] for direction, _, kw in calls if direction == "backward"] == [False, True]


def test_strided_inputs_and_a_strided_lse():
    """q/k/v as BHSD transposes (what flex_attn_func takes too) and an LSE that is a transposed view
    (written through a copy) give the same results."""
    q, k, v = fixed(3)
    plan = fixed_plan(q, k, v, build_backward=True)
    qs, ks, vs = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not qs.is_contiguous()
    lse = torch.empty(H, B, S).transpose(0, 1)
    got = run_fwd(qs, ks, vs, plan, (B, H, S))
    fwd = FlexAttentionFwd(qs, ks, vs, got[0], plan, lse)
    fwd.compile()
    fwd.execute(qs, ks, vs, got[0], plan, lse)
    want, want_lse = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True)
    assert torch.equal(got[0], want) and torch.equal(got[1], want_lse) and torch.equal(lse, want_lse)
    do = torch.randn(want.shape).transpose(1, 2).contiguous().transpose(1, 2)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    bwd = FlexAttentionBwd(qs, ks, vs, want, do, lse, *grads, plan)
    bwd.compile()
    bwd.execute(qs, ks, vs, want, do, lse, *grads, plan)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flexattn.flex_attn_func(*leaves, mask_plan=plan).backward(do)
    for got_grad, leaf in zip(grads, leaves, strict=True):
        torch.testing.assert_close(got_grad, leaf.grad)


def test_outputs_in_slices_of_packed_buffers():
    """o, dq, dk, dv may be strided buffers with a unit last stride, as cuDNN's (here slices of one
    packed ``[B, S, Hq + 2 Hkv, D]`` gradient buffer): they get what contiguous ones get."""
    q, k, v = fixed(4)
    q, k, v = (t[..., :DV] for t in (q, k, v))  # one head dim, so that the buffers pack
    plan = fixed_plan(q, k, v, build_backward=True)
    want, lse = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True)
    o = torch.full((B, S, 2 * H, DV), float("nan"))[:, :, H:]
    FlexAttentionFwd(q, k, v, o, plan)(q, k, v, o, plan)
    assert torch.equal(o, want)
    do = torch.randn(want.shape)
    dqkv = torch.full((B, S, H + 2 * HKV, DV), float("nan"))
    grads = dqkv.split([H, HKV, HKV], dim=2)
    FlexAttentionBwd(q, k, v, want, do, lse, *grads, plan)(q, k, v, want, do, lse, *grads, plan)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flexattn.flex_attn_func(*leaves, mask_plan=plan).backward(do)
    for got, leaf in zip(grads, leaves, strict=True):
        assert torch.equal(got, leaf.grad)


def test_outputs_must_hold_elements_of_their_own():
    """An output buffer that repeats elements (expanded), shares them with another output or an
    input, or is a node of an autograd graph would take a result that another overwrites (or that
    overwrites what the kernels still read, or bypasses autograd): refused, naming it, at
    check_support and at execute. Buffers sliced apart from one packed tensor are fine (above)."""
    q, k, v = fixed(5)
    q, k, v = (t[..., :DV].contiguous() for t in (q, k, v))
    plan = fixed_plan(q, k, v, build_backward=True)
    o, lse = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True)
    do = torch.randn(o.shape)

    def backward(dq, dk, dv):
        FlexAttentionBwd(q, k, v, o, do, lse, dq, dk, dv, plan).check_support()

    dkv = torch.empty(B, S, HKV, DV)  # one buffer given as dk and as dv: dk would be lost
    with pytest.raises(flexattn.InputValueError, match="dk shares memory with dv"):
        backward(torch.empty_like(q), dkv, dkv)
    with pytest.raises(flexattn.InputValueError, match="dq shares memory with do"):
        backward(do.view(q.shape), torch.empty_like(k), torch.empty_like(v))
    expanded = torch.zeros(1, S, HKV, DV).expand(B, S, HKV, DV)
    with pytest.raises(flexattn.InputValueError, match="dv names some elements more than once"):
        backward(torch.empty_like(q), torch.empty_like(k), expanded)
    graph_node = torch.zeros(q.shape, requires_grad=True) * 2
    with pytest.raises(flexattn.InputValueError, match="dq is a result of autograd"):
        backward(graph_node, torch.empty_like(k), torch.empty_like(v))
    folded = torch.zeros(B * S * H * DV).as_strided(o.shape, (S * H * DV, H * DV, DV // 2, 1))
    with pytest.raises(flexattn.InputValueError, match="o names some elements more than once"):
        FlexAttentionFwd(q, k, v, folded, plan).check_support()
    # the same at execute, whose tensors may alias where the samples did not
    fwd = FlexAttentionFwd(q, k, v, torch.empty_like(o), plan)
    fwd.compile()
    with pytest.raises(flexattn.InputValueError, match="o shares memory with q"):
        fwd.execute(q, k, v, q, plan)
    fwd.execute(q, k, v, o, plan)  # its own buffer


def test_errors_name_what_does_not_fit():
    q, k, v = fixed()
    plan = fixed_plan(q, k, v)
    o = torch.empty(B, S, H, DV)
    fwd = FlexAttentionFwd(q, k, v, o, plan)
    with pytest.raises(flexattn.UnsupportedCallError, match=r"call compile\(\) before execute") as info:
        fwd.execute(q, k, v, o, plan)
    assert isinstance(info.value, RuntimeError)  # cuDNN's type for it
    with pytest.raises(flexattn.InputValueError, match=r"o must be torch.float32 of shape \(2, 50, 4, 8\)"):
        FlexAttentionFwd(q, k, v, torch.empty(B, S, H, D), plan).check_support()
    with pytest.raises(flexattn.InputValueError, match="lse must be"):
        FlexAttentionFwd(q, k, v, o, plan, torch.empty(H, B * S)).compile()
    with pytest.raises(flexattn.InputValueError, match=r"o must have a unit last stride, got strides \(1600"):
        FlexAttentionFwd(q, k, v, torch.empty(B, S, DV, H).transpose(2, 3), plan).compile()
    fwd.compile()
    with pytest.raises(flexattn.InputValueError, match=r"q does not match its sample: shape \(2, 40, 4"):
        fwd.execute(q[:, :40], k, v, o, plan)
    with pytest.raises(flexattn.InputValueError, match="lse: a sample was not given"):
        fwd.execute(q, k, v, o, plan, torch.empty(B, H, S))
    with pytest.raises(flexattn.InputTypeError, match="workspace must be None or a torch.Tensor"):
        fwd.execute(q, k, v, o, plan, workspace=16)
    fwd.execute(q, k, v, o, plan, workspace=torch.empty(fwd.workspace_size, dtype=torch.uint8))  # cuDNN style
    with pytest.raises(flexattn.InputValueError, match="current_stream is for CUDA tensors"):
        fwd.execute(q, k, v, o, plan, current_stream=0)
    with pytest.raises(flexattn.InputTypeError, match="mask_plan must be a MaskPlan"):
        fwd.execute(q, k, v, o, "plan")
    other = flexattn.create_mask_plan(masks.causal(S - 1, batch=B), q[:, 1:], k[:, 1:], v[:, 1:])
    with pytest.raises(flexattn.PlanBindingError, match="q has shape"):
        fwd.execute(q, k, v, o, other)
    with pytest.raises(flexattn.InputTypeError, match="sm90_use_smem_mask_pipeline must be True"):
        FlexAttentionFwd(q, k, v, o, plan, sm90_use_smem_mask_pipeline="smem")
    direct = torch.empty_like(o)
    FlexAttentionFwd(q, k, v, direct, plan, sm90_use_smem_mask_pipeline=False)(q, k, v, direct, plan)
    assert torch.equal(direct, o)  # a speed hint: the reference has no choice to make
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    lse = torch.empty(B, H, S)
    with pytest.raises(flexattn.MissingBackwardViewError, match="build_backward=True"):
        FlexAttentionBwd(q, k, v, o, o, lse, dq, dk, dv, plan).compile()
    with pytest.raises(flexattn.InputTypeError, match="deterministic must be a bool"):
        FlexAttentionBwd(q, k, v, o, o, lse, dq, dk, dv, plan, deterministic=1)
    # a sample that is not a tensor is refused by name at construction (not an AttributeError)
    with pytest.raises(flexattn.InputTypeError, match="sample_o must be a torch.Tensor, got list"):
        FlexAttentionFwd(q, k, v, [0.0], plan)
    with pytest.raises(flexattn.InputTypeError, match="sample_lse must be a torch.Tensor, got float"):
        FlexAttentionFwd(q, k, v, o, plan, 0.0)
    with pytest.raises(flexattn.InputTypeError, match="sample_dq must be a torch.Tensor, got list"):
        FlexAttentionBwd(q, k, v, o, o, lse, [0.0], dk, dv, plan)
    # only lse / max_logit (forward) and dlse (backward) may be left out
    with pytest.raises(flexattn.InputTypeError, match="sample_q must be a torch.Tensor, got NoneType"):
        FlexAttentionFwd(None, k, v, o, plan)
    with pytest.raises(flexattn.InputTypeError, match="sample_lse must be a torch.Tensor, got NoneType"):
        FlexAttentionBwd(q, k, v, o, o, None, dq, dk, dv, plan)


def test_payload_hint_reaches_only_consumers_that_take_it():
    """sm90_use_smem_mask_pipeline goes to a consumer's forward as payload_via_smem when set, and
    not at all to a plugin consumer written before the keyword existed."""
    from flexattn.explicit import _payload_hint

    class Old:
        def forward(self, plan, q, k, v, *, softmax_scale, return_max_logit, out=None, lse=None): ...

    class New:
        def forward(self, plan, q, k, v, *, softmax_scale, return_max_logit, out=None, lse=None,
                    payload_via_smem=None): ...  # fmt: skip

    assert _payload_hint(Old, False) == {} and _payload_hint(New, None) == {}
    assert _payload_hint(New, False) == {"payload_via_smem": False}
