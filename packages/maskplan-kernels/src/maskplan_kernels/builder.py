"""The GPU planner: spec section 4 as a pipeline of named stages, mirroring
:mod:`maskplan_core.reference.builder` (the oracle: every tensor of every view is equal).

::

    geometry (1 CTA) -> classify fwd [-> classify bwd -> K2Q count] -> scan + header
        -> ONE host read of the 8-value header (+ the longest K2Q row), errors raised
        -> materialise Q2K -> forward schedule (stats, scatter) [-> materialise K2Q + dQ order]
        -> MaskPlan

Before the header read every size is a host-known upper bound (:class:`ViewBounds`); padding rows
belong to an all-empty dummy sample, so they contribute zeros. After the read the plan tensors get
their exact sizes. Everything runs on the caller's current CUDA stream; there is no other host
read and no host synchronisation (the payload layout table is uploaded once per process and
layout, outside any later build). The header read waits for that stream only, so a plan built on
a side stream does not wait for the work queued on the others; an event recorded after the last
stage lets consumers on any stream wait for the plan (:mod:`maskplan_core.plan_ready`).

A warm build is host-bound (each kernel runs for microseconds), so the host path is kept short:
what depends only on the views and the problem's shape (compiled stages, payload tables, bounds,
arena layouts, schedule parameters) is a cached :class:`BuildProgram`; a build allocates one
workspace arena, one arena of kept descriptors/counts and one arena per view after the header,
and launches with addresses computed from each arena's base (no tensor views on the launch path).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from maskplan_core.consumer import ViewConfig, check_build_inputs
from maskplan_core.error_flags import raise_for_error_flags
from maskplan_core.geometry import PlanGeometry
from maskplan_core.plan import MaskPlan, PlanView
from maskplan_core.plan_ready import mark_ready
from maskplan_core.reference.builder import read_back

from ._cute_args import advance, int32_address, torch_stream
from ._launch import ArenaLayout, StageTimer, no_timer, persistent_ctas
from ._sections import ScheduleParams
from ._tile_packer import ROW_PARTS, MaterializeConfig, packer_slots
from .classify import ClassifyConfig, compile_classify
from .geometry import (
    DESC_COLS,
    HDR_BWD_FULL,
    HDR_BWD_K_ROWS,
    HDR_BWD_PARTIAL,
    HDR_ERROR,
    HDR_FWD_FULL,
    HDR_FWD_PARTIAL,
    HDR_FWD_Q_ROWS,
    HEADER_LEN,
    GeometryConfig,
    ViewBounds,
    compile_geometry,
)
from .k2q_count import K2QCountConfig, compile_k2q_count
from .materialize_k2q import compile_k2q_materialize
from .materialize_q2k import compile_q2k_materialize
from .payload_table import device_source_table
from .scan_header import ScanConfig, compile_scan_header
from .schedule_scatter import WORK_COLS, ScheduleScatterConfig, compile_schedule_scatter
from .schedule_stats import STATS_COLS, ScheduleStatsConfig, compile_schedule_stats

# counts planes of the (4, Hmask, rows) count tensors
CNT_PARTIAL, CNT_FULL, OFF_PARTIAL, OFF_FULL = 0, 1, 2, 3

#: programs kept per process, and sizes per program (a training run uses a handful of view/shape
#: combinations; varlen batches bring new sizes every step); past them the oldest entry goes
PROGRAM_CACHE_SIZE = 64
SIZES_CACHE_SIZE = 64


def _extent(n: int) -> int:
    """A layout extent for a possibly empty tensor (never indexed when the true size is 0)."""
    return max(int(n), 1)


def _csr(counts: torch.Tensor, idx_p: torch.Tensor, masks: torch.Tensor, idx_f: torch.Tensor) -> dict:
    """The CSR tensors of a view (either direction), named as in ``maskplan_core.plan``."""
    cnt_p, cnt_f, off_p, off_f = counts.unbind(0)
    return {
        "mask_block_cnt": cnt_p,
        "mask_block_offset": off_p,
        "mask_block_idx": idx_p,
        "mask_block_masks": masks,
        "full_block_cnt": cnt_f,
        "full_block_offset": off_f,
        "full_block_idx": idx_f,
    }


def _sequence_desc(build: PlanBuild, name: str) -> dict:
    """A view's ``sequence_desc`` (kept descriptor ``name`` without the dummy row B): varlen only."""
    if not build.geometry.varlen:
        return {}
    return {"sequence_desc": build.sizes.kept.view(build.kept, name)[: build.batch]}


