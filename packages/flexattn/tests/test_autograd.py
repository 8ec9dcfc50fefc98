"""Eager autograd through ``flex_attn_func`` beyond one ``backward()``: plan lifetime, ``create_graph``
(double backward refused, first-order gradients unchanged) and ``torch.func`` (CPU reference)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import flexattn
from flexattn import masks

B, S, H, D = 2, 40, 2, 8


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (B, S, H, D)
    return tuple(torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))


def plan_for(q, k, v):
    return flexattn.create_mask_plan(masks.sliding_window(S, window_left=9, batch=B), q, k, v)


class PlanAttributeLayer(torch.nn.Module):
    """A layer reading its plan from an attribute, which the next micro-batch may replace."""

    def forward(self, q, k, v):
        return flexattn.flex_attn_func(q, k, v, mask_plan=self.plan)


def test_a_plan_nobody_holds_lives_until_the_backward():
    """``flex_attn_func(..., mask_plan=create_mask_plan(...))``: the graph keeps the plan."""
    q, k, v = inputs()
    plan = plan_for(q, k, v)
    want = torch.autograd.grad(flexattn.flex_attn_func(q, k, v, mask_plan=plan).sum(), (q, k, v))
    del plan
    out = flexattn.flex_attn_func(q, k, v, mask_plan=plan_for(q, k, v))
    gc.collect()
    got = torch.autograd.grad(out.sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_layer_building_its_plan(reentrant):
    """Activation checkpointing of a layer that builds its own plan: the backward recomputes the
    layer (a new plan; non-reentrant checkpointing then hands the backward the recomputed saved
    tensors, the new plan's handle among them, which keeps it for the comparison and which it
    unpacks once only, ``create_graph=True`` included) and gives the gradients of the plain layer."""
    from torch.utils.checkpoint import checkpoint

    def layer(q, k, v):
        return flexattn.flex_attn_func(q, k, v, mask_plan=plan_for(q, k, v))

    grads = []
    for run in (layer, lambda *x: checkpoint(layer, *x, use_reentrant=reentrant)):
        q, k, v = inputs(4)
        run(q, k, v).square().sum().backward()  # reentrant checkpointing refuses autograd.grad
        grads.append([x.grad for x in (q, k, v)])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    if not reentrant:  # reentrant checkpointing refuses autograd.grad, which create_graph needs
        q, k, v = inputs(4)
        out = checkpoint(layer, q, k, v, use_reentrant=False)
        got = torch.autograd.grad(out.square().sum(), (q, k, v), create_graph=True)
        for a, b in zip(got, grads[0], strict=True):
            assert torch.equal(a, b)


def test_a_checkpointed_layer_whose_plan_changed_before_the_backward_is_refused():
    """Non-reentrant checkpointing recomputes the layer in the backward. A layer that reads its
    plan from an attribute, which the next micro-batch replaced meanwhile, recomputes O and LSE
    with that other plan, and no plan gives the forward's gradients from them: refused, saying
    why, a plan of the same block counts (the fingerprint) too; so is a layer building its plan
    from a mask attribute that changed, to one of the same block counts too. The attribute
    replaced by the same plan rebuilt gives the gradients."""
    from torch.utils.checkpoint import checkpoint

    layer = PlanAttributeLayer()
    q, k, v = inputs(5)
    layer.plan = plan_for(q, k, v)
    out = checkpoint(layer, q, k, v, use_reentrant=False)
    layer.plan = flexattn.create_mask_plan(masks.causal(S, batch=B), q, k, v)
    with pytest.raises(flexattn.PlanBindingError, match="checkpointed function reads changed"):
        out.sum().backward()
    # S = 40 is one tile: document masks of any split share block counts, signatures and shapes
    # (the fingerprint), and only the plans' tensors tell them apart
    first = layer.plan = flexattn.create_mask_plan(masks.document([[10, 30]] * B, causal=True), q, k, v)
    out = checkpoint(layer, q, k, v, use_reentrant=False)
    layer.plan = flexattn.create_mask_plan(masks.document([[20, 20]] * B, causal=True), q, k, v)
    assert layer.plan.fingerprint == first.fingerprint and not layer.plan.same_mask_as(first)
    with pytest.raises(flexattn.PlanBindingError, match="checkpointed function reads changed"):
        out.sum().backward()
    # a layer building its plan from a mask attribute that changed: the saved handle keeps the
    # rebuilt plan for the backward, whose fingerprint tells it from the forward's
    mask_layer = PlanAttributeLayer()
    mask_layer.forward = lambda q, k, v: flexattn.flex_attn_func(
        q, k, v, mask_plan=flexattn.create_mask_plan(mask_layer.mask, q, k, v)
    )
    mask_layer.mask = masks.sliding_window(S, window_left=9, batch=B)
    out = checkpoint(mask_layer, q, k, v, use_reentrant=False)
    mask_layer.mask = masks.causal(S, batch=B)
    with pytest.raises(flexattn.PlanBindingError, match="checkpointed function reads changed"):
        out.sum().backward()
    mask_layer.mask = masks.document([[10, 30]] * B, causal=True)  # the same fingerprint: the saved
    out = checkpoint(mask_layer, q, k, v, use_reentrant=False)  # handle keeps the rebuilt plan
    mask_layer.mask = masks.document([[20, 20]] * B, causal=True)  # for the comparison
    with pytest.raises(flexattn.PlanBindingError, match="checkpointed function reads changed"):
        out.sum().backward()
    want = torch.autograd.grad(flexattn.flex_attn_func(q, k, v, mask_plan=plan_for(q, k, v)).sum(), (q, k, v))
    layer.plan = plan_for(q, k, v)
    out = checkpoint(layer, q, k, v, use_reentrant=False)
    layer.plan = plan_for(q, k, v)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_retained_checkpointed_graph_whose_plan_changed_before_its_second_backward_is_refused():
    """Non-reentrant checkpointing recomputes the layer for every backward of a retained graph: the
    second, after the layer's plan attribute was replaced and the forward's plan dropped, compares
    the recomputation's plan with the forward's (the first backward does not let go of it)."""
    from torch.utils.checkpoint import checkpoint

    layer = PlanAttributeLayer()
    q, k, v = inputs(7)
    layer.plan = plan_for(q, k, v)
    out = checkpoint(layer, q, k, v, use_reentrant=False)
    torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True)
    layer.plan = flexattn.create_mask_plan(masks.causal(S, batch=B), q, k, v)
    gc.collect()
    with pytest.raises(flexattn.PlanBindingError, match="checkpointed function reads changed"):
        torch.autograd.grad(out.sum(), (q, k, v))


@pytest.mark.parametrize("policy", ["save-attention", "recompute-all", "save-handle"])
def test_selective_checkpointing_keeps_the_forwards_plan(policy):
    """Selective activation checkpointing (``context_fn``: torch's dispatch modes, so the call takes
    the ``flexattn::fwd`` op, which a policy can save): a layer building its plan from its
    arguments gives the plain layer's gradients (saving the attention, the recomputation's plan is
    never run: its handle pins it for the comparison); one whose plan attribute changed before the
    backward is refused, whether the recomputation reran the attention with the new plan or took
    the saved O and LSE and would have run the new plan's backward on them. A policy saving the
    handle tensor (``aten.lift_fresh``) recomputes with the forward's plan: its gradients."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    saved_op = {
        "save-attention": torch.ops.flexattn.fwd.default,
        "save-handle": torch.ops.aten.lift_fresh.default,
        "recompute-all": None,
    }[policy]

    def choose(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is saved_op else CheckpointPolicy.PREFER_RECOMPUTE

    def selective(fn, *args):
        context = functools.partial(create_selective_checkpoint_contexts, choose)
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context)

    def layer(q, k, v):
        return flexattn.flex_attn_func(q, k, v, mask_plan=plan_for(q, k, v))

    q, k, v = inputs(7)
    want = torch.autograd.grad(layer(q, k, v).square().sum(), (q, k, v))
    got = torch.autograd.grad(selective(layer, q, k, v).square().sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)

    attribute = PlanAttributeLayer()
    attribute.plan = plan_for(q, k, v)
    got = torch.autograd.grad(selective(attribute, q, k, v).square().sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    out = selective(attribute, q, k, v)
    attribute.plan = flexattn.create_mask_plan(masks.causal(S, batch=B), q, k, v)
    if policy == "save-handle":
        got = torch.autograd.grad(out.square().sum(), (q, k, v))
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        return
    with pytest.raises(flexattn.PlanBindingError, match="checkpointed function reads changed"):
        out.sum().backward()


def test_a_recomputed_plan_that_is_gone_is_refused():
    """The backward's plan choice (flexattn.ops._checked_handle) where the saved handle names a
    plan no longer alive (a copy made without the pin, which torch.utils.checkpoint keeps): it
    cannot be compared with the forward's, so it is refused, saying so; one alive of the same mask
    runs on the forward's plan."""
    from types import SimpleNamespace

    from flexattn.ops import _checked_handle

    q, k, v = inputs(6)
    plan, rebuilt = plan_for(q, k, v), plan_for(q, k, v)
    ctx = SimpleNamespace(mask_plan=plan)
    assert _checked_handle(ctx, (q, rebuilt.handle_tensor.clone()))[-1] is plan.handle_tensor
    saved = (q, rebuilt.handle_tensor.clone())
    del rebuilt
    gc.collect()
    with pytest.raises(flexattn.PlanBindingError, match="is gone"):
        _checked_handle(ctx, saved)


@pytest.mark.parametrize("nesting", ["plain-in-selective", "flop-counter-around-the-backward"])
def test_a_checkpointed_forward_and_its_recomputation_may_take_different_routes(nesting):
    """Eager calls and calls under a dispatch mode (the op's route) save the same tensors, so
    torch's checkpoint accepts a recomputation under other modes than its forward: a plain
    checkpoint nested in a selective one (the forward under the selective mode, the inner
    recomputation under none), or a ``FlopCounterMode`` around the backward alone."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = inputs(8)
    plan = plan_for(q, k, v)

    def layer(q, k, v):
        return flexattn.flex_attn_func(q, k, v, mask_plan=plan)

    want = torch.autograd.grad(layer(q, k, v).square().sum(), (q, k, v))
    if nesting == "plain-in-selective":
        policy = functools.partial(
            create_selective_checkpoint_contexts, lambda ctx, op, *a, **kw: CheckpointPolicy.PREFER_RECOMPUTE
        )
        out = checkpoint(
            lambda *qkv: checkpoint(layer, *qkv, use_reentrant=False),
            q, k, v, use_reentrant=False, context_fn=policy,
        )  # fmt: skip
        got = torch.autograd.grad(out.square().sum(), (q, k, v))
    else:
        out = checkpoint(layer, q, k, v, use_reentrant=False)
        with FlopCounterMode(display=False):
            got = torch.autograd.grad(out.square().sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_kept_lse_does_not_keep_an_eager_calls_plan():
    """An eager training call's LSE kept for logging (``lse.detach()``) holds no plan: the call's
    autograd context kept the plan until the backward, and only compiled calls pin it to the LSE's
    memory (their graphs hold the handle alone). Plans hold the payloads: one per step, kept, would
    grow without bound."""
    q, k, v = inputs(2)
    plan = plan_for(q, k, v)
    alive = weakref.ref(plan)
    out, lse = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True)
    out.sum().backward()
    kept = lse.detach()
    del plan, out, lse
    gc.collect()
    assert alive() is None and kept.shape == (B, H, S)


@pytest.mark.parametrize("kept", ["loss", "lse"])
def test_a_graph_kept_after_its_backward_does_not_keep_the_plan(kept):
    """``losses.append(loss)`` (or an LSE kept with its graph) after ``backward()``: the backward
    freed the graph's saved tensors, and the plan with them, though the attention's node lives on."""
    q, k, v = inputs(3)
    plan = plan_for(q, k, v)
    alive = weakref.ref(plan)
    out, lse = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True)
    loss = out.square().sum() + lse.sum()
    loss.backward()
    held = {"loss": loss, "lse": lse}[kept]
    del plan, out, lse, loss
    gc.collect()
    assert held.grad_fn is not None and alive() is None


@pytest.mark.parametrize("copies", [False, True], ids=["plain", "hook-copies"])
def test_a_retained_graph_backs_up_twice_on_a_plan_nobody_holds(copies):
    """``backward(retain_graph=True)`` then another backward of the same graph, the plan dropped in
    between: the second finds the plan through the saved handle's pin, or (a saved-tensor hook
    copied the handle, which pins nothing) through the context's own reference."""
    q, k, v = inputs(4)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone() if copies else t, lambda t: t):
        out = flexattn.flex_attn_func(q, k, v, mask_plan=plan_for(q, k, v))
    first = torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True)
    gc.collect()
    second = torch.autograd.grad(out.sum(), (q, k, v))
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_fixed_length_lse_is_contiguous_and_differentiable():
    """The fixed-length LSE is a contiguous ``[B, H, S]`` tensor, as cuDNN's (code written for it
    may ``.view`` it), with the values and the LSE gradient path of the varlen call on the same rows."""
    q, k, v = inputs(3)
    out, lse = flexattn.flex_attn_func(q, k, v, mask_plan=plan_for(q, k, v), return_lse=True)
    assert lse.shape == (B, H, S) and lse.is_contiguous()
    cu = torch.arange(0, B * S + 1, S, dtype=torch.int32)
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=S, max_seqlen_k=S)
    q3, k3, v3 = (t.reshape(B * S, H, D) for t in (q, k, v))
    plan3 = flexattn.create_mask_plan(
        masks.sliding_window(window_left=9, cu_seqlens_q=cu, cu_seqlens_k=cu), q3, k3, v3, **varlen
    )
    out3, lse3 = flexattn.flex_attn_func(q3, k3, v3, mask_plan=plan3, return_lse=True)
    assert torch.equal(lse.view(B, H * S), lse3.view(H, B, S).transpose(0, 1).reshape(B, H * S))
    gen = torch.Generator().manual_seed(4)
    do, dlse = (
        torch.randn(out.shape, generator=gen, dtype=out.dtype),
        torch.randn(lse.shape, generator=gen, dtype=lse.dtype),
    )
    got = torch.autograd.grad((out, lse), (q, k, v), (do, dlse))
    want = torch.autograd.grad(
        (out3, lse3), (q, k, v), (do.reshape(out3.shape), dlse.transpose(0, 1).reshape(lse3.shape))
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_create_graph_gives_the_same_gradients():
    q, k, v = inputs(1)
    plan = plan_for(q, k, v)
    want = torch.autograd.grad(flexattn.flex_attn_func(q, k, v, mask_plan=plan).sum(), (q, k, v))
    out = flexattn.flex_attn_func(q, k, v, mask_plan=plan)
    got = torch.autograd.grad(out.sum(), (q, k, v), create_graph=True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b) and a.requires_grad


def test_double_backward_raises_instead_of_dropping_terms():
    """A gradient penalty differentiates dq: refused, as in compiled graphs, never a silent
    constant (which would drop the penalty's gradient)."""
    q, k, v = inputs(2)
    plan = plan_for(q, k, v)
    (dq,) = torch.autograd.grad(flexattn.flex_attn_func(q, k, v, mask_plan=plan).sum(), q, create_graph=True)
    # the library's error, still a RuntimeError for callers that catch torch's
    with pytest.raises(flexattn.UnsupportedCallError, match="no double backward through attention") as info:
        dq.pow(2).sum().backward()
    assert isinstance(info.value, RuntimeError)


def test_torch_func_grad_matches_autograd():
    q, k, v = inputs(3)
    plan = plan_for(q, k, v)
    want = torch.autograd.grad(flexattn.flex_attn_func(q, k, v, mask_plan=plan).pow(2).sum(), q)[0]
    k0, v0 = k.detach(), v.detach()
    got = torch.func.grad(lambda x: flexattn.flex_attn_func(x, k0, v0, mask_plan=plan).pow(2).sum())(
        q.detach()
    )
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_torch_func_transforms_of_a_function_that_builds_its_plan():
    """``torch.func.grad`` / ``vjp`` of a loss that builds its plan inside: the plan's handle tensor
    is then a torch.func wrapper (no storage to read a pin from), and the gradients are the plain
    ones."""
    q, k, v = inputs(9)
    out = flexattn.flex_attn_func(q, k, v, mask_plan=plan_for(q, k, v))
    want = torch.autograd.grad(out.pow(2).sum(), q)[0]

    def loss(x):
        return flexattn.flex_attn_func(x, k.detach(), v.detach(), mask_plan=plan_for(x, k, v)).pow(2).sum()

    got = torch.func.grad(loss)(q.detach())
    _, pullback = torch.func.vjp(loss, q.detach())
    for g in (got, pullback(torch.ones((), dtype=q.dtype))[0]):
        assert torch.allclose(g, want, rtol=0, atol=1e-12)


def test_eager_calls_do_not_read_torchs_process_wide_mode_flag(monkeypatch):
    """torch's ``is_in_torch_dispatch_mode()`` is one flag for the process, set by a mode on any
    thread (and left set by two entered at once): an eager call, ``torch.func.grad`` included, keeps
    its route while it is set, since no mode is on this thread's stacks."""
    import torch.utils._python_dispatch as python_dispatch

    monkeypatch.setattr(python_dispatch, "_is_in_torch_dispatch_mode", True)
    assert python_dispatch.is_in_torch_dispatch_mode()
    test_torch_func_grad_matches_autograd()


@pytest.mark.parametrize("how", ["is_grads_batched", "jacobian-vectorize", "jacrev", "vmap-grad"])
def test_batched_gradients_are_refused_with_the_alternative(how):
    """A vmapped backward (one vector-Jacobian product per batch entry) is refused by the library,
    not left to fail inside torch's batching rules; unbatched ``jacobian`` still works."""
    q, k, v = inputs(5)
    plan = plan_for(q, k, v)

    def attend(x):
        return flexattn.flex_attn_func(x, k, v, mask_plan=plan)

    weighted_grad = torch.func.grad(lambda x, w: (attend(x) * w).sum())

    calls = {
        "is_grads_batched": lambda: torch.autograd.grad(
            attend(q), q, torch.randn(3, *q.shape, dtype=q.dtype), is_grads_batched=True
        ),
        "jacobian-vectorize": lambda: torch.autograd.functional.jacobian(attend, q, vectorize=True),
        "jacrev": lambda: torch.func.jacrev(attend)(q),
        # the cotangent batched under a grad wrapper, the attention inputs not
        "vmap-grad": lambda: torch.func.vmap(weighted_grad, in_dims=(None, 0))(
            q.detach(), torch.randn(3, *q.shape, dtype=q.dtype)
        ),
    }
    with pytest.raises(flexattn.UnsupportedCallError, match="one gradient at a time"):
        calls[how]()


def test_forward_mode_is_refused_with_the_alternative():
    q, k, v = (t.detach() for t in inputs(6))
    plan = plan_for(q, k, v)
    tangent = torch.ones_like(q)
    with pytest.raises(flexattn.UnsupportedCallError, match="no forward-mode derivative"):
        torch.func.jvp(lambda x: flexattn.flex_attn_func(x, k, v, mask_plan=plan), (q,), (tangent,))
    with pytest.raises(flexattn.UnsupportedCallError, match="no forward-mode derivative"):
        # linearize traces the jvp under make_fx (the op's route), whose tangents came back zero
        torch.func.linearize(lambda x: flexattn.flex_attn_func(x, k, v, mask_plan=plan), q)[1](tangent)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(q, torch.ones_like(q))
        with pytest.raises(flexattn.UnsupportedCallError, match="reverse mode"):
            flexattn.flex_attn_func(dual, k, v, mask_plan=plan)


def test_vmap_is_refused_with_the_alternative():
    q, k, v = (t.detach() for t in inputs(4))
    plan = plan_for(q, k, v)
    with pytest.raises(flexattn.UnsupportedCallError, match="torch.vmap"):
        torch.vmap(lambda x: flexattn.flex_attn_func(x, k, v, mask_plan=plan))(q[None])
