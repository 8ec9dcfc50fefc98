"""Head dims without a kernel of their own, run on the kernel of the next head dims up.

:func:`flexattn_sm90.heuristics.kernel_head_dims` picks the kernel's head dims; a plan for such a
problem carries that kernel's views (tile and payload layout) over the problem's own geometry.
The consumer runs the kernel on a copy of the view whose geometry has the kernel's head dims
(:func:`kernel_view`) and on zero-padded tensors (:func:`pad_head_dim`)::

    q, k  [T, H, Dqk] -> [T, H, Dqk' ]   zero columns: Q K^T, the softmax, LSE and D = rowsum(dO O)
    v     [T, H, Dv ] -> [T, H, Dv'  ]   unchanged; O's and dV's extra columns are 0, dQ's / dK's
    out, dout likewise                   extra columns are 0 too; all are cut off

The padded tensors are copies made per call (the padded dims' time plus a copy of each input).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from maskplan_core.plan import PlanView
from maskplan_core.plan_ready import share_ready

from .heuristics import kernel_head_dims

_KERNEL_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def kernel_view(view: PlanView) -> PlanView:
    """``view`` where its head dims have a kernel, else (once per view) a copy with the kernel's
    head dims in its geometry, reading the same tensors."""
    g = view.geometry
    dims = kernel_head_dims(g.head_dim_qk, g.head_dim_v)
    if dims == (g.head_dim_qk, g.head_dim_v):
        return view
    padded = _KERNEL_VIEWS.get(view)
    if padded is None:
        geometry = dataclasses.replace(g, head_dim_qk=dims[0], head_dim_v=dims[1])
        padded = PlanView(view.role, view.signature, view.layout, geometry, view.tensors)
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
