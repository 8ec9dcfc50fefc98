"""Compile-only tests of the SM100 forward kernel (generic qstage1 + 1CTA, qstage2 + 1CTA,
qstage1 + 2CTA, and D256: the qstage1 + 1CTA kernel at (256, 256)): it traces and compiles to sm_100a
on a machine without a GPU (placeholder pointers, no CUDA allocation), its PTX has the instructions
the design promises (tcgen05 MMA into TMEM, 32x32b TMEM loads/stores, TMA, the CLC queue; 1CTA:
direct payload loads; 2CTA: cta_group::2 MMAs, TMA and TMEM allocation, multicast commits and CLC
responses, the SMEM payload ring) and, where ptxas is installed, no register spills.

Compiling is the ONLY verification this kernel has had: no SM100 hardware was available, and it has
never run. Run with ``CUTE_DSL_ARCH=sm_100a`` (the nox session sets it); the DSL fixes its target
once per process, so in a process that already targets another architecture these tests skip.
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")  # the launcher also passes --gpu-arch sm_100a

import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("cutlass.cute")

from flexattn_sm100.config import FWD_VARIANTS, Sm100FwdConfig  # noqa: E402
from flexattn_sm100.fwd_kernel import (  # noqa: E402
    IMPLEMENTED_VARIANTS,
    QSTAGE2_MAX_HEAD_DIM_QK,
    Sm100FwdKernel,
    kv_stages_for,
)
from flexattn_sm100.fwd_launch import (  # noqa: E402
    GPU_ARCH,
    SOURCE_PACKAGES,
    compile_forward,
    compile_uncached,
    kernel_key,
    require_kernel,
    supports,
)
from flexattn_sm100.heuristics import select_fwd_config  # noqa: E402
from maskplan_core.errors import UnsupportedConfigError  # noqa: E402
from maskplan_kernels import compile_cache  # noqa: E402
from maskplan_kernels.testing import assert_ptxas_clean, ptxas_report, unchecked_by_ptxas  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("CUTE_DSL_ARCH") != "sm_100a",
    reason="the CuTe DSL target is fixed per process; run with CUTE_DSL_ARCH=sm_100a",
)

#: every (head dims, dtype) the qstage1 + 1CTA kernel is the default for, and the d256 variant (the
#: same kernel at (256, 256): O over TMEM columns 256..511, one K/V stage), compiled once each (~2-10 s)
CONFIGS = [((32, 32), "bfloat16"), ((64, 64), "bfloat16"), ((128, 128), "bfloat16"), ((128, 128), "float16"),
           ((96, 96), "bfloat16"), ((192, 128), "bfloat16"), ((256, 256), "bfloat16"),
           ((256, 256), "float16")]  # fmt: skip


#: the qstage1 + 2CTA configs compiled here (every pair with Dv <= 128 compiles; three keep the suite
#: short; (32, 32) has the smallest PV MMA, N = Dv = 32, each CTA holding 16 columns of V^T)
CONFIGS_2CTA = [((32, 32), "bfloat16"), ((128, 128), "bfloat16"), ((192, 128), "float16")]


def config(dims, dtype="bfloat16", variant=None):
    """The config of ``variant``, by default the heuristics' one (d256 for (256, 256), else qstage1-1cta)."""
    return select_fwd_config(head_dim_qk=dims[0], head_dim_v=dims[1], dtype=dtype, variant=variant)


def _count(ptx: str, pattern: str) -> int:
    return len(re.findall(pattern, ptx))


