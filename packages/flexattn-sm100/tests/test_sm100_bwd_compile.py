"""Compile-only tests of the SM100 backward (k2q-1cta, k2q-2cta and d256 main kernels and their
postprocess): every supported config traces and compiles to sm_100a on a machine without a GPU, the PTX
has what the design promises (tcgen05 MMAs of the five GEMMs with the designed shapes, 32x32b TMEM
loads/stores, TMA, the bulk fp32 dQ reduction, the deterministic turnstile, setmaxnreg; for the k2q-2cta
pair: multicast Q / dO loads and releases, the DSMEM dQ handoff, cluster barriers) and ptxas reports no
spills.

Compiling is the ONLY verification these kernels have had: no SM100 hardware was available, and they
have never run. Run with ``CUTE_DSL_ARCH=sm_100a``; in a process that already targets another
architecture these tests skip.
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")  # the launcher also passes --gpu-arch sm_100a

import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("cutlass.cute")

from flexattn_sm100 import Sm100Consumer  # noqa: E402
from flexattn_sm100.bwd_helpers import BwdGeometry  # noqa: E402
from flexattn_sm100.bwd_kernel import (  # noqa: E402
    HEAD_DIMS,
    IMPLEMENTED_VARIANTS,
    SMEM_OVERHEAD,
    Sm100BwdKernel,
    smem_bytes,
)
from flexattn_sm100.bwd_launch import compile_uncached, config_for_view, kernel_keys  # noqa: E402
from flexattn_sm100.config import BWD_VARIANTS, Sm100BwdConfig  # noqa: E402
from flexattn_sm100.heuristics import select_bwd_config, select_fwd_config  # noqa: E402
from maskplan_core import masks  # noqa: E402
from maskplan_core.consumer import ViewConfig  # noqa: E402
from maskplan_core.errors import UnsupportedConfigError  # noqa: E402
from maskplan_core.testing import qkv, reference_plan  # noqa: E402
from maskplan_kernels.consumer_inputs import check_register_split  # noqa: E402
from maskplan_kernels.testing import assert_ptxas_clean  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("CUTE_DSL_ARCH") != "sm_100a",
    reason="the CuTe DSL target is fixed per process; run with CUTE_DSL_ARCH=sm_100a",
)

#: ((Dqk, Dv), dtype, deterministic[, variant]): each head-dim pair and dtype, both modes, about 3 s
#: each; (256, 256) is the d256 variant, in both dtypes and both modes; k2q-2cta (named) for every
#: head-dim pair in both dtypes, each dtype in both modes
MAIN = [((32, 32), "bfloat16", False), ((32, 32), "float16", True),
        ((64, 64), "bfloat16", False), ((96, 96), "bfloat16", False), ((128, 128), "bfloat16", False),
        ((128, 128), "float16", True), ((64, 64), "float16", True), ((192, 128), "bfloat16", False),
        ((192, 128), "float16", True), ((256, 256), "bfloat16", False), ((256, 256), "bfloat16", True),
        ((256, 256), "float16", False), ((256, 256), "float16", True),
        ((32, 32), "bfloat16", True, "k2q-2cta"), ((32, 32), "float16", False, "k2q-2cta"),
        ((64, 64), "bfloat16", False, "k2q-2cta"), ((64, 64), "float16", True, "k2q-2cta"),
        ((96, 96), "bfloat16", True, "k2q-2cta"), ((96, 96), "float16", False, "k2q-2cta"),
        ((128, 128), "bfloat16", False, "k2q-2cta"), ((128, 128), "float16", True, "k2q-2cta"),
        ((192, 128), "bfloat16", True, "k2q-2cta"), ((192, 128), "float16", False, "k2q-2cta")]  # fmt: skip


def config(d, dtype: str = "bfloat16", variant: str | None = None) -> Sm100BwdConfig:
    """The config of head dim ``d`` or head-dim pair ``(Dqk, Dv)``: ``variant``, or by default d256 for
    (256, 256), else k2q-1cta."""
    dqk, dv = d if isinstance(d, tuple) else (d, d)
    variant = variant or ("d256" if (dqk, dv) == (256, 256) else "k2q-1cta")
    return Sm100BwdConfig(head_dim_qk=dqk, head_dim_v=dv, dtype=dtype, variant=BWD_VARIANTS[variant])


def _ptx(kind, d, dtype, tmp_path, variant=None, **kw) -> str:
    compiled = compile_uncached(
        kind, config(d, dtype, variant), extra_options=f"--keep-ptx --dump-dir {tmp_path}", **kw
    )
    ptx = compiled.__ptx__
    assert ".target sm_100a" in ptx
    assert_ptxas_clean(ptx, "sm_100a", tmp_path)
    return ptx


def _count(ptx: str, pattern: str) -> int:
    return len(re.findall(pattern, ptx))


def mma_shapes(ptx: str) -> set[tuple[int, int, str, str]]:
    """``(M, N, A major, B major)`` of the tcgen05 instruction descriptors the PTX selects between
    (immediates of ``selp.b32``: M >> 4 in bits 24-28, N >> 3 in bits 17-22, A / B MN-major in bits
    15 / 16)."""
    shapes = set()
    for pair in re.findall(r"selp\.b32\s+%r\d+, (\d+), (\d+), %p", ptx):
        for idesc in map(int, pair):
            m, n = ((idesc >> 24) & 0x1F) * 16, ((idesc >> 17) & 0x3F) * 8
            if m in (64, 128, 256) and n:
                shapes.add((m, n, "MN" if idesc >> 15 & 1 else "K", "MN" if idesc >> 16 & 1 else "K"))
    return shapes


def _case_id(case) -> str:
    (dqk, dv), dtype, deterministic, *variant = case
    return "-".join([*variant, f"d{dqk}x{dv}", dtype, "det" if deterministic else "atomic"])


@pytest.mark.parametrize("case", MAIN, ids=[_case_id(c) for c in MAIN])
def test_main_kernel_compiles(case, tmp_path):
    d, dtype, deterministic, *variant = case
    variant = (variant or [None])[0]
    dqk, dv = d
    kernel = Sm100BwdKernel(config(d, dtype, variant))
    # tn: the K rows of a CTA (k2q-2cta: half the plan block's)
    geo, tm, tn = kernel.geometry, kernel.tile_m, kernel.geometry.tile_n
    plan = "separate" if dqk == 256 else "serial" if dqk + dv > 256 else "overlapped"
    assert kernel.tmem_plan == plan
    ptx = _ptx("main", d, dtype, tmp_path, variant, deterministic=deterministic)
    # UMMA, cta_group 1: S^T (Dqk/16 k-blocks) and dP^T (Dv/16) at two sites each (first step, next
    # step; the serial plan, dP over S, issues dP^T at one), dV, dK (tile_m/16 each), dQ (tile_n/16); only dV
    # takes A from TMEM (P^T)
    mma = re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[%r\d+\],\s*(\S+),", ptx)
    assert len(mma) == 2 * dqk // 16 + (1 if plan == "serial" else 2) * dv // 16 + 2 * tm // 16 + tn // 16
    assert sum(a.startswith("[") for a in mma) == tm // 16
    # the designed shapes: S^T, dP^T (M = K rows, N = Q rows, both K-major); dV, dK (N = the CTA's
    # head-dim columns, B MN-major); dQ = dS K (M = 128 Q rows) or d256's dQ^T = K^T dS^T (M = 128
    # head-dim columns, N = 64 Q rows), both MN-major
    dq = (geo.dk_cols, tm) if geo.dq_transposed else (tm, dqk)
    assert mma_shapes(ptx) == {
        (tn, tm, "K", "K"), (tn, geo.dv_cols, "K", "MN"), (tn, geo.dk_cols, "K", "MN"), (*dq, "MN", "MN")
    }  # fmt: skip
    # S x2, dP x2 (serial: x1), dQ, dO/Q releases, dK/dV done
    assert _count(ptx, r"tcgen05\.commit\.cta_group::1") == (7 if plan == "serial" else 8)
    # compute: S^T and dP^T in 2 chunks of 32 columns, at the partial and the full site; P^T stores;
    # epilogue dV and dK (the CTA's columns over the W warpgroups); dQ warps: the dQ accumulator's
    # columns in chunks of 32, at two sites
    wgs = len(kernel.compute_warps) // 4
    width = {x: 32 if (x // wgs) % 32 == 0 else 16 for x in (geo.dk_cols, geo.dv_cols)}
    epilogue = (geo.dv_cols // wgs) // width[geo.dv_cols] + (geo.dk_cols // wgs) // width[geo.dk_cols]
    dq_chunks = geo.dq_acc[1] // 32
    loads = 2 * 2 * 2 + epilogue + 2 * dq_chunks
    assert _count(ptx, r"tcgen05\.ld\.sync\.aligned\.32x32b\.x\d+\.b32") == loads
    assert _count(ptx, r"tcgen05\.st\.sync\.aligned\.32x32b\.x32\.b32") == 2
    assert _count(ptx, r"tcgen05\.alloc\.") == 1 and _count(ptx, r"tcgen05\.dealloc\.") == 1
    # TMA of K and V (once, own rows) and of Q and dO (at two sites: partial, full entries), each
    # tile one or more boxes (K / Q and V / dO alike). Without a pair, K / V and the partial site's
    # Q / dO also have the tail-zeroing path: 5 sets of boxes. A pair multicasts every Q / dO box and
    # no K / V box (and does not zero), so those are twice as many
    tma = r"cp\.async\.bulk\.tensor\.\w+\.shared::c\w+\.global\.tile\.mbarrier::complete_tx::bytes"
    own = _count(ptx, tma + r"\.L2")
    mcast = _count(ptx, r"cp\.async\.bulk\.tensor\.[\w:.]+\.multicast::cluster")
    if kernel.pair > 1:
        assert own > 0 and mcast == 2 * own, (own, mcast)
    else:
        assert own > 0 and own % 5 == 0 and mcast == 0, (own, mcast)
    # LSE2 and D (bulk copies; a pair: rank 0 LSE2, rank 1 D, multicast, at both sites), released by
    # each compute warp to every CTA that filled the stage (a pair: remote-capable arrives)
    stats = _count(ptx, r"cp\.async\.bulk\.shared::c\w*\.global\.mbarrier::complete_tx::bytes")
    stats_mcast = _count(ptx, r"cp\.async\.bulk\.shared::cluster\.global\.[\w:.]+\.multicast::cluster")
    assert stats > 0 and stats_mcast == (4 if kernel.pair > 1 else 0)
    assert _count(ptx, r"mbarrier\.arrive\.shared::cluster\.b64") == (2 if kernel.pair > 1 else 0)
    assert _count(ptx, r"cp\.reduce\.async\.bulk\.global\.shared::cta\.bulk_group\.add\.f32") == 2 * dq_chunks
    # the pair: Q / dO stages released to both CTAs (multicast commits); the dQ handoff at two sites
    # per chunk: 8 st.async of 16 bytes into the leader's run, one remote arrive freeing it; the
    # cluster barriers after the barrier init and before exit
    pair = kernel.pair > 1
    assert _count(ptx, r"tcgen05\.commit\.cta_group::1\.\S+\.multicast::cluster") == (2 if pair else 0)
    st_async = r"st\.async\.shared::cluster\.mbarrier::complete_tx::bytes\.v4\.b32"
    assert _count(ptx, st_async) == (2 * dq_chunks * 32 // 4 if pair else 0)
    remote_arrive = r"mbarrier\.arrive\.release\.cluster\.shared::cluster\.b64"
    assert _count(ptx, remote_arrive) == (2 * dq_chunks if pair else 0)
    arrives = (_count(ptx, r"barrier\.cluster\.arrive\.relaxed;"), _count(ptx, r"barrier\.cluster\.arrive;"))
    assert arrives == (int(pair), int(pair)) and _count(ptx, r"barrier\.cluster\.wait;") == 2 * int(pair)
    assert _count(ptx, r"ld\.global(\.nc)?\.v2\.b32") == 1  # the 2 payload words, GMEM -> registers
    # compute warps up, dQ warps down; the MMA + load warpgroup keeps the launch registers
    assert re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx) == [
        ("inc", str(kernel.compute_regs)), ("dec", str(kernel.dq_regs))
    ]  # fmt: skip
    assert ("ld.acquire.gpu.global.b32" in ptx) == deterministic  # the turnstile
    assert ("red.release.gpu.global.add.s32" in ptx) == deterministic
    assert (".f32.bf16.bf16" in ptx or "kind::f16" in ptx) and (
        (dtype == "bfloat16") == ("cvt.rn.bf16x2.f32" in ptx)
    )


@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("with_dlse", [False, True], ids=["no-dlse", "dlse"])
def test_shared_preprocess_compiles(d, with_dlse, tmp_path):
    """The architecture-neutral preprocess (maskplan_kernels.consumer_bwd_preprocess) at this
    backward's tile_m (128; d256: 64): the dQ accumulator is zeroed with 16-byte stores."""
    assert config(d).tile_m == (64 if d == 256 else 128)
    ptx = _ptx("pre", d, "bfloat16", tmp_path, with_dlse=with_dlse)
    assert re.search(r"st\.global\.(v4\.[fb]32|v2\.b64)", ptx)  # sm_100a: 16-byte stores as v2.b64


