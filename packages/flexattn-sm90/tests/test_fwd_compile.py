"""Compile-only tests of the SM90 forward kernel: it traces and compiles to sm_90a on a machine
without a GPU (fake tensors, no CUDA allocation), and its PTX has the instructions the design
promises (WGMMA, TMA, the payload bulk copy, the atomic scheduler) with no register spills."""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # the launcher also passes --gpu-arch sm_90a

import re

import pytest

pytest.importorskip("cutlass.cute")

from flexattn_sm90.config import SMEM_LIMIT, SMEM_RESERVE  # noqa: E402
from flexattn_sm90.fwd_launch import DEFAULT_SCHEDULE, compile_uncached, kernel_key  # noqa: E402
from flexattn_sm90.heuristics import SUPPORTED_HEAD_DIMS, select_fwd_config  # noqa: E402
from maskplan_kernels.testing import (  # noqa: E402
    assert_ptxas_clean,
    assert_waits_before_global_access,
    integer_divisions,
    wgmma_shapes,
)


def _compile(dq=128, dv=128, dtype="bfloat16", *, smem=True, max_logit=False, tmp_path=None):
    config = select_fwd_config(head_dim_qk=dq, head_dim_v=dv, dtype=dtype)
    extra = f"--keep-ptx --dump-dir {tmp_path}" if tmp_path is not None else ""
    compiled = compile_uncached(config, mask_via_smem=smem, with_max_logit=max_logit, extra_options=extra)
    return config, compiled


