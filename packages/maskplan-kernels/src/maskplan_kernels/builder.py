"""The GPU planner: spec section 4 as a pipeline of named stages, mirroring
:mod:`maskplan_core.reference.builder` (the oracle: every tensor of every view is equal).

::

    geometry (1 CTA) -> classify fwd [-> classify bwd -> K2Q count] -> scan + header
        -> ONE host read of the 8-value header, errors raised
        -> materialise Q2K -> forward schedule (stats, scatter) [-> materialise K2Q + dQ order]
        -> MaskPlan

Before the header read every size is a host-known upper bound (:class:`ViewBounds`); padding rows
belong to an all-empty dummy sample, so they contribute zeros. After the read the plan tensors get
their exact sizes. Everything runs on the caller's current CUDA stream; there is no other host
read and no host synchronisation (the payload layout table is uploaded once per process and
layout, outside any later build).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from maskplan_core.consumer import ViewConfig
from maskplan_core.error_flags import raise_for_error_flags
from maskplan_core.geometry import PlanGeometry
from maskplan_core.plan import MaskPlan, PlanView

from ._cute_args import int32_address, int32_addresses, torch_stream
from ._launch import StageTimer, arena, no_timer, persistent_ctas
from ._sections import ScheduleParams
from ._tile_packer import MaterializeConfig
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


def _csr(counts: torch.Tensor, idx_p: torch.Tensor, masks: torch.Tensor, idx_f: torch.Tensor) -> dict:
    """The CSR tensors of a view (either direction), named as in ``maskplan_core.plan``."""
    return {
        "mask_block_cnt": counts[CNT_PARTIAL],
        "mask_block_offset": counts[OFF_PARTIAL],
        "mask_block_idx": idx_p,
        "mask_block_masks": masks,
        "full_block_cnt": counts[CNT_FULL],
        "full_block_offset": counts[OFF_FULL],
        "full_block_idx": idx_f,
    }


def _extent(n: int) -> int:
    """A layout extent for a possibly empty tensor (never indexed when the true size is 0)."""
    return max(int(n), 1)


@dataclass
class ViewWorkspace:
    """Pre-header tensors of one view geometry (upper-bound sized)."""

    config: ViewConfig
    bounds: ViewBounds
    desc_q: torch.Tensor  # (B+1, 8) "q" descriptor (+ dummy row); the forward view keeps it
    row_batch_q: torch.Tensor  # (uq,)
    visible: torch.Tensor  # (Hmask, uq, k_words)
    full: torch.Tensor  # (Hmask, uq, k_words)
    counts: torch.Tensor  # (4 or 2, Hmask, uq): partial/full counts (+ offsets for the forward view)
    desc_k: torch.Tensor | None = None  # backward: (B+1, 8) "k" descriptor, kept by the view
    row_batch_k: torch.Tensor | None = None  # backward: (uk,)
    k2q_counts: torch.Tensor | None = None  # backward: (4, Hmask, uk)


@dataclass
class PlanBuild:
    """Everything one build passes between stages."""

    mask_func: torch.Tensor
    geometry: PlanGeometry
    device: torch.device
    header: torch.Tensor  # (8,)
    stats: torch.Tensor  # (B * Hkv, 4) forward schedule section stats
    fwd: ViewWorkspace
    bwd: ViewWorkspace | None

    @property
    def hmask(self) -> int:
        return self.mask_func.shape[0]

    @property
    def nfunc(self) -> int:
        return self.mask_func.shape[1]

    @property
    def total_q(self) -> int:
        return self.mask_func.shape[2]

    @property
    def batch(self) -> int:
        return self.geometry.batch

    @cached_property
    def stream(self) -> int:
        """The caller's current stream, read once per build (every stage launches on it)."""
        return torch_stream(self.device)


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
        stage_classify(build, build.fwd)
    if build.bwd is not None:
        with timer("classify_bwd"):
            stage_classify(build, build.bwd)
        with timer("k2q_count"):
            stage_k2q_count(build)
    with timer("scan_header"):
        stage_scan_header(build)
    with timer("header_read"):
        header = read_header(build.header)
    raise_for_error_flags(header[HDR_ERROR], mask_func, geometry)
    with timer("materialize_q2k"):
        fwd_tensors = stage_materialize_q2k(build, header)
    with timer("schedule"):
        stage_schedule(build, header, fwd_tensors["fwd_work_desc"])
    views = {"forward": PlanView("forward", forward.signature, forward.layout, geometry, fwd_tensors)}
    if build.bwd is not None:
        with timer("materialize_k2q"):
            bwd_tensors = stage_materialize_k2q(build, header)
        views["backward"] = PlanView("backward", backward.signature, backward.layout, geometry, bwd_tensors)
    return MaskPlan(geometry, views, tuple(header), consumer_name)


