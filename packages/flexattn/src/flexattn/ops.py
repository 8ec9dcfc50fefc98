"""``flexattn::fwd`` / ``flexattn::bwd``: ``flex_attn_func`` as ``torch.library`` custom ops.

``flex_attn_func`` checks its arguments in Python (type checks, the plan's dtype, device and
rank, the backward-view check: metadata work, which Dynamo traces into guards), then calls
``torch.ops.flexattn.fwd`` with the caller's q, k, v, which checks their sizes against the plan
on each call's values (traced, each comparison would be a guard pinning q's sizes to a plan
Dynamo holds as a constant, a module attribute or a global: a graph per shape); autograd
reaches ``torch.ops.flexattn.bwd`` through ``register_autograd``. Both ops have fake
implementations (output shapes and dtypes from the input shapes alone), so
``torch.compile(fullgraph=True)`` traces a model that calls ``flex_attn_func`` without a graph
break, and AOTAutograd traces its backward.

How the MaskPlan crosses the op boundary
----------------------------------------
A custom op takes tensors and plain values only. We pass the plan as its handle: every
:class:`~maskplan_core.MaskPlan` gets a process-unique :attr:`~maskplan_core.MaskPlan.handle` when
it is built, and :func:`~maskplan_core.plan.plan_for_handle` maps it back through a
``WeakValueDictionary``, so the registry never keeps a plan (and its device tensors) alive. We
chose this over passing the plan's tensors explicitly because

* the op schema stays small and fixed; the number and meaning of a view's tensors is the
  consumer's business (a fixed-length forward view has 8 of them, 9 varlen, a backward view one
  more, a third-party consumer may add others), and the static half of a plan (geometry,
  signatures, payload layout) cannot be a tensor anyway, so a handle would be needed in any case;
* a plan is immutable, so the handle names fixed content; nothing the op reads can change
  between tracing and running.

The handle travels as :attr:`~maskplan_core.MaskPlan.handle_tensor`, a 0-d int64 CPU tensor made
with the plan. Dynamo takes a tensor reached from the call's arguments, a module attribute or a
global as a graph input (guarded on dtype and shape only), so one graph serves every plan of a
geometry however the model holds it. As an int it was a constant: a plan passed as an argument
recompiled once (then automatic-dynamic made it symbolic), one held by a module or a global
recompiled for every plan, until Dynamo's recompile limit sent the frame back to eager. Only the
fake implementation sees the traced value, and it never reads it.

The cost: the plan must stay alive while a compiled graph that captured its handle runs (a
collected plan raises a clear error naming the handle), and a graph cannot be exported to
another process with a plan inside it (handles start at a random offset per process, so there
the handle names no plan and the call is refused, rather than run with another plan's mask). A
training forward pins its plan to the storage of the LSE it saves for the backward
(:func:`_pin_plan`), so the backward never outlives the plan, even one built inside the compiled
region.

Eager calls go around the ops
-----------------------------
torch wraps every custom op's implementation in a shim that disables Dynamo, and the shim's
first call imports ``torch._dynamo`` (1.5 s with warm bytecode caches, 5 s without, measured on
the first forward of a process). An eager program never needs Dynamo, so :func:`attention` calls
the same implementations through :class:`EagerAttention` (a ``torch.autograd.Function``) when
it runs plain tensors outside any compile or tracing mode; compiled graphs (and fake-tensor
tracing) contain ``flexattn::fwd`` / ``flexattn::bwd``.
Both routes share the implementation, the saved tensors and the gradient function below.

The consumer's signature check (resolve the consumer for q's device, compare the plan's
signatures field by field) runs in the real implementation, memoised per (plan, device, mode);
the exception passes through the dispatcher unchanged, so eager and compiled calls raise the
same ``PlanSignatureMismatch`` (raised from a fake implementation, Dynamo would wrap it in its
``TorchRuntimeError``, which is why the fake implementation checks nothing).
"""

from __future__ import annotations

import math
from weakref import WeakKeyDictionary, ref