@pytest.mark.parametrize(
    "d,dtype", [(32, "bfloat16"), (64, "bfloat16"), (128, "float16"), (256, "bfloat16"), (256, "float16")]
)
def test_postprocess_compiles(d, dtype, tmp_path):
    ptx = _ptx("post", d, dtype, tmp_path)
    # thread t reads accumulator row t, 16 bytes at a time: a dQ row (Dqk values), or d256's dQ^T row
    # (the 64 Q rows of dQ column t), stored one 2-byte element per Q row
    cols = 64 if d == 256 else d
    assert _count(ptx, r"ld\.global\.(v4\.[fb]32|v2\.b64)") == cols // 4
    assert _count(ptx, r"st\.global\.b16") == (64 if d == 256 else 0)


def test_budgets():
    """SMEM (operand tiles, statistics, dQ runs) fits 227 KB, TMEM columns fit 512 (the serial plan:
    S^T, P^T, dP^T and dQ inside the columns before dV), the register split fits the registers the
    CTA launches with (448 threads: 128, d256's 320: 168). A k2q-2cta CTA is a k2q-1cta CTA: the same
    SMEM, TMEM map and registers (the peer's dQ chunk lands in the leader's existing run)."""
    for variant, pairs in HEAD_DIMS.items():
        for dqk, dv in pairs:
            k = Sm100BwdKernel(config((dqk, dv), variant=variant))
            assert k.config.variant.name == variant
            geo = k.geometry
            if variant == "k2q-2cta":
                one = Sm100BwdKernel(config((dqk, dv), variant="k2q-1cta"))
                assert (k.pair, k.tile_n, k.cta_n, k.payload_subtiles) == (2, 256, 128, 2)
                assert geo == one.geometry and (k.q_stages, k.tmem_plan, k.tmem_dk) == (
                    one.q_stages, one.tmem_plan, one.tmem_dk
                )
                assert (k.compute_regs, k.dq_regs) == (one.compute_regs, one.dq_regs)
            assert smem_bytes(geo, k.q_stages, k.do_stages) + SMEM_OVERHEAD <= 227 * 1024
            assert k.tmem_dk + geo.dk_cols <= 512 and k.tmem_dq + geo.dq_acc[1] <= k.tmem_dv
            if k.tmem_plan == "serial":
                assert (k.q_stages, k.tmem_s, k.tmem_dp, k.tmem_dq) == (1, 0, 0, 0)
                # P^T (tile_m / 2 columns) clear of S^T and dP^T, before dV
                assert k.tmem_s + k.tile_m <= k.tmem_p and k.tmem_p + k.tile_m // 2 <= k.tmem_dv
            if k.tmem_plan == "separate":  # S^T, dP^T, P^T, dQ, dV, dK back to back, no sharing
                ends = [k.tmem_s + k.tile_m, k.tmem_dp + k.tile_m, k.tmem_p + k.tile_m // 2]
                starts = [k.tmem_dp, k.tmem_p, k.tmem_dq]
                assert ends == starts and k.tmem_dq + geo.dq_acc[1] == k.tmem_dv and k.q_stages == 1
    # why the serial plans keep one Q stage
    assert smem_bytes(BwdGeometry(128, 128, 192, 128), 2, 1) + SMEM_OVERHEAD > 227 * 1024
    d256 = Sm100BwdKernel(config((256, 256)))
    assert smem_bytes(d256.geometry, 2, 1) > 227 * 1024
    # why d256 splits the head dim: unsplit, dV and dK alone take all 512 columns
    assert 2 * 128 + 256 + 256 > 512 and (d256.tmem_dv, d256.tmem_dk, d256.tmem_dk + 128) == (224, 352, 480)
    assert (d256.num_threads, d256.launch_regs, Sm100BwdKernel(config(128)).launch_regs) == (320, 168, 128)
    with pytest.raises(ValueError, match="does not fit"):
        check_register_split(448, ((168, 8), (80, 4), (128, 2)), 128)


def test_unimplemented_variants_and_head_dims_are_refused():
    assert IMPLEMENTED_VARIANTS == ("k2q-1cta", "k2q-2cta", "d256")
    k2q = ((32, 32), (64, 64), (96, 96), (128, 128), (192, 128))
    assert HEAD_DIMS == {"k2q-1cta": k2q, "k2q-2cta": k2q, "d256": ((256, 256),)}
    for variant, pairs in HEAD_DIMS.items():  # the default wherever the kernel fits; never k2q-2cta
        for dq, dv in pairs:
            default = select_bwd_config(head_dim_qk=dq, head_dim_v=dv, dtype="bfloat16").variant.name
            assert default == ("k2q-1cta" if variant == "k2q-2cta" else variant)
    d256 = Sm100BwdKernel(select_bwd_config(head_dim_qk=256, head_dim_v=256, dtype="float16"))
    assert (d256.splits, d256.tile_m, d256.tile_n, d256.geometry.dq_transposed) == (2, 64, 128, True)
    assert d256.ctas_per_block == 2  # the two halves of a K block adjacent in grid x (decode_work)
    pair = Sm100BwdKernel(config(128, variant="k2q-2cta"))  # a cluster of 2 along grid x in both orders
    assert (pair.pair, pair.ctas_per_block) == (2, 2)
    with pytest.raises(NotImplementedError, match="fits"):
        Sm100BwdKernel(Sm100BwdConfig(head_dim_qk=256, head_dim_v=256, dtype="bfloat16",
                                      variant=BWD_VARIANTS["k2q-2cta"]))  # fmt: skip
    with pytest.raises(NotImplementedError, match="fits"):
        Sm100BwdKernel(Sm100BwdConfig(head_dim_qk=256, head_dim_v=256, dtype="bfloat16",
                                      variant=BWD_VARIANTS["k2q-1cta"]))  # fmt: skip
    with pytest.raises(NotImplementedError, match="fits"):
        Sm100BwdKernel(Sm100BwdConfig(head_dim_qk=128, head_dim_v=128, dtype="bfloat16",
                                      variant=BWD_VARIANTS["d256"]))  # fmt: skip


VIEWS = [((256, 256), "d256"), ((32, 32), "k2q-1cta"), ((128, 128), "k2q-1cta"), ((128, 128), "k2q-2cta"),
         ((192, 128), "k2q-2cta"), ((256, 256), "k2q-2cta")]  # fmt: skip


@pytest.mark.parametrize("dims,variant", VIEWS)
def test_launcher_takes_the_views_of_implemented_variants(dims, variant):
    """A CPU-planned backward view of d256, k2q-1cta or k2q-2cta is launchable where the variant has a
    kernel for its head dims; a k2q-2cta view of (256, 256) is refused."""
    q, k, v = qkv((1, 200, 2), (1, 200, 2), *dims, torch.bfloat16, device="cpu")
    pair = {"head_dim_qk": dims[0], "head_dim_v": dims[1], "dtype": "bfloat16"}
    config = Sm100BwdConfig(variant=BWD_VARIANTS[variant], **pair)
    fwd = select_fwd_config(**pair)
    plan = reference_plan(
        masks.causal(200, batch=1), q, k, v, consumer=Sm100Consumer.name,
        forward=lambda g: ViewConfig(signature=fwd.plan_signature(), layout=fwd.payload_layout),
        backward=lambda g: ViewConfig(signature=config.plan_signature(), layout=config.payload_layout),
    )  # fmt: skip
    view = plan.view("backward")
    if dims in HEAD_DIMS[variant]:
        assert config_for_view(view) == config
    else:
        refusal = rf"\(256, 256\) has no SM100 {variant} backward kernel"
        with pytest.raises(UnsupportedConfigError, match=refusal):
            config_for_view(view)


def test_kernel_keys_ignore_runtime_geometry():
    a = config(128)
    b = Sm100BwdConfig(head_dim_qk=128, head_dim_v=128, dtype="bfloat16", variant=BWD_VARIANTS["k2q-1cta"],
                       qhead_per_kvhead=4, varlen=True)  # fmt: skip
    kw = {"deterministic": False, "with_dlse": False}
    assert kernel_keys(a, **kw) == kernel_keys(b, **kw)
    det = kernel_keys(a, deterministic=True, with_dlse=False)
    assert det["main"] != kernel_keys(a, **kw)["main"] and det["pre"] == kernel_keys(a, **kw)["pre"]
    # the pair is another main kernel (never the k2q-1cta one from the cache), with the same 128-row
    # Q blocks, so the same preprocess and postprocess
    pair = kernel_keys(config(128, variant="k2q-2cta"), **kw)
    assert pair["main"] != kernel_keys(a, **kw)["main"]
    assert (pair["pre"], pair["post"]) == (kernel_keys(a, **kw)["pre"], kernel_keys(a, **kw)["post"])
