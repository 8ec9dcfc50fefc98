"""Host side of launching an attention kernel that consumes a plan view: the argument preparation
every consumer (SM90, SM100; forward and backward) does the same way.

Consumer kernels follow the planner kernels' convention (:mod:`maskplan_kernels._cute_args`): raw
global pointers plus int32 sizes, layouts derived in the ``@cute.jit`` host entry, TVM-FFI
launches with ``int`` addresses, ``int`` sizes and ``float`` scalars. What differs is alignment:
Q/K/V/O and the payload tensor are read by TMA, bulk copies or vector loads, so the compile-time
placeholders assume 16 bytes (``consumer_inputs.ALIGN``) and every address a launch passes is made
so (the caller's tensors: :mod:`maskplan_kernels.consumer_inputs`; :func:`int32_tensor`; fresh
allocations). Here:

* placeholder pointers and dtypes: :func:`gmem_ptr`, :func:`cute_dtype`;
* a forward call's tensors at once: :func:`forward_io`;
* the plan's tensors: :func:`int32_tensor`, and for a forward view :func:`fwd_view_args` (for a
  backward view :func:`bwd_view_args`), derived once per (view, device) through
  :func:`cached_view_args` (a plan is immutable; entries die with the view; the creating stream
  waits for the plan's build, which may have run on another stream, and any other stream for
  the creation);
  :func:`fwd_placeholders` / :func:`bwd_placeholders` stand in for the arguments at compile time;
* a backward call at once: :func:`backward_io`, then its three launches (preprocess, main,
  postprocess) on one workspace: :func:`launch_backward`;
* the three backward kernels' compile keys and compiles (uncached, or through
  :mod:`maskplan_kernels.compile_cache`): :class:`BackwardCompiler`, given the consumer's GPU arch,
  kernel classes and key prefixes.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import cutlass.cute as cute
import torch
from cutlass import Float32, Int32

from maskplan_core.consumer import KERNEL_DTYPE_NAMES, capturing, cuda_index
from maskplan_core.plan import PlanView
from maskplan_core.plan_ready import wait_ready

from . import compile_cache
from ._cute_args import torch_stream
from ._launch import persistent_ctas, sm_count
from .consumer_bwd_preprocess import BwdPreprocess
from .consumer_inputs import (
    ALIGN,
    aligned,
    check_inputs,
    fp32_softmax_scale,
    output,
    positive_softmax_scale,
    qkv_operands,
    qkv_strides,
    require_int32_offsets,
)
from .consumer_k2q import SPARSE_ROW_FILL, k2q_row_fill
from .consumer_plan import CUTE_DTYPES
from .geometry import ViewBounds
from .kv_head_split import kv_head_split, no_kv_head_split

_DUMMY: dict[tuple, torch.Tensor] = {}


# -- pointers -------------------------------------------------------------------------------------
def gmem_ptr(dtype, align: int = 4) -> cute.Pointer:
    """A compile-time placeholder of a global-memory pointer argument (element type, assumed
    alignment); a launch passes the tensor's address (``data_ptr()``) in its place."""
    return cute.runtime.make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)


def cute_dtype(dtype: torch.dtype):
    """The CuTe element type of a float16/bfloat16 torch dtype."""
    return CUTE_DTYPES[KERNEL_DTYPE_NAMES[dtype]]


# -- a forward call -------------------------------------------------------------------------------
class ForwardIO(NamedTuple):
    """A forward call's tensors, ready for the kernel (:func:`forward_io`)."""

    q: torch.Tensor  # qkv_operands; negated for a negative softmax_scale
    k: torch.Tensor
    v: torch.Tensor
    softmax_scale: float  # > 0
    out: torch.Tensor  # (total_q, Hq, Dv), q's dtype
    lse: torch.Tensor  # (Hq, total_q) fp32
    max_logit: torch.Tensor | None  # (Hq,) fp32, -inf
    per_sample: bool  # the kernel must take q, k, v rows per sample (qkv_operands)
    strides: tuple[int, ...]  # qkv_strides
    #: no query row or no key, or no task: ``out`` is 0 and ``lse`` -inf already, no kernel runs
    nothing_visible: bool = False

    def arguments(self, prep: FwdViewArgs, *, tile_counter: int | None, num_ctas: int, stream) -> tuple:
        """The arguments of a forward kernel's ``from_pointers`` (``FwdHostEntry``): these tensors,
        the view's (``prep``), the tile counter's address (None unless the kernel is persistent),
        sizes, :func:`qkv_strides`, then the scale, the grid and the stream."""
        return (
            *(x.data_ptr() for x in (self.q, self.k, self.v, self.out, self.lse)),
            None if self.max_logit is None else self.max_logit.data_ptr(),
            *prep.pointers,
            tile_counter,
            *prep.sizes,
            *self.strides,
            self.softmax_scale,
            num_ctas,
            stream,
        )