import torch
from torch._ops import _len_torch_dispatch_stack_pre_dispatch

from maskplan_core import (
    InputValueError,
    MaskPlan,
    PlanBindingError,
    PlanSignatureMismatch,
    UnsupportedCallError,
)
from maskplan_core.consumer import has_thd_view, on_device, thd
from maskplan_core.plan import plan_for_handle

from .planning import resolve_views
from .registry import arch_family

#: plan -> {(device, training): consumer}: a plan's signatures are checked once per device and mode
#: (plans are immutable), which keeps the per-call host cost of a reused plan small.
_CHECKED: WeakKeyDictionary[MaskPlan, dict] = WeakKeyDictionary()


def checked_consumer(plan: MaskPlan, device: torch.device, training: bool):
    """The consumer that runs ``plan`` on ``device``, after its signature check (memoised)."""
    key = (device, training)
    known = _CHECKED.setdefault(plan, {})
    if key not in known:
        known[key] = _check_signatures(plan, device, training)
    return known[key]


def _check_signatures(plan: MaskPlan, device: torch.device, training: bool):
    """Resolve the consumer for ``device`` and compare every needed view's signature field by field."""
    family, cc = arch_family(device)
    g = plan.geometry
    pack = plan.view("forward").signature.topology.pack_gqa
    consumer, fwd, bwd = resolve_views(g, family, cc, pack, training)
    for expected in (fwd, bwd):
        if expected is None:
            continue
        view = plan.view(expected.signature.direction)
        diffs = expected.signature.diff(view.signature)
        if diffs and plan.consumer != consumer.name:  # another consumer's: name the two, not the fields
            raise PlanSignatureMismatch(
                f"the plan was built for {plan.consumer}, but {consumer.name} runs these {device.type} "
                f"tensors: rebuild it with create_mask_plan from tensors on this device, without target= "
                f"(a plan made with target= shows another consumer's block map and layout, and runs "
                f"only on its hardware); {len(diffs)} {view.role} signature fields differ "
                f"({', '.join(d.field for d in diffs)})",
                diffs,
            )
        if diffs:
            listing = "; ".join(str(d) for d in diffs)
            raise PlanSignatureMismatch(
                f"the plan's {view.role} view was built for {plan.consumer} but {consumer.name} "
                f"runs these tensors ({listing}); rebuild the plan with create_mask_plan on this device",
                diffs,
            )
    return consumer


def backward_determinism(deterministic: bool) -> bool:
    """Whether a backward adds dQ in one fixed order (the plan's ``dq_write_order`` or its reverse,
    as the consumer's kernel walks): asked for, or
    ``torch.use_deterministic_algorithms(True)`` in force when the backward runs (torch's rule: its
    ops take their deterministic algorithm then, whatever the call says)."""
    return deterministic or torch.are_deterministic_algorithms_enabled()


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """LSE / max-logit dtype: fp32, fp64 for fp64 inputs (the CPU reference computes in fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- implementations ------------------------------------------------------------------------------
def _forward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: torch.Tensor,
    scale: float,
    training: bool,
    deterministic: bool,
    want_max: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The caller's THD or ``[B, S, H, D]`` q, k, v in: ``out [total_q, Hq, Dv]``,
    ``lse [Hq, total_q]``, ``max_logit [Hq]`` (``[0]`` unless
    ``want_max``). ``plan`` is a :attr:`MaskPlan.handle_tensor`; ``training`` selects the signature check
    (forward and backward views); ``deterministic`` is only kept for the backward. A training call
    pins the plan to its LSE (:func:`_pin_plan`): the op's compiled callers hold only the handle.
    The plan binding is checked here, on the values: a compiled ``flex_attn_func`` leaves q, k and
    v's sizes to this check (``MaskPlan.check_binding``), so that it raises eager's error and traces
    no guard pinning them to a plan Dynamo holds as a constant (a module attribute, a global)."""
    mask_plan = plan_for_handle(int(plan))
    mask_plan.check_binding(q, k, v)
    return _run_forward(q, k, v, mask_plan, scale, training, want_max, pin=training)