# ------------------------------------------------------------------------------------------------
# what builds share


@dataclass(frozen=True)
class BuildSizes:
    """The size-dependent part of a program: bounds, arena layouts, the size-specialised stages.

    Workspace arena (freed when the build returns)::

        header | stats | rb_f | vis_f | full_f [| desc_bq | rb_bq | rb_bk | vis_b | full_b | counts_b]

    Kept arena (the plan's storage: bound-sized counts, and the views' descriptors if varlen)::

        counts_f [| k2q_counts] [| desc_f [| desc_bk]]

    A fixed-length view retains no ``sequence_desc`` (its consumers derive it:
    ``maskplan_core.plan.fixed_sequence_desc``), so there ``desc_f``/``desc_bk`` are workspace the
    planner's own kernels read.

    Varlen views whose exact row count is below the bound get compact counts after the header;
    their bound-sized counts then stay in the kept arena unused (at most a few rows per sample).
    """

    fb: ViewBounds
    bb: ViewBounds | None
    workspace: ArenaLayout
    kept: ArenaLayout
    schedule: ScheduleParams
    scatter: object  # compiled schedule scatter (specialised on the K block bound)


@dataclass(frozen=True, eq=False)
class BuildProgram:
    """What every build for one pair of views and one problem shape shares: the compiled stages
    and the payload tables (addresses included). Sizes change from batch to batch with varlen
    input, so they are a second cache level (:meth:`sizes`)."""

    forward: ViewConfig
    backward: ViewConfig | None
    geometry: object
    classify_fwd: object
    classify_bwd: object | None
    k2q_count: object | None
    scan_header: object
    materialize_q2k: object
    schedule_stats: object
    materialize_k2q: object | None
    fwd_table: torch.Tensor  # held so that the address below stays valid; kernels take the address
    bwd_table: torch.Tensor | None
    fwd_table_address: object
    bwd_table_address: object
    _sizes: OrderedDict = field(default_factory=OrderedDict, repr=False)

    @classmethod
    def compile(cls, forward: ViewConfig, backward: ViewConfig | None, nfunc: int, device) -> BuildProgram:
        fwd_table = device_source_table(forward.layout, device)
        has_bwd = backward is not None
        bwd_table = device_source_table(backward.layout, device) if has_bwd else None
        return cls(
            forward=forward,
            backward=backward,
            geometry=compile_geometry(GeometryConfig(has_backward=has_bwd)),
            classify_fwd=_classify_stage(forward, nfunc),
            classify_bwd=_classify_stage(backward, nfunc) if has_bwd else None,
            k2q_count=compile_k2q_count(K2QCountConfig()) if has_bwd else None,
            scan_header=compile_scan_header(ScanConfig(num_arrays=4 if has_bwd else 2)),
            materialize_q2k=compile_q2k_materialize(_materialize_config(forward, nfunc)),
            schedule_stats=compile_schedule_stats(ScheduleStatsConfig()),
            materialize_k2q=(
                compile_k2q_materialize(_materialize_config(backward, nfunc)) if has_bwd else None
            ),
            fwd_table=fwd_table,
            bwd_table=bwd_table,
            fwd_table_address=int32_address(fwd_table),
            bwd_table_address=int32_address(bwd_table) if has_bwd else None,
        )

    def sizes(self, g: PlanGeometry) -> BuildSizes:
        key = (g.batch, g.max_seqlen_q, g.max_seqlen_k, g.total_q, g.total_k)
        sizes = self._sizes.get(key)
        if sizes is None:
            sizes = self._make_sizes(g)
            with _PROGRAMS_LOCK:
                self._sizes[key] = sizes
                if len(self._sizes) > SIZES_CACHE_SIZE:
                    self._sizes.popitem(last=False)
        return sizes

    def _make_sizes(self, g: PlanGeometry) -> BuildSizes:
        h, b = g.mask_heads, g.batch
        fb = ViewBounds.of(g, self.forward.tile_m, self.forward.tile_n)
        workspace = {
            "header": (HEADER_LEN,),
            "stats": (b * g.num_heads_kv, STATS_COLS),
            "rb_f": (fb.q_rows,),
            "vis_f": (h, fb.q_rows, fb.k_words),
            "full_f": (h, fb.q_rows, fb.k_words),
        }
        kept = {"counts_f": (4, h, fb.q_rows)}
        descriptors = {"desc_f": (b + 1, DESC_COLS)}
        bb = None
        if self.backward is not None:
            bb = ViewBounds.of(g, self.backward.tile_m, self.backward.tile_n)
            workspace |= {
                "desc_bq": (b + 1, DESC_COLS),
                "rb_bq": (bb.q_rows,),
                "rb_bk": (bb.k_rows,),
                "vis_b": (h, bb.q_rows, bb.k_words),
                "full_b": (h, bb.q_rows, bb.k_words),
                "counts_b": (2, h, bb.q_rows),
            }
            kept |= {"k2q_counts": (4, h, bb.k_rows)}
            descriptors |= {"desc_bk": (b + 1, DESC_COLS)}
        if g.varlen:
            kept |= descriptors
        else:
            workspace |= descriptors
        return BuildSizes(
            fb=fb,
            bb=bb,
            workspace=ArenaLayout(workspace),
            kept=ArenaLayout(kept),
            schedule=ScheduleParams.of(g, self.forward.signature.topology.pack_gqa),
            scatter=compile_schedule_scatter(ScheduleScatterConfig.for_max_k_blocks(fb.max_k_blocks)),
        )