def forward_io(
    view: PlanView, q, k, v, *, softmax_scale: float, return_max_logit: bool, out=None, lse=None,
    row_granule: int | None = None,
) -> ForwardIO:  # fmt: skip
    """Check a forward call's ``q/k/v`` against the view, make them kernel-ready
    (:func:`qkv_operands`, with the consumer's ``row_granule``) and allocate (or check)
    ``out``/``lse`` and the -inf initialised ``max_logit``. Returns :class:`ForwardIO`. An empty
    problem (no query row or no key: ``nothing_visible``) gets ``out = 0`` and ``lse = -inf`` here,
    as cuDNN returns them, and its q, k, v are returned as they are."""
    softmax_scale = fp32_softmax_scale(softmax_scale)  # refused even where no kernel runs
    check_inputs(view, q=q, k=k, v=v)
    g, device = view.geometry, q.device
    require_int32_offsets(g, payload_words=view.mask_block_masks.numel())
    total_q, num_heads_q = g.total_q, g.num_heads_q
    out = output(out, "out", (total_q, num_heads_q, g.head_dim_v), q.dtype, device)
    lse = output(lse, "lse", (num_heads_q, total_q), torch.float32, device)
    max_logit = None
    if return_max_logit:  # fp32 whatever torch's default dtype: the kernels write fp32
        max_logit = torch.full((num_heads_q,), float("-inf"), dtype=torch.float32, device=device)
    if g.total_q == 0 or g.total_k == 0 or view.fwd_work_desc.shape[0] == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return ForwardIO(q, k, v, softmax_scale, out, lse, max_logit, False, (), nothing_visible=True)
    q, softmax_scale = positive_softmax_scale(q, softmax_scale)
    q, k, v, per_sample = qkv_operands(view, q, k, v, row_granule=row_granule)
    strides = qkv_strides(q, k, v, g.batch, per_sample)
    return ForwardIO(q, k, v, softmax_scale, out, lse, max_logit, per_sample, strides)


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


class _StreamEntry:
    """Device launch arguments (``value.tensors``) and the streams that may read them: the one they
    were made on, and each stream already joined to it (:func:`cached_view_args`). They are made
    from the view's tensors on the current stream once it waits for the plan's build, which may
    have run on another stream (:mod:`maskplan_core.plan_ready`). Made inside a CUDA graph capture,
    their device work (a copy, a derived descriptor) runs only when the graph replays: such values
    serve that capture and are kept for the graph (``captured``), and the first call outside a
    capture makes them again (:meth:`remake`)."""

    def __init__(self, fn, view: PlanView, device: torch.device) -> None:
        self.captured: list = []
        self.make(fn, view, device)

    def make(self, fn, view: PlanView, device: torch.device) -> None:
        creator = torch.cuda.current_stream(device)
        self.handles = {creator.cuda_stream}
        self.ready = None  # made inside a graph capture: nothing outside it may wait for that
        in_capture = capturing(device)
        if not in_capture:
            wait_ready(view, device)
        self.value = value = fn(view, device)
        if not in_capture:
            self.ready = torch.cuda.Event()
            self.ready.record(creator)
            for t in value.tensors:  # the plan's own may come from another stream's allocations
                t.record_stream(creator)

    def remake(self, fn, view: PlanView, device: torch.device) -> None:
        """Values made inside a capture, made again outside it; the graph keeps reading the old."""
        self.captured.append(self.value)
        self.make(fn, view, device)

    def join(self, handle: int, device: torch.device) -> None:
        """Order the current stream (``handle``) after the arguments' creation, and record their
        tensors on it: they are freed with the view, maybe while this stream still reads them."""
        stream = torch.cuda.current_stream(device)
        if self.ready is not None:
            stream.wait_event(self.ready)
        for t in self.value.tensors:
            t.record_stream(stream)
        self.handles.add(handle)


def cached_view_args(fn):
    """:func:`cached_per_view` for ``fn(view, device)`` returning device tensors (``.tensors``),
    made on the stream of the first call and safe on any other: a call on a stream not seen
    before makes it wait for their creation (once; later work on it stays ordered) and records
    the tensors on it. The plan's own tensors are among them where they are used as they are
    (:func:`int32_tensor`). A CUDA graph capture joins nothing: it may not depend on uncaptured
    work, which ``torch.cuda.graph`` users order before it."""
    entry = cached_per_view(lambda view, device: _StreamEntry(fn, view, device))
    on_cpu = cached_per_view(fn)  # the CPU tests of the argument layout: no streams

    @functools.wraps(fn)
    def args(view: PlanView, device: torch.device):
        if device.type != "cuda":
            return on_cpu(view, device)
        e = entry(view, device)
        handle = torch_stream(device)
        if (handle not in e.handles or e.ready is None) and not capturing(device):
            if e.ready is None:  # made inside a capture, whose device work has not run
                e.remake(fn, view, device)
            else:
                e.join(handle, device)
        return e.value

    return args


def int32_tensor(t: torch.Tensor, device: torch.device, shape_if_empty: tuple[int, ...]) -> torch.Tensor:
    """A contiguous, 16-byte aligned int32 tensor; empty ones become a small dummy (never read)."""
    if t.numel() == 0:
        key = (device, shape_if_empty)
        if key not in _DUMMY:
            _DUMMY[key] = torch.zeros(shape_if_empty, dtype=torch.int32, device=device)
        return _DUMMY[key]
    return aligned(t.to(device=device, dtype=torch.int32))


