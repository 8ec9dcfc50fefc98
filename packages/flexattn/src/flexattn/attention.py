"""``flex_attn_func``: check the arguments and the plan binding, then run attention through
:func:`flexattn.ops.attention` (the ``flexattn::fwd`` custom op under ``torch.compile``).

It checks the plan's signatures against the consumer of q's device and dispatches to it;
autograd reaches the consumer's backward. Everything here before the op reads
shapes, dtypes and Python values only, so ``torch.compile`` traces it without a graph break.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import sys
from collections.abc import Callable
from typing import Literal, ParamSpec, TypeVar, overload

import torch

from maskplan_core import (
    InputTypeError,
    InputValueError,
    MaskPlan,
    MissingBackwardViewError,
    ScaleTypeError,
    UnsupportedCallError,
)
from maskplan_core.validation import endpoints_of, mask_kind

from . import ops
from .autocast import autocast_inputs

P = ParamSpec("P")
R = TypeVar("R")


def _check_options(softmax_scale, deterministic, return_lse, return_max_logit) -> None:
    for name, value in (
        ("deterministic", deterministic),
        ("return_lse", return_lse),
        ("return_max_logit", return_max_logit),
    ):
        if type(value) is not bool:
            raise InputTypeError(f"{name} must be a bool, got {type(value).__name__}")
    check_scale(softmax_scale, "return_max_logit" if return_max_logit else None)


def check_scale(softmax_scale, max_logit_arg: str | None = None) -> None:
    """``softmax_scale`` is None or a finite real number (a float, an int, a numpy scalar),
    non-negative where the call returns the max logit (``max_logit_arg`` names the argument that
    asks for it)."""
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            hint = (
                " (a tensor's value would need a host read per call: pass softmax_scale.item(), or a "
                "Python float kept beside it)"
                if isinstance(softmax_scale, torch.Tensor)
                else ""
            )
            raise ScaleTypeError(
                f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}{hint}"
            )
        if not isinstance(softmax_scale, (int, float)):  # a numpy scalar, a fraction: checked as a float
            try:
                softmax_scale = float(softmax_scale)
            except OverflowError:
                softmax_scale = math.inf
        # comparisons, not math.isfinite: torch.compile may trace a float argument as a SymFloat
        finite = softmax_scale == softmax_scale and abs(softmax_scale) <= sys.float_info.max
        if not finite:
            shown = repr(softmax_scale) if isinstance(softmax_scale, float) else "an int past the float range"
            raise InputValueError(f"softmax_scale must be finite, got {shown}")
        if max_logit_arg is not None and softmax_scale < 0:
            raise InputValueError(f"{max_logit_arg} needs a non-negative softmax_scale, got {softmax_scale}")


def resolve_scale(softmax_scale, g) -> float:
    """A checked ``softmax_scale``, or ``1 / sqrt(head_dim_qk)`` of the plan's geometry ``g``."""
    return 1.0 / math.sqrt(g.head_dim_qk) if softmax_scale is None else float(softmax_scale)


