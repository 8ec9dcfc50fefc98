"""Head dims a consumer has no kernel for, run on the next kernel up.

A consumer builds its kernels for a few (Dqk, Dv) pairs; any pair one of them holds runs on the one
with the fewest head-dim columns (:func:`holding_head_dims`), since zero columns change no score,
probability or output column::

    q, k  [T, H, Dqk] -> [T, H, Dqk']   zero columns: Q K^T, the softmax, LSE and D = rowsum(dO O)
    v     [T, H, Dv ] -> [T, H, Dv' ]   unchanged; O's and dV's extra columns are 0, dQ's / dK's
    out, dout likewise                  extra columns are 0 too; all are cut off

Kernels that read narrower tensors into their tiles in place (SM90: TMA fills the columns past them
with zeros, for head dims that are multiples of 8) take the caller's tensors; the rest take a copy
per call. The consumer runs its launchers on :func:`kernel_view` (the view with the head dims the
kernels take the tensors at) through :func:`run_padded_forward` / :func:`run_padded_backward`, which
pad the tensors to those head dims and cut the outputs back, into the caller's buffers where given.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import torch

from maskplan_core.consumer import AttentionOutputs
from maskplan_core.errors import UnsupportedConfigError, warn_caller
from maskplan_core.plan import PlanView
from maskplan_core.plan_ready import share_ready

_KERNEL_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def holding_head_dims(
    head_dim_qk: int, head_dim_v: int, supported: tuple[tuple[int, int], ...], owner: str
) -> tuple[int, int]:
    """The pair of ``supported`` (``owner``'s kernels) that runs ``(head_dim_qk, head_dim_v)``: the
    pair itself where it is one, else the one with the fewest head-dim columns that holds both
    (``(72, 72)`` on ``(80, 80)``, ``(64, 128)`` on ``(128, 128)``); :class:`UnsupportedConfigError`
    where none does."""
    fits = [d for d in supported if d[0] >= head_dim_qk and d[1] >= head_dim_v]
    if not fits:
        raise UnsupportedConfigError(
            f"(head_dim_qk, head_dim_v)=({head_dim_qk}, {head_dim_v}) is not supported by {owner}: "
            f"its kernels run {', '.join(map(repr, supported))} and, zero-padded, any pair "
            "that one of them holds"
        )
    return min(fits, key=lambda d: (d[0] + d[1], d))


def warn_held(owner: str, head_dims: tuple[int, int], kernel: tuple[int, int], copied_to: str | None) -> None:
    """Say that ``head_dims`` run on ``owner``'s ``kernel`` pair; ``copied_to``: what q, k, v, out
    and dout are zero-padded to in a copy per call, if they are. Shown once per pair: consumers
    resolve a request once (memoised), and Python's default filter shows a message once per place."""
    copies = "" if copied_to is None else (
        f" and with q, k, v (and out, dout) where narrower copied per call, zero-padded to {copied_to}"
    )  # fmt: skip
    warn_caller(
        f"{owner} has no kernel for (head_dim_qk, head_dim_v)={head_dims}: they run on the {kernel} "
        f"kernels, at those head dims' cost{copies}"
    )


def kernel_view(view: PlanView, head_dims_of: Callable[[int, int], tuple[int, int]]) -> PlanView:
    """``view`` where the kernels take its tensors at its own head dims, else (once per view) a
    copy whose geometry has the head dims ``head_dims_of(head_dim_qk, head_dim_v)`` (the consumer's
    rule: its kernel pair's, or SM90's multiples of 8) gives, reading the same plan tensors."""
    g = view.geometry
    head_dims = head_dims_of(g.head_dim_qk, g.head_dim_v)
    if head_dims == (g.head_dim_qk, g.head_dim_v):
        return view
    padded = _KERNEL_VIEWS.get(view)
    if padded is None or (padded.geometry.head_dim_qk, padded.geometry.head_dim_v) != head_dims:
        geometry = dataclasses.replace(g, head_dim_qk=head_dims[0], head_dim_v=head_dims[1])
        padded = dataclasses.replace(view, geometry=geometry)
        share_ready(view, padded)
        _KERNEL_VIEWS[view] = padded
    return padded


def pad_head_dim(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` (``[..., d]``) with zero columns up to ``dim``; ``t`` itself where ``d == dim``."""
    extra = dim - t.shape[-1]
    return t if extra == 0 else torch.nn.functional.pad(t, (0, extra))


def cut_head_dim(padded: torch.Tensor, dim: int, into: torch.Tensor | None) -> torch.Tensor:
    """The first ``dim`` columns of ``padded`` (all of them where it has ``dim``): written into
    ``into`` (a caller's buffer, unless the kernel wrote it: ``padded is into``) and returned, else
    as a contiguous tensor."""
    cut = padded[..., :dim] if padded.shape[-1] != dim else padded
    if into is None:
        return cut.contiguous()
    return into if cut is into else into.copy_(cut)


def run_padded_forward(
    run_forward: Callable, view: PlanView, q, k, v, *, out: torch.Tensor | None = None, **options
) -> AttentionOutputs:
    """``run_forward(view, q, k, v, out=..., **options) -> (o, lse, max_logit)`` (a consumer's
    launcher) on :func:`kernel_view` ``view``: q, k, v padded to its head dims, O cut back to v's
    (into ``out`` where given; the kernel writes ``out`` itself where v is not padded)."""
    dqk, dv = view.geometry.head_dim_qk, view.geometry.head_dim_v
    padded_v = pad_head_dim(v, dv)
    o, lse, max_logit = run_forward(
        view,
        pad_head_dim(q, dqk),
        pad_head_dim(k, dqk),
        padded_v,
        out=out if padded_v is v else None,
        **options,
    )
    return AttentionOutputs(cut_head_dim(o, v.shape[-1], out), lse, max_logit)


def run_padded_backward(
    run_backward: Callable,
    view: PlanView,
    q,
    k,
    v,
    out,
    lse,
    dout,
    dlse,
    *,
    dq=None,
    dk=None,
    dv=None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``run_backward(view, q, k, v, out, lse, dout, dlse, dq=, dk=, dv=, **options) -> (dq, dk,
    dv)`` on :func:`kernel_view` ``view``, as :func:`run_padded_forward`: the gradients cut back to
    q's, k's and v's head dims, into ``dq`` / ``dk`` / ``dv`` where given."""
    dims_qk, dims_v = view.geometry.head_dim_qk, view.geometry.head_dim_v
    padded_q, padded_k = (pad_head_dim(t, dims_qk) for t in (q, k))
    padded_v, padded_out, padded_dout = (pad_head_dim(t, dims_v) for t in (v, out, dout))
    # a caller's buffer takes the kernels' writes where its head dim is not padded
    qk_native, v_native = padded_q is q, padded_v is v
    grads = run_backward(
        view, padded_q, padded_k, padded_v, padded_out, lse, padded_dout, dlse,
        dq=dq if qk_native else None, dk=dk if qk_native else None, dv=dv if v_native else None, **options,
    )  # fmt: skip
    inputs, into = (q, k, v), (dq, dk, dv)
    return tuple(cut_head_dim(g, t.shape[-1], i) for g, t, i in zip(grads, inputs, into, strict=True))
