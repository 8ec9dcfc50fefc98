"""The SM100 forward kernel tests the bit the payload layout assigns (spec 5.1, 9.5), on CPU.

``fwd_fragment_probe.py`` traces the kernel's own softmax-fragment builder
(:meth:`Sm100FwdKernel.softmax_fragments`, compile-time only, ``CUTE_DSL_ARCH=sm_100a``) and reports,
for every softmax thread ``t`` and register ``e``, the score element ``(m, n)`` the tcgen05.ld 32x32b
copy puts in ``rS[e]``. The kernel keeps ``rS[e]`` iff bit ``e % 32`` of its payload word ``e // 32``
of group ``t`` is set (``fwd_helpers.apply_packed_predicate``, words loaded at
``(entry * groups + t) * words_per_group``). So agreement means, for all ``t, e``::

    layout.element_coords()[m, n] == (subtile 0, group t, word e // 32, bit e % 32)

It also checks the two other per-thread fragments whose register order the kernel relies on: the
packed P store (register ``j`` -> TMEM column ``j``, holding P columns ``2j, 2j + 1``) and the O
chunk load (register ``e`` -> O column ``e``, stored to GMEM as a contiguous row). Nothing here has
run on SM100 hardware.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexattn_sm100.heuristics import select_fwd_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("cutlass") is None, reason="CuTe DSL (cutlass) not installed"
    ),
]

PROBE = Path(__file__).with_name("fwd_fragment_probe.py")
CASE = (128, 128, "bfloat16")


@pytest.fixture(scope="module")
def kernel_fragments() -> dict[str, list]:
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_100a", "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(
        [sys.executable, str(PROBE), json.dumps([CASE])], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.splitlines()[-1])[0]


def test_bit_tested_is_bit_assigned(kernel_fragments):
    layout = select_fwd_config(
        head_dim_qk=CASE[0], head_dim_v=CASE[1], dtype=CASE[2], variant="qstage1-1cta"
    ).payload_layout
    assert (layout.subtiles, layout.groups, layout.words_per_group) == (1, 128, 4)
    subtile, group, word, bit = layout.element_coords()
    coords = torch.tensor(kernel_fragments["s"])  # [thread, register, (m, n)]
    assert coords.shape == (layout.groups, layout.elements_per_thread, 2)
    m, n = coords[..., 0], coords[..., 1]
    t = torch.arange(layout.groups).view(-1, 1).expand_as(m)
    e = torch.arange(layout.elements_per_thread).view(1, -1).expand_as(m)
    assert bool((subtile[m, n] == 0).all())
    assert torch.equal(group[m, n], t), "register rows disagree with the payload groups"
    assert torch.equal(word[m, n], e // 32), "register order disagrees with the payload words"
    assert torch.equal(bit[m, n], e % 32), "register order disagrees with the payload bits"
    # and the registers cover the tile exactly once
    assert torch.unique(m * layout.tile_n + n).numel() == layout.tile_m * layout.tile_n


def test_packed_p_and_o_chunk_registers_are_row_ordered(kernel_fragments):
    p = torch.tensor(kernel_fragments["p"])  # [thread, 64, (row, packed column)]
    o = torch.tensor(kernel_fragments["o"])  # [thread, 32, (row, column)]
    for regs in (p, o):
        threads, count, _ = regs.shape
        assert threads == 128
        assert torch.equal(regs[..., 0], torch.arange(128).view(-1, 1).expand(128, count))
        assert torch.equal(regs[..., 1], torch.arange(count).view(1, -1).expand(128, count))
