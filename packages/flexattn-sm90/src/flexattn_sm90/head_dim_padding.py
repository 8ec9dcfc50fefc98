"""Head dims that are not a multiple of 8, run on tensors zero-padded to one.

The kernels read q, k, v, out and dout at any head dims that are multiples of 8 (a 16-byte aligned
row, as TMA needs) up to their own (:attr:`flexattn_sm90.config.Sm90FwdConfig.io_head_dims`).
Other head dims take a copy per call: the consumer runs the kernels on a copy of the view whose
geometry has the head dims rounded up to a multiple of 8 (:func:`kernel_view`) and on tensors
zero-padded to them (:func:`pad_head_dim`)::

    q, k  [T, H, Dqk] -> [T, H, Dqk' ]   zero columns: Q K^T, the softmax, LSE and D = rowsum(dO O)
    v     [T, H, Dv ] -> [T, H, Dv'  ]   unchanged; O's and dV's extra columns are 0, dQ's / dK's
    out, dout likewise                   extra columns are 0 too; all are cut off
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from maskplan_core.plan import PlanView
from maskplan_core.plan_ready import share_ready

from .heuristics import io_head_dims

_KERNEL_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def kernel_view(view: PlanView) -> PlanView:
    """``view`` where its head dims are multiples of 8, else (once per view) a copy with them
    rounded up to one in its geometry, reading the same tensors."""
    g = view.geometry
    dims = io_head_dims(g.head_dim_qk, g.head_dim_v)
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