def _run_forward(q, k, v, mask_plan, scale, training, want_max, *, pin: bool):
    """:func:`_forward_impl` after its binding check, on the caller's q, k, v (both routes save
    those), pinning the plan to the LSE only where ``pin`` (eager calls keep their plan in their
    autograd context instead, so an LSE the caller keeps does not keep it)."""
    q, k, v = map(qkv_operand, (q, k, v))
    consumer = checked_consumer(mask_plan, q.device, training)
    with on_device(q.device):
        res = consumer.forward(mask_plan, q, k, v, softmax_scale=scale, return_max_logit=want_max)
    max_logit = res.max_logit
    if max_logit is None:
        max_logit = q.new_empty(0, dtype=stat_dtype(q.dtype))
    lse = res.lse.contiguous()
    if pin:
        _pin_plan(lse, mask_plan)
    return res.out.contiguous(), lse, max_logit.contiguous()


def _pin_plan(tensor: torch.Tensor, mask_plan: MaskPlan) -> None:
    """Keep ``mask_plan`` alive as long as the storage of ``tensor``: a compiled training forward's
    LSE, or the handle an eager or in-mode one saves (:func:`_eager_setup`, :func:`attention`).

    A compiled graph saves the op's LSE for its backward but carries only the plan's handle, so a
    plan built inside the compiled region (a local of the eager frame between two graphs) would be
    collected before a compiled backward needs it. The saved tensor need not be ``lse`` itself
    (AOTAutograd may save another tensor object on the same memory), but it shares its storage,
    whose Python object torch keeps, with its attributes, for as long as the storage lives: the
    plan then lives as long as a backward (or the caller's LSE) can still use it. A saved-tensor
    hook that copies the LSE (``torch.autograd.graph.save_on_cpu``) frees that storage, and with it
    the pin: then the caller keeps the plan (the error of ``plan_for_handle`` says so)."""
    tensor.untyped_storage()._flexattn_plan = mask_plan


