"""The SM100 backward kernel tests the bit the backward payload layout assigns, and reads each SMEM
buffer consistently through both of its MMA roles (spec 5.1, 9.5), on CPU.

``bwd_fragment_probe.py`` traces the kernel's own fragment builders
(:meth:`Sm100BwdKernel.compute_fragments`, :meth:`Sm100BwdKernel.dq_fragments`), its payload
addressing (:meth:`Sm100BwdKernel.payload_offset`, :meth:`Sm100BwdKernel.cta_k_rows`) and its SMEM views
(:func:`bwd_helpers.smem_views`) at compile time (``CUTE_DSL_ARCH=sm_100a``, no GPU), for the k2q-1cta,
k2q-2cta and d256 variants. Compute thread ``t`` of CTA rank ``c`` (k2q-2cta: the pair's two; else
only 0) keeps register ``e`` iff bit ``e % 32`` of word ``e // 32`` of the words it loads at
``payload_offset(entry, c, t)`` is set, and its TMEM lane ``r`` is K row ``cta_k_rows(c) + r`` of the
plan block, so agreement means, for all ``c, t, e``::

    config.payload_layout.element_coords()[m, n] == (c, t, e // 32, e % 32)
    payload_offset(entry, c, t) is the offset of mask_block_masks[entry, c, t, 0]

(k2q-1cta: ``TmemLoadLayout(128, 128, 2, transposed=True)``; k2q-2cta: ``TmemLoadLayout(128, 256, 2,
transposed=True)``, subtile c = rank c's 128 K rows; d256: ``TmemLoadLayout(64, 128, 1,
transposed=True)``) where ``(m, n)`` is the score element the kernel's register ``e`` holds. Nothing
here has run on SM100 hardware.
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

from flexattn_sm100.bwd_helpers import DQ_CHUNK, dq_accum_offset
from flexattn_sm100.config import BWD_VARIANTS, Sm100BwdConfig
from maskplan_kernels.testing import assert_row_view

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("cutlass") is None, reason="CuTe DSL (cutlass) not installed"
    ),
]

PROBE = Path(__file__).with_name("bwd_fragment_probe.py")
#: (variant, Dqk, Dv, dtype)
CASES = (("k2q-1cta", 128, 128, "bfloat16"), ("k2q-1cta", 96, 96, "float16"),
         ("k2q-1cta", 32, 32, "bfloat16"), ("d256", 256, 256, "bfloat16"),
         ("k2q-2cta", 128, 128, "bfloat16"), ("k2q-2cta", 192, 128, "float16"))  # fmt: skip


def payload_layout(case):
    variant, dqk, dv, dtype = case
    config = Sm100BwdConfig(head_dim_qk=dqk, head_dim_v=dv, dtype=dtype, variant=BWD_VARIANTS[variant])
    return config.payload_layout


@pytest.fixture(scope="module")
def probed() -> list[dict]:
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_100a", "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(CASES)], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.splitlines()[-1])


def test_bit_tested_is_bit_assigned(probed):
    # tile_m, tile_n, subtiles (= CTA ranks), groups
    expected = {"k2q-1cta": (128, 128, 1, 256), "k2q-2cta": (128, 256, 2, 256), "d256": (64, 128, 1, 128)}
    assert len(probed) == len(CASES)
    for spec, case in zip(CASES, probed, strict=True):
        layout = payload_layout(spec)
        tm, tn, subtiles, groups = expected[spec[0]]
        assert (layout.tile_m, layout.tile_n, layout.subtiles, layout.groups) == (tm, tn, subtiles, groups)
        assert (layout.words_per_group, layout.elements_per_thread, layout.transposed) == (2, 64, True)
        assert len(case["ranks"]) == subtiles
        subtile, group, word, bit = layout.element_coords()
        coords = torch.tensor(case["s"])  # [thread, register, (m, n)] of the CTA's own K rows
        assert coords.shape == (layout.groups, layout.elements_per_thread, 2)
        t = torch.arange(layout.groups).view(-1, 1).expand(coords.shape[:2])
        e = torch.arange(layout.elements_per_thread).view(1, -1).expand(coords.shape[:2])
        # mask_block_masks[entry, subtile, group, word] of entries 0 and 1, as int32 offsets
        offsets = torch.arange(2 * layout.words_per_tile).view(2, subtiles, groups, layout.words_per_group)
        seen = []
        for c, rank in enumerate(case["ranks"]):
            m, n = coords[..., 0], coords[..., 1] + rank["k_row0"]  # the plan block's K row
            assert bool((subtile[m, n] == c).all()), f"rank {c} tests another CTA's subtile"
            assert torch.equal(group[m, n], t), "register owners disagree with the payload groups"
            assert torch.equal(word[m, n], e // 32), "register order disagrees with the payload words"
            assert torch.equal(bit[m, n], e % 32), "register order disagrees with the payload bits"
            assert rank["offsets"] == offsets[1, c, :, 0].tolist(), f"rank {c} loads another plane's words"
            seen.append(m * layout.tile_n + n)
        assert torch.unique(torch.cat(seen)).numel() == layout.tile_m * layout.tile_n


def test_p_store_and_dq_load_registers_are_row_ordered(probed):
    """P^T register i -> TMEM column i of the thread's own lane (16-bit pairs 2i, 2i + 1); dQ register
    e -> column e of the dQ thread's row, which the dQ run map then places."""
    for case in probed:
        for key in ("p", "dq"):
            regs = torch.tensor(case[key])  # [thread, registers, (row, column)]
            threads, count, _ = regs.shape
            assert threads == 128 and count == 32
            assert torch.equal(regs[..., 0], torch.arange(128).view(-1, 1).expand(128, count))
            assert torch.equal(regs[..., 1], torch.arange(count).view(1, -1).expand(128, count))


