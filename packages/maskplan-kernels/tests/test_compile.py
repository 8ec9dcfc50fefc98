"""CPU tier: every planner kernel compiles for the CI target without a GPU and without allocating.

``conftest.py`` sets ``CUTE_DSL_ARCH`` (sm_90a by default) before cutlass is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # also when this file is run on its own

import torch  # noqa: E402

from maskplan_kernels._cute_args import int32_address  # noqa: E402
from maskplan_kernels.classify import ClassifyConfig, compile_classify  # noqa: E402

# (tile_m, tile_n, nfunc, num_threads, chunk_blocks): the SM90 forward tile, a backward-like tile
# with many endpoints, and a tile taller than the CTA with a small K chunk (multi-chunk path).
CONFIGS = [
    ClassifyConfig(tile_m=128, tile_n=128, nfunc=1),
    ClassifyConfig(tile_m=64, tile_n=128, nfunc=9),
    ClassifyConfig(tile_m=192, tile_n=80, nfunc=5, num_threads=64, chunk_blocks=64),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.tile_m}x{c.tile_n}-nfunc{c.nfunc}")
def test_classify_compiles_without_gpu(config):
    cuda_was_initialized = torch.cuda.is_initialized()  # GPU tests of the same session may have
    start = time.perf_counter()
    compiled = compile_classify(config)
    elapsed = time.perf_counter() - start
    assert compiled is not None
    assert compile_classify(config) is compiled  # cached per static config
    if not cuda_was_initialized:
        assert not torch.cuda.is_initialized()  # compiling neither allocates nor synchronises
    assert elapsed < 30, f"compile took {elapsed:.1f} s"


def test_config_rejects_bad_static_parameters():
    with pytest.raises(ValueError, match="odd"):
        ClassifyConfig(tile_m=128, tile_n=128, nfunc=2)
    with pytest.raises(ValueError, match="num_threads"):
        ClassifyConfig(tile_m=128, tile_n=128, nfunc=1, num_threads=100)
    with pytest.raises(ValueError, match="chunk_blocks"):
        ClassifyConfig(tile_m=128, tile_n=128, nfunc=1, chunk_blocks=48)


def test_int32_address_takes_contiguous_int32_tensors_only():
    t = torch.zeros(3, 4, dtype=torch.int32)
    assert int32_address(t) == t.data_ptr()
    with pytest.raises(ValueError, match="contiguous"):
        int32_address(torch.zeros(4, 6, dtype=torch.int32)[:, ::2])
    with pytest.raises(TypeError, match="int32"):
        int32_address(torch.zeros(4, dtype=torch.int64))


def test_maskplan_core_does_not_import_cutlass():
    code = (
        "import sys, maskplan_core, maskplan_core.reference\n"
        "assert 'cutlass' not in sys.modules, 'maskplan_core imported cutlass'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