def _classify_stage(view: ViewConfig, nfunc: int):
    return compile_classify(ClassifyConfig(tile_m=view.tile_m, tile_n=view.tile_n, nfunc=nfunc))


def _materialize_config(view: ViewConfig, nfunc: int) -> MaterializeConfig:
    return MaterializeConfig(view.tile_m, view.tile_n, nfunc, view.layout.words_per_tile)


def unserved(geometry: PlanGeometry, forward: ViewConfig, backward: ViewConfig | None) -> str | None:
    """Why the planner kernels do not build this plan, or None where they do: a view whose tiles'
    endpoints do not fit the materialiser's shared memory (:func:`~._tile_packer.packer_slots`; at
    SM90's 128-row tiles, nfunc above 73). The consumer then plans with the reference planner on
    the same device, which builds the same tensors (``Consumer.build_plan``)."""
    for view, listed in ((forward, "k"), (backward, "q")):
        if view is not None and geometry.nfunc > max_nfunc(view, listed):
            return (
                f"the planner kernels take at most {max_nfunc(view, listed)} endpoints per row on "
                f"{view.tile_m} x {view.tile_n} {view.signature.direction} tiles, the mask has "
                f"nfunc={geometry.nfunc}"
            )
    return None


#: max_nfunc's answers by (view id, listed), with the view (kept alive, so its id names it): every
#: GPU plan build asks
_MAX_NFUNC: dict[tuple[int, str], tuple[ViewConfig, int]] = {}


def max_nfunc(view: ViewConfig, listed: str) -> int:
    """The largest (odd) nfunc whose endpoints fit the materialiser of ``view``'s tiles."""
    known = _MAX_NFUNC.get((id(view), listed))
    if known is None or known[0] is not view:
        nfunc = 1
        while packer_slots(_materialize_config(view, nfunc + 2), listed) > 0:
            nfunc += 2
        if len(_MAX_NFUNC) >= PROGRAM_CACHE_SIZE:
            _MAX_NFUNC.clear()
        known = _MAX_NFUNC[(id(view), listed)] = (view, nfunc)
    return known[1]