@pytest.mark.parametrize("dims,dtype", CONFIGS, ids=[f"{a}x{b}-{t}" for (a, b), t in CONFIGS])
def test_compiles(dims, dtype, tmp_path):
    dq, dv = dims
    cfg = config(dims, dtype)
    assert supports(cfg) and cfg.variant.name == ("d256" if dims == (256, 256) else "qstage1-1cta")
    max_logit = dims == (128, 128) and dtype == "float16"
    compiled = compile_uncached(
        cfg, with_max_logit=max_logit, extra_options=f"--keep-ptx --dump-dir {tmp_path}"
    )
    ptx = compiled.__ptx__
    assert ".target sm_100a" in ptx
    # UMMA: S = Q K^T (A, B from SMEM) Dqk/16 k-blocks, issued at two sites (first block, next block);
    # O += P V (A = P from TMEM, N = Dv up to 256 in one instruction) tile_n/16 = 8 k-blocks
    mma = re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[%r\d+\],\s*(\S+),", ptx)
    assert len(mma) == 2 * dq // 16 + 8
    assert sum(a.startswith("[") for a in mma) == 8  # the P operand comes from TMEM
    # softmax: S rows via tcgen05.ld 32x32b.x32 (4 per tile, two sites), O rescale (Dv/32 per
    # site, two sites) and epilogue (Dv/32): O is never held in more than 32 registers; P via
    # tcgen05.st (2 per tile, two sites) and O rescale
    assert _count(ptx, r"tcgen05\.ld\.sync\.aligned\.32x32b\.x32\.b32") == 8 + 3 * dv // 32
    assert _count(ptx, r"tcgen05\.st\.sync\.aligned\.32x32b\.x32\.b32") == 4 + 2 * dv // 32
    assert _count(ptx, r"tcgen05\.alloc\.") == 1 and _count(ptx, r"tcgen05\.dealloc\.") == 1
    assert "clusterlaunchcontrol.try_cancel" in ptx  # spec 4.8: hardware CLC queue over fwd_work_desc
    assert "cp.async.bulk.tensor" in ptx  # TMA loads of Q/K/V
    # spec 6.2: the payload goes GMEM -> registers directly (one 16-byte load of 4 words), no SMEM stage
    assert _count(ptx, r"ld\.global(\.nc)?\.v4\.b32") == 1
    assert not re.search(r"cp\.async\.bulk\.shared::c\w*\.global", ptx)
    # O rows: Dv/8 16-byte stores per thread
    assert _count(ptx, r"st\.global\.v4\.b32") == dv // 8
    if max_logit:
        assert "atom.global.max.s32" in ptx or "atom.global.max.f32" in ptx or "red.global.max" in ptx
    assert_ptxas_clean(ptx, "sm_100a", tmp_path)