def test_each_smem_buffer_agrees_with_itself_in_both_roles(probed):
    """K (A of S^T / B of dQ), Q (B of S^T / B of dK), dO (B of dP^T / B of dV) and dS (A of dK, which
    the compute threads write through / A of dQ) address every element identically."""
    for case in probed:
        for name, check in case["smem"].items():
            assert check["mismatches"] == 0, (name, check)
            assert check["swizzles"][0] == check["swizzles"][1], (name, check)
            assert check["stage_strides"][0] == check["stage_strides"][1], (name, check)


def test_sequence_row_buffers_are_the_row_view_the_tail_zeroing_takes(probed):
    """The load warp zeroes the rows past the sample of K, V (a tail K block) and Q, dO (a sample's
    last Q block) through ``stage_fill.row_view`` with the buffer's swizzle: each buffer's stage
    must be that view (``operand_2d`` of it, itself checked against the MMA's partition)."""
    for spec, case in zip(CASES, probed, strict=True):
        for name, check in case["rows"].items():
            assert check["partition_mismatches"] == 0, (spec, name)
            assert_row_view(check["offsets"], tuple(check["swizzle"]), 16)


def test_dq_accumulator_order_is_a_bijection():
    """The dQ accumulator order of a Q block (bwd_helpers.dq_accum_offset, which the main kernel
    writes and the postprocess reads) covers the stored rows x cols matrix exactly once, a 4 KB run
    per (32 rows, chunk): dQ (128 x D) or d256's dQ^T (256 x 64, rows 128 h .. of half h)."""
    for rows, cols in ((128, 32), (128, 64), (128, 96), (128, 128), (128, 192), (256, 64)):
        offsets = torch.tensor([[dq_accum_offset(r, c, rows) for c in range(cols)] for r in range(rows)])
        assert torch.equal(offsets.flatten().sort().values, torch.arange(rows * cols))
        run = offsets // (32 * DQ_CHUNK)
        w, c = torch.arange(rows).view(-1, 1) // 32, torch.arange(cols).view(1, -1) // DQ_CHUNK
        assert torch.equal(run, c * (rows // 32) + w)