_PROGRAMS: OrderedDict = OrderedDict()
_PROGRAMS_LOCK = threading.Lock()


def program_for(mask_func: torch.Tensor, g: PlanGeometry, forward: ViewConfig, backward: ViewConfig | None):
    """The cached :class:`BuildProgram` of these views (kept alive by the cache, so their ids name
    them) and this problem shape."""
    key = (id(forward), id(backward), mask_func.shape[0], mask_func.shape[1], g.num_heads_q,
           g.num_heads_kv, g.head_dim_qk, g.head_dim_v, g.dtype, g.varlen, mask_func.device)
    program = _PROGRAMS.get(key)
    if program is None:
        with _PROGRAMS_LOCK:
            program = _PROGRAMS.get(key)
            if program is None:
                program = _PROGRAMS[key] = BuildProgram.compile(forward, backward, g.nfunc, mask_func.device)
                if len(_PROGRAMS) > PROGRAM_CACHE_SIZE:
                    _PROGRAMS.popitem(last=False)
    return program


@dataclass
class PlanBuild:
    """Everything one build passes between stages: its arenas and every launch address."""

    mask_func: torch.Tensor
    geometry: PlanGeometry
    program: BuildProgram
    sizes: BuildSizes
    workspace: torch.Tensor
    kept: torch.Tensor
    addr: dict
    stream: int
    hmask: int  # mask_func's sizes as ints (a tensor's shape is slower to read, and read often)
    total_q: int

    @property
    def batch(self) -> int:
        return self.geometry.batch

    @property
    def device(self) -> torch.device:
        return self.mask_func.device

    @property
    def header(self) -> torch.Tensor:
        return self.sizes.workspace.view(self.workspace, "header")

    def plane(self, name: str, plane: int, rows: int) -> object:
        """Address of plane ``plane`` of a ``(planes, Hmask, rows)`` counts tensor."""
        return advance(self.addr[name], plane * self.hmask * rows)


# ------------------------------------------------------------------------------------------------
# the pipeline


def build_plan_gpu(
    mask_func: torch.Tensor,
    geometry: PlanGeometry,
    forward: ViewConfig,
    backward: ViewConfig | None,
    consumer_name: str,
    *,
    stage_timer: StageTimer | None = None,
) -> MaskPlan:
    """GPU twin of :func:`maskplan_core.reference.build_plan` (same tensors, same header, same errors).

    ``mask_func``: contiguous CUDA int32 ``[Hmask, nfunc, total_q]`` and ``geometry`` from
    ``maskplan_core.validate_plan_inputs`` (structure already validated). ``stage_timer``: an
    optional ``name -> context manager`` wrapped around each stage (benchmarks pass a
    :class:`~maskplan_kernels._launch.CudaEventTimer`).
    """
    timer = stage_timer or no_timer
    _check_inputs(mask_func, geometry, forward, backward)
    build = prepare(mask_func, geometry, forward, backward)
    with timer("geometry"):
        stage_geometry(build)
    with timer("classify_fwd"):
        stage_classify(build, backward=False)
    if backward is not None:
        with timer("classify_bwd"):
            stage_classify(build, backward=True)
        with timer("k2q_count"):
            stage_k2q_count(build)
    with timer("scan_header"):
        stage_scan_header(build)
    with timer("header_read"):
        header, longest_k_row = read_header(build)
    raise_for_error_flags(header[HDR_ERROR], mask_func, geometry)
    with timer("materialize_q2k"):
        fwd_tensors = stage_materialize_q2k(build, header)
    with timer("schedule"):
        stage_schedule(build, fwd_tensors["fwd_work_desc"].shape[0])
    views = {"forward": PlanView("forward", forward.signature, forward.layout, geometry, fwd_tensors)}
    if backward is not None:
        with timer("materialize_k2q"):
            bwd_tensors = stage_materialize_k2q(build, header)
        views["backward"] = PlanView(
            "backward", backward.signature, backward.layout, geometry, bwd_tensors, longest_row=longest_k_row
        )
    mark_ready(views.values(), mask_func.device)  # consumers on other streams wait for this point
    return MaskPlan(geometry, views, tuple(header), consumer_name)


