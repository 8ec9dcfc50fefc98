"""Compile-only tests of the SM100 backward (k2q-1cta main kernel and its postprocess): every supported
config traces and compiles to sm_100a on a machine without a GPU, the PTX has what the design promises
(tcgen05 MMAs of the five GEMMs, 32x32b TMEM loads/stores, TMA, the bulk fp32 dQ reduction, the
deterministic turnstile, setmaxnreg) and ptxas reports no spills.

Compiling is the ONLY verification these kernels have had: no SM100 hardware was available, and they
have never run. Run with ``CUTE_DSL_ARCH=sm_100a``; in a process that already targets another
architecture these tests skip.
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")  # the launcher also passes --gpu-arch sm_100a

import re  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("cutlass.cute")

from flexattn_sm100.bwd_kernel import (  # noqa: E402
    HEAD_DIMS,
    IMPLEMENTED_VARIANTS,
    LAUNCH_REGS,
    Sm100BwdKernel,
    smem_bytes,
)
from flexattn_sm100.bwd_launch import compile_uncached, kernel_keys  # noqa: E402
from flexattn_sm100.config import BWD_VARIANTS, Sm100BwdConfig  # noqa: E402
from flexattn_sm100.heuristics import select_bwd_config  # noqa: E402
from maskplan_kernels.consumer_launch import check_register_split  # noqa: E402
from maskplan_kernels.testing import assert_ptxas_clean  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("CUTE_DSL_ARCH") != "sm_100a",
    reason="the CuTe DSL target is fixed per process; run with CUTE_DSL_ARCH=sm_100a",
)

#: ((Dqk, Dv), dtype, deterministic): each head-dim pair and dtype, both modes, about 3 s each
MAIN = [((64, 64), "bfloat16", False), ((96, 96), "bfloat16", False), ((128, 128), "bfloat16", False),
        ((128, 128), "float16", True), ((64, 64), "float16", True), ((192, 128), "bfloat16", False),
        ((192, 128), "float16", True)]  # fmt: skip


def config(d, dtype: str = "bfloat16") -> Sm100BwdConfig:
    """The k2q-1cta config of head dim ``d`` or head-dim pair ``(Dqk, Dv)``."""
    dqk, dv = d if isinstance(d, tuple) else (d, d)
    return Sm100BwdConfig(head_dim_qk=dqk, head_dim_v=dv, dtype=dtype, variant=BWD_VARIANTS["k2q-1cta"])


def _ptx(kind, d, dtype, tmp_path, **kw) -> str:
    compiled = compile_uncached(
        kind, config(d, dtype), extra_options=f"--keep-ptx --dump-dir {tmp_path}", **kw
    )
    ptx = compiled.__ptx__
    assert ".target sm_100a" in ptx
    assert_ptxas_clean(ptx, "sm_100a", tmp_path)
    return ptx


def _count(ptx: str, pattern: str) -> int:
    return len(re.findall(pattern, ptx))


@pytest.mark.parametrize(
    "d,dtype,deterministic", MAIN, ids=[f"d{q}x{v}-{t}-{'det' if x else 'atomic'}" for (q, v), t, x in MAIN]
)
def test_main_kernel_compiles(d, dtype, deterministic, tmp_path):
    dqk, dv = d
    serial = Sm100BwdKernel(config(d, dtype)).serial
    assert serial == (dqk + dv > 256)
    ptx = _ptx("main", d, dtype, tmp_path, deterministic=deterministic)
    # UMMA, cta_group 1: S^T (Dqk/16 k-blocks) and dP^T (Dv/16) at two sites each (first step, next
    # step; the serial plan issues dP^T at one), dV, dK (tile_m/16 = 8 each), dQ (tile_n/16 = 8);
    # only dV takes A from TMEM (P^T)
    mma = re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[%r\d+\],\s*(\S+),", ptx)
    assert len(mma) == 2 * dqk // 16 + (1 if serial else 2) * dv // 16 + 3 * 8
    assert sum(a.startswith("[") for a in mma) == 8
    # S x2, dP x2 (serial: x1), dQ, dO/Q releases, dK/dV done
    assert _count(ptx, r"tcgen05\.commit\.cta_group::1") == (7 if serial else 8)
    # compute: S^T and dP^T in 2 chunks of 32 columns, at the partial and the full site; P^T stores;
    # epilogue dV and dK (D/2 columns per warpgroup); dQ warps: Dqk/32 chunks at two sites
    width = {x: 32 if (x // 2) % 32 == 0 else 16 for x in (dqk, dv)}
    loads = 2 * 2 * 2 + (dv // 2) // width[dv] + (dqk // 2) // width[dqk] + 2 * dqk // 32
    assert _count(ptx, r"tcgen05\.ld\.sync\.aligned\.32x32b\.x\d+\.b32") == loads
    assert _count(ptx, r"tcgen05\.st\.sync\.aligned\.32x32b\.x32\.b32") == 2
    assert _count(ptx, r"tcgen05\.alloc\.") == 1 and _count(ptx, r"tcgen05\.dealloc\.") == 1
    assert "cp.async.bulk.tensor" in ptx  # TMA of K, V, Q, dO
    assert re.search(r"cp\.async\.bulk\.shared::c\w*\.global", ptx)  # LSE2 and D
    assert _count(ptx, r"cp\.reduce\.async\.bulk\.global\.shared::cta\.bulk_group\.add\.f32") == 2 * dqk // 32
    assert _count(ptx, r"ld\.global(\.nc)?\.v2\.b32") == 1  # the 2 payload words, GMEM -> registers
    assert _count(ptx, r"setmaxnreg\.inc") == 2 and _count(ptx, r"setmaxnreg\.dec") == 2
    assert ("ld.acquire.gpu.global.b32" in ptx) == deterministic  # the turnstile
    assert ("red.release.gpu.global.add.s32" in ptx) == deterministic
    assert (".f32.bf16.bf16" in ptx or "kind::f16" in ptx) and (
        (dtype == "bfloat16") == ("cvt.rn.bf16x2.f32" in ptx)
    )


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("with_dlse", [False, True], ids=["no-dlse", "dlse"])
def test_shared_preprocess_compiles_at_tile_m_128(d, with_dlse, tmp_path):
    """The architecture-neutral preprocess (maskplan_kernels.consumer_bwd_preprocess) at this
    backward's tile_m = 128 (512 threads): the dQ accumulator is zeroed with 16-byte stores."""
    assert config(d).tile_m == 128
    ptx = _ptx("pre", d, "bfloat16", tmp_path, with_dlse=with_dlse)
    assert re.search(r"st\.global\.(v4\.[fb]32|v2\.b64)", ptx)  # sm_100a: 16-byte stores as v2.b64


