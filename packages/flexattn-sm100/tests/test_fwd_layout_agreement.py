"""The SM100 forward kernels test the bit the payload layout assigns (spec 5.1, 9.5), on CPU.

``fwd_fragment_probe.py`` traces the kernel's own softmax-fragment builder
(:meth:`Sm100FwdKernel.softmax_fragments`, compile-time only, ``CUTE_DSL_ARCH=sm_100a``) with the
kernel's own MMA slice of every payload subtile ``r`` (qstage1-1cta and d256: rank 0 only; qstage1-2cta:
both CTAs of the pair; qstage2-1cta: both q stages' softmax warpgroups) and reports, for every softmax
thread ``t`` and register ``e``, the score element ``(m, n)`` of the plan block that the tcgen05.ld
32x32b copy puts in ``rS[e]``. The kernel keeps ``rS[e]`` iff
bit ``e % 32`` of its payload word ``e // 32`` of group ``t`` in plane ``payload_plane_index(entry,
r)`` is set (``apply_packed_predicate``; 1CTA loads the words from GMEM, 2CTA from a stage of the
SMEM ring the load warp fills with that plane). So agreement means, for all ``r, t, e``::

    layout.element_coords()[m, n] == (subtile r, group t, word e // 32, bit e % 32)

and the addressing checks say the words read are those of ``mask_block_masks[entry, r, t, :]``.
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
#: (head_dim_qk, head_dim_v, dtype, variant); one probe process for all
CASES = [
    (128, 128, "bfloat16", "qstage1-1cta"),
    (32, 32, "bfloat16", "qstage1-1cta"),
    (128, 128, "bfloat16", "qstage1-2cta"),
    (128, 128, "bfloat16", "qstage2-1cta"),
    (256, 256, "bfloat16", "d256"),
]
#: payload subtiles of each variant: CTA ranks (2CTA) or q stages (qstage2)
SUBTILES = {"qstage1-1cta": 1, "qstage1-2cta": 2, "qstage2-1cta": 2, "d256": 1}


def case_id(case) -> str:
    """``variant-DqkxDv``: the key of the case's probe result."""
    return f"{case[3]}-{case[0]}x{case[1]}"


IDS = [case_id(case) for case in CASES]


@pytest.fixture(scope="module")
def probed() -> dict[str, dict]:
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_100a", "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(CASES)], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return dict(zip(IDS, json.loads(run.stdout.splitlines()[-1]), strict=True))


def layout_of(case):
    return select_fwd_config(
        head_dim_qk=case[0], head_dim_v=case[1], dtype=case[2], variant=case[3]
    ).payload_layout


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bit_tested_is_bit_assigned(case, probed):
    layout = layout_of(case)
    ranks = SUBTILES[case[3]]
    assert (layout.subtiles, layout.groups, layout.words_per_group) == (ranks, 128, 4)
    subtile, group, word, bit = layout.element_coords()
    per_rank = torch.tensor(probed[case_id(case)]["s"])  # [rank, thread, register, (m, n)]
    assert per_rank.shape == (ranks, layout.groups, layout.elements_per_thread, 2)
    for r in range(ranks):
        m, n = per_rank[r, ..., 0], per_rank[r, ..., 1]
        t = torch.arange(layout.groups).view(-1, 1).expand_as(m)
        e = torch.arange(layout.elements_per_thread).view(1, -1).expand_as(m)
        assert bool((subtile[m, n] == r).all()), f"rank {r}: registers outside its payload subtile"
        assert torch.equal(group[m, n], t), f"rank {r}: register rows disagree with the payload groups"
        assert torch.equal(word[m, n], e // 32), f"rank {r}: register order disagrees with the words"
        assert torch.equal(bit[m, n], e % 32), f"rank {r}: register order disagrees with the bits"
    # and the registers of all ranks cover the plan block exactly once
    m, n = per_rank[..., 0], per_rank[..., 1]
    assert torch.unique(m * layout.tile_n + n).numel() == layout.tile_m * layout.tile_n == m.numel()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_words_read_are_the_entry_plane_of_the_cta(case, probed):
    """The words the kernel reads for (entry, rank r, thread t), packed by the layout's own packer
    from a random tile, reproduce the tile at the elements of r's registers: plane index, in-plane
    (group, word) offset and, for the SMEM ring, the stage layout agree with ``mask_block_masks``."""
    layout, got = layout_of(case), probed[case_id(case)]
    plane_words = got["plane_words"]
    assert plane_words == layout.groups * layout.words_per_group
    entries = got["entries"]
    shape = (max(entries) + 1, layout.tile_m, layout.tile_n)
    tiles = torch.rand(shape, generator=torch.Generator().manual_seed(0)) < 0.5
    flat = layout.pack(tiles).reshape(-1)  # mask_block_masks as the kernel sees it: [nnz * plane_words]
    if got["mask_stages"]:  # the ring stage holds the plane in GMEM order: word w of group t at t * W + w
        ring = torch.tensor(got["ring"])
        expected = torch.arange(plane_words).view(layout.groups, layout.words_per_group)
        assert torch.equal(ring, expected)
    coords = torch.tensor(got["s"])  # [rank, thread, register, (m, n)]
    for i, entry in enumerate(entries):
        for r, plane in enumerate(got["planes"][i]):
            words = flat[plane * plane_words : (plane + 1) * plane_words].view(layout.groups, -1)
            e = torch.arange(layout.elements_per_thread)
            bits = (words[:, e // 32] >> (e % 32)) & 1  # [thread, register]: the bit the kernel tests
            m, n = coords[r, ..., 0], coords[r, ..., 1]
            assert torch.equal(bits.bool(), tiles[entry][m, n]), f"entry {entry} rank {r}"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_packed_p_and_o_chunk_registers_are_row_ordered(case, probed):
    for key in ("p", "o"):
        per_rank = torch.tensor(probed[case_id(case)][key])  # [rank, thread, registers, (row, column)]
        for r, regs in enumerate(per_rank):
            threads, count, _ = regs.shape
            assert threads == 128
            rows = 128 * r + torch.arange(128).view(-1, 1).expand(128, count)
            assert torch.equal(regs[..., 0], rows), (key, r)
            assert torch.equal(regs[..., 1], torch.arange(count).view(1, -1).expand(128, count)), (key, r)
