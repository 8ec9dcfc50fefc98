"""``create_mask_plan``: validate, resolve the consumer's views, plan."""

from __future__ import annotations

import logging

import torch

from maskplan_core import (
    InputTypeError,
    MaskPlan,
    PlanGeometry,
    UnsupportedCallError,
    UnsupportedConfigError,
    ViewConfig,
    ViewRequest,
    validate_plan_inputs,
)
from maskplan_core.consumer import capturing
from maskplan_core.untraced import untraced
from maskplan_core.validation import require_optional_bool

from .autocast import autocast_dtypes
from .registry import arch_family, consumer_for

log = logging.getLogger("flexattn")


#: resolve_views' answers by problem (a refused request is not kept: it raises every time), keyed by
#: plain values: a ViewRequest model costs a few microseconds to make, on every plan build and call
_RESOLVED: dict[tuple, tuple] = {}
_RESOLVED_MAX = 256


def resolve_views(g: PlanGeometry, family: str, cc, pack_gqa, build_backward: bool):
    """``(consumer, forward view, backward view or None)`` for this problem; memoised, since every
    plan build of a training step asks the same question."""
    cc = None if cc is None else tuple(cc)
    problem = (g.head_dim_qk, g.head_dim_v, g.num_heads_q, g.num_heads_kv, g.mask_heads, g.dtype, g.varlen)
    key = (family, cc, pack_gqa, build_backward, *problem)
    views = _RESOLVED.get(key)
    if views is None:
        consumer = consumer_for(family)
        request = ViewRequest.for_geometry(g, "forward", family, compute_capability=cc, pack_gqa=pack_gqa)
        fwd: ViewConfig = consumer.resolve(request)
        backward = request.model_copy(update={"direction": "backward"})
        bwd = consumer.resolve(backward) if build_backward else None
        if len(_RESOLVED) >= _RESOLVED_MAX:
            _RESOLVED.clear()
        views = _RESOLVED[key] = (consumer, fwd, bwd)
    return views


def create_mask_plan(
    mask_func: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    pack_gqa: bool | None = None,
    build_backward: bool | None = None,
    target: str | None = None,
) -> MaskPlan:
    """Build a reusable plan for an interval mask.

    ``mask_func``: contiguous int32 ``[Hmask, nfunc, total_q]`` (Hmask 1 or Hq, nfunc odd); row
    ``i``'s visible keys are ``[0, F0) U [F1, F2) U ...`` in sample-local positions (build them
    with :mod:`flexattn.masks`). Q/K/V are BSHD (fixed) or THD with all four varlen arguments
    together (``cu_seqlens_q`` / ``cu_seqlens_k``: int32 ``[B + 1]`` prefixes of the samples'
    lengths; ``max_seqlen_q`` / ``max_seqlen_k``: the longest sample's; the plan keeps a copy of
    the boundaries, and a call with a batch of other boundaries but the same token total runs with
    these, unnoticed: build one plan per batch);
    only their shapes, dtype and device matter, not their values (inside a ``torch.autocast``
    region, the dtype they reach attention in: the region's, as in :func:`flex_attn_func`).
    ``build_backward=None`` builds the backward (K2Q) view when autograd is enabled and any of
    q/k/v requires grad.
    ``target`` plans for another architecture family's consumer (e.g. ``"sm90"`` on a laptop, to
    inspect its block map); the default is the consumer of the tensors' device.
    ``pack_gqa=True`` (GQA with a shared mask, Hmask=1) packs the ``Hq / Hkv`` q heads of each kv
    head into one forward tile, so every K/V block is loaded once per kv head; the plan's forward
    Q block is then ``128 / (Hq / Hkv)`` positions. The backward view is the same either way (its
    kernel visits all q heads of a kv head in one CTA). ``None`` lets the consumer choose: SM90
    packs a shared mask's group of 4, 8, 16, 32 or 64 q heads per kv head, where it measured the
    forward faster on the whole (5-8% on documents; on random masks within 3% either way, but 10%
    faster at 32 and 32% at 64; elsewhere from 3% slower to 7% faster); the reference consumer (CPU)
    and SM100 do not pack. ``False``
    never packs.

    On a GPU the build runs on the current CUDA stream, and its one host read (8 sizes, 9 with a
    backward view) waits for that stream only: building the next batch's plan on a side stream
    (``with torch.cuda.stream(side):``, its device inputs, the endpoints and any ``cu_seqlens``, made
    there or ordered before it) overlaps the step running on the main stream. Attention calls on
    any stream wait for the plan's build on the GPU, without a host wait; a CUDA graph capture
    waits for nothing outside it, so a plan used in one must be complete first
    (``torch.cuda.synchronize()`` or ``wait_stream``), as must one whose tensors are read
    otherwise on another stream (``to_dense()``, ``stats()``, a library's own kernels).
    """
    return _PLAN(
        mask_func, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, pack_gqa,
        build_backward, target,
    )  # fmt: skip


def _plan(
    mask_func, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, pack_gqa, build_backward,
    target,
) -> MaskPlan:  # fmt: skip
    # before validation, which may already sync a stream (a new shape's sample prefixes)
    for t in (q, mask_func):
        if isinstance(t, torch.Tensor) and t.device.type == "cuda" and capturing(t.device):
            raise UnsupportedCallError(
                "create_mask_plan cannot run inside a CUDA graph capture: a build reads its sizes back "
                "to the host, which a capture forbids; build the plan before the capture and pass it in "
                "(a captured step may use it, and every replay reads the same plan)"
            )
    require_optional_bool("pack_gqa", pack_gqa)
    require_optional_bool("build_backward", build_backward)
    # the device first: on one no consumer runs on (meta, mps) the input rules of another would mislead
    family, cc = arch_family(q.device) if isinstance(q, torch.Tensor) else (None, None)
    geometry = validate_plan_inputs(
        mask_func,
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        dtypes=autocast_dtypes(q, k, v),
    )
    if build_backward is None:
        build_backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if target is not None:
        if not isinstance(target, str):
            raise InputTypeError(
                f"target must be an architecture family name (str) or None, got {type(target).__name__}"
            )
        family, cc = target, None
    try:
        consumer, fwd, bwd = resolve_views(geometry, family, cc, pack_gqa, build_backward)
    except UnsupportedConfigError as e:
        if target is None or e.argument != "dtype":
            raise
        raise UnsupportedConfigError(  # a laptop's fp32 / fp64 prototype asking for a GPU's block map
            f"{e} (to plan for {target}'s tiles from these tensors, pass them in a dtype it takes, "
            "e.g. q.bfloat16(): only their shapes, dtype and device are read)",
            e.argument,
        ) from e
    if log.isEnabledFor(logging.DEBUG):
        log.debug("planning %s for %s (backward=%s)", geometry.describe(), consumer.name, build_backward)
    return consumer.build_plan(mask_func, geometry, fwd, bwd)


#: :func:`create_mask_plan`'s build, run eagerly where torch.compile traces the call
_PLAN = untraced(_plan, "create_mask_plan")
