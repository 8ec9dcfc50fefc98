"""The layout against CuTe DSL itself: the TiledMma the kernel will build must own the same elements.

Compile-time only (no GPU): ``cute_probe_sm90.py`` runs in a fresh interpreter with
``CUTE_DSL_ARCH=sm_90a`` and reports each thread's ``partition_C`` of an identity tensor, i.e. the
accumulator coordinates of its registers in register order.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexattn_sm90.payload_layout import WgmmaAccumulatorLayout

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("cutlass") is None, reason="CuTe DSL (cutlass) not installed"
    ),
]

CASES = [
    (128, 128, 2, False), (128, 64, 2, False), (128, 128, 2, True), (64, 128, 2, True), (64, 64, 2, True),
    (64, 96, 2, False),
]  # fmt: skip
PROBE = Path(__file__).with_name("cute_probe_sm90.py")


@pytest.fixture(scope="module")
def cute_fragments() -> dict[tuple, list]:
    layouts = [WgmmaAccumulatorLayout(m, n, w, transposed=t) for m, n, w, t in CASES]
    args = [(lay.acc_rows, lay.acc_cols, (lay.wg_m, lay.wg_n, 1)) for lay in layouts]
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(args)], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return dict(zip(CASES, json.loads(run.stdout.splitlines()[-1]), strict=True))


@pytest.mark.parametrize("case", CASES, ids=[f"{m}x{n}-wg{w}-{'kq' if t else 'qk'}" for m, n, w, t in CASES])
def test_layout_equals_cute_tiled_mma(case, cute_fragments):
    tile_m, tile_n, num_warpgroups, transposed = case
    layout = WgmmaAccumulatorLayout(tile_m, tile_n, num_warpgroups, transposed=transposed)
    frags = cute_fragments[case]
    assert len(frags) == layout.groups
    for t, regs in enumerate(frags):
        acc = [[n, m] if transposed else [m, n] for m, n in layout.thread_elements(t)]
        assert acc == regs, f"thread {t}"