def _backward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    plan: torch.Tensor,
    scale: float,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` shaped like ``(q, k, v)`` (THD, or ``[B, S, H, D]``); ``dlse`` ``[Hq, total_q]``
    or None."""
    mask_plan = plan_for_handle(int(plan))
    consumer = checked_consumer(mask_plan, q.device, True)
    operands = map(qkv_operand, (q, k, v))
    with on_device(q.device):
        dq, dk, dv = consumer.backward(
            mask_plan, *operands, out, lse, dout, dlse, softmax_scale=scale,
            deterministic=backward_determinism(deterministic),
        )  # fmt: skip
    return tuple(g.contiguous().view(x.shape) for g, x in ((dq, q), (dk, k), (dv, v)))


# -- the ops --------------------------------------------------------------------------------------
# cudagraph_unsafe: the launch arguments come from the plan the handle tensor names, read on the
# host at each call; a CUDA graph replay (torch.compile's "reduce-overhead") would rerun the
# recorded plan's launches whatever plan the input names, so inductor runs the ops between its
# CUDA graphs instead (graph partition)
_TAGS = (torch.Tag.cudagraph_unsafe,)
fwd = torch.library.custom_op("flexattn::fwd", _forward_impl, mutates_args=(), tags=_TAGS)
bwd = torch.library.custom_op("flexattn::bwd", _backward_impl, mutates_args=(), tags=_TAGS)


@fwd.register_fake
def _fwd_fake(q, k, v, plan, scale, training, deterministic, want_max):
    # Shapes only. Never read ``plan`` here: using its value would specialise the graph on one
    # plan, and an error raised while tracing reaches the user as Dynamo's TorchRuntimeError.
    # q: THD, or [B, S, H, D]. The product of its sizes, not numel(), which Dynamo
    # takes as a fixed number: a varlen batch of another token total was a graph of its own
    total_q, num_heads_q = math.prod(q.shape[:-2]), q.shape[-2]
    stat = stat_dtype(q.dtype)
    out = q.new_empty((total_q, num_heads_q, v.shape[-1]))
    lse = q.new_empty((num_heads_q, total_q), dtype=stat)
    max_logit = q.new_empty((num_heads_q if want_max else 0,), dtype=stat)
    return out, lse, max_logit


@bwd.register_fake
def _bwd_fake(q, k, v, out, lse, dout, dlse, plan, scale, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# -- autograd -------------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output):
    q, k, v, plan, scale, _training, deterministic, _want_max = inputs
    out, lse, _max_logit = output
    ctx.save_for_backward(q, k, v, out, lse, plan)
    ctx.scale, ctx.deterministic = scale, deterministic
    ctx.set_materialize_grads(False)  # an unused lse gives dlse=None, not a tensor of zeros


def _op_setup_context(ctx, inputs, output):
    """The op's context: :func:`_setup_context` and the plan a real handle pins (the op's route
    under a dispatch mode: selective checkpointing), for :func:`_checked_handle`; none while
    tracing. (The eager route keeps its plan itself: :func:`_eager_setup`.)"""
    _setup_context(ctx, inputs, output)
    ctx.mask_plan = _pinned_plan(inputs[3])
    ctx.own_handle = ref(inputs[3])


def _gradients(ctx, saved, dout, dlse, backward_fn):
    """The op's gradients from ``saved``, its saved tensors (read once: non-reentrant checkpointing
    allows one unpack), the plan's handle last."""
    q, k, v, out, lse, plan = saved
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = backward_fn(q, k, v, out, lse, dout.contiguous(), dlse, plan, ctx.scale, ctx.deterministic)
    return dq, dk, dv, None, None, None, None, None


def _backward(ctx, dout, dlse, _dmax):
    saved = ctx.saved_tensors
    grads = _gradients(ctx, _checked_handle(ctx, saved), dout, dlse, torch.ops.flexattn.bwd)
    _release_plan(ctx, saved[-1])
    return grads


fwd.register_autograd(_backward, setup_context=_op_setup_context)


def _not_twice_differentiable(ctx, *grads):
    raise UnsupportedCallError("flexattn::bwd is not differentiable (no double backward through attention)")


bwd.register_autograd(_not_twice_differentiable, setup_context=lambda ctx, inputs, output: None)


# -- eager route ----------------------------------------------------------------------------------
def _no_forward_mode(ctx, *tangents):
    raise UnsupportedCallError(
        "flex_attn_func has no forward-mode derivative (torch.func.jvp, torch.autograd.forward_ad): "
        "use reverse mode (backward, torch.func.vjp / grad)"
    )


def _eager_setup(ctx, inputs, output, pin: bool = False):
    """The eager context: the op's saved tensors, and the plan. ``pin`` (a training call, under no
    torch.func transform, which would wrap the copy) saves a copy of the plan's handle tensor
    pinning the plan (a few us): under non-reentrant checkpointing the recomputed forward's copy
    is what the backward gets, and it keeps the plan that forward ran with (one the checkpointed
    function built and dropped too) alive for :func:`_checked_handle`."""
    q, k, v, mask_plan, *options = inputs
    handle = mask_plan.handle_tensor
    if pin:
        handle = handle.clone()
        _pin_plan(handle, mask_plan)
    _setup_context(ctx, (q, k, v, handle, *options), output)
    ctx.mask_plan, ctx.own_handle = mask_plan, ref(handle)
    ctx.mark_non_differentiable(output[2])


def _vmapped(g) -> bool:
    """Whether a vmap batch sits in ``g`` at any depth of its functorch wrappers (``vmap(grad(f))``
    hands the backward a grad wrapper around a batched tensor), the autograd engine's own batching
    (``is_grads_batched``) included."""
    functorch = torch._C._functorch
    while g is not None:
        if functorch.is_batchedtensor(g) or functorch.is_legacy_batchedtensor(g):
            return True
        g = functorch.get_unwrapped(g) if functorch.is_functorch_wrapped_tensor(g) else None
    return False


def _eager_backward(ctx, dout, dlse, _dmax):
    if _vmapped(dout) or _vmapped(dlse):
        raise UnsupportedCallError(
            "flex_attn_func's backward takes one gradient at a time, not a vmapped batch of them "
            "(is_grads_batched=True, jacobian(vectorize=True), torch.func.jacrev): loop over the "
            "gradients, or batch through the B dimension of q/k/v"
        )
    saved = ctx.saved_tensors
    with torch.no_grad():
        grads = _gradients(ctx, _checked_handle(ctx, saved), dout, dlse, _backward_impl)
    _release_plan(ctx, saved[-1])
    if torch.is_grad_enabled():  # create_graph=True
        grads = (*FirstOrderGradients.apply(*saved[:3], *grads[:3]), *grads[3:])
    return grads


def _pinned_plan(handle) -> MaskPlan | None:
    """The plan pinned to a real handle tensor (:func:`_pin_plan`), else None (a fake or traced one,
    the plan's own handle tensor, a copy a saved-tensor hook made, or a torch.func wrapper: a plan
    built inside ``torch.func.grad`` has one as its handle tensor, and a wrapper has no storage)."""
    if type(handle) is not torch.Tensor or torch._C._functorch.is_functorch_wrapped_tensor(handle):
        return None
    return getattr(handle.untyped_storage(), "_flexattn_plan", None)


def _live_plan(handle: int) -> MaskPlan | None:
    try:
        return plan_for_handle(handle)
    except InputValueError:
        return None


def _checked_handle(ctx, saved: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``saved`` (the op's saved tensors, the plan's handle last) with the handle of the plan the
    backward runs on (:func:`_backward_plan`): the forward's, ``ctx.mask_plan``, where the saved
    handle names it or a plan of the same mask; as saved while tracing (no ``ctx.mask_plan``).
    Both routes save the same tensors, so a checkpointed forward and its recomputation may take
    different routes (a plain checkpoint nested in a selective one, ``FlopCounterMode`` around the
    backward alone)."""
    forward_plan, handle = _forward_plan(ctx), saved[-1]
    if forward_plan is None:
        return saved
    recomputed = _pinned_plan(handle)
    if recomputed is None:  # the plan's own handle tensor, or a copy a saved-tensor hook made
        recomputed = _live_plan(int(handle))
    return (*saved[:-1], _backward_plan(forward_plan, recomputed).handle_tensor)


def _forward_plan(ctx) -> MaskPlan | None:
    plan = ctx.mask_plan
    return plan() if isinstance(plan, ref) else plan


def _release_plan(ctx, handle: torch.Tensor) -> None:
    """After a backward, the context holds its plan weakly where the saved ``handle`` is the
    forward's own and pins it: a retained graph's next backward still finds the plan through that
    pin, and a graph whose saved tensors the backward freed no longer keeps the plan alive, though
    the node lives on with a kept loss or LSE. Otherwise the context keeps its strong reference,
    which a retained graph's next backward may need: a handle a saved-tensor hook copied pins
    nothing, and non-reentrant checkpointing recomputes the saved tensors for every backward, the
    next one perhaps with another plan, which :func:`_checked_handle` compares with the forward's."""
    plan = _forward_plan(ctx)
    if plan is not None and ctx.own_handle() is handle and _pinned_plan(handle) is plan:
        ctx.mask_plan = ref(plan)


def _backward_plan(forward_plan: MaskPlan, recomputed: MaskPlan | None) -> MaskPlan:
    """The plan a backward runs on, from its forward's plan (the autograd context's) and the plan of
    the forward whose saved tensors it got. Non-reentrant checkpointing (selective too) replaces
    the saved tensors with a recomputed forward's, made with the plan the checkpointed function read
    or built then (the saved handle pins it): the forward's own; one rebuilt from the same inputs
    (the same mask: :meth:`MaskPlan.same_mask_as`, one device read); or a plan of another mask,
    where what the function reads changed between forward and backward (the next micro-batch's
    plan or mask in a module attribute): no plan gives the forward's gradients from that O and LSE
    (selective checkpointing that saved them runs the recomputation's plan with the forward's O and
    LSE: other gradients again), refused. So is a recomputation's plan that is gone (``None``: a
    saved-tensor hook copied the handle that kept it), which cannot be compared."""
    if recomputed is forward_plan or (recomputed is not None and recomputed.same_mask_as(forward_plan)):
        return forward_plan
    if recomputed is None:
        raise PlanBindingError(
            "the MaskPlan of the forward that activation checkpointing recomputed for this backward is "
            "gone (a saved-tensor hook copied the handle tensor that kept it alive), so it cannot be "
            "compared with the forward's: build the plan outside the checkpointed function and pass it "
            "in (or keep a reference to a plan the function reads until the backward has run)"
        )
    raise PlanBindingError(
        "the forward that activation checkpointing (torch.utils.checkpoint, use_reentrant=False, "
        "selective or not) recomputed for this backward ran with another MaskPlan (another mask or "
        "other settings) than the forward did: what the checkpointed function reads changed in "
        "between (a module attribute replaced by the next micro-batch's forward?), or a selective "
        "checkpointing policy saved ops that building the plan inside the function uses, so its "
        "saved tensors are another plan's. Pass the plan (or its mask) to the checkpointed function "
        "as an argument, build it outside, or replace it only after the backward"
    )


class EagerAttention(torch.autograd.Function):
    """``flexattn::fwd`` with its autograd, for eager calls (module docstring). It holds the plan
    object in its context until the backward has run (:func:`_release_plan`), so a plan built per
    step and never stored (``flex_attn_func(..., mask_plan=create_mask_plan(...))``) lives as long
    as the graph needs it, whatever saved-tensor hooks do with the LSE (the op's own pin,
    :func:`_pin_plan`, goes with the LSE's storage, which a hook such as ``save_on_cpu`` replaces).

    The classic ``forward(ctx, ...)`` form: ``Function.apply`` binds the arguments of a function
    with a ``setup_context`` through ``inspect.signature`` on every call (30-40 us of host time per
    call, measured on the CPU; a training step's attention is host-bound at a few ms of GPU work,
    benchmarks/RESULTS.md, session 18). torch.func transforms need that form:
    :class:`EagerAttentionTransforms` serves them with the same pieces."""

    @staticmethod
    def forward(ctx, q, k, v, mask_plan, scale, training, deterministic, want_max):
        output = _run_forward(q, k, v, mask_plan, scale, training, want_max, pin=False)
        options = (scale, training, deterministic, want_max)
        _eager_setup(ctx, (q, k, v, mask_plan, *options), output, pin=training)  # no copy for inference
        return output

    backward = staticmethod(_eager_backward)
    jvp = staticmethod(_no_forward_mode)


class EagerAttentionTransforms(torch.autograd.Function):
    """:class:`EagerAttention` in the ``setup_context`` form, for calls under torch.func transforms
    (``torch.func.grad`` works; ``torch.vmap`` is refused with the alternative)."""

    @staticmethod
    def forward(q, k, v, mask_plan, scale, training, deterministic, want_max):
        return _run_forward(q, k, v, mask_plan, scale, training, want_max, pin=False)

    setup_context = staticmethod(_eager_setup)
    backward = staticmethod(_eager_backward)
    jvp = staticmethod(_no_forward_mode)

    @staticmethod
    def vmap(info, in_dims, *args):
        raise UnsupportedCallError(
            "flex_attn_func does not support torch.vmap: batch through the B dimension of q/k/v "
            "(or THD with cu_seqlens) and one plan"
        )


class FirstOrderGradients(torch.autograd.Function):
    """dq/dk/dv returned under ``create_graph=True`` (eager): differentiating them raises, as the
    compiled route's ``flexattn::bwd`` does. Returned as constants instead, a double backward
    (e.g. a gradient penalty) would silently drop every term that depends on them."""

    @staticmethod
    def forward(q, k, v, dq, dk, dv):
        return dq.clone(), dk.clone(), dv.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        _not_twice_differentiable(ctx)


def attention(
    q, k, v, mask_plan: MaskPlan, scale: float, training: bool, deterministic: bool, want_max: bool
):
    """``(out, lse, max_logit)`` THD of the caller's q, k, v: :class:`EagerAttention` for plain
    tensors in plain eager mode (after ``flex_attn_func``'s binding check); the custom op (which
    carries ``mask_plan.handle_tensor`` and checks the binding itself) under ``torch.compile``, fake
    tensors, tensor subclasses or any ``TorchDispatchMode`` (``make_fx``, export), which need its
    fake implementation. The op refuses forward mode as the eager route does (``torch.func.jvp``
    traced by Dynamo, ``linearize``'s trace): torch runs a custom op whose inputs require no grad,
    as forward-mode duals don't, without its autograd, so the tangents would come back zero. Dynamo
    shows a jvp as a forward-mode level under a functorch transform; a mode shows the duals
    themselves. A ``dual_level`` open around other code is no jvp."""
    plain = all(type(t) is torch.Tensor for t in (q, k, v))
    compiling = torch.compiler.is_compiling()
    in_mode = not compiling and _under_dispatch_mode()  # (Dynamo cannot trace the stacks' lengths)
    if plain and not compiling and not in_mode:
        eager = EagerAttentionTransforms if torch._C._are_functorch_transforms_active() else EagerAttention
        return eager.apply(q, k, v, mask_plan, scale, training, deterministic, want_max)
    if torch.autograd.forward_ad._current_level >= 0 and (
        torch._C._are_functorch_transforms_active() if compiling else _has_tangent(q, k, v)
    ):
        _no_forward_mode(None)  # the op would give zero tangents: forward-mode duals need no grad
    handle = mask_plan.handle_tensor
    if in_mode:
        # made inside the mode: a fake tensor under FakeTensorMode (which refuses real inputs), a
        # constant of the traced graph under make_fx; on the host whatever the default device. A
        # real one (selective checkpointing's modes) pins its plan: non-reentrant checkpointing
        # hands the backward the recomputation's handle, whose plan must live for _checked_handle.
        # A recomputation whose policy saved this op gets the forward's handle back, pinned and
        # naming the forward's plan, which the op then runs: its pin stays
        handle = torch.tensor(mask_plan.handle, dtype=torch.int64, device="cpu")
        if type(handle) is torch.Tensor and _pinned_plan(handle) is None:
            _pin_plan(handle, mask_plan)
    return fwd(q, k, v, handle, scale, training, deterministic, want_max)


def _has_tangent(*tensors: torch.Tensor) -> bool:
    return any(torch.autograd.forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def qkv_operand(t: torch.Tensor) -> torch.Tensor:
    """q, k or v as consumers take it (``maskplan_core.consumer.Consumer``): the ``[total, H, D]``
    view of a BSHD / THD tensor, or a BSHD tensor that has none (a ``[B, H, S, D]`` tensor transposed
    at B > 1) as it is, for the consumer to read in place or copy. The op takes the caller's tensors
    (its binding check needs their B and S) and consumers view them so themselves."""
    return thd(t) if has_thd_view(t) else t


def _under_dispatch_mode() -> bool:
    """Whether this thread runs under a ``TorchDispatchMode`` (``make_fx``, ``FakeTensorMode``,
    export's pre-dispatch modes), from the mode stacks. torch's ``is_in_torch_dispatch_mode()``
    reads a process-wide flag instead, which a mode on any thread sets for every thread, and which
    modes entered on two threads at once leave set (each exit restores the flag the other saw):
    eager calls then took the custom op, whose route refuses ``torch.func`` transforms."""
    return torch._C._len_torch_dispatch_stack() > 0 or _len_torch_dispatch_stack_pre_dispatch() > 0