def read_header(build: PlanBuild) -> tuple[list[int], int]:
    """THE host read of a build: the 8-value allocation header (spec 4.5) and the backward view's
    ``longest_row`` (``maskplan_core.reference.builder.read_back``; padding rows of the K2Q counts
    are zero)."""
    counts = None
    if build.sizes.bb is not None:
        k2q = build.sizes.kept.view(build.kept, "k2q_counts")
        counts = (k2q[CNT_PARTIAL], k2q[CNT_FULL])
    return read_back(build.header, counts)


def _check_inputs(
    mask_func, geometry: PlanGeometry, forward: ViewConfig, backward: ViewConfig | None
) -> None:
    if not isinstance(mask_func, torch.Tensor) or not mask_func.is_cuda:
        raise TypeError(
            "build_plan_gpu needs a CUDA mask_func; CPU tensors use maskplan_core.reference.build_plan"
        )
    check_build_inputs(mask_func, geometry, forward, backward)


def prepare(mask_func, geometry: PlanGeometry, forward: ViewConfig, backward: ViewConfig | None) -> PlanBuild:
    """The build's program and sizes, its two pre-header arenas and their addresses."""
    program = program_for(mask_func, geometry, forward, backward)
    sizes = program.sizes(geometry)
    device = mask_func.device
    workspace, kept = sizes.workspace.allocate(device), sizes.kept.allocate(device)
    addr = sizes.workspace.addresses(int32_address(workspace)) | sizes.kept.addresses(int32_address(kept))
    hmask, _, total_q = mask_func.shape
    return PlanBuild(
        mask_func, geometry, program, sizes, workspace, kept, addr, torch_stream(device), hmask, total_q
    )


def stage_geometry(build: PlanBuild) -> None:
    """Compact row prefixes, descriptors, row ownership, prefix validation, header rows."""
    g, a, fb, bb = build.geometry, build.addr, build.sizes.fb, build.sizes.bb
    has_bwd = bb is not None
    other = bb if has_bwd else fb  # the backward view's Q geometry; stand-ins without one
    build.program.geometry(
        int32_address(g.cu_seqlens_q),
        int32_address(g.cu_seqlens_k),
        a["header"],
        a["desc_f"],
        a["rb_f"],
        a["desc_bq"] if has_bwd else a["desc_f"],
        a["rb_bq"] if has_bwd else a["rb_f"],
        a["desc_bk"] if has_bwd else a["desc_f"],
        a["rb_bk"] if has_bwd else a["rb_f"],
        g.batch,
        g.total_q,
        g.total_k,
        g.max_seqlen_q,
        g.max_seqlen_k,
        fb.tile_m,
        fb.tile_n,
        other.tile_m,
        other.tile_n,
        fb.q_rows,
        bb.q_rows if has_bwd else 0,
        bb.k_rows if has_bwd else 0,
        int(g.varlen),
        build.stream,
    )


#: workspace names of one view's Q-major classification: descriptor, row batch, bitsets, counts
_CLASSIFY_NAMES = {False: ("desc_f", "rb_f", "vis_f", "full_f", "counts_f"),
                   True: ("desc_bq", "rb_bq", "vis_b", "full_b", "counts_b")}


