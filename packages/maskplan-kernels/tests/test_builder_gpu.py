"""GPU tier: ``build_plan_gpu`` equals ``maskplan_core.reference.build_plan`` tensor for tensor.

Every tensor of every view (CSR cnt/offset/idx, ``mask_block_masks``, ``sequence_desc`` (varlen
views only), ``fwd_work_desc``, ``dq_write_order(_full)``) and the allocation header are compared with
``torch.equal`` for fixed and varlen inputs (empty samples, Sq != Sk, Hmask 1 and Hq, nfunc 1..9,
GQA, PackGQA scheduling, several L2 sections, S = 32k), forward-only and with backward, with the
reference row-major layout, the SM90 WGMMA layouts and the SM100 consumer's views. Malformed
endpoints / prefixes must raise the reference's exception class and message; a build reads the
device exactly once; two builds on two streams at once give the reference plans.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from plan_cases import KINDS, assert_plans_equal, make_geometry, make_mask, view_config  # noqa: E402

from maskplan_core.errors import EndpointError, SeqlenError  # noqa: E402
from maskplan_core.payload import RowMajorLayout  # noqa: E402
from maskplan_core.reference import build_plan  # noqa: E402

pytestmark = pytest.mark.gpu

DEVICE = "cuda"


def _layouts(name: str):
    """``rowmajor``; ``sm90``: the D=128 forward and (S^T, 64 x 128) backward layouts; ``sm90-s``: the
    (192, 128) backward's S-oriented 64 x 96 one, whose warpgroups split the K columns."""
    if name == "rowmajor":
        return RowMajorLayout(128, 128), RowMajorLayout(128, 128)
    sm90 = pytest.importorskip("flexattn_sm90.payload_layout")
    if name == "sm90":
        return sm90.wgmma_layout(128, 128), sm90.wgmma_layout(64, 128, None, True)
    if name == "sm90-s":
        return sm90.wgmma_layout(128, 128), sm90.wgmma_layout(64, 96, 2, False)
    raise ValueError(name)


def build_both(geometry, mask, fwd_layout, bwd_layout, *, pack_gqa=False):
    from maskplan_kernels.builder import build_plan_gpu

    qpk = geometry.qhead_per_kvhead
    fwd = view_config(fwd_layout, "forward", pack_gqa=pack_gqa, qpk=qpk)
    bwd = view_config(bwd_layout, "backward", qpk=qpk) if bwd_layout is not None else None
    ref = build_plan(mask, geometry, fwd, bwd, "test")
    got = build_plan_gpu(mask, geometry, fwd, bwd, "test")
    torch.cuda.synchronize()
    return ref, got


def run_case(
    q_lens,
    k_lens,
    *,
    hq,
    hkv,
    hmask,
    nfunc,
    varlen,
    layouts,
    backward,
    seed,
    kinds=KINDS,
    pack_gqa=False,
    head_dim=128,
):
    g = make_geometry(
        q_lens,
        k_lens,
        hq=hq,
        hkv=hkv,
        hmask=hmask,
        nfunc=nfunc,
        varlen=varlen,
        device=DEVICE,
        head_dim=head_dim,
    )
    mask = make_mask(q_lens, k_lens, hmask, nfunc, seed, kinds=kinds, device=DEVICE)
    fwd_layout, bwd_layout = layouts
    ref, got = build_both(g, mask, fwd_layout, bwd_layout if backward else None, pack_gqa=pack_gqa)
    assert_plans_equal(ref, got)
    for role in got.roles:  # the ABI's value checks, on CUDA tensors
        got.view(role).validate()
    return ref, got


# --------------------------------------------------------------------------------------------------
# bit-exact against the reference


