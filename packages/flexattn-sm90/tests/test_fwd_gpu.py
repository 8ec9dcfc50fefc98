"""GPU tests of the SM90 forward kernel (H200) against the fp32 reference on the same plan.

Plans are built by the reference planner with the SM90 consumer's own forward ViewConfig (what
``flexattn.create_mask_plan`` does on an SM90 device), so the kernel consumes exactly the view
it will get in production. Outputs are poisoned with NaN before each run: an element the kernel
does not write fails the test. Tolerance (max abs error vs fp32 on random normal inputs): bf16
2e-2, fp16 5e-3.

    python -m pytest packages/flexattn-sm90/tests/test_fwd_gpu.py -m gpu -q
"""

import functools

import pytest
import torch

pytestmark = pytest.mark.gpu

from maskplan_core import testing  # noqa: E402

if testing.cuda_arch_major() != 9:
    pytest.skip("needs an SM90 (Hopper) GPU", allow_module_level=True)

from flexattn_sm90 import SUPPORTED_HEAD_DIMS, Sm90Consumer, fwd_launch  # noqa: E402
from flexattn_sm90.fwd_launch import config_for_view, run_forward  # noqa: E402
from flexattn_sm90.fwd_mainloop import SCHEDULES  # noqa: E402
from maskplan_core import masks  # noqa: E402
from maskplan_core.testing import (  # noqa: E402
    STRIDED_CASES,
    ForwardCases,
    check_forward,
    reference_plan,
    resolve_view,
)
from maskplan_kernels.consumer_inputs import qkv_operands  # noqa: E402

DEV = torch.device("cuda")
qkv = functools.partial(testing.qkv, device=DEV)
random_intervals = functools.partial(testing.random_intervals, device=DEV)


def sm90_plan(mask_func, q, k, v, pack_gqa=False, **varlen):
    """A forward-only plan with the SM90 consumer's view (reference planner, CUDA tensors)."""
    consumer = Sm90Consumer()
    forward = functools.partial(resolve_view, consumer, direction="forward", pack_gqa=pack_gqa)
    return reference_plan(mask_func, q, k, v, consumer=consumer.name, forward=forward, **varlen)


def check(mask_func, q, k, v, *, varlen=None, mask_via_smem=True, scale=None, schedule=None, pack_gqa=False):
    plan = sm90_plan(mask_func, q, k, v, pack_gqa, **(varlen or {}))
    run = functools.partial(run_forward, mask_via_smem=mask_via_smem, schedule=schedule)
    check_forward(run, plan.view("forward"), q, k, v, scale=scale)
    return plan


#: the cases shared with the SM100 suite (maskplan_core.testing), on this consumer's check
CASES = ForwardCases(check, run_forward, DEV)


