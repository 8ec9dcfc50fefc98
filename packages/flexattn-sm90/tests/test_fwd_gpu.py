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

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs an SM90 (Hopper) GPU", allow_module_level=True)

from flexattn_sm90 import Sm90Consumer  # noqa: E402
from flexattn_sm90.fwd_launch import run_forward  # noqa: E402
from flexattn_sm90.fwd_mainloop import SCHEDULES  # noqa: E402
from maskplan_core import masks, testing  # noqa: E402
from maskplan_core.testing import ForwardCases, check_forward, reference_plan, resolve_view  # noqa: E402

DEV = torch.device("cuda")
qkv = functools.partial(testing.qkv, device=DEV)
random_intervals = functools.partial(testing.random_intervals, device=DEV)


def sm90_plan(mask_func, q, k, v, **varlen):
    """A forward-only plan with the SM90 consumer's view (reference planner, CUDA tensors)."""
    consumer = Sm90Consumer()
    forward = functools.partial(resolve_view, consumer, direction="forward")
    return reference_plan(mask_func, q, k, v, consumer=consumer.name, forward=forward, **varlen)


def check(mask_func, q, k, v, *, varlen=None, mask_via_smem=True, scale=None, schedule=None):
    plan = sm90_plan(mask_func, q, k, v, **(varlen or {}))
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
@pytest.mark.parametrize("dqk,dv", [(64, 64), (96, 96), (192, 128), (256, 256)])
@pytest.mark.parametrize("kind", ["causal", "random"])
def test_head_dims(dqk, dv, kind):
    CASES.head_dims(dqk, dv, kind)


def test_softmax_scale_and_reuse():
    """A plan is reused with new values and another scale; two launches agree bit for bit."""
    CASES.softmax_scale_and_reuse(new_value_scales=(0.05,))


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