def caller_lse(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The kernels' ``[Hq, total_q]`` LSE in the layout of the caller's ``q`` (bound to the plan):
    for a fixed-length ``[B, Sq, Hq, D]`` q ``[B, Hq, Sq]`` (a view), for a varlen THD q itself.
    q's sizes, not the geometry's: compiled, q's are symbols where a plan Dynamo holds as a
    constant has numbers, which a view by them would pin."""
    return lse if q.dim() == 3 else lse.view(q.shape[2], q.shape[0], q.shape[1]).transpose(0, 1)


def require_plan(mask_plan: object, q: object) -> None:
    """Raise ``InputTypeError`` unless ``mask_plan`` is a :class:`MaskPlan`, saying how to make one
    from a mask passed in its place (endpoints, or a form :func:`endpoints_of` converts), or for
    ``q``'s layout where none was passed."""
    if not isinstance(mask_plan, MaskPlan):
        convert = endpoints_of(mask_plan)
        if convert is None and isinstance(mask_plan, torch.Tensor):
            convert = "mask_func"  # endpoints already
        hint = f"; build one with create_mask_plan({convert}, q, k, v)" if convert else ""
        if mask_plan is None:
            hint = f"; for attention without a mask pass mask_plan={_full_plan_hint(q)}"
        raise InputTypeError(
            f"mask_plan must be a MaskPlan from create_mask_plan, got {mask_kind(mask_plan)}{hint}"
        )


def _full_plan_hint(q: object) -> str:
    """The plan of no mask (torch's block_mask=None, SDPA without attn_mask) for ``q``'s layout:
    varlen THD (rank 3) takes its samples' boundaries, BSHD its batch and lengths."""
    if isinstance(q, torch.Tensor) and q.dim() == 3:
        return (
            "create_mask_plan(masks.full(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k), q, k, v, "
            "cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)"
        )
    return "create_mask_plan(masks.full(Sq, Sk, batch=B, device=q.device), q, k, v)"


#: keywords of torch's flex_attention and scaled_dot_product_attention a ported call may still
#: pass, and what to do instead (packages/flexattn/README.md, "Coming from torch FlexAttention")
_PEER_KEYWORDS = {
    "query": "pass q, k, v positionally",
    "key": "pass q, k, v positionally",
    "value": "pass q, k, v positionally",
    "block_mask": "pass mask_plan=create_mask_plan(masks.from_block_mask(block_mask), q, k, v)",
    "scale": "pass softmax_scale=",
    "enable_gqa": "drop it: Hq a multiple of Hkv is GQA",
    "return_aux": "pass return_lse=True (and return_max_logit=True: one maximum per head)",
    "score_mod": "flexattn masks only; a score_mod that only masks is a mask_mod (masks.from_mask_mod)",
    "kernel_options": "drop it: the plan fixes the kernels' tiles",
    "attn_mask": "pass mask_plan=create_mask_plan(masks.from_dense(attn_mask), q, k, v)",
    "is_causal": (
        "pass mask_plan=create_mask_plan(masks.causal(Sq, Sk, batch=B, align='top_left', device=q.device), "
        "q, k, v) (SDPA's is_causal aligns the diagonal top-left; masks.causal's default, FlashAttention's "
        "bottom-right, differs where Sq != Sk)"
    ),
    "dropout_p": (
        "flexattn has no attention dropout, and no call computes dropout_p > 0: train without it "
        "(dropout_p=0 changes the training) or keep torch's or FlashAttention's attention where it is "
        "needed"
    ),
}
#: keywords of FlashAttention's calls (flash_attn_func, flash_attn_varlen_func), where a varlen
#: batch's lengths and the mask go with every call; here the plan carries both
_SAMPLES_IN_PLAN = (
    "the plan carries the samples: pass cu_seqlens_q / cu_seqlens_k / max_seqlen_q / max_seqlen_k "
    "to create_mask_plan (with the mask and q, k, v in THD), then mask_plan= here; a plan is bound to "
    "the boundaries it was built with, and a batch of other boundaries but the same token total would "
    "run with the old ones: build one plan per batch"
)
_FLASH_KEYWORDS = {
    "cu_seqlens_q": _SAMPLES_IN_PLAN,
    "cu_seqlens_k": _SAMPLES_IN_PLAN,
    "max_seqlen_q": _SAMPLES_IN_PLAN,
    "max_seqlen_k": _SAMPLES_IN_PLAN,
    "seqused_k": "the mask carries it: pass seqused_k= to the builder (masks.causal / full / sliding_window)",
    "softcap": "flexattn has no logit softcapping: keep FlashAttention for those layers",
    "alibi_slopes": "flexattn has no ALiBi (a bias, not a mask): keep FlashAttention for those layers",
    "block_table": "flexattn has no paged KV cache: pass contiguous k, v (THD) and a plan of their samples",
    "leftpad_k": "flexattn has no left-padded k: pack the samples (THD, a plan of their cu_seqlens_k)",
    "return_attn_probs": "pass return_lse=True (the LSE; no probabilities are returned)",
    "return_softmax_lse": "pass return_lse=True",
    "stream": "drop it: flexattn runs on torch's current stream (with torch.cuda.stream(s): ...)",
}
_PEER_KEYWORDS.update(_FLASH_KEYWORDS)
#: FlashAttention's mask keywords, read together (_flash_mask_fix)
_FLASH_MASK_KEYWORDS = ("causal", "window_size")
#: the peers' defaults of those keywords, which ask for nothing: refused all the same, with "drop it"
_PEER_DEFAULTS = {
    "block_mask": None, "score_mod": None, "attn_mask": None, "kernel_options": None, "return_aux": None,
    "scale": None, "is_causal": False, "enable_gqa": False, "dropout_p": 0.0, "stream": None,
    "seqused_k": None, "softcap": 0.0, "alibi_slopes": None, "block_table": None,
    "return_attn_probs": False, "return_softmax_lse": False, "leftpad_k": None,
}  # fmt: skip
#: the keywords whose default is torch's "no mask": without a mask_plan, the plan of no mask
_MASK_KEYWORDS = ("block_mask", "attn_mask", "is_causal")


def _asks_nothing(value: object, default: object) -> bool:
    if isinstance(default, float):
        return type(value) in (int, float) and value == default
    return value is default


def _peer(name: str) -> str:
    """Whose keyword ``name`` is."""
    if name == "dropout_p":
        return "torch's and FlashAttention's"
    return "FlashAttention's" if name in _FLASH_KEYWORDS else "torch's"


def _flash_mask_fix(given: dict, has_plan: bool, q: object) -> str:
    """FlashAttention's ``causal`` and ``window_size=(left, right)`` (``given``: those of the call,
    with its ``seqused_k``) read together as its kernels read them (a causal call's ``right`` is 0
    whatever it says; -1: no limit; the diagonal bottom-right, at the used keys), as the plan of
    one mask in ``q``'s layout (THD: its samples' boundaries)."""
    causal, window_size = given.get("causal", False), given.get("window_size", (-1, -1))
    if not (type(causal) is bool or (type(causal) is int and causal in (0, 1))):
        return f"causal= takes True or False, got {causal!r}"
    try:
        if len(window_size) != 2:  # type: ignore[arg-type]
            raise TypeError
        left, given_right = (operator.index(x) for x in window_size)  # type: ignore[attr-defined]
    except TypeError:
        return f"window_size= takes (left, right), two ints (-1: no limit), got {window_size!r}"
    right = 0 if causal else given_right
    used = "seqused_k" in given
    if left < 0 and right < 0 and not used:
        if has_plan:
            said = " and ".join(f"{name}={value!r}" for name, value in given.items())
            one = len(given) == 1
            return f"drop {'it' if one else 'them'}: {said} {'is' if one else 'are'} FlashAttention's no mask"
        return f"FlashAttention's no mask: pass mask_plan={_full_plan_hint(q)}"
    varlen = isinstance(q, torch.Tensor) and q.dim() == 3
    args = ["cu_seqlens_q=cu_q, cu_seqlens_k=cu_k" if varlen else "Sq, Sk, batch=B"]
    mask = "full" if left < 0 and right < 0 else "causal"
    if left >= 0 or right > 0:  # a window; -1 (no limit) is a side that reaches every key
        mask = "sliding_window"
        unlimited = ("max_k", "max_q") if varlen else ("Sk", "Sq")  # bottom-right: i + Sk - Sq
        args += [f"window_left={left if left >= 0 else unlimited[0]}"]
        args += [f"window_right={right if right >= 0 else unlimited[1]}"] if right != 0 else []
    if used:
        args += ["seqused_k=seqused_k"]
    if not varlen:
        args += ["device=q.device"]
    tail = ", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k" if varlen else ""
    why = "aligned bottom-right, as FlashAttention's"
    if causal and given_right > 0:
        why += "; FlashAttention takes window_size[1] as 0 where causal=True"
    return f"pass mask_plan=create_mask_plan(masks.{mask}({', '.join(args)}), q, k, v{tail}) ({why})"


def _peer_fix(name: str, value: object, has_plan: bool, q: object) -> str:
    """What to do instead of a peer's keyword ``name=value`` (``q``: the call's)."""
    if name not in _PEER_DEFAULTS or not _asks_nothing(value, _PEER_DEFAULTS[name]):
        return _PEER_KEYWORDS[name]
    if not has_plan and name in _MASK_KEYWORDS:
        return f"torch's no mask: pass mask_plan={_full_plan_hint(q)}"
    return f"drop it: {value!r} is {_peer(name)} default, which asks for nothing"


def _positional_fix(args: tuple, has_plan: bool) -> str:
    """What to do instead of the positional arguments past q, k, v of a call in torch's form
    (flex_attention's score_mod, block_mask, scale, ...; SDPA's attn_mask, dropout_p, is_causal,
    scale): the first that asks for something (not None, False or 0), by what it is."""
    defaults = (None, False, 0.0)
    given = [(i, a) for i, a in enumerate(args[3:], 4) if not any(_asks_nothing(a, d) for d in defaults)]
    if not given and has_plan:
        return "drop them: torch's defaults ask for nothing"
    if not given:
        return f"pass mask_plan={_full_plan_hint(args[0])}"
    i, arg = given[0]
    kind = mask_kind(arg)
    if isinstance(arg, MaskPlan):
        fix = "pass it as mask_plan="
    elif kind == "BlockMask":
        fix = f"torch's block_mask? {_PEER_KEYWORDS['block_mask']}"
    elif endpoints_of(arg) is not None and callable(arg):
        fix = f"torch's score_mod? {_PEER_KEYWORDS['score_mod']}"
    elif isinstance(arg, torch.Tensor) and arg.dtype in (torch.int32, torch.int64) and arg.dim() == 1:
        fix = f"FlashAttention's cu_seqlens_q? {_SAMPLES_IN_PLAN}"
    elif isinstance(arg, torch.Tensor) and arg.dtype == torch.int32:
        fix = "interval endpoints? pass mask_plan=create_mask_plan(mask_func, q, k, v)"
    elif isinstance(arg, torch.Tensor):
        dense = "attn_mask" if arg.dtype == torch.bool else "attn_mask == 0"  # an additive mask's zeros
        fix = f"SDPA's attn_mask? pass mask_plan=create_mask_plan(masks.from_dense({dense}), q, k, v)"
    elif arg is True:
        fix = f"SDPA's is_causal? {_PEER_KEYWORDS['is_causal']}"
    elif isinstance(arg, numbers.Real):
        fix = "torch's scale? pass softmax_scale= (SDPA's dropout_p: flexattn has no dropout)"
    else:
        fix = "pass it by its keyword"
    return f"argument {i} is {kind}: {fix}"


def _peer_keywords(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn``, refusing torch's keywords and positional arguments of its attention functions with
    what to do instead (a wrapper, so that ``fn``'s signature stays cuDNN's; Python's own error
    names the keyword or the argument count only)."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        has_plan = "mask_plan" in kwargs
        q = args[0] if args else kwargs.get("q")
        if len(args) > 3:
            raise InputTypeError(
                f"{fn.__name__}() takes q, k, v positionally and the rest by keyword (mask_plan=, "
                f"softmax_scale=, ...); {_positional_fix(args, has_plan)}"
            )
        mask_keywords = {name: kwargs[name] for name in _FLASH_MASK_KEYWORDS if name in kwargs}
        if mask_keywords and "seqused_k" in kwargs:  # the diagonal aligns to the used keys
            mask_keywords["seqused_k"] = kwargs["seqused_k"]
        if mask_keywords:
            fix = _flash_mask_fix(mask_keywords, has_plan, q)
            names = " and ".join(f"{name}=" for name in mask_keywords)
            plural = "s" if len(mask_keywords) > 1 else ""
            raise InputTypeError(f"{fn.__name__}() got {names}, FlashAttention's keyword{plural}: {fix}")
        for name, value in kwargs.items():
            if name in _PEER_KEYWORDS:
                fix = _peer_fix(name, value, has_plan, q)
                raise InputTypeError(f"{fn.__name__}() got {name}=, {_peer(name)} keyword: {fix}")
        if not has_plan:
            raise InputTypeError(
                f"{fn.__name__}() needs mask_plan=, a MaskPlan from create_mask_plan(mask_func, q, k, v); "
                f"for attention without a mask, mask_plan={_full_plan_hint(q)}"
            )
        return fn(*args, **kwargs)

    return call


# What a type checker sees: ``out`` alone, or the tuple the flags ask for (at run time, the
# implementation below).
@overload
def flex_attn_func(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask_plan: MaskPlan,
    softmax_scale: float | None = ..., deterministic: bool = ...,
    return_lse: Literal[False] = ..., return_max_logit: Literal[False] = ...,
) -> torch.Tensor: ...  # fmt: skip
@overload
def flex_attn_func(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask_plan: MaskPlan,
    softmax_scale: float | None = ..., deterministic: bool = ...,
    return_lse: Literal[True], return_max_logit: Literal[False] = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip
@overload
def flex_attn_func(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask_plan: MaskPlan,
    softmax_scale: float | None = ..., deterministic: bool = ...,
    return_lse: Literal[False] = ..., return_max_logit: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip
@overload
def flex_attn_func(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask_plan: MaskPlan,
    softmax_scale: float | None = ..., deterministic: bool = ...,
    return_lse: Literal[True], return_max_logit: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...  # fmt: skip
@overload
def flex_attn_func(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask_plan: MaskPlan,
    softmax_scale: float | None = ..., deterministic: bool = ...,
    return_lse: bool = ..., return_max_logit: bool = ...,
) -> torch.Tensor | tuple[torch.Tensor, ...]: ...  # fmt: skip


@_peer_keywords
def flex_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask_plan: MaskPlan,
    softmax_scale: float | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    return_max_logit: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Interval-mask attention over fixed BSHD or varlen THD tensors, reusing ``mask_plan``.

    The plan holds its batch's sample boundaries and mask; the call takes no boundaries, so a
    plan of another varlen batch with the same token total runs with that batch's boundaries,
    unnoticed (``torch.equal(plan.geometry.cu_seqlens_q, cu_seqlens_q)`` tells): one plan per batch.

    ``softmax_scale`` multiplies the logits (None: ``1 / sqrt(head_dim_qk)``). ``deterministic``
    makes the backward's dQ bit-identical from run to run (one fixed order of its contributions, the
    plan's ``dq_write_order`` or its reverse; the forward is deterministic either way), as does
    ``torch.use_deterministic_algorithms(True)`` in force when the backward runs. ``return_lse`` /
    ``return_max_logit`` add outputs:

    Returns ``out`` (``[B, Sq, Hq, Dv]`` / ``[total_q, Hq, Dv]``), then the LSE (``[B, Hq, Sq]``
    / ``[Hq, total_q]``) if ``return_lse``, then the ``[Hq]`` maximum scaled logit over visible
    elements if ``return_max_logit``, as a tuple when more than ``out`` is asked for. Both LSE
    shapes are contiguous, as cuDNN's (the fixed-length one a copy of the kernels' ``[Hq, B * Sq]``
    order, made only where the LSE is returned). LSE and max logit are fp32 (fp64 for fp64 inputs
    on the CPU reference); the max logit is a statistic without gradient (``requires_grad=False``).
    Rows with no visible key give ``out = 0`` and ``lse = -inf``. Inside a ``torch.autocast``
    region q, k, v are cast to its dtype, as SDPA's are (float64 aside), so ``out`` has that
    dtype. Differentiable once, in reverse mode: a double backward, and in eager code a vmapped
    backward (``is_grads_batched``, ``jacrev``, ``vmap(grad(...))``), forward mode (``jvp``) and
    ``torch.vmap``, raise :class:`~maskplan_core.UnsupportedCallError`, as ``torch.jit.trace`` does.

    Samples are independent, as in dense attention: a nan / inf in one sample's q, k, v or
    gradient never reaches another sample's outputs or gradients (the tiles past a sample's end
    hold the next sample's rows; the reference and the SM90 kernels zero them before use, as do
    the compile-checked SM100 kernels but their CTA-pair variants). Within a sample, a nan / inf
    in the V of a key hidden from a row still reaches that row where they share a tile (0 x nan in
    P V, as in SDPA): keep hidden keys' K and V finite (zero a KV cache's unwritten slots).
    """
    if torch.jit.is_tracing():  # the tracer records the reference's ops or crashes inside torch
        raise UnsupportedCallError(
            "flex_attn_func cannot be traced by torch.jit.trace (TorchScript): use torch.compile, or "
            "torch.export of a module that holds its plan"
        )
    require_plan(mask_plan, q)
    _check_options(softmax_scale, deterministic, return_lse, return_max_logit)
    q, k, v = autocast_inputs(q, k, v)
    mask_plan.check_binding(q, k, v, op_checks_sizes=True)  # the op checks them (ops.attention)
    g = mask_plan.geometry
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if training and not mask_plan.has_backward:
        raise MissingBackwardViewError(
            "q/k/v require grad but the plan has no backward view; rebuild it with "
            "create_mask_plan(..., build_backward=True), or call under torch.no_grad()"
        )
    scale = resolve_scale(softmax_scale, g)
    out, lse, max_logit = ops.attention(q, k, v, mask_plan, scale, training, deterministic, return_max_logit)
    if q.dim() == 4:  # by q's sizes, as caller_lse
        out = out.view(*q.shape[:3], v.shape[-1])
    max_logit = max_logit.detach()  # a statistic, not differentiable
    returned_lse = (caller_lse(lse, q).contiguous(),) if return_lse else ()
    results = (out,) + returned_lse + ((max_logit,) if return_max_logit else ())
    return results[0] if len(results) == 1 else results