@pytest.mark.parametrize("layouts", ["rowmajor", "sm90", "sm90-s"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("nfunc", [1, 3, 5, 9])
@pytest.mark.parametrize("heads", [(4, 2, 1), (4, 2, 4)], ids=["hm1-gqa2", "hmq-gqa2"])
def test_fixed_length(layouts, backward, nfunc, heads):
    hq, hkv, hmask = heads
    run_case(
        [1000] * 2,
        [1500] * 2,
        hq=hq,
        hkv=hkv,
        hmask=hmask,
        nfunc=nfunc,
        varlen=False,
        layouts=_layouts(layouts),
        backward=backward,
        seed=nfunc,
    )


VARLEN = [
    ([300, 0, 517, 1, 129], [260, 700, 0, 5, 1024]),  # empty q, empty k, tiny samples
    ([0, 0, 64], [10, 0, 64]),
    ([2048, 777], [777, 2048]),
    ([1], [0]),
    ([130] * 40, [260] * 40),  # many samples: several geometry chunks... and row ownership warps
]


@pytest.mark.parametrize("lens", VARLEN, ids=lambda x: f"B{len(x[0])}")
@pytest.mark.parametrize("layouts", ["rowmajor", "sm90", "sm90-s"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("nfunc", [1, 7])
def test_varlen(lens, layouts, backward, nfunc):
    q_lens, k_lens = lens
    run_case(
        q_lens,
        k_lens,
        hq=2,
        hkv=1,
        hmask=2,
        nfunc=nfunc,
        varlen=True,
        layouts=_layouts(layouts),
        backward=backward,
        seed=len(q_lens) + nfunc,
    )


def test_varlen_loose_max_seqlen():
    """max_seqlen larger than every sample: the upper bounds exceed the exact rows (compaction path)."""
    q_lens, k_lens = [300, 20, 129], [260, 700, 5]
    g = make_geometry(q_lens, k_lens, hq=2, hkv=2, hmask=2, nfunc=3, device=DEVICE, max_q=5000, max_k=9000)
    mask = make_mask(q_lens, k_lens, 2, 3, seed=12, device=DEVICE)
    ref, got = build_both(g, mask, RowMajorLayout(128, 128), RowMajorLayout(128, 128))
    assert_plans_equal(ref, got)


def test_varlen_empty_samples_with_max_seqlen_0():
    """``max_seqlen = seqlens.max()`` of a batch of empty samples is 0: a plan with no block."""
    g = make_geometry([0, 0], [0, 0], hq=2, hkv=1, hmask=1, nfunc=3, device=DEVICE, max_q=0, max_k=0)
    mask = make_mask([0, 0], [0, 0], 1, 3, seed=2, device=DEVICE)
    ref, got = build_both(g, mask, RowMajorLayout(128, 128), RowMajorLayout(128, 128))
    assert_plans_equal(ref, got)


@pytest.mark.parametrize(
    "tiles",
    [((64, 128), (64, 128)), ((128, 80), (128, 80)), ((16, 32), (32, 16))],
    ids=lambda t: f"{t[0][0]}x{t[0][1]}",
)
def test_other_tiles_and_tails(tiles):
    (fm, fn), (bm, bn) = tiles
    run_case(
        [700, 0, 1500],
        [3000, 100, 2500],
        hq=4,
        hkv=4,
        hmask=4,
        nfunc=5,
        varlen=True,
        layouts=(RowMajorLayout(fm, fn), RowMajorLayout(bm, bn)),
        backward=True,
        seed=11,
    )


def test_multi_chunk_rows_and_words():
    """Q2K rows over more than 32 bitset words (1024 K blocks) and K2Q rows over more than one
    CTA-width of Q blocks: 16x16 tiles, Sq = 10k, Sk = 20k."""
    run_case(
        [10_000],
        [20_000],
        hq=1,
        hkv=1,
        hmask=1,
        nfunc=3,
        varlen=False,
        layouts=(RowMajorLayout(16, 16), RowMajorLayout(16, 16)),
        backward=True,
        seed=5,
        kinds=("causal", "window"),
    )


def test_pack_gqa_schedule():
    run_case(
        [900, 333],
        [1200, 4000],
        hq=8,
        hkv=2,
        hmask=1,
        nfunc=3,
        varlen=True,
        layouts=(RowMajorLayout(128, 128), None),
        backward=False,
        seed=9,
        pack_gqa=True,
    )


def test_several_l2_sections():
    """Hkv = 8, S = 32k, D = 64 bf16: 4 kv heads per 50 MiB section, two sections per sample."""
    run_case(
        [32_768],
        [32_768],
        hq=8,
        hkv=8,
        hmask=8,
        nfunc=3,
        varlen=False,
        layouts=(RowMajorLayout(128, 128), None),
        backward=False,
        seed=3,
        head_dim=64,
        kinds=("causal", "window", "document", "empty"),
    )


@pytest.mark.parametrize("kinds", [("causal",), ("window",), ("document",), KINDS])
def test_long_sequence_32k(kinds):
    run_case(
        [32_768],
        [32_768],
        hq=2,
        hkv=2,
        hmask=2,
        nfunc=5,
        varlen=False,
        layouts=_layouts("rowmajor"),
        backward=True,
        seed=7,
        kinds=kinds,
    )


def test_long_sequence_32k_sm90():
    run_case(
        [32_768],
        [32_768],
        hq=2,
        hkv=1,
        hmask=1,
        nfunc=5,
        varlen=False,
        layouts=_layouts("sm90"),
        backward=True,
        seed=8,
        kinds=("causal", "document"),
    )


@pytest.mark.parametrize(
    "hq,hkv,hmask,pack_gqa",
    [(4, 2, 4, False), (4, 2, 1, True), (8, 1, 1, True), (16, 1, 1, True)],
    ids=["hmq", "pack-g2", "pack-g8", "pack-g16"],
)
def test_sm90_consumer_views(hq, hkv, hmask, pack_gqa):
    """The views exactly as the SM90 consumer resolves them for the facade (PackGQA: plan Q blocks
    of 128 / G positions and the packed payload layout)."""
    consumer_mod = pytest.importorskip("flexattn_sm90.consumer")
    from maskplan_core.consumer import ViewRequest
    from maskplan_kernels.builder import build_plan_gpu

    lens_q, lens_k = [2048, 777], [777, 2048]
    g = make_geometry(lens_q, lens_k, hq=hq, hkv=hkv, hmask=hmask, nfunc=3, device=DEVICE)
    mask = make_mask(lens_q, lens_k, hmask, 3, seed=1, device=DEVICE)
    consumer = consumer_mod.Sm90Consumer()

    def request(direction):
        return ViewRequest(
            arch_family="sm90",
            compute_capability=(9, 0),
            direction=direction,
            head_dim_qk=128,
            head_dim_v=128,
            num_heads_q=hq,
            num_heads_kv=hkv,
            mask_heads=hmask,
            pack_gqa=pack_gqa,
            dtype="bfloat16",
            varlen=True,
        )

    fwd, bwd = consumer.resolve(request("forward")), consumer.resolve(request("backward"))
    assert fwd.tile_m == (128 // (hq // hkv) if pack_gqa else 128)
    ref = build_plan(mask, g, fwd, bwd, consumer.name)
    got = build_plan_gpu(mask, g, fwd, bwd, consumer.name)
    assert_plans_equal(ref, got)


#: (forward variant, backward variant, head dims): every SM100 kernel topology, each of its payload
#: shapes (128 x 128; 256 x 128 over two subtiles; the backward's 128 x 256 pair and 64 x 128 D256)
SM100_VIEWS = [
    ("qstage1-1cta", "k2q-1cta", (128, 128)),
    ("qstage2-1cta", "k2q-2cta", (64, 64)),
    ("qstage1-2cta", "k2q-2cta", (128, 128)),
    ("d256", "d256", (256, 256)),
]


@pytest.mark.parametrize("variants", SM100_VIEWS, ids=lambda v: f"{v[0]}+{v[1]}")
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_sm100_consumer_views(variants, varlen):
    """The SM100 consumer's views (never run on SM100 hardware, but its plans are built by these
    kernels there): the same tensors as the reference planner's."""
    sm100 = pytest.importorskip("flexattn_sm100")
    from maskplan_core.consumer import ViewConfig
    from maskplan_kernels.builder import build_plan_gpu

    fwd_variant, bwd_variant, (dqk, dv) = variants
    problem = dict(head_dim_qk=dqk, head_dim_v=dv, dtype="bfloat16", qhead_per_kvhead=2, varlen=varlen)
    fwd = sm100.Sm100FwdConfig(variant=sm100.FWD_VARIANTS[fwd_variant], **problem)
    bwd = sm100.Sm100BwdConfig(variant=sm100.BWD_VARIANTS[bwd_variant], **problem)
    fwd, bwd = (ViewConfig(c.plan_signature(), c.payload_layout) for c in (fwd, bwd))
    lens_q, lens_k = ([2048, 777, 0, 300], [777, 2048, 100, 0]) if varlen else ([1000] * 2, [1500] * 2)
    g = make_geometry(lens_q, lens_k, hq=4, hkv=2, hmask=4, nfunc=3, varlen=varlen, device=DEVICE,
                      head_dim=dqk)  # fmt: skip
    mask = make_mask(lens_q, lens_k, 4, 3, seed=len(lens_q), device=DEVICE)
    name = sm100.Sm100Consumer.name
    ref = build_plan(mask, g, fwd, bwd, name)
    got = build_plan_gpu(mask, g, fwd, bwd, name)
    assert_plans_equal(ref, got)


# --------------------------------------------------------------------------------------------------
# malformed metadata: same exception class and message as the reference


@pytest.mark.parametrize("corrupt", ["above_k_len", "negative", "unordered", "both"])
def test_malformed_endpoints_raise_like_the_reference(corrupt):
    from maskplan_kernels.builder import build_plan_gpu

    q_lens, k_lens, nfunc = [300, 0, 200], [400, 50, 0], 5
    g = make_geometry(q_lens, k_lens, hq=2, hkv=1, hmask=2, nfunc=nfunc, device=DEVICE)
    mask = make_mask(q_lens, k_lens, 2, nfunc, seed=5, kinds=("random", "causal"), device=DEVICE)
    row = 250
    if corrupt == "above_k_len":
        mask[1, nfunc - 1, row] = 401
    elif corrupt == "negative":
        mask[0, :3, row] = torch.tensor([0, 0, -3])
    elif corrupt == "unordered":
        mask[0, :, row] = torch.tensor([10, 20, 15, 30, 40])
    else:
        mask[0, :, row] = torch.tensor([10, 20, 15, 30, 40])
        mask[1, 0, 301] = 1  # sample 2 has k_len 0
    fwd = view_config(RowMajorLayout(64, 128), "forward")
    bwd = view_config(RowMajorLayout(64, 128), "backward")
    with pytest.raises(EndpointError) as ref_err:
        build_plan(mask, g, fwd, bwd, "test")
    with pytest.raises(EndpointError) as got_err:
        build_plan_gpu(mask, g, fwd, bwd, "test")
    assert type(got_err.value) is type(ref_err.value)
    assert str(got_err.value) == str(ref_err.value)


@pytest.mark.parametrize("corrupt", ["q_start", "k_end", "decrease", "over_max"])
def test_malformed_prefixes_raise_like_the_reference(corrupt):
    from maskplan_kernels.builder import build_plan_gpu

    q_lens, k_lens = [400, 300, 200], [500, 100, 200]
    g = make_geometry(q_lens, k_lens, hq=1, hkv=1, hmask=1, nfunc=1, device=DEVICE)
    mask = make_mask(q_lens, k_lens, 1, 1, seed=3, kinds=("causal",), device=DEVICE)
    if corrupt == "q_start":
        g.cu_seqlens_q[0] = 1
    elif corrupt == "k_end":
        g.cu_seqlens_k[-1] += 5
    elif corrupt == "decrease":
        g.cu_seqlens_k[1], g.cu_seqlens_k[2] = g.cu_seqlens_k[2].clone(), g.cu_seqlens_k[1].clone()
    else:
        g.cu_seqlens_q[1] = 450  # sample 0: 450 > max_seqlen_q = 400
    fwd = view_config(RowMajorLayout(128, 128), "forward")
    bwd = view_config(RowMajorLayout(128, 128), "backward")
    with pytest.raises(SeqlenError) as ref_err:
        build_plan(mask, g, fwd, bwd, "test")
    with pytest.raises(SeqlenError) as got_err:
        build_plan_gpu(mask, g, fwd, bwd, "test")
    assert str(got_err.value) == str(ref_err.value)


# --------------------------------------------------------------------------------------------------
# one host read, stream independence


def test_exactly_one_host_read(monkeypatch):
    """With torch's sync debug mode set to error, only the header read may synchronise."""
    import maskplan_kernels.builder as builder

    q_lens, k_lens = [900, 333], [1200, 4000]
    g = make_geometry(q_lens, k_lens, hq=2, hkv=1, hmask=2, nfunc=3, device=DEVICE)
    mask = make_mask(q_lens, k_lens, 2, 3, seed=4, device=DEVICE)
    fwd_layout, bwd_layout = RowMajorLayout(128, 128), RowMajorLayout(128, 128)
    build_both(g, mask, fwd_layout, bwd_layout)  # warm: compiles, uploads the layout tables
    reads = []
    real_read = builder.read_header

    def read_once(build):
        reads.append(1)
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            return real_read(build)
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    monkeypatch.setattr(builder, "read_header", read_once)
    fwd, bwd = view_config(fwd_layout, "forward"), view_config(bwd_layout, "backward")
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = builder.build_plan_gpu(mask, g, fwd, bwd, "test")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert reads == [1]
    assert_plans_equal(build_plan(mask, g, fwd, bwd, "test"), got)


def test_two_streams_concurrently():
    from maskplan_kernels.builder import build_plan_gpu

    problems = []
    for i, (q_lens, k_lens) in enumerate([([900, 333], [1200, 4000]), ([4096], [4096])]):
        g = make_geometry(q_lens, k_lens, hq=4, hkv=2, hmask=4, nfunc=5, device=DEVICE)
        mask = make_mask(q_lens, k_lens, 4, 5, seed=20 + i, device=DEVICE)
        fwd = view_config(RowMajorLayout(128, 128), "forward", qpk=2)
        bwd = view_config(RowMajorLayout(128, 128), "backward", qpk=2)
        problems.append((mask, g, fwd, bwd))
    for mask, g, fwd, bwd in problems:  # warm (compile) outside the race
        build_plan_gpu(mask, g, fwd, bwd, "test")
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    results: list = [None, None]
    errors: list = []
    barrier = threading.Barrier(2)

    def worker(i):
        try:
            mask, g, fwd, bwd = problems[i]
            with torch.cuda.stream(streams[i]):
                barrier.wait()
                for _ in range(3):
                    results[i] = build_plan_gpu(mask, g, fwd, bwd, "test")
            streams[i].synchronize()
        except Exception as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    for (mask, g, fwd, bwd), got in zip(problems, results, strict=True):
        assert_plans_equal(build_plan(mask, g, fwd, bwd, "test"), got)


def test_stage_timer_records_every_stage():
    from maskplan_kernels._launch import CudaEventTimer
    from maskplan_kernels.builder import build_plan_gpu

    g = make_geometry([1000], [1000], hq=2, hkv=1, hmask=1, nfunc=1, device=DEVICE)
    mask = make_mask([1000], [1000], 1, 1, seed=0, kinds=("causal",), device=DEVICE)
    fwd = view_config(RowMajorLayout(128, 128), "forward", qpk=2)
    bwd = view_config(RowMajorLayout(128, 128), "backward", qpk=2)
    timer = CudaEventTimer()
    build_plan_gpu(mask, g, fwd, bwd, "test", stage_timer=timer)
    times = timer.elapsed_ms()
    assert set(times) == {
        "geometry",
        "classify_fwd",
        "classify_bwd",
        "k2q_count",
        "scan_header",
        "header_read",
        "materialize_q2k",
        "schedule",
        "materialize_k2q",
    }
    assert all(t >= 0 for t in times.values())


def test_endpoints_past_the_kernels_budget_are_planned_by_the_reference_planner():
    """nfunc = 75 on SM90's D=64 views (128-row tiles hold at most 73 endpoints a row in the
    materialisers' shared memory): the consumer says so and the reference planner builds the plan
    on the GPU, the plan the planner kernels would have built."""
    consumer_mod = pytest.importorskip("flexattn_sm90.consumer")
    from maskplan_core.consumer import ViewRequest

    lens = [1000, 300]
    g = make_geometry(lens, lens, hq=4, hkv=2, hmask=1, nfunc=75, device=DEVICE)
    mask = make_mask(lens, lens, 1, 75, seed=2, device=DEVICE)
    consumer = consumer_mod.Sm90Consumer()
    fwd, bwd = (
        consumer.resolve(ViewRequest.for_geometry(g, d, "sm90", compute_capability=(9, 0)))
        for d in ("forward", "backward")
    )
    said = "at most 73 endpoints per row .* reference planner builds this plan"
    with pytest.warns(UserWarning, match=said):
        got = consumer.build_plan(mask, g, fwd, bwd)
    assert_plans_equal(build_plan(mask, g, fwd, bwd, consumer.name), got)