# -- masks, fixed length --------------------------------------------------------------------------
DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("mask_via_smem", [True, False], ids=["smem", "direct"])
def test_causal(dtype, mask_via_smem):
    CASES.causal(dtype, mask_via_smem=mask_via_smem)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_sliding_window(dtype):
    CASES.sliding_window(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_document(dtype):
    CASES.document(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("mask_via_smem", [True, False], ids=["smem", "direct"])
def test_random_multi_interval_per_head(dtype, mask_via_smem):
    CASES.random_multi_interval_per_head(dtype, mask_via_smem=mask_via_smem)


def test_all_empty_rows():
    CASES.all_empty_rows()


def test_all_full():
    CASES.all_full()


@pytest.mark.parametrize("sq,sk", [(300, 1000), (1000, 300), (129, 127)])
def test_sq_ne_sk(sq, sk):
    CASES.sq_ne_sk(sq, sk)


@pytest.mark.parametrize("hq,hkv,hmask", [(8, 2, 1), (8, 2, 8), (6, 1, 1)])
def test_gqa(hq, hkv, hmask):
    CASES.gqa(hq, hkv, hmask)


# -- varlen ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["causal", "random"])
def test_varlen_with_empty_samples(dtype, kind):
    # samples: normal, q empty, k empty (rows see nothing), long, tail not a multiple of 128
    CASES.varlen_with_empty_samples(dtype, kind)


# -- other head dims ------------------------------------------------------------------------------
#: head dims without a kernel of their own, run by the next kernel up on the tensors as they are
#: (heuristics.io_head_dims): one per forward tile and per backward tile family, and Dqk alone
NARROWER = [(72, 72), (48, 48), (64, 128), (160, 128)]


#: the kernels' own head dims but (128, 128), which the default cases run
OWN = [d for d in SUPPORTED_HEAD_DIMS if d != (128, 128)]


@pytest.mark.parametrize("dqk,dv", [*OWN, *NARROWER])
@pytest.mark.parametrize("kind", ["causal", "random"])
def test_head_dims(dqk, dv, kind):
    CASES.head_dims(dqk, dv, kind)


@pytest.mark.parametrize("dqk,dv", Sm90Consumer.supported_head_dims)
def test_direct_payload_head_dims(dqk, dv):
    """Direct GMEM->register payload loads (chosen where at least half of the blocks are partial)
    at every head dim, on per-head random intervals: every block of them is partial."""
    B, S, H = 2, 700, 4
    q, k, v = qkv((B, S, H), (B, S, 2), dqk, dv, torch.bfloat16, seed=40)
    mask = random_intervals(H, 5, torch.full((B * S,), S), seed=41)
    plan = check(mask, q, k, v, mask_via_smem=None)
    view = plan.view("forward")
    assert view.mask_block_idx.numel() >= view.full_block_idx.numel()


@pytest.mark.parametrize("mask_via_smem", [True, False], ids=["smem", "direct"])
@pytest.mark.parametrize("dqk,dv", [*Sm90Consumer.supported_head_dims, *NARROWER])
def test_samples_stay_apart(dqk, dv, mask_via_smem):
    """A tail K block holds the next sample's first rows; with samples 1 and 4 of the varlen batch
    non-finite (their Q, K and V rows), the other samples' O and LSE equal a clean run's."""
    H, cu_q, cu_k = 4, testing.VARLEN_CU_Q, testing.VARLEN_CU_K
    q, k, v = qkv((cu_q[-1], H), (cu_k[-1], 2), dqk, dv, torch.bfloat16, seed=42)
    mask = random_intervals(H, 5, testing.varlen_k_len(), seed=43)
    plan = sm90_plan(mask, q, k, v, **testing.varlen_args(DEV))
    view = plan.view("forward")
    run = functools.partial(run_forward, view, softmax_scale=dqk**-0.5, mask_via_smem=mask_via_smem)
    clean_out, clean_lse, _ = run(q, k, v)
    for b in (1, 4):
        q[cu_q[b] : cu_q[b + 1]] = float("nan")
        k[cu_k[b] : cu_k[b + 1]] = float("nan")
        v[cu_k[b] : cu_k[b + 1]] = float("inf")
    out, lse, _ = run(q, k, v)
    for b in (0, 2, 3):
        rows = slice(cu_q[b], cu_q[b + 1])
        assert torch.equal(out[rows], clean_out[rows]), f"sample {b}'s O changed"
        assert torch.equal(lse[:, rows], clean_lse[:, rows]), f"sample {b}'s LSE changed"


def test_softmax_scale_and_reuse():
    """A plan is reused with new values and another scale; two launches agree bit for bit."""
    CASES.softmax_scale_and_reuse(new_value_scales=(0.05,))


@pytest.mark.parametrize("pack_gqa", [False, True], ids=["heads", "pack-gqa"])
@pytest.mark.parametrize("layout,varlen", STRIDED_CASES.values(), ids=list(STRIDED_CASES))
def test_strided_inputs(layout, varlen, pack_gqa):
    """q, k, v as slices of a packed QKV tensor or transposed BHSD tensors, read in place."""
    CASES.strided_inputs(layout, varlen, pack_gqa=pack_gqa)


@pytest.mark.parametrize("d", [64, 256])
def test_strided_inputs_head_dims(d):
    """Packed QKV slices on the other forward tiles (two Q buffers at 64, the 128 x 64 tile at 256)."""
    CASES.strided_inputs("packed", d=d)


@pytest.mark.parametrize(
    "seqlen,d,pack_gqa",
    [(768, 128, False), (768, 128, True), (768, 64, False), (768, 256, False), (700, 128, False)],
)
def test_bshd_views_of_bhsd(seqlen, d, pack_gqa):
    """q, k, v of 2 samples transposed from ``[B, H, S, D]``: no THD view, so read per sample where S
    is a multiple of the kernel's granule (768), else copied (700); the same results either way."""
    view, q, k, v = CASES.per_sample_inputs(seqlen, d, pack_gqa=pack_gqa)
    granule = config_for_view(view).row_granule
    assert qkv_operands(view, q, k, v, row_granule=granule)[3] == (seqlen % granule == 0)


# -- consumer schedules ---------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("mask_via_smem", [True, False], ids=["smem", "direct"])
def test_schedules(schedule, mask_via_smem):
    """Every main-loop schedule on masks mixing partial, full and empty blocks, tasks without
    blocks, GQA and varlen tails."""
    B, S, H, D = 2, 700, 4, 128
    q, k, v = qkv((B, S, H), (B, S, 2), D, D, torch.bfloat16, seed=12)
    ep = random_intervals(H, 5, torch.full((B * S,), S), seed=12)
    ep[..., 130:260] = 0  # a Q block without any block
    check(ep, q, k, v, mask_via_smem=mask_via_smem, schedule=schedule)
    check(masks.causal(S, batch=B, device=DEV), q, k, v, mask_via_smem=mask_via_smem, schedule=schedule)
    cu_q = torch.tensor([0, 100, 100, 164, 964, 1300], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 300, 500, 500, 1400, 1533], dtype=torch.int32, device=DEV)
    q, k, v = qkv((1300, 4), (1533, 2), D, D, torch.float16, seed=13)
    k_len = (cu_k[1:] - cu_k[:-1]).repeat_interleave(cu_q[1:] - cu_q[:-1])
    varlen = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 800, "max_seqlen_k": 900}
    check(random_intervals(1, 5, k_len, seed=13), q, k, v, varlen=varlen, schedule=schedule)


