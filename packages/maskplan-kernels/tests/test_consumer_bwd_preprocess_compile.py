"""CPU tier: the architecture-neutral backward preprocess (``consumer_bwd_preprocess.BwdPreprocess``)
compiles without a GPU for the CI target (sm_90a unless ``CUTE_DSL_ARCH`` says otherwise) at both
consumers' tile_m (SM90: 64, SM100: 128), with and without ``dlse``, and zeroes the dQ accumulator
with 16-byte stores and no register spills. The SM100 package compiles it for sm_100a
(flexattn-sm100 tests/test_sm100_bwd_compile.py)."""

from __future__ import annotations

import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # also when this file is run on its own

pytest.importorskip("cutlass.cute")

import cutlass.cute as cute  # noqa: E402
from cutlass import BFloat16  # noqa: E402

from maskplan_kernels.consumer_bwd_preprocess import BwdPreprocess  # noqa: E402
from maskplan_kernels.consumer_launch import bwd_placeholders  # noqa: E402
from maskplan_kernels.testing import assert_ptxas_clean  # noqa: E402

ARCH = os.environ["CUTE_DSL_ARCH"]
HEAD_DIMS = [(32, 32), (64, 64), (80, 80), (96, 96), (128, 128)]


def _ptx(dq, dv, tile_m, with_dlse, tmp_path, zero_dq_accum=True) -> str:
    kernel = BwdPreprocess(
        dq, dv, "bfloat16", tile_m=tile_m, zero_dq_accum=zero_dq_accum
    )
    compiled = cute.compile(
        kernel.from_pointers, *bwd_placeholders("pre", BFloat16, with_dlse=with_dlse),
        options=f"--gpu-arch {ARCH} --keep-ptx --dump-dir {tmp_path}",
    )  # fmt: skip
    ptx = compiled.__ptx__
    assert f".target {ARCH}" in ptx
    return ptx


@pytest.mark.parametrize("dq,dv", HEAD_DIMS, ids=[f"{a}x{b}" for a, b in HEAD_DIMS])
@pytest.mark.parametrize("tile_m", [64, 128])
@pytest.mark.parametrize("with_dlse", [False, True], ids=["no-dlse", "dlse"])
def test_preprocess_compiles(dq, dv, tile_m, with_dlse, tmp_path):
    ptx = _ptx(dq, dv, tile_m, with_dlse, tmp_path)
    # the dQ accumulator is zeroed with 16-byte stores (sm_100a writes them as v2.b64)
    assert re.search(r"st\.global\.(v4\.[fb]32|v2\.b64)", ptx)
    assert_ptxas_clean(ptx, ARCH, tmp_path)


@pytest.mark.parametrize("zero_dq_accum", [True, False], ids=["zeroes", "leaves"])
def test_dq_accumulator_zeroing_is_optional(zero_dq_accum, tmp_path):
    """The 16-byte stores are the accumulator's zeroing; without it only LSE2, D and the turnstile
    counts are written."""
    ptx = _ptx(128, 128, 64, False, tmp_path, zero_dq_accum=zero_dq_accum)
    assert bool(re.search(r"st\.global\.(v4\.[fb]32|v2\.b64)", ptx)) == zero_dq_accum
    assert_ptxas_clean(ptx, ARCH, tmp_path)


@pytest.mark.parametrize("dq,dv", [(96, 80), (64, 48), (128, 72)])
def test_o_rows_of_any_multiple_of_8(dq, dv, tmp_path):
    """O / dO rows whose 16-byte pieces do not split evenly over a row's 4 threads (the SM90 kernels
    run such head dims on the next kernel up, whose dQ accumulator is ``dq`` wide): each thread
    loads its pieces inside the row, one 16-byte load per piece and tensor."""
    ptx = _ptx(dq, dv, 64, False, tmp_path)
    assert len(re.findall(r"ld\.global(\.\w+)*\.v4\.[bu]32", ptx)) == 2 * -(-dv // 32)
    assert_ptxas_clean(ptx, ARCH, tmp_path)


def test_head_dims_must_split_into_vectors():
    with pytest.raises(ValueError, match="16-byte vectors"):
        BwdPreprocess(64, 44, "bfloat16", tile_m=64)