@pytest.mark.parametrize("smem", [True, False], ids=["smem-pipeline", "direct-payload"])
@pytest.mark.parametrize("dq,dv", SUPPORTED_HEAD_DIMS)
def test_compiles_every_head_dim(dq, dv, smem, tmp_path):
    """Both payload deliveries are production paths (run_forward picks one per view)."""
    config, compiled = _compile(dq, dv, smem=smem, tmp_path=tmp_path)
    ptx = compiled.__ptx__
    assert ".target sm_90a" in ptx
    shapes = wgmma_shapes(ptx)
    # S = Q K^T is m64n{tile_n}, O += P V is m64n{Dv}; the default (overlap) schedule issues
    # Dqk/16 and tile_n/16 of them at three sites each (its first S / last PV and two loops)
    qk, pv = f"m64n{config.tile_n}k16", f"m64n{dv}k16"
    expect = {qk: 3 * dq // 16}
    expect[pv] = expect.get(pv, 0) + 3 * config.tile_n // 16
    assert shapes == expect
    # the O epilogue: per thread Dv / 16 stmatrix.x4 (a warp's 16 rows x Dv) into SMEM, then Dv / 16
    # 16-byte row pieces (a warpgroup's 64 rows x Dv over 128 threads); no 2- or 4-byte O stores
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.shared.b16") == dv // 16
    assert ptx.count("st.global.v4.b32") == dv // 16
    assert "st.global.b16" not in ptx and "st.global.v2.b32" not in ptx
    assert_ptxas_clean(ptx, "sm_90a", tmp_path)


@pytest.mark.parametrize("dq,dv", [(72, 72), (48, 48), (64, 128), (128, 64), (160, 128)])
def test_compiles_tensors_narrower_than_the_kernel(dq, dv, tmp_path):
    """Head dims without a kernel run on the next kernel up, reading the tensors at their own head
    dims (TMA zero-fills the rest of each tile) and storing only O's columns: its chunks that hold
    any (16-byte pieces past Dv skipped per thread), no more stores than the kernel's own."""
    config, compiled = _compile(dq, dv, tmp_path=tmp_path)
    assert config.io_head_dims == (dq, dv) and (config.head_dim_qk, config.head_dim_v) != (dq, dv)
    native = select_fwd_config(head_dim_qk=config.head_dim_qk, head_dim_v=config.head_dim_v, dtype="bfloat16")
    kw = {"mask_via_smem": True, "with_max_logit": False, "schedule": DEFAULT_SCHEDULE}
    assert kernel_key(config, **kw) != kernel_key(native, **kw)
    ptx = compiled.__ptx__
    chunk = config.o_chunk_cols
    assert ptx.count("st.global.v4.b32") == -(-dv // chunk) * chunk // 16
    assert "cp.async.bulk.tensor" in ptx
    assert_ptxas_clean(ptx, "sm_90a", tmp_path)


@pytest.mark.parametrize(
    "dq,dv,group", [(64, 64, 1), (128, 128, 1), (192, 128, 1), (256, 256, 1), (128, 128, 4), (72, 72, 1)]
)
def test_compiles_rows_per_sample(dq, dv, group, tmp_path):
    """q, k, v read per sample (``[B, S, H, D]`` views of ``[B, H, S, D]``): the same kernel under
    its own key, whose Q / K / V loads are 5-D TMA (head dim, rows of a granule, granules, sample,
    head) where the flat kernel's are 3-D. A load's coordinates divide by the static granule only
    (``ThdHostEntry.sample_rows``): no more integer divisions than the flat kernel's."""
    config = select_fwd_config(
        head_dim_qk=dq, head_dim_v=dv, dtype="bfloat16", pack_gqa=group > 1, qhead_per_kvhead=group
    )
    kw = {"mask_via_smem": True, "with_max_logit": False, "schedule": DEFAULT_SCHEDULE}
    assert kernel_key(config, **kw, per_sample=True) != kernel_key(config, **kw)
    extra = f"--keep-ptx --dump-dir {tmp_path}"
    ptx = compile_uncached(config, **kw, per_sample=True, extra_options=extra).__ptx__
    (tmp_path / "flat").mkdir()
    flat = compile_uncached(config, **kw, extra_options=f"--keep-ptx --dump-dir {tmp_path / 'flat'}").__ptx__
    assert "cp.async.bulk.tensor.5d" in ptx and "cp.async.bulk.tensor.3d" not in ptx
    assert "cp.async.bulk.tensor.3d" in flat and wgmma_shapes(ptx) == wgmma_shapes(flat)
    assert integer_divisions(ptx) == integer_divisions(flat)
    assert_ptxas_clean(ptx, "sm_90a", tmp_path)


@pytest.mark.parametrize("smem", [True, False], ids=["smem-pipeline", "direct-payload"])
def test_d128_instructions(smem, tmp_path):
    _, compiled = _compile(smem=smem, tmp_path=tmp_path)
    ptx = compiled.__ptx__
    assert "cp.async.bulk.tensor" in ptx  # TMA loads of Q/K/V
    assert "atom.global.add.u32" in ptx  # the stream's scheduler counter
    assert_waits_before_global_access(ptx)  # launched with PDL
    assert "setmaxnreg.dec.sync.aligned.u32 \t24" in ptx
    assert "setmaxnreg.inc.sync.aligned.u32 \t240" in ptx
    # spec 6.2: one 2 KB bulk copy per partial block into the SMEM mask stage; direct delivery
    # instead loads each thread's 2 words with one 8-byte load
    has_bulk = re.search(r"cp\.async\.bulk\.shared::c\w*\.global", ptx) is not None
    assert has_bulk == smem
    assert ("ld.global.v2.b32" in ptx) == (not smem)
    assert_ptxas_clean(ptx, "sm_90a", tmp_path)


#: m64n128k16 WGMMAs (8 per 128x128 GEMM) a schedule's code issues: simple: S and PV in the
#: partial and the full loop; overlap: S_0, [S_next, O += PV] in both loops and the last O += PV
SCHEDULE_WGMMAS = {"simple": 2 * (8 + 8), "overlap": 8 + 2 * (8 + 8) + 8}


@pytest.mark.parametrize("schedule", sorted(SCHEDULE_WGMMAS))
def test_schedules_compile(schedule, tmp_path):
    config = select_fwd_config(head_dim_qk=128, head_dim_v=128, dtype="bfloat16")
    extra = f"--keep-ptx --dump-dir {tmp_path}"
    compiled = compile_uncached(
        config, mask_via_smem=True, with_max_logit=False, schedule=schedule, extra_options=extra
    )
    ptx = compiled.__ptx__
    assert wgmma_shapes(ptx) == {"m64n128k16": SCHEDULE_WGMMAS[schedule]}
    # overlap: S and PV in flight together, the consumer waits for the older only, once per loop
    assert ptx.count("wgmma.wait_group.sync.aligned \t1;") == (2 if schedule == "overlap" else 0)
    assert_ptxas_clean(ptx, "sm_90a", tmp_path)  # incl. no WGMMA ptxas serialised


def test_fp16_and_max_logit_compile(tmp_path):
    _, compiled = _compile(dtype="float16", max_logit=True, tmp_path=tmp_path)
    ptx = compiled.__ptx__
    assert wgmma_shapes(ptx) == {"m64n128k16": SCHEDULE_WGMMAS[DEFAULT_SCHEDULE]}
    assert ".f32.f16.f16" in ptx
    assert "atom.global.max.s32" in ptx and "atom.global.min.u32" in ptx  # float atomic max


def test_kernel_key_ignores_runtime_geometry():
    """GQA ratio and varlen-ness are runtime values: one kernel serves them all."""
    a = select_fwd_config(head_dim_qk=128, head_dim_v=128, dtype="bfloat16")
    b = select_fwd_config(head_dim_qk=128, head_dim_v=128, dtype="bfloat16", qhead_per_kvhead=4, varlen=True)
    kw = {"mask_via_smem": True, "with_max_logit": False, "schedule": "simple"}
    assert kernel_key(a, **kw) == kernel_key(b, **kw)
    c = select_fwd_config(head_dim_qk=128, head_dim_v=128, dtype="float16")
    assert kernel_key(a, **kw) != kernel_key(c, **kw)


@pytest.mark.parametrize(
    "dq,dv,group,smem,max_logit",
    [(128, 128, 4, True, True), (128, 128, 16, False, False), (64, 64, 2, True, False),
     (256, 256, 8, True, True), (192, 128, 32, False, True), (96, 96, 128, True, False)],
)  # fmt: skip
def test_pack_gqa_compiles(dq, dv, group, smem, max_logit, tmp_path):
    """PackGQA forward: same GEMMs; the payload plane is 2 KB / G, one word per thread row."""
    config = select_fwd_config(
        head_dim_qk=dq, head_dim_v=dv, dtype="bfloat16", pack_gqa=True, qhead_per_kvhead=group
    )
    extra = f"--keep-ptx --dump-dir {tmp_path}"
    compiled = compile_uncached(config, mask_via_smem=smem, with_max_logit=max_logit, extra_options=extra)
    ptx = compiled.__ptx__
    (tmp_path / "unpacked").mkdir()
    unpacked = _compile(dq, dv, smem=smem, max_logit=max_logit, tmp_path=tmp_path / "unpacked")[1]
    assert wgmma_shapes(ptx) == wgmma_shapes(unpacked.__ptx__)
    has_bulk = re.search(r"cp\.async\.bulk\.shared::c\w*\.global", ptx) is not None
    assert has_bulk == smem
    assert_ptxas_clean(ptx, "sm_90a", tmp_path)


@pytest.mark.parametrize(
    "dq,dv,pack_gqa,want",
    [(64, 64, False, (2, False, 64)), (96, 96, False, (2, False, 32)),
     (128, 128, False, (2, False, 64)), (192, 128, False, (1, True, 32)),
     (256, 256, False, (1, False, 128)), (256, 256, True, (1, False, 64)),
     (128, 128, True, (2, False, 128))],
)  # fmt: skip
def test_q_buffers_and_o_epilogue_chunk_fit_smem(dq, dv, pack_gqa, want):
    """Two Q buffers up to D = 128, one with Q after the first K / V block at (192, 128); the O
    staging chunk: a power of two dividing Dv, next to the operand tiles within SMEM."""
    group = 8 if pack_gqa else 1
    config = select_fwd_config(
        head_dim_qk=dq, head_dim_v=dv, dtype="bfloat16", pack_gqa=pack_gqa, qhead_per_kvhead=group
    )
    chunk = config.o_chunk_cols
    assert (config.q_buffers, config.q_after_first_kv, chunk) == want
    assert chunk & (chunk - 1) == 0 and dv % chunk == 0
    assert config.operand_smem_bytes + 2 * config.tile_m * chunk + SMEM_RESERVE <= SMEM_LIMIT


def test_pack_gqa_kernel_key_has_the_group():
    kw = {"mask_via_smem": True, "with_max_logit": False, "schedule": "simple"}
    keys = {
        kernel_key(select_fwd_config(head_dim_qk=128, head_dim_v=128, dtype="bfloat16", pack_gqa=p,
                                     qhead_per_kvhead=g), **kw)
        for p, g in ((False, 2), (False, 4), (True, 2), (True, 4))
    }  # fmt: skip
    assert len(keys) == 3  # unpacked: one kernel for every ratio; packed: one per ratio
