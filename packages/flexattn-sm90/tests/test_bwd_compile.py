"""Compile-only tests of the SM90 backward (K-major main kernel, postprocess, the shared preprocess): every
supported config traces and compiles to sm_90a on a machine without a GPU, and the PTX has what
the design promises (WGMMA of the five GEMMs, TMA, the payload bulk copy, the bulk fp32 dQ
reduction, the deterministic turnstile) with no register spills."""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # the launcher also passes --gpu-arch sm_90a

import re

import pytest

pytest.importorskip("cutlass.cute")

from flexattn_sm90.bwd_helpers import dq_warpgroup_tile  # noqa: E402
from flexattn_sm90.bwd_launch import compile_uncached, kernel_keys  # noqa: E402
from flexattn_sm90.heuristics import SUPPORTED_HEAD_DIMS, select_bwd_config  # noqa: E402
from maskplan_kernels.testing import assert_ptxas_clean, integer_divisions, wgmma_shapes  # noqa: E402


def _ptx(
    kind, dq=128, dv=128, dtype="bfloat16", *, tmp_path, deterministic=False, with_dlse=False,
    per_sample=False, sparse_rows=False,
) -> str:  # fmt: skip
    config = select_bwd_config(head_dim_qk=dq, head_dim_v=dv, dtype=dtype)
    compiled = compile_uncached(
        kind, config, deterministic=deterministic, with_dlse=with_dlse, per_sample=per_sample,
        sparse_rows=sparse_rows, extra_options=f"--keep-ptx --dump-dir {tmp_path}",
    )  # fmt: skip
    ptx = compiled.__ptx__
    assert ".target sm_90a" in ptx
    return ptx


#: spill bytes allowed on the 128 x 128 tile (head dims up to 64, 232 registers per MMA thread): the
#: persistent kernel's dK / dV staging addresses, loop-invariant, which ptxas computes before the
#: item loop and spills (44 bytes stored at (64, 64)); the SASS (nvdisasm) reloads them in each
#: item's epilogue and once per item or head, never inside the step loop (RESULTS.md, session 29)
SPILLS_128_ROW_TILE = 96


def _assert_ptxas_clean(ptx: str, tmp_path, dq=128, dv=128) -> None:
    config = select_bwd_config(head_dim_qk=dq, head_dim_v=dv, dtype="bfloat16")
    allowed = SPILLS_128_ROW_TILE if config.tile_m == 128 else 0
    assert_ptxas_clean(ptx, "sm_90a", tmp_path, max_spill_bytes=allowed)