@pytest.mark.parametrize("d,dtype", [(64, "bfloat16"), (128, "float16")])
def test_postprocess_compiles(d, dtype, tmp_path):
    ptx = _ptx("post", d, dtype, tmp_path)
    assert _count(ptx, r"ld\.global\.(v4\.[fb]32|v2\.b64)") == d // 4  # the accumulator, 16 bytes at a time


def test_budgets():
    """SMEM (operand tiles, statistics, dQ runs) fits 227 KB, TMEM columns fit 512 (the serial plan:
    S^T, P^T, dP^T and dQ inside the columns before dV), the register split fits the 448 x 128
    registers the CTA launches with."""
    for dqk, dv in HEAD_DIMS:
        k = Sm100BwdKernel(config((dqk, dv)))
        assert smem_bytes(dqk, dv, k.q_stages, k.do_stages) + 4096 <= 227 * 1024
        assert k.tmem_dk + dqk <= 512 and k.tmem_dq + dqk <= k.tmem_dv
        if k.serial:
            assert (k.q_stages, k.tmem_s, k.tmem_dp, k.tmem_dq) == (1, 0, 0, 0)
            assert k.tmem_s + 128 <= k.tmem_p and k.tmem_p + 64 <= k.tmem_dv  # P^T clear of S^T, dP^T
    assert smem_bytes(192, 128, 2, 1) + 4096 > 227 * 1024  # why the serial plan keeps one Q stage
    with pytest.raises(ValueError, match="does not fit"):
        check_register_split(448, ((168, 8), (88, 4), (56, 1), (152, 1)), LAUNCH_REGS)


def test_unimplemented_variants_and_head_dims_are_refused():
    assert IMPLEMENTED_VARIANTS == ("k2q-1cta",)
    assert HEAD_DIMS == ((64, 64), (96, 96), (128, 128), (192, 128))
    for dq, dv in HEAD_DIMS:  # the default wherever the kernel fits
        assert select_bwd_config(head_dim_qk=dq, head_dim_v=dv, dtype="bfloat16").variant.name == "k2q-1cta"
    default = select_bwd_config(head_dim_qk=256, head_dim_v=256, dtype="bfloat16")  # no kernel
    assert default.variant.name == "d256"
    with pytest.raises(NotImplementedError, match="d256"):
        Sm100BwdKernel(default)
    with pytest.raises(NotImplementedError, match="k2q-2cta"):
        Sm100BwdKernel(Sm100BwdConfig(head_dim_qk=128, head_dim_v=128, dtype="bfloat16",
                                      variant=BWD_VARIANTS["k2q-2cta"]))  # fmt: skip
    with pytest.raises(NotImplementedError, match="fits"):
        Sm100BwdKernel(Sm100BwdConfig(head_dim_qk=256, head_dim_v=256, dtype="bfloat16",
                                      variant=BWD_VARIANTS["k2q-1cta"]))  # fmt: skip


def test_kernel_keys_ignore_runtime_geometry():
    a = config(128)
    b = Sm100BwdConfig(head_dim_qk=128, head_dim_v=128, dtype="bfloat16", variant=BWD_VARIANTS["k2q-1cta"],
                       qhead_per_kvhead=4, varlen=True)  # fmt: skip
    kw = {"deterministic": False, "with_dlse": False}
    assert kernel_keys(a, **kw) == kernel_keys(b, **kw)
    det = kernel_keys(a, deterministic=True, with_dlse=False)
    assert det["main"] != kernel_keys(a, **kw)["main"] and det["pre"] == kernel_keys(a, **kw)["pre"]