@pytest.mark.parametrize("ctas", [1, 3])
@pytest.mark.parametrize(
    "schedule,d,dv",
    [("overlap", 64, 64), ("overlap", 96, 96), ("overlap", 128, 128), ("simple", 128, 128),
     ("overlap", 192, 128), ("overlap", 256, 256)],
)  # fmt: skip
def test_task_handover(schedule, d, dv, ctas, monkeypatch):
    """One CTA runs task after task: the grid is capped at 1 or 3 persistent CTAs (a grid of one
    CTA per SM gives every CTA of a test with fewer than 132 tasks a single task). Many short tasks:
    documents of 1-3 K blocks, one-block tasks, tasks without blocks before and after tasks with
    blocks, GQA and PackGQA, per-head random masks. Two Q buffers up to D = 128; one from (192, 128)
    on, loaded after the task's first K / V block at (192, 128)."""
    monkeypatch.setattr(fwd_launch, "persistent_ctas", lambda device, items: min(items, ctas))
    B, S, H = 2, 1000, 4
    q, k, v = qkv((B, S, H), (B, S, 2), d, dv, torch.bfloat16, seed=30)
    ep = masks.document([[40, 300, 5, 128, 527], [130, 1, 869]], device=DEV)
    ep[..., 256:384] = 0  # Q block 2 of each sample visits no block
    ep[..., S + 896 :] = 0  # nor does the last Q block of the second sample
    check(ep, q, k, v, schedule=schedule)
    if d == 128:  # PackGQA: 2 q heads per tile row block, its own epilogue addressing
        check(ep, q, k, v, schedule=schedule, pack_gqa=True)
    check(random_intervals(H, 5, torch.full((B * S,), S), seed=31), q, k, v, schedule=schedule)


# -- the stream's scheduler counter ---------------------------------------------------------------
def test_scheduler_counter_returns_to_zero(monkeypatch):
    """Every launch leaves its stream's counter at zero (its last ticket resets it) whatever its
    task count and grid, so the next launch on the stream takes every task: outputs stay bit-equal
    to the first run's. Another stream has its own counter. Under CUDA graph capture each call gets
    a fresh counter, and replays match eager."""
    B, S, H, SCALE = 2, 700, 4, 128**-0.5
    q, k, v = qkv((B, S, H), (B, S, 2), 128, 128, torch.bfloat16, seed=40)
    views = [
        sm90_plan(mask, q, k, v).view("forward")
        for mask in (
            masks.causal(S, batch=B, device=DEV),
            masks.document([[40, 300, 5, 128, 227], [130, 1, 569]], device=DEV),
            random_intervals(H, 5, torch.full((B * S,), S), seed=41),
        )
    ]
    q, k, v = (t.flatten(0, 1) for t in (q, k, v))  # the consumer protocol's THD
    first = [run_forward(view, q, k, v, softmax_scale=SCALE)[0] for view in views]
    counter = fwd_launch.scheduler_counter(DEV, torch.cuda.current_stream().cuda_stream)
    assert counter.item() == 0
    for ctas in (1, 3, 1000):
        monkeypatch.setattr(fwd_launch, "persistent_ctas", lambda device, items, c=ctas: min(items, c))
        for view, want in zip(views, first, strict=True):
            assert torch.equal(run_forward(view, q, k, v, softmax_scale=SCALE)[0], want)
            assert counter.item() == 0, f"counter left at {counter.item()} ({ctas} CTAs)"
    monkeypatch.undo()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outs = [run_forward(view, q, k, v, softmax_scale=SCALE)[0] for view in views]
        side_counter = fwd_launch.scheduler_counter(DEV, side.cuda_stream)
    torch.cuda.current_stream().wait_stream(side)
    assert side_counter.data_ptr() != counter.data_ptr() and side_counter.item() == 0
    assert all(torch.equal(a, b) for a, b in zip(outs, first, strict=True))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [run_forward(view, q, k, v, softmax_scale=SCALE)[0] for view in views]
    for _ in range(2):
        for out in captured:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(captured, first, strict=True))