def _expected_wgmma(dq: int, dv: int, dtype: str = "bfloat16") -> dict[str, int]:
    """Per step: S^T and dP^T, or S and dP (each warpgroup's m64nN slab of the payload layout, dq/16
    and dv/16 k-blocks), dK and dV (tile_m/16 k-blocks; N = D, or D/2 where the warpgroups split the
    head dim) or dK^T and dV^T (D/64 atoms of N = the warpgroup's K columns, tile_m/16 k-blocks
    each), dQ (each warpgroup's bwd_helpers.dq_warpgroup_tile, tile_n/16 k-blocks per 64 rows);
    the partial and the full loop each hold one step."""
    config = select_bwd_config(head_dim_qk=dq, head_dim_v=dv, dtype=dtype)
    layout, tm, tn = config.payload_layout, config.tile_m, config.tile_n
    _, dq_cols = dq_warpgroup_tile(tm, dq)
    dkv_split = layout.wg_n  # 1: the warpgroups split S^T's K rows; 2: its Q columns and dK / dV's D
    if config.transposed_scores:
        dkv = ((f"m64n{dq // dkv_split}k16", tm // 16), (f"m64n{dv // dkv_split}k16", tm // 16))
    else:
        dkv = tuple((f"m64n{layout.wg_cols}k16", d // 64 * tm // 16) for d in (dq, dv))
    expect: dict[str, int] = {}
    for shape, count in (
        (f"m64n{layout.wg_cols}k16", (dq + dv) // 16),
        *dkv,
        (f"m64n{dq_cols}k16", tn // 16),
    ):
        expect[shape] = expect.get(shape, 0) + 2 * count
    return expect


@pytest.mark.parametrize("dq,dv", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_main_kernel_compiles(dq, dv, dtype, tmp_path):
    ptx = _ptx("main", dq, dv, dtype, tmp_path=tmp_path)
    assert wgmma_shapes(ptx) == _expected_wgmma(dq, dv, dtype)
    assert (".f32.bf16.bf16" in ptx) == (dtype == "bfloat16")
    # the dK / dV epilogue: both tiles (tile_n rows) staged by stmatrix.x4 (256 elements per warp, 8
    # warps), and every global store a 16-byte row piece (8 elements; per thread at least 1/256 of
    # the tiles, more where a width of 96 or 192 leaves threads over, which repeat a row piece)
    config = select_bwd_config(head_dim_qk=dq, head_dim_v=dv, dtype=dtype)
    tm, tn = config.tile_m, config.tile_n
    results = tn * (dq + dv) // 2048
    # dS (and P where they meet in SMEM) leave the score fragment by stmatrix (.trans from S^T), in
    # the partial and the full step: no element-wise 2-byte SMEM stores. dK^T / dV^T leave by .trans.
    scores = 2 * (2 if config.payload_layout.wg_n > 1 else 1) * tm * tn // 2048
    plain, trans = (results, scores) if config.transposed_scores else (scores, results)
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.shared.b16") == plain
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == trans
    assert "st.shared.b16" not in ptx and "st.shared.u16" not in ptx
    stores = ptx.count("st.global.v4.b32")
    assert stores >= tn * (dq + dv) // 2048 and ptx.count("st.global") == stores
    _assert_ptxas_clean(ptx, tmp_path, dq, dv)


#: the main kernel's dQ modes: (deterministic, sparse_rows)
#: (the kernel takes the mirrored order, consumer_k2q.walk_row, on sparse rows in either mode; the
#: compiler asks for it in deterministic mode from (192, 128) on: LaunchOrder.mirrors_sparse_rows)
DQ_MODES = {
    "atomic": (False, False),
    "deterministic": (True, False),
    "atomic-sparse": (False, True),
    "deterministic-sparse": (True, True),
}


@pytest.mark.parametrize("mode", DQ_MODES)
def test_main_kernel_d128_instructions(mode, tmp_path):
    deterministic, sparse_rows = DQ_MODES[mode]
    stored = deterministic or sparse_rows  # BackwardCompiler.first_dq_stored
    ptx = _ptx("main", tmp_path=tmp_path, deterministic=deterministic, sparse_rows=sparse_rows)
    assert "cp.async.bulk.tensor" in ptx  # TMA loads of K, V, Q, dO
    assert re.search(r"cp\.async\.bulk\.shared::c\w*\.global", ptx)  # payload plane, LSE, D
    # dQ accumulation: a bulk add per warpgroup chunk, in each dQ writer (two with turnstiles)
    assert ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") == 2 * (1 + stored)
    assert "setmaxnreg.dec.sync.aligned.u32 \t24" in ptx
    assert "setmaxnreg.inc.sync.aligned.u32 \t240" in ptx
    assert "st.shared.v4" in ptx  # dQ fragments into the 16-byte vectors of their chunk
    # the turnstile (acquire spin, then a release increment) where each Q block's first
    # contribution (rank 0) is stored rather than added: the others wait for their rank
    # (deterministic) or for the first (atomic mode on sparse rows)
    assert ("ld.acquire.gpu.global.b32" in ptx) == stored
    assert ("red.release.gpu.global.add.s32" in ptx) == stored
    assert ptx.count("cp.async.bulk.global.shared::cta.bulk_group ") == 4 * stored
    _assert_ptxas_clean(ptx, tmp_path)


@pytest.mark.parametrize("dq,dv", [(192, 128), (256, 256)])
@pytest.mark.parametrize("mode", DQ_MODES)
def test_wide_heads_dq_path(dq, dv, mode, tmp_path):
    """Every dQ mode at (192, 128) and (256, 256) takes dQ out through the dQ writer's bulk adds
    from SMEM; no MMA thread reduces into GMEM itself."""
    deterministic, sparse_rows = DQ_MODES[mode]
    ptx = _ptx("main", dq, dv, tmp_path=tmp_path, deterministic=deterministic, sparse_rows=sparse_rows)
    assert "red.global.add" not in ptx
    assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in ptx
    _assert_ptxas_clean(ptx, tmp_path)


@pytest.mark.parametrize(
    "dq,dv,expect",
    [
        # (SMEM dQ chunks, dQ writers, Q stages, dO stages) in atomic mode, then every mode with
        # turnstiles (deterministic, atomic-sparse, deterministic-sparse): a kernel with turnstiles
        # runs two dQ writers on alternate steps
        (128, 128, ((2, 1, 2, 2), (2, 2, 2, 2))),
        (192, 128, ((2, 1, 2, 1), (2, 2, 2, 1))),  # the 96-row K / V leave SMEM for 1 dO stage
        (256, 256, ((1, 1, 2, 1), (1, 2, 2, 1))),  # one chunk, filled in turn, keeps 2 Q stages
    ],
)
def test_dq_path_and_stages_per_mode(dq, dv, expect):
    from flexattn_sm90.bwd_kernel import Sm90BwdKernel

    config = select_bwd_config(head_dim_qk=dq, head_dim_v=dv, dtype="bfloat16")
    for deterministic, sparse_rows in DQ_MODES.values():
        stored = deterministic or sparse_rows
        k = Sm90BwdKernel(config, deterministic=deterministic, first_dq_stored=stored, mirrored=sparse_rows)
        assert (k.dq_chunks, k.dq_writers, k.q_stages, k.do_stages) == expect[stored]
    with pytest.raises(ValueError, match="first_dq_stored=False"):
        Sm90BwdKernel(config, deterministic=True, first_dq_stored=False)
    with pytest.raises(ValueError, match="mirrored=True"):
        Sm90BwdKernel(config, first_dq_stored=False, mirrored=True)


@pytest.mark.parametrize("dq,dv", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("mode", DQ_MODES)
def test_main_kernel_takes_the_order_its_key_names(mode, dq, dv):
    """The kernel the compiler builds for a key takes the order the key names: the mirrored one in
    deterministic mode on sparse K2Q rows where a Q block is large ((192, 128), (256, 256)), else
    the plan's (a kernel launching K rows ascending with mirrored ranks would wait forever on a
    turnstile); there it takes atomic mode's kv heads at a time."""
    from flexattn_sm90.bwd_launch import COMPILER

    deterministic, sparse_rows = DQ_MODES[mode]
    config = select_bwd_config(head_dim_qk=dq, head_dim_v=dv, dtype="bfloat16")
    kernel = COMPILER.build("main", config, deterministic=deterministic, sparse_rows=sparse_rows)
    keys = kernel_keys(config, deterministic=deterministic, with_dlse=False, sparse_rows=sparse_rows)
    large = (dq, dv) in ((192, 128), (256, 256))
    assert kernel.mirrored == (deterministic and sparse_rows and large)
    assert ("mirrored", kernel.mirrored) in keys["main"]


@pytest.mark.parametrize("mode", DQ_MODES)
def test_preprocess_is_the_shared_one(mode, tmp_path):
    """The preprocess is maskplan_kernels.consumer_bwd_preprocess at this backward's tile_m (its own
    compile tests live in packages/maskplan-kernels/tests). It zeroes the dQ accumulator (its
    16-byte stores) only in atomic mode on dense K2Q rows: elsewhere the main kernel stores each Q
    block's first contribution."""
    deterministic, sparse_rows = DQ_MODES[mode]
    ptx = _ptx("pre", tmp_path=tmp_path, with_dlse=True, deterministic=deterministic, sparse_rows=sparse_rows)
    assert "consumer_bwd_preprocessBwdPreprocess" in ptx
    assert bool(re.search(r"st\.global\.(v4\.[fb]32|v2\.b64)", ptx)) == (mode == "atomic")


@pytest.mark.parametrize("dq,dv", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_postprocess_compiles(dq, dv, dtype, deterministic, tmp_path):
    """dQ leaves the fragment through SMEM (stmatrix) and reaches GMEM in 16-byte row pieces only."""
    ptx = _ptx("post", dq, dv, dtype, tmp_path=tmp_path, deterministic=deterministic)
    # every 8x8 matrix of the block staged once: a warp's share of the tile_m x D block, in x4 (16 x 16)
    # or, where a warpgroup's dQ columns are an odd multiple of 8 (40 at D = 80), x2 instructions
    tm = select_bwd_config(head_dim_qk=dq, head_dim_v=dv, dtype=dtype).tile_m
    x4, x2 = (ptx.count(f"stmatrix.sync.aligned.m8n8.{x}.shared.b16") for x in ("x4", "x2"))
    assert 4 * x4 + 2 * x2 == tm * dq // 64 // 8, (x4, x2)
    stores = set(re.findall(r"st\.global\.\S+", ptx))
    assert stores == {"st.global.v4.b32"}, stores
    _assert_ptxas_clean(ptx, tmp_path)


def test_postprocess_reads_the_turnstile_count_where_the_first_dq_is_stored(tmp_path):
    """The postprocess of deterministic mode and of atomic mode on sparse K2Q rows (one kernel)
    loads one more int32 than atomic mode's on dense rows, the block's turnstile count (0: no K
    block visited the block, whose accumulator nothing wrote)."""
    config = select_bwd_config(head_dim_qk=128, head_dim_v=128, dtype="bfloat16")
    keys = {
        mode: kernel_keys(config, deterministic=d, with_dlse=False, sparse_rows=s)["post"]
        for mode, (d, s) in DQ_MODES.items()
    }
    assert keys["atomic-sparse"] == keys["deterministic"] != keys["atomic"]
    load = re.compile(r"ld\.global\.(?:[a-z]+\.)*[bsu]32\b")
    loads = [len(load.findall(_ptx("post", tmp_path=tmp_path, sparse_rows=s))) for s in (False, True)]
    assert loads[1] == loads[0] + 1, loads


def test_unsupported_tiles_refused():
    """Configs the heuristics never select are refused by the kernel with the reason."""
    from flexattn_sm90.bwd_kernel import Sm90BwdKernel
    from flexattn_sm90.config import Sm90BwdConfig

    rows = r"64-row Q blocks on 2 warpgroups \(128-row ones up to head dim 64\)"
    with pytest.raises(NotImplementedError, match=rows):
        Sm90BwdKernel(Sm90BwdConfig(head_dim_qk=128, head_dim_v=128, dtype="bfloat16", tile_m=128))
    with pytest.raises(NotImplementedError, match=r"equal \(32, 64, 80, 96, 128\)"):
        Sm90BwdKernel(Sm90BwdConfig(head_dim_qk=128, head_dim_v=64, dtype="bfloat16"))
    with pytest.raises(NotImplementedError, match="multiples of 64"):
        Sm90BwdKernel(Sm90BwdConfig(head_dim_qk=160, head_dim_v=160, dtype="bfloat16", tile_n=64))


def test_kernel_keys_ignore_runtime_geometry():
    """GQA ratio and varlen-ness are runtime values: one set of kernels serves them all."""
    a = select_bwd_config(head_dim_qk=128, head_dim_v=128, dtype="bfloat16")
    b = select_bwd_config(head_dim_qk=128, head_dim_v=128, dtype="bfloat16", qhead_per_kvhead=4, varlen=True)
    kw = {"deterministic": False, "with_dlse": False}
    assert kernel_keys(a, **kw) == kernel_keys(b, **kw)
    # deterministic mode and atomic mode on sparse K2Q rows: their main kernels store each Q block's
    # first dQ, so their preprocess does not zero the accumulator and their postprocess zeroes the
    # blocks nothing visited; deterministic mode ignores the row fill at D = 128, and from (192,
    # 128) on takes the mirrored order on sparse rows
    det, base = kernel_keys(a, deterministic=True, with_dlse=False), kernel_keys(a, **kw)
    assert all(det[kind] != base[kind] for kind in ("pre", "main", "post"))
    sparse = kernel_keys(a, **kw, sparse_rows=True)
    assert [sparse[kind] == det[kind] for kind in ("pre", "main", "post")] == [True, False, True]
    assert sparse["main"] != base["main"]
    assert kernel_keys(a, deterministic=True, with_dlse=False, sparse_rows=True) == det
    wide = select_bwd_config(head_dim_qk=256, head_dim_v=256, dtype="bfloat16")
    det, det_sparse = (
        kernel_keys(wide, deterministic=True, with_dlse=False, sparse_rows=s) for s in (False, True)
    )
    assert [det_sparse[kind] == det[kind] for kind in ("pre", "main", "post")] == [True, False, True]
    assert ("mirrored", True) in det_sparse["main"] and ("mirrored", False) in det["main"]
    dlse = kernel_keys(a, deterministic=False, with_dlse=True)
    assert dlse["pre"] != kernel_keys(a, **kw)["pre"] and dlse["main"] == kernel_keys(a, **kw)["main"]


def test_register_split_must_fit_the_launch_allocation():
    """32 + 2 x 240 fits 65536 but not the 3 x 168 registers a 384-thread CTA launches with:
    ``setmaxnreg.inc`` then waits forever (the first backward split hung on the H200)."""
    from flexattn_sm90.fwd_helpers import register_split

    assert register_split(2, 24, 240) == (24, 240)
    assert register_split(1, 24, 240) == (24, 240)
    with pytest.raises(ValueError, match="does not fit 3 x 168"):
        register_split(2, 32, 240)


@pytest.mark.parametrize("dq,dv", [(72, 72), (48, 48), (64, 128), (160, 128)])
@pytest.mark.parametrize("kind", ["pre", "main", "post"])
def test_compiles_tensors_narrower_than_the_kernel(kind, dq, dv, tmp_path):
    """Head dims without a kernel: the next kernel up's three kernels read and write the tensors at
    their own head dims (the preprocess's O / dO rows, the main kernel's TMA loads and dK / dV
    stores, the postprocess's dQ), each under its own compile key."""
    config = select_bwd_config(head_dim_qk=dq, head_dim_v=dv, dtype="bfloat16")
    assert config.io_head_dims == (dq, dv)
    native = select_bwd_config(head_dim_qk=config.head_dim_qk, head_dim_v=config.head_dim_v, dtype="bfloat16")
    keys = kernel_keys(config, deterministic=True, with_dlse=False)
    assert keys[kind] != kernel_keys(native, deterministic=True, with_dlse=False)[kind]
    ptx = _ptx(kind, dq, dv, tmp_path=tmp_path, deterministic=True)
    if kind == "main":
        assert wgmma_shapes(ptx) == _expected_wgmma(config.head_dim_qk, config.head_dim_v)
    _assert_ptxas_clean(ptx, tmp_path, dq, dv)


@pytest.mark.parametrize("dq,dv", SUPPORTED_HEAD_DIMS)
def test_main_kernel_compiles_rows_per_sample(dq, dv, tmp_path):
    """q, k, v read per sample (``[B, S, H, D]`` views of ``[B, H, S, D]``): the main kernel under
    its own key, its Q / K / V loads 5-D TMA (the flat kernel's: 3-D; dO stays THD), the same GEMMs
    and no more integer divisions (``ThdHostEntry.sample_rows``); the granule is a multiple of both
    tiles."""
    config = select_bwd_config(head_dim_qk=dq, head_dim_v=dv, dtype="bfloat16")
    assert config.row_granule % config.tile_m == 0 and config.row_granule % config.tile_n == 0
    kw = {"deterministic": True, "with_dlse": False}
    keys, flat_keys = kernel_keys(config, **kw, per_sample=True), kernel_keys(config, **kw)
    assert keys["main"] != flat_keys["main"]
    assert (keys["pre"], keys["post"]) == (flat_keys["pre"], flat_keys["post"])
    ptx = _ptx("main", dq, dv, tmp_path=tmp_path, per_sample=True, **kw)
    assert "cp.async.bulk.tensor.5d" in ptx and "cp.async.bulk.tensor.3d" in ptx  # dO: flat
    assert wgmma_shapes(ptx) == _expected_wgmma(dq, dv)
    flat = _ptx("main", dq, dv, tmp_path=tmp_path, **kw)
    assert integer_divisions(ptx) == integer_divisions(flat)
    _assert_ptxas_clean(ptx, tmp_path, dq, dv)


@pytest.mark.parametrize("dim", [128, 256])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_launch_order_probe_compiles(dim, deterministic):
    """test_bwd_gpu's one-warp probe of the main kernel's launch-order rule (``launch_order_probe``)
    compiles for sm_90a, so the GPU test fails on the rule, not on the probe."""
    from launch_order_probe import compile_probe

    assert compile_probe(dim, dim, deterministic) is not None