def read_header(header: torch.Tensor) -> list[int]:
    """THE host read of a build: the 8-value allocation header (spec 4.5)."""
    return header.tolist()


def _check_inputs(
    mask_func, geometry: PlanGeometry, forward: ViewConfig, backward: ViewConfig | None
) -> None:
    if not isinstance(mask_func, torch.Tensor) or not mask_func.is_cuda:
        raise TypeError(
            "build_plan_gpu needs a CUDA mask_func; CPU tensors use maskplan_core.reference.build_plan"
        )
    if mask_func.dtype != torch.int32 or mask_func.dim() != 3 or not mask_func.is_contiguous():
        raise TypeError(
            f"mask_func must be a contiguous int32 [Hmask, nfunc, total_q] tensor, got "
            f"{mask_func.dtype} {tuple(mask_func.shape)}"
        )
    # torch.device("cuda") names the current device; tensors always carry an index
    same_device = mask_func.device == torch.empty(0, device=geometry.device).device
    if not same_device or mask_func.shape[2] != geometry.total_q:
        raise ValueError(
            f"mask_func {tuple(mask_func.shape)} on {mask_func.device} does not match the geometry "
            f"({geometry.describe()})"
        )
    for cfg in (forward, backward):
        if cfg is None:
            continue
        layout = cfg.layout
        if (layout.tile_m, layout.tile_n) != (cfg.tile_m, cfg.tile_n):
            raise ValueError(f"{layout!r} does not match the view tile {cfg.tile_m}x{cfg.tile_n}")


def prepare(mask_func, geometry: PlanGeometry, forward: ViewConfig, backward: ViewConfig | None) -> PlanBuild:
    """Allocate the pre-header workspace (one arena) and the descriptors/counts a view may keep."""
    device, h, b = mask_func.device, mask_func.shape[0], geometry.batch
    fb = ViewBounds.of(geometry, forward.tile_m, forward.tile_n)
    bb = ViewBounds.of(geometry, backward.tile_m, backward.tile_n) if backward is not None else None
    shapes = [
        (HEADER_LEN,),
        (b * geometry.num_heads_kv, STATS_COLS),
        (fb.q_rows,),
        (h, fb.q_rows, fb.k_words),
        (h, fb.q_rows, fb.k_words),
    ]
    if bb is not None:
        shapes += [
            (b + 1, DESC_COLS),
            (bb.q_rows,),
            (bb.k_rows,),
            (h, bb.q_rows, bb.k_words),
            (h, bb.q_rows, bb.k_words),
            (2, h, bb.q_rows),
        ]
    ws = arena(device, shapes)
    header, stats, rb_f, vis_f, full_f = ws[:5]
    # kept by the plan when the bound is exact (fixed length), so not in the workspace arena
    desc_f = torch.empty(b + 1, DESC_COLS, dtype=torch.int32, device=device)
    counts_f = torch.empty(4, h, fb.q_rows, dtype=torch.int32, device=device)
    fwd = ViewWorkspace(forward, fb, desc_f, rb_f, vis_f, full_f, counts_f)
    bwd = None
    if bb is not None:
        desc_bq, rb_bq, rb_bk, vis_b, full_b, counts_b = ws[5:]
        desc_bk = torch.empty(b + 1, DESC_COLS, dtype=torch.int32, device=device)
        k2q_counts = torch.empty(4, h, bb.k_rows, dtype=torch.int32, device=device)
        bwd = ViewWorkspace(backward, bb, desc_bq, rb_bq, vis_b, full_b, counts_b, desc_bk, rb_bk, k2q_counts)
    return PlanBuild(mask_func, geometry, device, header, stats, fwd, bwd)


