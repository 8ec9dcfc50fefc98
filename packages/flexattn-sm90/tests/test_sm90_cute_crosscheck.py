"""Layout maths against CuTe DSL itself: the TiledMma the kernel will build must own the same
elements as the payload layout, and the rows ``maskplan_kernels.stage_fill.zero_rows`` zeroes as
contiguous runs must be exactly a swizzled SMEM tile's rows past the sample.

Compile-time only (no GPU): ``cute_probe_sm90.py`` runs in a fresh interpreter with
``CUTE_DSL_ARCH=sm_90a`` and reports each thread's ``partition_C`` of an identity tensor (the
accumulator coordinates of its registers in register order), or an SMEM layout's offsets.
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


def _probe(kind: str, args: list) -> list:
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(
        [sys.executable, str(PROBE), kind, json.dumps(args)], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def cute_fragments() -> dict[tuple, list]:
    layouts = [WgmmaAccumulatorLayout(m, n, w, transposed=t) for m, n, w, t in CASES]
    args = [(lay.acc_rows, lay.acc_cols, (lay.wg_m, lay.wg_n, 1)) for lay in layouts]
    return dict(zip(CASES, _probe("fragments", args), strict=True))


@pytest.mark.parametrize("case", CASES, ids=[f"{m}x{n}-wg{w}-{'kq' if t else 'qk'}" for m, n, w, t in CASES])
def test_layout_equals_cute_tiled_mma(case, cute_fragments):
    tile_m, tile_n, num_warpgroups, transposed = case
    layout = WgmmaAccumulatorLayout(tile_m, tile_n, num_warpgroups, transposed=transposed)
    frags = cute_fragments[case]
    assert len(frags) == layout.groups
    for t, regs in enumerate(frags):
        acc = [[n, m] if transposed else [m, n] for m, n in layout.thread_elements(t)]
        assert acc == regs, f"thread {t}"


# (rows, cols, major) of the SMEM tiles the kernels zero rows of: Q / dO (tile_m rows), K / V
# (tile_n rows), every head dim, each contiguous run (major) their readers ask for; None: all cols
SMEM_TILES = [
    (rows, cols, major)
    for rows in (64, 96, 128)
    for cols in (32, 64, 96, 128, 192, 256)
    for major in (None, 16, 32, 48, 64)
    if major is None or (cols % major == 0 and major < cols)
]


@pytest.fixture(scope="module")
def smem_offsets() -> dict[tuple, dict]:
    return dict(zip(SMEM_TILES, _probe("smem_rows", SMEM_TILES), strict=True))


def _swizzled_piece(element_offset: int, swizzle: list[int]) -> int:
    """The 16-byte piece a bf16 element lands in: the tile's swizzle acts on byte addresses (SMEM
    tensors carry it on their pointer), ``Swizzle<bits, base, shift>``."""
    bits, base, shift = swizzle
    byte = 2 * element_offset
    yyy = ((1 << bits) - 1) << (base + shift)
    return (byte ^ ((byte & yyy) >> shift)) // 16


@pytest.mark.parametrize("tile", SMEM_TILES, ids=str)
def test_zero_rows_runs_are_the_rows_past_the_sample(tile, smem_offsets):
    """``zero_rows``' run formula, restated here (the kernel code itself runs on the GPU only): per
    column block of ``w`` = offset(1, 0) columns, the bytes of elements [block * rows * w + first *
    w, (block + 1) * rows * w) through a plain pointer (``toint`` of the tile's swizzled pointer is
    its raw address). Checked: those bytes hold exactly the pieces of rows ``first`` and after,
    where CuTe's swizzled layout places them. The GPU suites check the zeroed tails' results."""
    rows, cols, _ = tile
    probe = smem_offsets[tile]
    offsets, swizzle = probe["offsets"], probe["swizzle"]
    w = offsets[1][0] - offsets[0][0]
    assert cols % w == 0
    assert all(offsets[0][c // 8] == (c // w) * rows * w + c % w for c in range(0, cols, 8))
    for first in range(rows + 1):
        want = {_swizzled_piece(o, swizzle) for row in offsets[first:] for o in row}
        runs = {
            2 * e // 16
            for block in range(cols // w)
            for e in range(block * rows * w + first * w, (block + 1) * rows * w, 8)
        }
        assert runs == want, f"first row {first}"