def sequence_desc_source(view: PlanView) -> torch.Tensor:
    """What a kernel's ``sequence_desc`` pointer addresses: a varlen view's retained descriptor, or
    for a fixed-length view (which retains none) an empty tensor, which :func:`int32_tensor` turns
    into the dummy the kernels, launched with ``varlen = 0``, never read (they derive the columns:
    ``consumer_plan.desc_field``)."""
    if view.geometry.varlen:
        return view.tensors["sequence_desc"]
    return torch.empty(0, dtype=torch.int32, device="cpu")


def plan_pointers(tensors: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
    """Addresses of plan tensors in ``from_pointers`` order (the payload, ``mask_block_masks``,
    comes 4th in every view; :func:`int32_tensor` made it 16-byte aligned for bulk copies)."""
    return tuple(x.data_ptr() for x in tensors)


#: the forward view's tensors a forward kernel reads, in ``from_pointers`` order, with the shape
#: of the dummy that stands in for an empty one (``sequence_desc``: :func:`sequence_desc_source`)
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


def qkv_stride_placeholders() -> list:
    """Compile-time stand-ins for :func:`qkv_strides` (nine ``Int32``)."""
    return [Int32(8) for _ in range(9)]


def fwd_placeholders(kernel, *, with_max_logit: bool) -> list:
    """Compile-time stand-ins for the arguments of a forward kernel's ``from_pointers``
    (:class:`maskplan_kernels.consumer_entry.FwdHostEntry`; same types as
    :meth:`ForwardIO.arguments` passes). ``kernel`` gives the dtype and whether it is
    ``persistent`` (a tile counter, else None)."""
    return [
        *(gmem_ptr(kernel.dtype, align=ALIGN) for _ in range(4)),  # q, k, v, o
        gmem_ptr(Float32),  # lse
        gmem_ptr(Float32) if with_max_logit else None,
        *(gmem_ptr(Int32, align=ALIGN if i == 3 else 4) for i in range(len(FWD_PLAN_TENSORS))),
        gmem_ptr(Int32) if kernel.persistent else None,  # tile counter
        *(Int32(1) for _ in range(11)),  # sizes (FwdViewArgs.sizes; the last: varlen)
        *qkv_stride_placeholders(),
        Float32(1.0), Int32(1), cute.runtime.make_fake_stream(),  # softmax_scale, num_ctas, stream
    ]  # fmt: skip


@dataclass(frozen=True)
class FwdViewArgs:
    """What a forward launch needs from a view, derived once per (view, device)."""

    tensors: tuple  # int32, contiguous, 16-byte aligned (kept alive for the pointers below)
    pointers: tuple  # addresses of the 9 plan tensors, in from_pointers order
    sizes: tuple  # total_q, total_k, Hq, Hkv, Hmask, rows, partial_nnz, full_nnz, B, tasks, varlen
    num_tasks: int
    partial_nnz: int
    full_nnz: int


@cached_view_args
def fwd_view_args(view: PlanView, device: torch.device) -> FwdViewArgs:
    """The forward view's tensors on ``device`` as kernel arguments (:data:`FWD_PLAN_TENSORS`)."""
    t, g = view.tensors, view.geometry
    sources = {
        "mask_block_masks": t["mask_block_masks"].reshape(-1),
        "sequence_desc": sequence_desc_source(view),
    }
    tensors = tuple(
        int32_tensor(sources[name] if name in sources else t[name], device, shape)
        for name, shape in FWD_PLAN_TENSORS
    )
    cnt, num_tasks = t["mask_block_cnt"], t["fwd_work_desc"].shape[0]
    partial_nnz, full_nnz = t["mask_block_idx"].numel(), t["full_block_idx"].numel()
    sizes = (
        g.total_q, g.total_k, g.num_heads_q, g.num_heads_kv, cnt.shape[0], cnt.shape[1],
        partial_nnz, full_nnz, g.batch, num_tasks, int(g.varlen),
    )  # fmt: skip
    return FwdViewArgs(tensors, plan_pointers(tensors), sizes, num_tasks, partial_nnz, full_nnz)


# -- backward -------------------------------------------------------------------------------------
def bwd_placeholders(kind: str, dtype, *, with_dlse: bool = False) -> list:
    """Compile-time stand-ins for the ``from_pointers`` arguments of backward kernel ``kind``
    (``"pre"``, ``"main"``, ``"post"``; same types as :func:`launch_backward` passes)."""
    f32, i32, stream = gmem_ptr(Float32, align=ALIGN), gmem_ptr(Int32), cute.runtime.make_fake_stream()
    if kind == "pre":
        return [
            gmem_ptr(dtype, align=ALIGN), gmem_ptr(dtype, align=ALIGN),  # out, dout
            gmem_ptr(Float32), gmem_ptr(Float32) if with_dlse else None,  # lse, dlse
            f32, f32, f32, i32, i32, i32, *(Int32(1) for _ in range(6)), stream,
        ]  # fmt: skip
    if kind == "main":
        return [
            *(gmem_ptr(dtype, align=ALIGN) for _ in range(6)),  # q, k, v, dout, dk, dv
            f32, f32, f32, i32,  # lse_log2, dsum, dq_accum, dq_semaphore
            i32, i32, i32, gmem_ptr(Int32, align=ALIGN),  # mask_block_cnt/offset/idx/masks
            i32, i32, i32, i32, i32,  # full_block_cnt/offset/idx, dq_write_order(_full)
            i32, i32, i32,  # sequence_desc, k_row_batch, q_block_begin
            *(Int32(1) for _ in range(13)),  # total_q ... varlen, max_ctas
            *qkv_stride_placeholders(), Float32(1.0), stream,
        ]  # fmt: skip
    return [
        f32, i32, gmem_ptr(dtype, align=ALIGN), i32, i32,  # dq_accum, dq_semaphore, dq, sequence_desc, qbb
        *(Int32(1) for _ in range(6)), Float32(1.0), stream,
    ]  # fmt: skip


@dataclass(frozen=True)
class BwdViewArgs:
    """What the backward launches need from a view, derived once per (view, device)."""

    tensors: tuple  # int32 device tensors, kept alive for the pointers below
    pointers: tuple  # addresses of the 12 plan tensors, in the main kernel's from_pointers order
    mask_heads: int
    k_rows: int
    partial_nnz: int
    full_nnz: int
    batch: int
    n_qblk: int  # padded Q blocks of all samples, a host bound (workspace rows / tile_m)
    max_q_blocks: int  # Q blocks of the longest sample, a host bound (grid of pre/postprocess)
    varlen: int  # 1: the kernels read sequence_desc; 0: they derive it
    longest_row: int | None = None  # the view's (PlanView.longest_row), where its planner recorded it

    @property
    def row_spread(self) -> float:
        """The longest K2Q row against the mean row (entries over K rows): about 1 where every K
        block reaches as many Q blocks (sliding windows, dense rows), 2 on causal masks, more where
        documents differ in length; 1.0 where the planner recorded no longest row, and with
        per-head masks (Hmask > 1), where an item walks the rows of all its kv head's q heads,
        whose sum the longest row does not bound."""
        entries = self.partial_nnz + self.full_nnz
        if self.longest_row is None or entries == 0 or self.mask_heads > 1:
            return 1.0
        return self.longest_row * self.k_rows / entries

    @property
    def sparse_rows(self) -> bool:
        """Whether the view's K2Q rows are sparse (``consumer_k2q.k2q_row_fill`` below
        ``SPARSE_ROW_FILL``), from sizes alone, as the kernels' ``view_row_fill`` reckons it."""
        entries, k_rows = self.partial_nnz + self.full_nnz, self.mask_heads * self.k_rows
        fill = k2q_row_fill(entries, k_rows, self.n_qblk / self.batch)
        return fill < SPARSE_ROW_FILL


@cached_view_args
def bwd_view_args(view: PlanView, device: torch.device) -> BwdViewArgs:
    """The backward view's tensors on ``device`` as kernel arguments
    (:class:`maskplan_kernels.consumer_plan.BwdPlanTensors` order), plus the sample of every K plan
    row and the first padded Q block of every sample."""
    t, g = view.tensors, view.geometry
    cnt = t["mask_block_cnt"]
    desc = view.sequence_desc().to(device=device, dtype=torch.int64)
    batch = desc.shape[0]
    # the sample of every K plan row; the first global (padded) Q block of every sample
    k_row_batch = torch.repeat_interleave(
        torch.arange(batch, device=device), desc[:, 5], output_size=cnt.shape[1]
    )
    q_blocks = desc[:, 6]
    q_block_begin = torch.cumsum(q_blocks, 0) - q_blocks
    # host bounds (no device read per new plan): exact for fixed length; padding blocks past a
    # sample's own are workspace nobody reads (the pre/postprocess exit past q_len, the main kernel
    # indexes from the exact q_block_begin)
    bounds = ViewBounds.of(g, *view.block_size)
    tensors = (
        int32_tensor(cnt, device, (1, 1)),
        int32_tensor(t["mask_block_offset"], device, (1, 1)),
        int32_tensor(t["mask_block_idx"], device, (4,)),
        int32_tensor(t["mask_block_masks"].reshape(-1), device, (4,)),
        int32_tensor(t["full_block_cnt"], device, (1, 1)),
        int32_tensor(t["full_block_offset"], device, (1, 1)),
        int32_tensor(t["full_block_idx"], device, (4,)),
        int32_tensor(t["dq_write_order"], device, (4,)),
        int32_tensor(t["dq_write_order_full"], device, (4,)),
        int32_tensor(sequence_desc_source(view), device, (1, 8)),
        int32_tensor(k_row_batch, device, (4,)),
        int32_tensor(q_block_begin, device, (4,)),
    )
    return BwdViewArgs(
        tensors=tensors,
        pointers=plan_pointers(tensors),
        mask_heads=cnt.shape[0],
        k_rows=cnt.shape[1],
        partial_nnz=t["mask_block_idx"].numel(),
        full_nnz=t["full_block_idx"].numel(),
        batch=batch,
        n_qblk=bounds.q_rows,
        max_q_blocks=bounds.max_q_blocks,
        varlen=int(view.geometry.varlen),
        longest_row=view.longest_row,
    )


@cached_view_args
def mirrored_view_args(view: PlanView, device: torch.device) -> BwdViewArgs:
    """:func:`bwd_view_args` with the mirrored order's dQ ranks in place of ``dq_write_order`` /
    ``dq_write_order_full``: an entry's rank among the K blocks reaching its Q block counted from
    the highest, ``writers - 1 - rank`` (``writers``: the Q block's entries in the view, partial and
    full). A kernel that takes them launches its K rows descending and walks them ascending
    (``consumer_k2q.walk_row``), so the writers of a Q block still come in rank order, and every
    run adds them in one order: the plan's reversed. Made on the device without a host read."""
    prep = bwd_view_args(view, device)
    q_block_begin = prep.tensors[11].to(torch.int64)
    keys = []
    for kind in ("partial", "full"):  # (mask head, global Q block) of every entry
        e = view.entries(kind)
        block = q_block_begin[e.batch.to(device)] + e.q_block.to(device)
        keys.append(e.head.to(device) * prep.n_qblk + block)
    every = torch.cat(keys)
    writers = torch.zeros(prep.mask_heads * prep.n_qblk, dtype=torch.int64, device=device)
    writers.index_add_(0, every, torch.ones_like(every))
    ranks = tuple(
        int32_tensor(writers[key] - 1 - view.tensors[name].to(device=device, dtype=torch.int64), device, (4,))
        for key, name in zip(keys, ("dq_write_order", "dq_write_order_full"), strict=True)
    )
    tensors = (*prep.tensors[:7], *ranks, *prep.tensors[9:])
    return dataclasses.replace(prep, tensors=tensors, pointers=plan_pointers(tensors))


#: alignment (bytes) of each part of the backward's workspace (cp.reduce.async.bulk needs 16)
WORKSPACE_ALIGN = 256


class BackwardIO(NamedTuple):
    """All of a backward call's tensors, checked and ready for :func:`launch_backward`."""

    view: PlanView
    prep: BwdViewArgs
    q: torch.Tensor  # q, k, v: qkv_operands; out, dout: 16-byte aligned, contiguous
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor  # fp32, contiguous
    dout: torch.Tensor
    dlse: torch.Tensor | None  # fp32, contiguous
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    per_sample: bool = False  # the main kernel must take q, k, v rows per sample (qkv_operands)
    strides: tuple[int, ...] = ()  # qkv_strides

    @property
    def grads(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.dq, self.dk, self.dv

    @property
    def nothing_visible(self) -> bool:
        """No key is visible anywhere (no K2Q entry, as with no query row or no key): every gradient
        is 0 (zeroed by :func:`backward_io`)."""
        return self.prep.partial_nnz + self.prep.full_nnz == 0


def backward_io(
    view: PlanView, q, k, v, out, lse, dout, dlse, *, accum_head_dim: int, dq=None, dk=None, dv=None,
    row_granule: int | None = None,
) -> BackwardIO:  # fmt: skip
    """Check a backward call's tensors against the view (:func:`check_inputs`, :func:`output`),
    allocate the gradients that were not given, align and convert the inputs (q, k, v:
    :func:`qkv_operands` with the consumer's ``row_granule``). ``accum_head_dim``: the kernel
    config's ``head_dim_qk``, the dQ accumulator's. When nothing is visible the gradients are
    zeroed and returned as they are (``nothing_visible``)."""
    check_inputs(view, q=q, k=k, v=v, out=out, lse=lse, dout=dout, dlse=dlse)
    g = view.geometry
    device = q.device
    dq = output(dq, "dq", (g.total_q, g.num_heads_q, g.head_dim_qk), q.dtype, device)
    dk = output(dk, "dk", (g.total_k, g.num_heads_kv, g.head_dim_qk), q.dtype, device)
    dv = output(dv, "dv", (g.total_k, g.num_heads_kv, g.head_dim_v), q.dtype, device)
    prep = bwd_view_args(view, device)
    dq_accum_rows = prep.n_qblk * view.signature.topology.tile_m
    dq_accum = (dq_accum_rows, accum_head_dim)
    require_int32_offsets(g, payload_words=view.mask_block_masks.numel(), dq_accum=dq_accum)
    io = BackwardIO(view, prep, q, k, v, out, lse, dout, dlse, dq, dk, dv)
    if io.nothing_visible:
        for x in io.grads:
            x.zero_()
        return io
    q, k, v, per_sample = qkv_operands(view, q, k, v, row_granule=row_granule)
    out, dout = aligned(out), aligned(dout)  # read by the preprocess, which takes contiguous rows
    lse = lse.to(torch.float32).contiguous()
    dlse = None if dlse is None else dlse.to(torch.float32).contiguous()
    strides = qkv_strides(q, k, v, g.batch, per_sample)
    return BackwardIO(view, prep, q, k, v, out, lse, dout, dlse, dq, dk, dv, per_sample, strides)


def launch_backward(
    compiled: dict, io: BackwardIO, config, softmax_scale: float, kv_head_split: Callable = no_kv_head_split
) -> None:
    """Allocate the workspace (fp32 LSE2 / D ``(Hq, n_qblk * tile_m)``, fp32 dQ accumulator
    ``(Hq, n_qblk * tile_m * Dqk)`` with ``config``'s ``tile_m`` and ``head_dim_qk``, int32
    turnstiles ``(Hq, n_qblk)`` and a persistent main kernel's ticket counter after them, all
    zeroed or written by the preprocess) and run ``compiled["pre"]``, ``["main"]`` and ``["post"]``
    on the current stream. The four parts are one allocation, each at
    a :data:`WORKSPACE_ALIGN` offset (the kernels take addresses; one ``torch.empty`` instead of
    four is host time saved on every call).

    ``kv_head_split(items, q_per_kv, sms, row_spread)`` (:attr:`BackwardCompiler.kv_head_split`
    where the config's kernel splits, else the default, which a kernel that does not split must
    get: it would read K / V past ``Hkv``; :attr:`BwdViewArgs.row_spread`) gives ``s = kv_split``;
    where it is above 1 the main kernel's items split each kv head's q heads into ``s`` parts,
    and each part's dK / dV goes to its own head ``hk * s + j`` of a ``(total_k, Hkv * s, D)``
    tensor in q's dtype (each part rounded to it, as FlashAttention-2's GQA backward does), summed
    into ``dk`` / ``dv`` afterwards (accumulated in fp32, in a fixed order: deterministic)::

        q heads of kv head hk:   hk*G .. hk*G + G/s - 1 | ... | hk*G + G - G/s .. hk*G + G - 1
        items (K row, head):     (r, hk*s + 0)            ...   (r, hk*s + s - 1)
    """
    g, prep, device = io.view.geometry, io.prep, io.q.device
    items, q_per_kv = prep.k_rows * g.num_heads_kv, g.num_heads_q // g.num_heads_kv
    kv_split = kv_head_split(items, q_per_kv, sm_count(cuda_index(device)), prep.row_spread)
    dkv_heads = g.num_heads_kv * kv_split
    dk, dv = io.dk, io.dv
    if kv_split > 1:
        dk, dv = (x.new_empty((g.total_k, dkv_heads, x.shape[-1])) for x in (io.dk, io.dv))
    hq, rows = g.num_heads_q, prep.n_qblk * config.tile_m
    offsets, size = [], 0
    for elements in (hq * rows, hq * rows, hq * rows * config.head_dim_qk, hq * prep.n_qblk + 1):  # 4-byte
        offsets.append(size)
        size += -(-4 * elements // WORKSPACE_ALIGN) * WORKSPACE_ALIGN
    buffer = torch.empty(size, dtype=torch.uint8, device=device)  # freed after the launches: stream-ordered
    workspace = tuple(buffer.data_ptr() + offset for offset in offsets)
    stream = torch_stream(device)
    seq_ptr, qbb_ptr = prep.pointers[9], prep.pointers[11]
    sizes = (g.total_q, hq, prep.batch, prep.n_qblk, prep.max_q_blocks, prep.varlen)
    softmax_scale = fp32_softmax_scale(softmax_scale)
    dlse = None if io.dlse is None else io.dlse.data_ptr()
    compiled["pre"](
        io.out.data_ptr(), io.dout.data_ptr(), io.lse.data_ptr(), dlse,
        *workspace, seq_ptr, qbb_ptr, *sizes, stream,
    )  # fmt: skip
    compiled["main"](
        *(x.data_ptr() for x in (io.q, io.k, io.v, io.dout, dk, dv)), *workspace, *prep.pointers,
        g.total_q, g.total_k, hq, g.num_heads_kv, dkv_heads, prep.mask_heads, prep.k_rows,
        prep.partial_nnz, prep.full_nnz, prep.batch, prep.n_qblk, prep.varlen,
        persistent_ctas(device, prep.k_rows * dkv_heads), *io.strides,
        softmax_scale, stream,
    )  # fmt: skip
    compiled["post"](*workspace[2:], io.dq.data_ptr(), seq_ptr, qbb_ptr, *sizes, softmax_scale, stream)
    if kv_split > 1:
        for parts, grad in ((dk, io.dk), (dv, io.dv)):
            torch.sum(parts.view(g.total_k, g.num_heads_kv, kv_split, -1), dim=2, out=grad)


# -- backward compile -----------------------------------------------------------------------------
def kernel_dims(config) -> tuple:
    """The head dims and dtype of a consumer config, as compile-key fields."""
    return (("head_dim_qk", config.head_dim_qk), ("head_dim_v", config.head_dim_v), ("dtype", config.dtype))


@dataclass(frozen=True)
class BackwardCompiler:
    """One consumer's three backward kernels (``"pre"``, ``"main"``, ``"post"``): their compile keys,
    the kernels traced against :func:`bwd_placeholders`, and their compile, uncached or through the
    project's compile cache (:mod:`maskplan_kernels.compile_cache`). The preprocess is the shared
    :class:`maskplan_kernels.consumer_bwd_preprocess.BwdPreprocess`; the consumer gives the rest.

    ``config`` is the consumer's backward config (``head_dim_qk``, ``head_dim_v``, ``dtype``,
    ``tile_m`` and whatever its kernels read). GQA ratio, varlen-ness and all sizes are runtime
    values: no key holds them.

    ``stores_first_dq``: the consumer's main kernel stores each Q block's first dQ contribution
    (rank 0 of ``dq_write_order``) rather than adding it in deterministic mode, and in atomic mode
    on sparse K2Q rows (:attr:`BwdViewArgs.sparse_rows`). There the preprocess leaves the fp32
    accumulator unzeroed (half of its memory traffic) and the postprocess writes dQ = 0 for the
    blocks whose turnstile count is 0 (no K block visited them). Atomic mode's other contributions
    then wait for the first: on dense rows that cost more than the zeroing saves (SM90, session 49:
    causal -1.7%, random-5 -0.9%; sliding-1024 +5.7%, document +5.5% at D = 128).

    ``mirrors_sparse_rows(config)``: in deterministic mode on sparse K2Q rows the config's main
    kernel takes the mirrored order (``main_kernel(config, ..., mirrored=True)``: K rows launched
    descending, walks ascending, :func:`mirrored_view_args`' ranks; the consumer says where it
    pays: ``consumer_k2q.walk_row``).
    """

    gpu_arch: str  # e.g. "sm_90a", passed as --gpu-arch
    source_packages: tuple[str, ...]  # packages the kernels are built from (on-disk cache key)
    key_prefixes: tuple[str, str, str]  # first field of the "pre", "main" and "post" keys
    #: main_kernel(config, deterministic=..., first_dq_stored=...) -> kernel with from_pointers
    main_kernel: Callable[..., Any]
    #: postprocess(config, zero_unvisited) -> kernel with from_pointers (DqPostprocessHostEntry)
    postprocess: Callable[[Any, bool], Any]
    main_key: Callable[[Any], tuple]  # static fields of the main kernel's key (before deterministic)
    #: the backward config a view was planned for (raising for views the consumer cannot run)
    config_for_view: Callable[[PlanView], Any]
    post_key: Callable[[Any], tuple] = lambda config: ()  # fields after (dims, tile_m) of the post key
    stores_first_dq: bool = False
    mirrors_sparse_rows: Callable[[Any], bool] = lambda config: False
    #: ``(Dqk, Dv)`` of the THD tensors a config's kernels take (narrower than its head dims where
    #: the kernels zero-fill the rest of their tiles); default: the config's head dims
    io_head_dims: Callable[[Any], tuple[int, int]] = lambda config: (config.head_dim_qk, config.head_dim_v)
    #: ``(items, q_per_kv, sms, row_spread) -> parts``: into how many items the main kernel splits
    #: each kv head's q heads, from its ``items`` (K rows x kv heads), the GQA ratio, the GPU's SM
    #: count and :attr:`BwdViewArgs.row_spread` (:func:`launch_backward`'s ``kv_split``), for the
    #: configs whose kernels split (``splits_kv_heads``)
    kv_head_split: Callable[[int, int, int, float], int] = kv_head_split
    #: whether a config's main kernel takes such a split (its items' kv heads ``Hkv x s``, K / V's
    #: ``hk``); where not, ``kv_head_split`` is not asked
    splits_kv_heads: Callable[[Any], bool] = lambda config: False
    #: the granule of a config's main kernel that takes q, k, v rows per sample
    #: (``main_kernel(config, ..., per_sample=True)``; ``ThdHostEntry.row_granule``),
    #: or None where the consumer has none (such q, k, v are copied: :func:`qkv_operands`)
    row_granule: Callable[[Any], int | None] = lambda config: None

    def first_dq_stored(self, deterministic: bool, sparse_rows: bool = False) -> bool:
        """Whether the main kernel stores each Q block's first dQ contribution (class docstring)."""
        return self.stores_first_dq and (deterministic or sparse_rows)

    def mirrored(self, config, deterministic: bool, sparse_rows: bool = False) -> bool:
        """Whether the main kernel takes the mirrored order (class docstring)."""
        return self.stores_first_dq and deterministic and sparse_rows and self.mirrors_sparse_rows(config)

    def kernel_keys(
        self, config, *, deterministic: bool, with_dlse: bool, per_sample: bool = False,
        sparse_rows: bool = False,
    ) -> dict[str, tuple]:  # fmt: skip
        """Compile keys of the three kernels (``sparse_rows``: :attr:`BwdViewArgs.sparse_rows`)."""
        dims, (pre, main, post) = kernel_dims(config), self.key_prefixes
        stored = self.first_dq_stored(deterministic, sparse_rows)
        mirrored = self.mirrored(config, deterministic, sparse_rows)
        io = ("io_head_dims", self.io_head_dims(config))
        return {
            "pre": (pre, dims, io, config.tile_m, ("dlse", with_dlse), ("zero_dq_accum", not stored)),
            "main": (
                main, *self.main_key(config), io, ("deterministic", deterministic),
                ("per_sample", per_sample), ("first_dq_stored", stored), ("mirrored", mirrored),
            ),  # fmt: skip
            "post": (post, dims, io, config.tile_m, *self.post_key(config), ("zero_unvisited", stored)),
        }

    def build(
        self, kind: str, config, *, deterministic: bool, per_sample: bool = False, sparse_rows: bool = False
    ):
        """The kernel object of ``kind`` (the same for either ``with_dlse``: the preprocess's dlse
        placeholder, a pointer or None, decides its trace)."""
        stored = self.first_dq_stored(deterministic, sparse_rows)
        if kind == "pre":
            return BwdPreprocess(
                config.head_dim_qk, self.io_head_dims(config)[1], config.dtype, tile_m=config.tile_m,
                zero_dq_accum=not stored,
            )  # fmt: skip
        if kind == "main":
            extra = {"per_sample": True} if per_sample else {}
            if self.mirrored(config, deterministic, sparse_rows):
                extra["mirrored"] = True
            return self.main_kernel(config, deterministic=deterministic, first_dq_stored=stored, **extra)
        return self.postprocess(config, stored)

    def jit_and_placeholders(
        self, kind: str, config, *, deterministic: bool, with_dlse: bool, per_sample: bool = False,
        sparse_rows: bool = False,
    ) -> tuple:  # fmt: skip
        """``(kernel.from_pointers, *placeholder arguments)``: what ``cute.compile`` takes."""
        kernel = self.build(
            kind, config, deterministic=deterministic, per_sample=per_sample, sparse_rows=sparse_rows
        )
        dtype = cute_dtype(getattr(torch, config.dtype))
        return (kernel.from_pointers, *bwd_placeholders(kind, dtype, with_dlse=with_dlse))

    def compile_uncached(
        self,
        kind: str,
        config,
        *,
        deterministic: bool = False,
        with_dlse: bool = False,
        per_sample: bool = False,
        sparse_rows: bool = False,
        extra_options: str = "",
    ):
        """Trace and compile kernel ``kind`` for :attr:`gpu_arch` (no GPU needed)."""
        options = f"--gpu-arch {self.gpu_arch} {extra_options}".strip()
        jit = self.jit_and_placeholders(
            kind, config, deterministic=deterministic, with_dlse=with_dlse, per_sample=per_sample,
            sparse_rows=sparse_rows,
        )  # fmt: skip
        return cute.compile(*jit, options=options)

    def run_backward(
        self, view: PlanView, q, k, v, out, lse, dout, dlse, *, softmax_scale: float,
        deterministic: bool = False, dq=None, dk=None, dv=None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Attention backward of ``view`` (a backward view of this consumer) on THD tensors
        (``dlse`` may be None): ``(dq, dk, dv)``.

        ``deterministic=True`` applies each Q block's dQ contributions in the plan's
        ``dq_write_order``, or in its reverse where the kernel takes the mirrored order
        (:attr:`mirrors_sparse_rows`; bit-identical results run to run); dK/dV are always deterministic (one
        CTA owns each K block and item kv head, and :func:`launch_backward` sums split parts in a
        fixed order; the split follows the GPU's SM count, so another GPU may round them
        otherwise). ``dq/dk/dv`` may be given (contiguous, of the output shapes and q's dtype) to
        be written in place; every element of them is written.
        """
        config = self.config_for_view(view)
        softmax_scale = fp32_softmax_scale(softmax_scale)  # refused even where no kernel runs
        io = backward_io(
            view, q, k, v, out, lse, dout, dlse, accum_head_dim=config.head_dim_qk, dq=dq, dk=dk, dv=dv,
            row_granule=self.row_granule(config),
        )  # fmt: skip
        if not io.nothing_visible:
            if self.mirrored(config, deterministic, io.prep.sparse_rows):
                io = io._replace(prep=mirrored_view_args(view, io.q.device))
            compiled = self.compile_backward(
                config, deterministic=deterministic, with_dlse=io.dlse is not None, per_sample=io.per_sample,
                sparse_rows=io.prep.sparse_rows,
            )  # fmt: skip
            split = self.kv_head_split if self.splits_kv_heads(config) else no_kv_head_split
            launch_backward(compiled, io, config, softmax_scale, split)
        return io.grads

    def compile_backward(
        self, config, *, deterministic: bool, with_dlse: bool, per_sample: bool = False,
        sparse_rows: bool = False,
    ) -> dict[str, object]:  # fmt: skip
        """The three compiled kernels for ``config``: compiled on first use, then served by the
        project's compile cache (in process and on disk). Thread-safe, one compile per key."""
        compiled = {}
        options = {
            "deterministic": deterministic, "with_dlse": with_dlse, "per_sample": per_sample,
            "sparse_rows": sparse_rows,
        }  # fmt: skip
        for kind, key in self.kernel_keys(config, **options).items():

            def build(kind=kind):
                return self.jit_and_placeholders(kind, config, **options)

            compiled[kind] = compile_cache.compile_cached(
                key, build, options=f"--gpu-arch {self.gpu_arch}", packages=self.source_packages
            )
        return compiled


__all__ = [
    "FWD_PLAN_TENSORS",
    "BackwardCompiler",
    "BackwardIO",
    "BwdViewArgs",
    "ForwardIO",
    "FwdViewArgs",
    "backward_io",
    "bwd_placeholders",
    "bwd_view_args",
    "cached_per_view",
    "cached_view_args",
    "capturing",
    "cute_dtype",
    "forward_io",
    "fwd_placeholders",
    "fwd_view_args",
    "gmem_ptr",
    "int32_tensor",
    "kernel_dims",
    "launch_backward",
    "mirrored_view_args",
    "plan_pointers",
    "qkv_stride_placeholders",
    "sequence_desc_source",
]
