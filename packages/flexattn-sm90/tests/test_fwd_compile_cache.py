"""The SM90 forward kernel goes through the project's compile cache (maskplan_kernels.compile_cache):
compiled once per key and process, written to disk, and loaded (not compiled) by a later process.
Compile-only: running the loaded kernel is tested on the GPU."""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # the launcher also passes --gpu-arch sm_90a

import pytest

pytest.importorskip("cutlass.cute")

tvm_ffi = pytest.importorskip("tvm_ffi")

from flexattn_sm90.fwd_launch import (  # noqa: E402
    DEFAULT_SCHEDULE,
    GPU_ARCH,
    SOURCE_PACKAGES,
    compile_forward,
    kernel_key,
)
from flexattn_sm90.heuristics import select_fwd_config  # noqa: E402
from maskplan_kernels import compile_cache  # noqa: E402
from maskplan_kernels.compile_cache import CALL_OPTIONS  # noqa: E402


def test_forward_kernel_is_cached_on_disk_and_loaded_back(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLEXATTN_CACHE", "1")
    monkeypatch.setattr(compile_cache, "_MEMORY", {})
    config = select_fwd_config(head_dim_qk=64, head_dim_v=64, dtype="float16")
    before = dict(compile_cache.STATS)
    compiled = compile_forward(config, with_max_logit=True)
    assert compile_forward(config, with_max_logit=True) is compiled
    key = kernel_key(config, mask_via_smem=True, with_max_logit=True, schedule=DEFAULT_SCHEDULE)
    assert key in compile_cache.cached_keys()
    (entry,) = (tmp_path / "kernels").glob("sm90-fwd-*.o")
    options = f"--gpu-arch {GPU_ARCH} {CALL_OPTIONS}"
    disk_key = compile_cache.make_key(key, options=options, packages=SOURCE_PACKAGES)
    assert entry.name == disk_key.filename and disk_key.arch == "sm_90a"
    assert [p[0] for p in disk_key.packages] == ["flexattn_sm90", "maskplan_kernels", "maskplan_core"]

    monkeypatch.setattr(compile_cache, "_MEMORY", {})  # a "new process"
    loaded = compile_forward(config, with_max_logit=True)
    delta = {k: v - before.get(k, 0) for k, v in compile_cache.STATS.items()}
    assert delta["compile"] == 1 and delta["disk_hit"] == 1 and delta["write"] == 1
    # both are TVM-FFI functions: the launch convention of run_forward (running them needs a GPU)
    assert isinstance(loaded, tvm_ffi.Function) and "TVMFFI" in type(compiled).__name__
