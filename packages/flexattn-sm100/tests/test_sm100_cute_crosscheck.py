"""Layout maths against CuTe DSL: the tcgen05 32x32b TMEM load of the QK accumulator must own the
same elements as the payload layout, and the forward's V^T stage must be the rows
``stage_fill.row_view`` hands the tail zeroing. Compile-time only (no GPU; ``cute_probe_sm100.py``
runs in a fresh interpreter with ``CUTE_DSL_ARCH=sm_100a``). These are the only checks the SM100
layouts have had: they have never run on SM100 hardware.

Covered: the forward 1CTA M128 and 2CTA M256 QK accumulators (subtile = CTA rank); the 1CTA
forward's V^T stage at every Dv tile width. Not covered: the backward's two-warpgroup column split
of S^T, which needs the kernel's own TMEM copy builder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexattn_sm100.payload_layout import TmemLoadLayout
from maskplan_kernels.testing import assert_row_view

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("cutlass") is None, reason="CuTe DSL (cutlass) not installed"
    ),
]

THREADS = [0, 1, 31, 32, 77, 127]
CASES = [(128, 128, 1), (256, 128, 2)]  # (tile_m, tile_n, cta_group_size)
PROBE = Path(__file__).with_name("cute_probe_sm100.py")


def _probe(kind: str, args: list) -> list:
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_100a", "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(
        [sys.executable, str(PROBE), kind, json.dumps(args)], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def cute_fragments() -> dict[tuple, list]:
    args = [(*case, THREADS) for case in CASES]
    return dict(zip(CASES, _probe("fragments", args), strict=True))


@pytest.mark.parametrize("case", CASES, ids=["m128-1cta", "m256-2cta"])
def test_layout_equals_cute_tmem_load(case, cute_fragments):
    tile_m, tile_n, _ = case
    layout = TmemLoadLayout(tile_m, tile_n)
    ranks = cute_fragments[case]
    assert len(ranks) == layout.subtiles
    for rank, per_thread in enumerate(ranks):  # subtile == CTA rank
        for t, regs in zip(THREADS, per_thread, strict=True):
            assert [list(x) for x in layout.thread_elements(t, subtile=rank)] == regs, (
                f"rank {rank} thread {t}"
            )


# (head_dim_v, tile_n) of the forward's V^T stages: every Dv width class (SW64 and SW128 atoms)
V_TILES = [(32, 128), (64, 128), (96, 128), (128, 128), (192, 128), (256, 128)]


@pytest.fixture(scope="module")
def v_stages() -> dict[tuple, dict]:
    return dict(zip(V_TILES, _probe("v_rows", V_TILES), strict=True))


@pytest.mark.parametrize("tile", V_TILES, ids=str)
def test_v_stage_is_the_row_view_the_tail_zeroing_takes(tile, v_stages):
    """``Sm100FwdKernel.load_kv`` zeroes a tail V^T stage's key rows past the sample through
    ``stage_fill.row_view`` (rows = keys, columns = Dv): that must be CuTe's layout of the stage."""
    assert_row_view(v_stages[tile]["offsets"], tuple(v_stages[tile]["swizzle"]))