def stage_geometry(build: PlanBuild) -> None:
    """Compact row prefixes, descriptors, row ownership, prefix validation, header rows."""
    g, fwd, bwd = build.geometry, build.fwd, build.bwd
    compiled = compile_geometry(GeometryConfig(has_backward=bwd is not None))
    other = bwd if bwd is not None else fwd  # unused stand-ins when there is no backward view
    compiled(
        *int32_addresses(
            g.cu_seqlens_q,
            g.cu_seqlens_k,
            build.header,
            fwd.desc_q,
            fwd.row_batch_q,
            other.desc_q,
            other.row_batch_q,
            bwd.desc_k if bwd is not None else fwd.desc_q,
            bwd.row_batch_k if bwd is not None else fwd.row_batch_q,
        ),
        g.batch,
        g.total_q,
        g.total_k,
        g.max_seqlen_q,
        g.max_seqlen_k,
        fwd.bounds.tile_m,
        fwd.bounds.tile_n,
        other.bounds.tile_m,
        other.bounds.tile_n,
        fwd.bounds.q_rows,
        bwd.bounds.q_rows if bwd is not None else 0,
        bwd.bounds.k_rows if bwd is not None else 0,
        int(g.varlen),
        build.stream,
    )


def stage_classify(build: PlanBuild, view: ViewWorkspace) -> None:
    """Q2K classification at the view's tile (the existing, hardware-verified kernel)."""
    bounds = view.bounds
    if build.hmask == 0 or bounds.q_rows == 0:
        return
    compiled = compile_classify(ClassifyConfig(tile_m=bounds.tile_m, tile_n=bounds.tile_n, nfunc=build.nfunc))
    compiled(
        *int32_addresses(
            build.mask_func,
            view.row_batch_q,
            view.desc_q,
            view.visible,
            view.full,
            view.counts[CNT_PARTIAL],
            view.counts[CNT_FULL],
            build.header[HDR_ERROR : HDR_ERROR + 1],
        ),
        build.hmask,
        build.total_q,
        bounds.q_rows,
        bounds.k_words,
        build.batch + 1,
        build.stream,
    )


def stage_k2q_count(build: PlanBuild) -> None:
    bwd = build.bwd
    if build.hmask == 0 or bwd.bounds.k_rows == 0:
        return
    compiled = compile_k2q_count(K2QCountConfig())
    compiled(
        *int32_addresses(
            bwd.visible,
            bwd.full,
            bwd.row_batch_k,
            bwd.desc_q,
            bwd.desc_k,
            bwd.k2q_counts[CNT_PARTIAL],
            bwd.k2q_counts[CNT_FULL],
        ),
        build.hmask,
        _extent(bwd.bounds.q_rows),
        bwd.bounds.k_rows,
        bwd.bounds.k_words,
        build.batch + 1,
        build.stream,
    )


def stage_scan_header(build: PlanBuild) -> None:
    fwd, bwd = build.fwd, build.bwd
    k2q = bwd.k2q_counts if bwd is not None else fwd.counts  # stand-ins when there is no backward view
    compiled = compile_scan_header(ScanConfig(num_arrays=4 if bwd is not None else 2))
    compiled(
        *int32_addresses(
            fwd.counts[CNT_PARTIAL],
            fwd.counts[OFF_PARTIAL],
            fwd.counts[CNT_FULL],
            fwd.counts[OFF_FULL],
            k2q[CNT_PARTIAL],
            k2q[OFF_PARTIAL],
            k2q[CNT_FULL],
            k2q[OFF_FULL],
            build.header,
        ),
        build.hmask * fwd.bounds.q_rows,
        build.hmask * bwd.bounds.k_rows if bwd is not None else 0,
        build.stream,
    )


def stage_materialize_q2k(build: PlanBuild, header: list[int]) -> dict[str, torch.Tensor]:
    """Exact-size forward CSRs and payloads; also allocates ``fwd_work_desc`` (filled by the schedule)."""
    fwd, g, h = build.fwd, build.geometry, build.hmask
    layout = fwd.config.layout
    n_rows, nnz_p, nnz_f = header[HDR_FWD_Q_ROWS], header[HDR_FWD_PARTIAL], header[HDR_FWD_FULL]
    pack = fwd.config.signature.topology.pack_gqa
    n_tasks = (g.num_heads_kv if pack else g.num_heads_q) * n_rows
    shapes = [
        (nnz_p,),
        (nnz_f,),
        (nnz_p, layout.subtiles, layout.groups, layout.words_per_group),
        (n_tasks, WORK_COLS),
    ]
    compact = fwd.bounds.q_rows != n_rows
    if compact:
        shapes.append((4, h, n_rows))
    out = arena(build.device, shapes)
    idx_p, idx_f, masks, work = out[:4]
    counts = out[4] if compact else fwd.counts
    if h * n_rows > 0:
        config = MaterializeConfig(fwd.bounds.tile_m, fwd.bounds.tile_n, build.nfunc, layout.words_per_tile)
        compiled = compile_q2k_materialize(config)
        compiled(
            *int32_addresses(
                build.mask_func,
                fwd.row_batch_q,
                fwd.desc_q,
                fwd.visible,
                fwd.full,
                fwd.counts,
                counts,
                idx_p,
                idx_f,
                masks,
                device_source_table(layout, build.device),
            ),
            h,
            build.total_q,
            fwd.bounds.q_rows,
            fwd.bounds.k_words,
            n_rows,
            build.batch + 1,
            _extent(nnz_p),
            _extent(nnz_f),
            int(compact),
            persistent_ctas(build.device, h * n_rows),
            build.stream,
        )
    return {
        **_csr(counts, idx_p, masks, idx_f),
        "sequence_desc": fwd.desc_q[: build.batch],
        "fwd_work_desc": work,
    }


