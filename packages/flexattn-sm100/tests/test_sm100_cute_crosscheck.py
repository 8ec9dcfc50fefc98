"""The layout against CuTe DSL: the tcgen05 32x32b TMEM load of the QK accumulator must own the same
elements. Compile-time only (no GPU; ``cute_probe_sm100.py`` runs in a fresh interpreter with
``CUTE_DSL_ARCH=sm_100a``). This is the only check the SM100 layout has had: it has never run on SM100
hardware.

Covered: the forward 1CTA M128 and 2CTA M256 QK accumulators (subtile = CTA rank). Not covered: the
backward's two-warpgroup column split of S^T, which needs the kernel's own TMEM copy builder.
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

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("cutlass") is None, reason="CuTe DSL (cutlass) not installed"
    ),
]

THREADS = [0, 1, 31, 32, 77, 127]
CASES = [(128, 128, 1), (256, 128, 2)]  # (tile_m, tile_n, cta_group_size)
PROBE = Path(__file__).with_name("cute_probe_sm100.py")


@pytest.fixture(scope="module")
def cute_fragments() -> dict[tuple, list]:
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_100a", "PYTHONPATH": os.pathsep.join(sys.path)}
    args = [(*case, THREADS) for case in CASES]
    run = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(args)], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return dict(zip(CASES, json.loads(run.stdout.splitlines()[-1]), strict=True))


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
