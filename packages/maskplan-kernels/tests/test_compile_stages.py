"""CPU tier: every planner stage kernel compiles for the CI target without a GPU and without allocating.

``conftest.py`` sets ``CUTE_DSL_ARCH`` (sm_90a by default) before cutlass is imported. The configs
cover what ``build_plan_gpu`` asks for: forward-only and backward geometry kernels, 2- and 4-array
scans, the SM90 / row-major payload shapes (words per tile 512, 256, 384 with a tile_n tail),
nfunc 1..9, and the schedule's bin classes (S = 8k, 128k, 1M keys at tile_n 128).
"""

from __future__ import annotations

import os
import re
import time

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # also when this file is run on its own

import torch  # noqa: E402

from maskplan_kernels._tile_packer import MaterializeConfig  # noqa: E402
from maskplan_kernels.geometry import GeometryConfig, compile_geometry  # noqa: E402
from maskplan_kernels.k2q_count import K2QCountConfig, compile_k2q_count  # noqa: E402
from maskplan_kernels.materialize_k2q import compile_k2q_materialize  # noqa: E402
from maskplan_kernels.materialize_q2k import compile_q2k_materialize  # noqa: E402
from maskplan_kernels.scan_header import ScanConfig, compile_scan_header  # noqa: E402
from maskplan_kernels.schedule_scatter import ScheduleScatterConfig, compile_schedule_scatter  # noqa: E402
from maskplan_kernels.schedule_stats import ScheduleStatsConfig, compile_schedule_stats  # noqa: E402
from maskplan_kernels.testing import ptxas_report, unchecked_by_ptxas  # noqa: E402

MATERIALIZE = [
    MaterializeConfig(tile_m=128, tile_n=128, nfunc=1, words_per_tile=512),  # SM90 fwd / row-major 128x128
    MaterializeConfig(tile_m=64, tile_n=128, nfunc=5, words_per_tile=256),  # SM90 bwd (S^T)
    MaterializeConfig(tile_m=128, tile_n=80, nfunc=9, words_per_tile=384),  # tile_n tail (row-major)
    MaterializeConfig(tile_m=16, tile_n=32, nfunc=3, words_per_tile=16, num_warps=4),  # tiny tile, few warps
]

STAGES = [
    ("geometry-fwd", compile_geometry, GeometryConfig(has_backward=False)),
    ("geometry-bwd", compile_geometry, GeometryConfig(has_backward=True)),
    ("scan-2", compile_scan_header, ScanConfig(num_arrays=2)),
    ("scan-4", compile_scan_header, ScanConfig(num_arrays=4)),
    ("k2q-count", compile_k2q_count, K2QCountConfig()),
    ("schedule-stats", compile_schedule_stats, ScheduleStatsConfig()),
    *[
        (f"schedule-scatter-{k}", compile_schedule_scatter, ScheduleScatterConfig.for_max_k_blocks(k))
        for k in (64, 1024, 8192)
    ],
    *[(f"q2k-{c.tile_m}x{c.tile_n}-nf{c.nfunc}", compile_q2k_materialize, c) for c in MATERIALIZE],
    *[(f"k2q-{c.tile_m}x{c.tile_n}-nf{c.nfunc}", compile_k2q_materialize, c) for c in MATERIALIZE],
]

COMPILE_TIMES: dict[str, float] = {}


@pytest.mark.parametrize("name, compile_fn, config", STAGES, ids=[s[0] for s in STAGES])
def test_stage_compiles_without_gpu(name, compile_fn, config):
    cuda_was_initialized = torch.cuda.is_initialized()
    start = time.perf_counter()
    compiled = compile_fn(config)
    elapsed = time.perf_counter() - start
    COMPILE_TIMES[name] = elapsed
    assert compiled is not None
    assert compile_fn(config) is compiled  # one compile per static config
    if not cuda_was_initialized:
        assert not torch.cuda.is_initialized()  # compiling neither allocates nor synchronises
    assert elapsed < 30, f"{name}: compile took {elapsed:.1f} s"


def test_configs_reject_bad_static_parameters():
    with pytest.raises(ValueError, match="odd"):
        MaterializeConfig(tile_m=128, tile_n=128, nfunc=4, words_per_tile=512)
    with pytest.raises(ValueError, match="table registers"):
        MaterializeConfig(tile_m=256, tile_n=256, nfunc=1, words_per_tile=4096, num_warps=4)
    with pytest.raises(ValueError, match="num_arrays"):
        ScanConfig(num_arrays=3)
    with pytest.raises(ValueError, match="shared"):
        ScheduleScatterConfig(bins=1 << 16, num_warps=8)
    with pytest.raises(ValueError, match="num_threads"):
        GeometryConfig(has_backward=False, num_threads=100)


def test_scatter_bins_cover_every_cost():
    for max_k in (0, 1, 31, 32, 64, 1000, 1024, 8191, 16383):
        cfg = ScheduleScatterConfig.for_max_k_blocks(max_k)
        assert cfg.bins >= max_k + 1
        assert (cfg.num_warps + 1) * cfg.bins * 4 <= 227 * 1024


@pytest.mark.parametrize("name, compile_fn, config", STAGES, ids=[s[0] for s in STAGES])
def test_stage_ptx_assembles_for_sm90a(name, compile_fn, config, tmp_path):
    """ptxas accepts the PTX, and the launch fits one SM (registers x threads <= 64K, little spilling)."""
    compiled = compile_fn(config, options=f"--keep-ptx --dump-dir {tmp_path}")
    report = ptxas_report(compiled.__ptx__, "sm_90a", tmp_path)
    if report is None:
        unchecked_by_ptxas("sm_90a")
        return
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", report))
    threads = int(re.search(r"\.reqntid (\d+)", compiled.__ptx__).group(1))
    assert registers * threads <= 64 * 1024, f"{name}: {registers} registers x {threads} threads"
    assert spills <= 256, f"{name}: {spills} bytes of spill stores\n{report}"