# -- PackGQA --------------------------------------------------------------------------------------
PACK = [(8, 2), (16, 1), (4, 4), (32, 2), (32, 1), (64, 1)]  # G = 4, 16, 1, 16, 32, 64 (MQA, Q blocks of 2)


@pytest.mark.parametrize("hq,hkv", PACK, ids=lambda x: str(x))
@pytest.mark.parametrize("kind", ["causal", "random", "document"])
def test_pack_gqa(hq, hkv, kind):
    """The q heads of a kv head packed into one tile (plan Q blocks of 128 / G positions), against
    the fp32 reference on the same plan: O, LSE and the per-head max logit of every head."""
    B, S, D = 2, 700, 128
    q, k, v = qkv((B, S, hq), (B, S, hkv), D, D, torch.bfloat16, seed=20)
    ep = {
        "causal": masks.causal(S, batch=B, device=DEV),
        "random": random_intervals(1, 5, torch.full((B * S,), S), seed=20),
        "document": masks.document([[100, 300, 13, 287], [700]], device=DEV),
    }[kind]
    plan = check(ep, q, k, v, pack_gqa=True)
    assert plan.view("forward").signature.topology.tile_m == 128 // (hq // hkv)


@pytest.mark.parametrize("dqk,dv", [(32, 32), (64, 64), (96, 96), (192, 128), (256, 256), (80, 80), (48, 48)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("hq", [8, 32, 64], ids=["g8", "g32", "g64"])  # MQA's default packing up to 64
def test_pack_gqa_head_dims(dqk, dv, dtype, hq):
    B, S, hkv = 1, 900, 1
    q, k, v = qkv((B, S, hq), (B, S, hkv), dqk, dv, dtype, seed=21)
    check(random_intervals(1, 3, torch.full((B * S,), S), seed=21), q, k, v, pack_gqa=True)


@pytest.mark.parametrize("mask_via_smem", [True, False], ids=["smem", "direct"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pack_gqa_varlen_and_schedules(mask_via_smem, schedule):
    """Varlen with empty samples and tails that split a packed tile, every schedule and payload
    delivery; rows with no visible key (O = 0, LSE = -inf)."""
    cu_q = torch.tensor([0, 100, 100, 164, 964, 1300], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 300, 500, 500, 1400, 1533], dtype=torch.int32, device=DEV)
    q, k, v = qkv((1300, 8), (1533, 2), 128, 128, torch.float16, seed=22)
    k_len = (cu_k[1:] - cu_k[:-1]).repeat_interleave(cu_q[1:] - cu_q[:-1])
    varlen = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 800, "max_seqlen_k": 900}
    ep = random_intervals(1, 5, k_len, seed=22)
    ep[..., 400:470] = 0
    options = dict(varlen=varlen, mask_via_smem=mask_via_smem, schedule=schedule, pack_gqa=True)
    check(ep, q, k, v, **options)
    check(masks.causal(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k), q, k, v, **options)


def test_pack_gqa_equals_unpacked():
    """Same mask, packed and unpacked plans: the outputs agree to rounding (same math, other tiles)."""
    B, S, hq, hkv, D = 2, 1000, 8, 2, 128
    q, k, v = qkv((B, S, hq), (B, S, hkv), D, D, torch.bfloat16, seed=23)
    ep = masks.sliding_window(S, window_left=300, batch=B, device=DEV)
    q3, k3, v3 = (t.reshape(-1, *t.shape[-2:]) for t in (q, k, v))
    outs = []
    for pack in (False, True):
        view = sm90_plan(ep, q, k, v, pack).view("forward")
        outs.append(run_forward(view, q3, k3, v3, softmax_scale=0.1, return_max_logit=True))
    (o0, l0, m0), (o1, l1, m1) = outs
    assert (o0.float() - o1.float()).abs().max().item() <= 1e-2
    assert (l0 - l1).abs().max().item() <= 1e-4
    assert torch.allclose(m0, m1)