def stage_schedule(build: PlanBuild, header: list[int], work: torch.Tensor) -> None:
    """``fwd_work_desc`` (spec 4.8): section stats, then rank/histogram/scatter per section."""
    fwd, g = build.fwd, build.geometry
    n_tasks = work.shape[0]
    if n_tasks == 0:
        return
    params = ScheduleParams.of(g, fwd.config.signature.topology.pack_gqa)
    common = (
        build.hmask,
        fwd.bounds.q_rows,
        build.batch + 1,
        params.num_sections,
    )
    section_args = (
        params.num_heads_kv,
        params.qhead_per_kvhead,
        params.pack_gqa,
        params.mask_per_head,
        params.row_bytes_kv,
        params.budget,
    )
    counts, desc, stats = int32_addresses(fwd.counts, fwd.desc_q, build.stats)
    compile_schedule_stats(ScheduleStatsConfig())(counts, desc, stats, *common, *section_args, build.stream)
    scatter = compile_schedule_scatter(ScheduleScatterConfig.for_max_k_blocks(fwd.bounds.max_k_blocks))
    scatter(
        counts,
        desc,
        stats,
        int32_address(work),
        *common,
        n_tasks,
        *section_args,
        fwd.bounds.tile_m,
        build.stream,
    )


def stage_materialize_k2q(build: PlanBuild, header: list[int]) -> dict[str, torch.Tensor]:
    """Exact-size K2Q CSRs, backward payloads and dQ write order."""
    bwd, h = build.bwd, build.hmask
    layout = bwd.config.layout
    n_k_rows, nnz_p, nnz_f = header[HDR_BWD_K_ROWS], header[HDR_BWD_PARTIAL], header[HDR_BWD_FULL]
    shapes = [
        (nnz_p,),
        (nnz_f,),
        (nnz_p,),
        (nnz_f,),
        (nnz_p, layout.subtiles, layout.groups, layout.words_per_group),
    ]
    compact = bwd.bounds.k_rows != n_k_rows
    if compact:
        shapes.append((4, h, n_k_rows))
    out = arena(build.device, shapes)
    idx_p, idx_f, dq_p, dq_f, masks = out[:5]
    counts = out[5] if compact else bwd.k2q_counts
    if h * n_k_rows > 0:
        config = MaterializeConfig(bwd.bounds.tile_m, bwd.bounds.tile_n, build.nfunc, layout.words_per_tile)
        compiled = compile_k2q_materialize(config)
        compiled(
            *int32_addresses(
                build.mask_func,
                bwd.row_batch_k,
                bwd.desc_q,
                bwd.desc_k,
                bwd.visible,
                bwd.full,
                bwd.k2q_counts,
                counts,
                idx_p,
                idx_f,
                dq_p,
                dq_f,
                masks,
                device_source_table(layout, build.device),
            ),
            h,
            build.total_q,
            _extent(bwd.bounds.q_rows),
            bwd.bounds.k_rows,
            bwd.bounds.k_words,
            n_k_rows,
            build.batch + 1,
            _extent(nnz_p),
            _extent(nnz_f),
            int(compact),
            persistent_ctas(build.device, h * n_k_rows),
            build.stream,
        )
    return {
        **_csr(counts, idx_p, masks, idx_f),
        "sequence_desc": bwd.desc_k[: build.batch],
        "dq_write_order": dq_p,
        "dq_write_order_full": dq_f,
    }