def stage_classify(build: PlanBuild, *, backward: bool) -> None:
    """Q2K classification at the view's tile (the existing, hardware-verified kernel)."""
    bounds = build.sizes.bb if backward else build.sizes.fb
    if build.hmask == 0 or bounds.q_rows == 0:
        return
    a = build.addr
    desc, rows, visible, full, counts = _CLASSIFY_NAMES[backward]
    classify = build.program.classify_bwd if backward else build.program.classify_fwd
    classify(
        int32_address(build.mask_func),
        a[rows],
        a[desc],
        a[visible],
        a[full],
        build.plane(counts, CNT_PARTIAL, bounds.q_rows),
        build.plane(counts, CNT_FULL, bounds.q_rows),
        advance(a["header"], HDR_ERROR),
        build.hmask,
        build.total_q,
        bounds.q_rows,
        bounds.k_words,
        build.batch + 1,
        build.stream,
    )


def stage_k2q_count(build: PlanBuild) -> None:
    bb, a = build.sizes.bb, build.addr
    if build.hmask == 0 or bb.k_rows == 0:
        return
    build.program.k2q_count(
        a["vis_b"],
        a["full_b"],
        a["rb_bk"],
        a["desc_bq"],
        a["desc_bk"],
        build.plane("k2q_counts", CNT_PARTIAL, bb.k_rows),
        build.plane("k2q_counts", CNT_FULL, bb.k_rows),
        build.hmask,
        _extent(bb.q_rows),
        bb.k_rows,
        bb.k_words,
        build.batch + 1,
        build.stream,
    )


def stage_scan_header(build: PlanBuild) -> None:
    fb, bb = build.sizes.fb, build.sizes.bb
    f_rows = fb.q_rows
    # stand-ins when there is no backward view
    k2q, k_rows = ("k2q_counts", bb.k_rows) if bb is not None else ("counts_f", f_rows)
    build.program.scan_header(
        build.plane("counts_f", CNT_PARTIAL, f_rows),
        build.plane("counts_f", OFF_PARTIAL, f_rows),
        build.plane("counts_f", CNT_FULL, f_rows),
        build.plane("counts_f", OFF_FULL, f_rows),
        build.plane(k2q, CNT_PARTIAL, k_rows),
        build.plane(k2q, OFF_PARTIAL, k_rows),
        build.plane(k2q, CNT_FULL, k_rows),
        build.plane(k2q, OFF_FULL, k_rows),
        build.addr["header"],
        build.hmask * f_rows,
        build.hmask * bb.k_rows if bb is not None else 0,
        build.stream,
    )


def _view_arena(build: PlanBuild, shapes: dict, counts_shape: tuple[int, ...], compact: bool):
    """The exact-size tensors of one view: one arena, its addresses, its tensors by name."""
    if compact:
        shapes = shapes | {"counts": counts_shape}
    layout = ArenaLayout.of(tuple(shapes.items()))
    buf = layout.allocate(build.device)
    build.addr.update(layout.addresses(int32_address(buf)))
    return {name: layout.view(buf, name) for name in shapes}


def stage_materialize_q2k(build: PlanBuild, header: list[int]) -> dict[str, torch.Tensor]:
    """Exact-size forward CSRs and payloads; also allocates ``fwd_work_desc`` (filled by the schedule)."""
    fb, g, h, program = build.sizes.fb, build.geometry, build.hmask, build.program
    layout = program.forward.layout
    n_rows, nnz_p, nnz_f = header[HDR_FWD_Q_ROWS], header[HDR_FWD_PARTIAL], header[HDR_FWD_FULL]
    pack = program.forward.signature.topology.pack_gqa
    n_tasks = (g.num_heads_kv if pack else g.num_heads_q) * n_rows
    compact = fb.q_rows != n_rows
    out = _view_arena(
        build,
        {
            "idx_p": (nnz_p,),
            "idx_f": (nnz_f,),
            "masks": (nnz_p, layout.subtiles, layout.groups, layout.words_per_group),
            "fwd_work_desc": (n_tasks, WORK_COLS),
        },
        (4, h, n_rows),
        compact,
    )
    a = build.addr
    counts_out = "counts" if compact else "counts_f"
    if h * n_rows > 0:
        program.materialize_q2k(
            int32_address(build.mask_func),
            a["rb_f"],
            a["desc_f"],
            a["vis_f"],
            a["full_f"],
            a["counts_f"],
            a[counts_out],
            a["idx_p"],
            a["idx_f"],
            a["masks"],
            program.fwd_table_address,
            h,
            build.total_q,
            fb.q_rows,
            fb.k_words,
            n_rows,
            build.batch + 1,
            _extent(nnz_p),
            _extent(nnz_f),
            int(compact),
            persistent_ctas(build.device, h * n_rows * ROW_PARTS),
            build.stream,
        )
    kept = build.sizes.kept
    counts = out["counts"] if compact else kept.view(build.kept, "counts_f")
    return {
        **_csr(counts, out["idx_p"], out["masks"], out["idx_f"]),
        **_sequence_desc(build, "desc_f"),
        "fwd_work_desc": out["fwd_work_desc"],
    }


