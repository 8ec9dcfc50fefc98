"""GPU tests of the SM100 forward kernel against the fp32 reference on the same plan.

They run ONLY on a compute-capability 10.x GPU. None was available when the kernel was written:
these tests have never run, and the kernel has only been compiled (``test_fwd_compile.py``).

Plans are built by the reference planner with the SM100 consumer's forward config for each variant
a kernel implements (qstage1 + 1CTA and qstage1 + 2CTA, forced with ``variant=``; every test runs
for both), so the kernel consumes exactly the view a plan for that config carries. Outputs are
poisoned with NaN before each run: an element the kernel does not write fails the test. Tolerance
(max abs error vs fp32 on random normal inputs), as for SM90: bf16 2e-2, fp16 5e-3.

    python -m pytest packages/flexattn-sm100/tests/test_fwd_gpu.py -m gpu -q
"""

import functools

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 10:
    pytest.skip("needs a compute-capability 10.x (SM100/SM103) GPU", allow_module_level=True)

from flexattn_sm100 import Sm100Consumer  # noqa: E402
from flexattn_sm100.fwd_launch import run_forward  # noqa: E402
from flexattn_sm100.heuristics import select_fwd_config  # noqa: E402
from maskplan_core import masks, testing  # noqa: E402
from maskplan_core.consumer import KERNEL_DTYPE_NAMES, ViewConfig  # noqa: E402
from maskplan_core.testing import check_forward, reference_plan, varlen_causal  # noqa: E402

DEV = torch.device("cuda")
VARIANTS = ("qstage1-1cta", "qstage1-2cta")
VARIANT = VARIANTS[0]  # the variant of the running test (set by the autouse fixture below)
qkv = functools.partial(testing.qkv, device=DEV)
random_intervals = functools.partial(testing.random_intervals, device=DEV)


@pytest.fixture(autouse=True, params=VARIANTS)
def variant(request, monkeypatch):
    """Every test runs once per forward kernel variant."""
    monkeypatch.setitem(globals(), "VARIANT", request.param)
    return request.param


def qstage1_view(g) -> ViewConfig:
    """The forward view of the qstage1 config (:data:`VARIANT`) for ``g``."""
    config = select_fwd_config(
        head_dim_qk=g.head_dim_qk, head_dim_v=g.head_dim_v, dtype=KERNEL_DTYPE_NAMES[g.dtype],
        qhead_per_kvhead=g.num_heads_q // g.num_heads_kv, varlen=g.varlen, variant=VARIANT,
    )  # fmt: skip
    return ViewConfig(signature=config.plan_signature(), layout=config.payload_layout)


def sm100_plan(mask_func, q, k, v, **varlen):
    """A forward-only plan with the SM100 qstage1 view (reference planner, CUDA tensors)."""
    return reference_plan(mask_func, q, k, v, consumer=Sm100Consumer.name, forward=qstage1_view, **varlen)


def check(mask_func, q, k, v, *, varlen=None, scale=None):
    plan = sm100_plan(mask_func, q, k, v, **(varlen or {}))
    check_forward(run_forward, plan.view("forward"), q, k, v, scale=scale)
    return plan


DTYPES = [torch.bfloat16, torch.float16]
DIMS = [(64, 64), (128, 128)]


