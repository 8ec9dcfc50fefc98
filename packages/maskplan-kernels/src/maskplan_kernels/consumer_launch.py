"""Host side of launching an attention kernel that consumes a plan view: the argument preparation
every consumer (SM90, SM100; forward and backward) does the same way.

Consumer kernels follow the planner kernels' convention (:mod:`maskplan_kernels._cute_args`): raw
global pointers plus int32 sizes, layouts derived in the ``@cute.jit`` host entry. What differs is
alignment: Q/K/V/O and the payload tensor are read by TMA, bulk copies or vector loads, so they
are 16-byte aligned (:data:`ALIGN`), and a placeholder pointer must carry the same assumed
alignment as the real one (it is part of the compiled signature). Here:

* pointers and dtypes: :func:`gmem_ptr`, :func:`cute_dtype`;
* the caller's tensors: :func:`check_inputs` (THD shapes against the plan geometry),
  :func:`aligned`, :func:`output`, :func:`positive_softmax_scale`;
* a forward call at once: :func:`forward_io`;
* the plan's tensors: :func:`int32_tensor`, and for a forward view :func:`fwd_view_args`, derived
  once per (view, device) through :func:`cached_per_view` (a plan is immutable; entries die with
  the view); :func:`fwd_placeholders` stands in for the forward pointers at compile time.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float16, Float32, Int32

from maskplan_core.errors import InputValueError
from maskplan_core.plan import PlanView

#: alignment (bytes) of Q/K/V/O and the payload tensor (TMA, bulk copies, 16-byte vector loads)
ALIGN = 16
#: stands in for softmax_scale = 0 (every visible score then weighs the same)
TINY_SCALE = 1e-30
_CUTE_DTYPES = {torch.bfloat16: BFloat16, torch.float16: Float16}
_DUMMY: dict[tuple, torch.Tensor] = {}


# -- pointers -------------------------------------------------------------------------------------
def gmem_ptr(dtype, address: int = 0, align: int = 4) -> cute.Pointer:
    """A global-memory pointer; ``address`` 0 makes it a compile-time placeholder of the same type."""
    return cute.runtime.make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)


def cute_dtype(dtype: torch.dtype):
    """The CuTe element type of a float16/bfloat16 torch dtype."""
    return _CUTE_DTYPES[dtype]


# -- the caller's tensors -------------------------------------------------------------------------
def check_inputs(view: PlanView, **tensors: torch.Tensor | None) -> None:
    """Raise :class:`InputValueError` unless every given tensor (``q, k, v, out, dout, lse, dlse``;
    None is skipped) is a CUDA tensor of the THD shape and dtype the view's geometry expects."""
    g = view.geometry
    q_shape = (g.total_q, g.num_heads_q, g.head_dim_qk)
    k_shape = (g.total_k, g.num_heads_kv, g.head_dim_qk)
    v_shape = (g.total_k, g.num_heads_kv, g.head_dim_v)
    o_shape = (g.total_q, g.num_heads_q, g.head_dim_v)
    stat_shape = (g.num_heads_q, g.total_q)
    expect = {
        "q": (q_shape, g.dtype),
        "k": (k_shape, g.dtype),
        "v": (v_shape, g.dtype),
        "out": (o_shape, g.dtype),
        "dout": (o_shape, g.dtype),
        "lse": (stat_shape, torch.float32),
        "dlse": (stat_shape, None),  # any floating point dtype
    }
    for name, x in tensors.items():
        if x is None:
            continue
        shape, dtype = expect[name]
        if tuple(x.shape) != shape or (dtype is not None and x.dtype != dtype) or x.device.type != "cuda":
            raise InputValueError(
                f"{name} is {tuple(x.shape)} {x.dtype} on {x.device}; the plan expects {shape} "
                f"{dtype or 'floating point'} on CUDA (THD layout)"
            )


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous (row-major THD, what the kernels' ``from_pointers`` assume) with a 16-byte
    aligned base; copies only when it is not."""
    if t.is_contiguous() and t.data_ptr() % ALIGN == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def output(t: torch.Tensor | None, name: str, shape: tuple[int, ...], dtype, device) -> torch.Tensor:
    """A new output tensor, or ``t`` checked to be one the kernel can write in place."""
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise InputValueError(
            f"{name} must be a contiguous {dtype} tensor {shape} on {device}, got {tuple(t.shape)} {t.dtype}"
        )
    if t.data_ptr() % ALIGN:
        raise InputValueError(f"{name} must be {ALIGN}-byte aligned")
    return t


def positive_softmax_scale(q: torch.Tensor, softmax_scale: float) -> tuple[torch.Tensor, float]:
    """``(q, scale)`` with ``scale > 0``: the kernels track the running max of raw scores, which
    needs a positive scale. ``s * c = (-q . k) * |c|`` for ``c < 0``, and ``c = 0`` is the limit of
    a tiny positive scale."""
    softmax_scale = float(softmax_scale)
    if softmax_scale < 0:
        q, softmax_scale = -q, -softmax_scale
    return q, max(softmax_scale, TINY_SCALE)


class ForwardIO(NamedTuple):
    """A forward call's tensors, ready for the kernel (:func:`forward_io`)."""

    q: torch.Tensor  # THD, contiguous, 16-byte aligned; negated for a negative softmax_scale
    k: torch.Tensor
    v: torch.Tensor
    softmax_scale: float  # > 0
    out: torch.Tensor  # (total_q, Hq, Dv), q's dtype
    lse: torch.Tensor  # (Hq, total_q) fp32
    max_logit: torch.Tensor | None  # (Hq,) fp32, -inf

    def pointers(self) -> tuple:
        """q, k, v, o, lse, max_logit (or None): the first arguments of a forward ``from_pointers``."""
        dt = cute_dtype(self.q.dtype)
        return (
            *(gmem_ptr(dt, x.data_ptr(), ALIGN) for x in (self.q, self.k, self.v, self.out)),
            gmem_ptr(Float32, self.lse.data_ptr()),
            None if self.max_logit is None else gmem_ptr(Float32, self.max_logit.data_ptr()),
        )


def forward_io(view: PlanView, q, k, v, *, softmax_scale: float, return_max_logit: bool, out=None, lse=None):
    """Check a forward call's THD ``q/k/v`` against the view, make them kernel-ready and allocate
    (or check) ``out``/``lse`` and the -inf initialised ``max_logit``. Returns :class:`ForwardIO`."""
    check_inputs(view, q=q, k=k, v=v)
    g, device = view.geometry, q.device
    q, k, v = aligned(q), aligned(k), aligned(v)
    q, softmax_scale = positive_softmax_scale(q, softmax_scale)
    total_q, num_heads_q = q.shape[0], q.shape[1]
    out = output(out, "out", (total_q, num_heads_q, g.head_dim_v), q.dtype, device)
    lse = output(lse, "lse", (num_heads_q, total_q), torch.float32, device)
    max_logit = torch.full((num_heads_q,), float("-inf"), device=device) if return_max_logit else None
    return ForwardIO(q, k, v, softmax_scale, out, lse, max_logit)


# -- the plan's tensors ---------------------------------------------------------------------------
def cached_per_view(fn):
    """``fn(view, *key)`` computed once per view and ``key`` (a plan is immutable); the entries
    live as long as the view. A call that raises caches nothing."""
    cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @functools.wraps(fn)
    def cached(view: PlanView, *key):
        per_view = cache.setdefault(view, {})
        if key not in per_view:
            per_view[key] = fn(view, *key)
        return per_view[key]

    return cached


def int32_tensor(t: torch.Tensor, device: torch.device, shape_if_empty: tuple[int, ...]) -> torch.Tensor:
    """A contiguous, 16-byte aligned int32 tensor; empty ones become a small dummy (never read)."""
    if t.numel() == 0:
        key = (device, shape_if_empty)
        if key not in _DUMMY:
            _DUMMY[key] = torch.zeros(shape_if_empty, dtype=torch.int32, device=device)
        return _DUMMY[key]
    t = t.to(device=device, dtype=torch.int32).contiguous()
    return t if t.data_ptr() % ALIGN == 0 else t.clone()


def plan_pointers(tensors: tuple[torch.Tensor, ...]) -> tuple[cute.Pointer, ...]:
    """Int32 pointers of plan tensors in ``from_pointers`` order, where the payload
    (``mask_block_masks``) comes 4th in every view and is 16-byte aligned (bulk copies)."""
    return tuple(gmem_ptr(Int32, x.data_ptr(), ALIGN if i == 3 else 4) for i, x in enumerate(tensors))


#: the forward view's tensors a forward kernel reads, in ``from_pointers`` order, with the shape
#: of the dummy that stands in for an empty one
FWD_PLAN_TENSORS = (
    ("mask_block_cnt", (1, 1)),
    ("mask_block_offset", (1, 1)),
    ("mask_block_idx", (4,)),
    ("mask_block_masks", (4,)),  # flattened
    ("full_block_cnt", (1, 1)),
    ("full_block_offset", (1, 1)),
    ("full_block_idx", (4,)),
    ("sequence_desc", (1, 8)),
    ("fwd_work_desc", (1, 4)),
)


def fwd_placeholders(dtype, *, with_max_logit: bool) -> list[cute.Pointer]:
    """Compile-time stand-ins for :meth:`ForwardIO.pointers` followed by :attr:`FwdViewArgs.pointers`
    (same types): the first 15 arguments of a forward ``from_pointers``."""
    return [
        *(gmem_ptr(dtype, align=ALIGN) for _ in range(4)),  # q, k, v, o
        gmem_ptr(Float32),  # lse
        gmem_ptr(Float32) if with_max_logit else None,
        *(gmem_ptr(Int32, align=ALIGN if i == 3 else 4) for i in range(len(FWD_PLAN_TENSORS))),
    ]


@dataclass(frozen=True)
class FwdViewArgs:
    """What a forward launch needs from a view, derived once per (view, device)."""

    tensors: tuple  # int32, contiguous, 16-byte aligned (kept alive for the pointers below)
    pointers: tuple  # cute pointers of the 9 plan tensors, in from_pointers order
    sizes: tuple  # Int32: total_q, total_k, Hq, Hkv, Hmask, rows, partial_nnz, full_nnz, B, tasks
    num_tasks: int
    partial_nnz: int
    full_nnz: int


@cached_per_view
def fwd_view_args(view: PlanView, device: torch.device) -> FwdViewArgs:
    """The forward view's tensors on ``device`` as kernel arguments (:data:`FWD_PLAN_TENSORS`)."""
    t, g = view.tensors, view.geometry
    flat = {"mask_block_masks": t["mask_block_masks"].reshape(-1)}
    tensors = tuple(int32_tensor(flat.get(name, t[name]), device, shape) for name, shape in FWD_PLAN_TENSORS)
    cnt, num_tasks = t["mask_block_cnt"], t["fwd_work_desc"].shape[0]
    partial_nnz, full_nnz = t["mask_block_idx"].numel(), t["full_block_idx"].numel()
    sizes = (
        g.total_q, g.total_k, g.num_heads_q, g.num_heads_kv, cnt.shape[0], cnt.shape[1],
        partial_nnz, full_nnz, t["sequence_desc"].shape[0], num_tasks,
    )  # fmt: skip
    return FwdViewArgs(
        tensors, plan_pointers(tensors), tuple(Int32(n) for n in sizes), num_tasks, partial_nnz, full_nnz
    )


__all__ = [
    "ALIGN",
    "FWD_PLAN_TENSORS",
    "TINY_SCALE",
    "ForwardIO",
    "FwdViewArgs",
    "aligned",
    "cached_per_view",
    "check_inputs",
    "cute_dtype",
    "forward_io",
    "fwd_placeholders",
    "fwd_view_args",
    "gmem_ptr",
    "int32_tensor",
    "output",
    "plan_pointers",
    "positive_softmax_scale",
]