def stage_schedule(build: PlanBuild, n_tasks: int) -> None:
    """``fwd_work_desc`` (spec 4.8): section stats, then rank/histogram/scatter per section."""
    if n_tasks == 0:
        return
    fb, params, a = build.sizes.fb, build.sizes.schedule, build.addr
    common = (build.hmask, fb.q_rows, build.batch + 1, params.num_sections)
    section_args = (
        params.num_heads_kv,
        params.qhead_per_kvhead,
        params.pack_gqa,
        params.mask_per_head,
        params.row_bytes_kv,
        params.budget,
    )
    # the schedule reads the bound-sized counts (compaction does not change a row's counts)
    counts, desc, stats = a["counts_f"], a["desc_f"], a["stats"]
    build.program.schedule_stats(counts, desc, stats, *common, *section_args, build.stream)
    build.sizes.scatter(
        counts,
        desc,
        stats,
        a["fwd_work_desc"],
        *common,
        n_tasks,
        *section_args,
        fb.tile_m,
        build.stream,
    )


def stage_materialize_k2q(build: PlanBuild, header: list[int]) -> dict[str, torch.Tensor]:
    """Exact-size K2Q CSRs, backward payloads and dQ write order."""
    bb, h, program = build.sizes.bb, build.hmask, build.program
    layout = program.backward.layout
    n_k_rows, nnz_p, nnz_f = header[HDR_BWD_K_ROWS], header[HDR_BWD_PARTIAL], header[HDR_BWD_FULL]
    compact = bb.k_rows != n_k_rows
    out = _view_arena(
        build,
        {
            "idx_p": (nnz_p,),
            "idx_f": (nnz_f,),
            "dq_write_order": (nnz_p,),
            "dq_write_order_full": (nnz_f,),
            "masks": (nnz_p, layout.subtiles, layout.groups, layout.words_per_group),
        },
        (4, h, n_k_rows),
        compact,
    )
    a = build.addr
    if h * n_k_rows > 0:
        program.materialize_k2q(
            int32_address(build.mask_func),
            a["rb_bk"],
            a["desc_bq"],
            a["desc_bk"],
            a["vis_b"],
            a["full_b"],
            a["k2q_counts"],
            a["counts" if compact else "k2q_counts"],
            a["idx_p"],
            a["idx_f"],
            a["dq_write_order"],
            a["dq_write_order_full"],
            a["masks"],
            program.bwd_table_address,
            h,
            build.total_q,
            _extent(bb.q_rows),
            bb.k_rows,
            bb.k_words,
            n_k_rows,
            build.batch + 1,
            _extent(nnz_p),
            _extent(nnz_f),
            int(compact),
            persistent_ctas(build.device, h * n_k_rows * ROW_PARTS),
            build.stream,
        )
    kept = build.sizes.kept
    counts = out["counts"] if compact else kept.view(build.kept, "k2q_counts")
    return {
        **_csr(counts, out["idx_p"], out["masks"], out["idx_f"]),
        **_sequence_desc(build, "desc_bk"),
        "dq_write_order": out["dq_write_order"],
        "dq_write_order_full": out["dq_write_order_full"],
    }