# -- masks, fixed length --------------------------------------------------------------------------
@pytest.mark.parametrize("dims", DIMS, ids=["d64", "d128"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_causal(dtype, dims):
    B, S, H = 2, 1000, 4
    q, k, v = qkv((B, S, H), (B, S, H), *dims, dtype)
    check(masks.causal(S, batch=B, device=DEV), q, k, v)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_sliding_window(dtype):
    B, S, H, D = 2, 777, 2, 128
    q, k, v = qkv((B, S, H), (B, S, H), D, D, dtype, seed=1)
    check(masks.sliding_window(S, window_left=200, batch=B, device=DEV), q, k, v)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_document(dtype):
    docs = [[100, 300, 13, 611], [1024]]
    q, k, v = qkv((2, 1024, 3), (2, 1024, 3), 128, 128, dtype, seed=2)
    check(masks.document(docs, causal=True, device=DEV), q, k, v)


@pytest.mark.parametrize("dims", DIMS, ids=["d64", "d128"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_random_multi_interval_per_head(dtype, dims):
    B, S, H = 2, 700, 4
    q, k, v = qkv((B, S, H), (B, S, H), *dims, dtype, seed=3)
    ep = random_intervals(H, 5, torch.full((B * S,), S), seed=3)  # Hmask = Hq
    check(ep, q, k, v)


def test_all_empty_rows():
    B, S, H, D = 2, 300, 2, 128
    q, k, v = qkv((B, S, H), (B, S, H), D, D, torch.bfloat16, seed=4)
    ep = masks.causal(S, batch=B, device=DEV).clone()
    ep[..., ::3] = 0  # every third row sees nothing
    ep[..., S : S + 128] = 0  # a whole Q block of sample 1: a task with no block at all
    check(ep, q, k, v)
    check(torch.zeros_like(ep), q, k, v)  # nothing visible anywhere


def test_all_full():
    B, S, H, D = 1, 512, 2, 128  # S a multiple of the tile: every block is full
    q, k, v = qkv((B, S, H), (B, S, H), D, D, torch.bfloat16, seed=5)
    plan = check(torch.full((1, 1, B * S), S, dtype=torch.int32, device=DEV), q, k, v)
    assert plan.view("forward").stats()["partial"] == 0


@pytest.mark.parametrize("sq,sk", [(300, 1000), (1000, 300), (129, 127)])
def test_sq_ne_sk(sq, sk):
    q, k, v = qkv((2, sq, 2), (2, sk, 2), 128, 128, torch.bfloat16, seed=6)
    check(masks.causal(sq, sk, batch=2, device=DEV), q, k, v)


@pytest.mark.parametrize("hq,hkv,hmask", [(8, 2, 1), (8, 2, 8), (6, 1, 1)])
def test_gqa(hq, hkv, hmask):
    B, S, D = 2, 600, 128
    q, k, v = qkv((B, S, hq), (B, S, hkv), D, D, torch.bfloat16, seed=7)
    check(random_intervals(hmask, 3, torch.full((B * S,), S), seed=7), q, k, v)


# -- varlen ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["causal", "random"])
def test_varlen_with_empty_samples(dtype, kind):
    # samples: normal, q empty, k empty (rows see nothing), long, tail not a multiple of 128
    cu_q = torch.tensor([0, 100, 100, 164, 964, 1300], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 300, 500, 500, 1400, 1533], dtype=torch.int32, device=DEV)
    H, Hkv, D = 4, 2, 128
    q, k, v = qkv((1300, H), (1533, Hkv), D, D, dtype, seed=8)
    k_len = (cu_k[1:] - cu_k[:-1]).repeat_interleave(cu_q[1:] - cu_q[:-1])
    ep = varlen_causal(cu_q, cu_k) if kind == "causal" else random_intervals(1, 5, k_len, seed=8)
    varlen = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 800, "max_seqlen_k": 900}
    check(ep, q, k, v, varlen=varlen)


# -- other head dims ------------------------------------------------------------------------------
@pytest.mark.parametrize("dqk,dv", [(96, 96), (192, 128)])
def test_other_head_dims(dqk, dv):
    B, S, H = 2, 600, 2
    q, k, v = qkv((B, S, H), (B, S, H), dqk, dv, torch.bfloat16, seed=9)
    check(random_intervals(1, 5, torch.full((B * S,), S)), q, k, v)


def test_softmax_scale_and_reuse():
    """A plan is reused with new values and another scale; two launches agree bit for bit."""
    B, S, H, D = 1, 640, 2, 128
    q, k, v = qkv((B, S, H), (B, S, H), D, D, torch.bfloat16, seed=10)
    ep = masks.sliding_window(S, window_left=100, batch=B, device=DEV)
    plan = check(ep, q, k, v, scale=0.3)
    q2, k2, v2 = qkv((B, S, H), (B, S, H), D, D, torch.bfloat16, seed=11)
    check(ep, q2, k2, v2, scale=0.05)
    check(ep, q2, k2, v2, scale=-0.2)  # negative scale: the launcher negates q
    view = plan.view("forward")
    a = run_forward(view, q.view(-1, H, D), k.view(-1, H, D), v.view(-1, H, D), softmax_scale=0.3)
    b = run_forward(view, q.view(-1, H, D), k.view(-1, H, D), v.view(-1, H, D), softmax_scale=0.3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_many_tasks_exercise_the_clc_queue():
    """More tasks than CTAs fit at once: running CTAs take the rest through CLC cancellation."""
    B, S, H, D = 4, 4096, 8, 64
    q, k, v = qkv((B, S, H), (B, S, H), D, D, torch.bfloat16, seed=12)
    check(masks.causal(S, batch=B, device=DEV), q, k, v)


def test_consumer_forward_runs_the_kernel_and_refuses_other_variants():
    B, S, H, D = 1, 300, 2, 128
    q, k, v = qkv((B, S, H), (B, S, H), D, D, torch.bfloat16, seed=13)
    plan = sm100_plan(masks.causal(S, batch=B, device=DEV), q, k, v)
    res = Sm100Consumer().forward(plan, q.view(-1, H, D), k.view(-1, H, D), v.view(-1, H, D),
                                  softmax_scale=0.1, return_max_logit=False)  # fmt: skip
    assert res.out.shape == (S, H, D) and res.max_logit is None