@pytest.mark.parametrize("dims,dtype", CONFIGS_2CTA, ids=[f"{a}x{b}-{t}" for (a, b), t in CONFIGS_2CTA])
def test_compiles_2cta(dims, dtype, tmp_path):
    """qstage1 + 2CTA: cluster (2, 1, 1), the leader issues M256 cta_group::2 MMAs; each CTA stages
    its own payload plane (2 KB) through a two-stage SMEM ring (spec 6.2)."""
    dq, dv = dims
    cfg = config(dims, dtype, "qstage1-2cta")
    assert supports(cfg) and cfg.mask_smem_bytes_per_cta == 4096
    compiled = compile_uncached(cfg, extra_options=f"--keep-ptx --dump-dir {tmp_path}")
    ptx = compiled.__ptx__
    assert ".target sm_100a" in ptx
    mma = re.findall(r"tcgen05\.mma\.cta_group::(\d)\.kind::f16\S*\s+\[%r\d+\],\s*(\S+),", ptx)
    assert len(mma) == 2 * dq // 16 + 8 and {g for g, _ in mma} == {"2"}
    assert sum(a.startswith("[") for _, a in mma) == 8  # the P operand comes from TMEM
    # the softmax WG of each CTA reads its own 128 lanes exactly as in the 1CTA kernel
    assert _count(ptx, r"tcgen05\.ld\.sync\.aligned\.32x32b\.x32\.b32") == 8 + 3 * dv // 32
    assert _count(ptx, r"tcgen05\.st\.sync\.aligned\.32x32b\.x32\.b32") == 4 + 2 * dv // 32
    assert (
        _count(ptx, r"tcgen05\.alloc\.cta_group::2") == 1
        and _count(ptx, r"tcgen05\.dealloc\.cta_group::2") == 1
    )
    assert _count(ptx, r"tcgen05\.commit\.cta_group::2\S*multicast::cluster") >= 1
    assert "multicast::cluster::all" in ptx  # one CLC query per cluster, response to both CTAs
    tma = re.findall(r"cp\.async\.bulk\.tensor\S*", ptx)
    assert tma and all(op.endswith("cta_group::2") for op in tma)
    # spec 6.2: one bulk copy of the CTA's plane into the ring, one 16-byte SMEM read per thread
    # and block, a proxy fence before the stage is released; no direct GMEM payload load
    assert _count(ptx, r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier") == 1
    assert _count(ptx, r"ld\.global(\.nc)?\.v4\.b32") == 0
    assert "fence.proxy.async.shared::cta" in ptx
    assert _count(ptx, r"barrier\.cluster\.wait") == 2  # after barrier init, before exit
    assert _count(ptx, r"st\.global\.v4\.b32") == dv // 8
    assert_ptxas_clean(ptx, "sm_100a", tmp_path)


#: the qstage2 + 1CTA configs compiled here (Dqk <= 128: two Q tiles and two K/V stages fit SMEM),
#: with the spill bytes ptxas may report. The 384-thread CTA launches with 168 registers; setmaxnreg
#: gives the softmax warpgroups 200 and the MMA/load warpgroup 104 (8 x 200 + 4 x 104 = 12 x 168).
#: fp16 at D128 wants one register more in the softmax (4 bytes spilled), and no other split fits:
#: 208 for the softmax leaves 88 for the MMA warp, which then spills 144 bytes at D128.
CONFIGS_QSTAGE2 = [((32, 32), "bfloat16", 0), ((64, 64), "bfloat16", 0), ((128, 128), "bfloat16", 0),
                   ((128, 128), "float16", 8)]  # fmt: skip


@pytest.mark.parametrize(
    "dims,dtype,max_spill", CONFIGS_QSTAGE2, ids=[f"{a}x{b}-{t}" for (a, b), t, _ in CONFIGS_QSTAGE2]
)
def test_compiles_qstage2(dims, dtype, max_spill, tmp_path):
    """qstage2 + 1CTA: two 128-row Q tiles per CTA, each with its own softmax warpgroup, S (P over
    it), O and pipelines; the MMA warp alternates the stages; setmaxnreg 200 / 104."""
    dq, dv = dims
    cfg = config(dims, dtype, "qstage2-1cta")
    assert supports(cfg) and cfg.mask_smem_bytes_per_cta == 0
    max_logit = dims == (64, 64)
    options = f"--keep-ptx --dump-dir {tmp_path}"
    ptx = compile_uncached(cfg, with_max_logit=max_logit, extra_options=options).__ptx__
    assert ".target sm_100a" in ptx
    # S = Q_q K^T at four sites (both stages before the loop and in it), O_q += P_q V at two
    mma = re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[%r\d+\],\s*(\S+),", ptx)
    assert len(mma) == 4 * dq // 16 + 16
    assert sum(a.startswith("[") for a in mma) == 16  # both stages' P operands come from TMEM
    # each stage's warpgroup runs the qstage1 softmax on its own TMEM columns
    assert _count(ptx, r"tcgen05\.ld\.sync\.aligned\.32x32b\.x32\.b32") == 2 * (8 + 3 * dv // 32)
    assert _count(ptx, r"tcgen05\.st\.sync\.aligned\.32x32b\.x32\.b32") == 2 * (4 + 2 * dv // 32)
    assert _count(ptx, r"tcgen05\.alloc\.") == 1 and _count(ptx, r"tcgen05\.dealloc\.") == 1
    assert "setmaxnreg.inc.sync.aligned.u32 \t200" in ptx and "setmaxnreg.dec.sync.aligned.u32 \t104" in ptx
    assert "clusterlaunchcontrol.try_cancel" in ptx
    # direct payload loads (one 16-byte load per stage's warpgroup), no SMEM ring
    assert _count(ptx, r"ld\.global(\.nc)?\.v4\.b32") == 2
    assert not re.search(r"cp\.async\.bulk\.shared::c\w*\.global", ptx)
    assert _count(ptx, r"st\.global\.v4\.b32") == 2 * dv // 8
    report = ptxas_report(ptx, "sm_100a", tmp_path)
    if report is None:
        unchecked_by_ptxas("sm_100a")
    else:
        spilled = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
        assert spilled and max(spilled) <= max_spill, report


def test_smem_fits_one_cta_per_sm():
    """Q + kv_stages x (K + V) (+ the 2CTA payload ring) fits 227 KB and exceeds half of it, so a
    second CTA never waits on TMEM (each takes all 512 columns). Two K/V stages or more wherever
    two fit; D256 (Q 64 KB, K + V 128 KB a stage) gets one."""
    for (dq, dv), _ in CONFIGS:
        for pair, q_tiles in ((1, 1), (2, 1), (1, 2)):
            if q_tiles == 2 and dq > QSTAGE2_MAX_HEAD_DIM_QK or pair == 2 and dv > 128:
                continue  # no kernel (test_head_dims_without_a_kernel_are_refused)
            stages = kv_stages_for(dq, dv, cta_group_size=pair, q_tiles=q_tiles)
            ring = 4096 if pair == 2 else 0
            smem = q_tiles * 128 * 2 * dq + stages * 128 * 2 * (dq + dv) // pair + ring
            two = q_tiles * 128 * 2 * dq + 2 * 128 * 2 * (dq + dv) // pair + ring
            assert stages >= (2 if two <= 220 * 1024 else 1), (dq, dv, pair, q_tiles, stages)
            assert 114 * 1024 < smem <= 210 * 1024, (dq, dv, pair, q_tiles, stages, smem)
    d256 = Sm100FwdKernel(config((256, 256)))
    assert (d256.kv_stages, d256.tmem_s_offsets, d256.tmem_o_offsets) == (1, (0,), (256,))


def test_head_dims_without_a_kernel_are_refused():
    """Every forward variant has a kernel; head dims a variant cannot hold are refused, naming them."""
    assert IMPLEMENTED_VARIANTS == tuple(FWD_VARIANTS)
    assert IMPLEMENTED_VARIANTS == ("qstage1-1cta", "qstage2-1cta", "qstage1-2cta", "d256")
    # qstage2 with Dqk 192: two Q tiles and two K/V stages exceed SMEM
    cfg = select_fwd_config(head_dim_qk=192, head_dim_v=128, dtype="bfloat16", variant="qstage2-1cta")
    assert not supports(cfg)
    with pytest.raises(NotImplementedError, match="head_dim_qk=192"):
        Sm100FwdKernel(cfg)
    with pytest.raises(UnsupportedConfigError, match="variant 'qstage2-1cta'.*head_dim_qk <= 128"):
        require_kernel(cfg)  # what run_forward raises for a view of this variant
    # Dv 256 (configs the heuristics never select): two O tiles exceed TMEM, the CTA pair is not written
    # for it, and head dims must split into MMA steps and O chunks
    for name, dims, reason in (
        ("qstage2-1cta", (128, 256), r"TMEM \(512 columns\).*head_dim_v <= 128"),
        ("qstage1-2cta", (256, 256), "CTA pair.*head_dim_v <= 128"),
        ("qstage1-1cta", (64, 48), "head_dim_v of 32"),
        ("d256", (320, 256), "both <= 256"),
    ):
        variant = FWD_VARIANTS[name]
        cfg = Sm100FwdConfig(head_dim_qk=dims[0], head_dim_v=dims[1], dtype="float16", variant=variant)
        with pytest.raises(NotImplementedError, match=rf"\({dims[0]}, {dims[1]}\).*{reason}"):
            Sm100FwdKernel(cfg)
        with pytest.raises(UnsupportedConfigError, match=f"variant {name!r}"):
            require_kernel(cfg)
    for name in IMPLEMENTED_VARIANTS:
        dims = (256, 256) if name == "d256" else (64, 64)
        cfg = select_fwd_config(head_dim_qk=dims[0], head_dim_v=dims[1], dtype="float16", variant=name)
        assert require_kernel(cfg) is cfg


def test_kernel_key_ignores_runtime_geometry():
    """GQA ratio and varlen-ness are runtime values: one kernel serves them all."""
    a = config((128, 128))
    b = select_fwd_config(
        head_dim_qk=128,
        head_dim_v=128,
        dtype="bfloat16",
        qhead_per_kvhead=4,
        varlen=True,
        variant="qstage1-1cta",
    )
    assert kernel_key(a, with_max_logit=False) == kernel_key(b, with_max_logit=False)
    assert kernel_key(a, with_max_logit=False) != kernel_key(
        config((128, 128), "float16"), with_max_logit=False
    )
    assert kernel_key(a, with_max_logit=False) != kernel_key(a, with_max_logit=True)
    two = config((128, 128), variant="qstage1-2cta")
    assert kernel_key(a, with_max_logit=False) != kernel_key(two, with_max_logit=False)
    # d256: fixed and varlen plans (of any GQA ratio) launch the one compiled (256, 256) kernel
    fixed, varlen = (
        select_fwd_config(head_dim_qk=256, head_dim_v=256, dtype="float16", qhead_per_kvhead=g, varlen=v)
        for g, v in ((1, False), (2, True))
    )
    assert fixed.variant.name == varlen.variant.name == "d256"
    assert kernel_key(fixed, with_max_logit=False) == kernel_key(varlen, with_max_logit=False)


def test_compile_forward_goes_through_the_project_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLEXATTN_CACHE", "1")
    monkeypatch.setattr(compile_cache, "_MEMORY", {})
    cfg = config((64, 64))
    compiled = compile_forward(cfg)
    assert compile_forward(cfg) is compiled
    key = kernel_key(cfg, with_max_logit=False)
    assert key in compile_cache.cached_keys()
    disk_key = compile_cache.make_key(key, options=f"--gpu-arch {GPU_ARCH}", packages=SOURCE_PACKAGES)
    assert disk_key.arch == "sm_100a"
    assert [p[0] for p in disk_key.packages] == ["flexattn_sm100", "maskplan_kernels", "maskplan_core"]


#: one kernel per direction, compiled for sm_103a; the script prints whether the PTX targets it
SM103_SCRIPTS = {
    "forward": """
from flexattn_sm100.heuristics import select_fwd_config
from flexattn_sm100.fwd_kernel import Sm100FwdKernel
from maskplan_kernels.consumer_launch import fwd_placeholders
import cutlass.cute as cute
cfg = select_fwd_config(head_dim_qk=128, head_dim_v=128, dtype="bfloat16", variant="qstage1-1cta")
kernel = Sm100FwdKernel(cfg)
args = fwd_placeholders(kernel, with_max_logit=False)
options = "--gpu-arch sm_103a --keep-ptx --dump-dir {dump}"
compiled = cute.compile(kernel.from_pointers, *args, options=options)
print(".target sm_103a" in compiled.__ptx__)
""",
    "backward": """
from flexattn_sm100.heuristics import select_bwd_config
from flexattn_sm100.bwd_launch import compile_uncached
cfg = select_bwd_config(head_dim_qk=128, head_dim_v=128, dtype="bfloat16")
compiled = compile_uncached("main", cfg, extra_options="--gpu-arch sm_103a --keep-ptx --dump-dir {dump}")
print(".target sm_103a" in compiled.__ptx__)
""",
}


@pytest.mark.slow
@pytest.mark.parametrize("direction", sorted(SM103_SCRIPTS))
def test_compiles_for_sm103a(direction, tmp_path):
    """SM103 is the same consumer family (spec 7): the forward and the backward kernel also compile
    for sm_103a (a fresh interpreter: the DSL's target is fixed per process)."""
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_103a", "PYTHONPATH": os.pathsep.join(sys.path)}
    script = SM103_SCRIPTS[direction].format(dump=tmp_path)
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.strip().splitlines()[-1] == "True"
