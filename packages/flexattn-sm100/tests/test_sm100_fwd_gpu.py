"""GPU tests of the SM100 forward kernel against the fp32 reference on the same plan.

They run ONLY on a compute-capability 10.x GPU. None was available when the kernel was written:
these tests have never run, and the kernel has only been compiled (``test_sm100_fwd_compile.py``).

Plans are built by the reference planner with the SM100 consumer's forward config for each generic
variant (qstage1 + 1CTA, qstage2 + 1CTA and qstage1 + 2CTA, forced with ``variant=``; every test runs
for each) and, for (Dqk, Dv) = (256, 256), the d256 variant (the only one for it; ``test_d256``), so
the kernel consumes exactly the view a plan for that config carries. Outputs are
poisoned with NaN before each run: an element the kernel does not write fails the test. Tolerance
(max abs error vs fp32 on random normal inputs), as for SM90: bf16 2e-2, fp16 5e-3.

    python -m pytest packages/flexattn-sm100/tests/test_sm100_fwd_gpu.py -m gpu -q
"""

import functools

import pytest
import torch

pytestmark = pytest.mark.gpu

from maskplan_core import testing  # noqa: E402

if testing.cuda_arch_major() != 10:
    pytest.skip("needs a compute-capability 10.x (SM100/SM103) GPU", allow_module_level=True)

from flexattn_sm100 import Sm100Consumer  # noqa: E402
from flexattn_sm100.fwd_launch import run_forward  # noqa: E402
from flexattn_sm100.heuristics import select_fwd_config  # noqa: E402
from maskplan_core import masks  # noqa: E402
from maskplan_core.consumer import KERNEL_DTYPE_NAMES, ViewConfig  # noqa: E402
from maskplan_core.testing import STRIDED_CASES, ForwardCases, check_forward, reference_plan  # noqa: E402

DEV = torch.device("cuda")
VARIANTS = ("qstage1-1cta", "qstage2-1cta", "qstage1-2cta")
VARIANT = VARIANTS[0]  # the variant of the running test (set by the autouse fixture below)
qkv = functools.partial(testing.qkv, device=DEV)
random_intervals = functools.partial(testing.random_intervals, device=DEV)


@pytest.fixture(autouse=True, params=VARIANTS)
def variant(request, monkeypatch):
    """Every test runs once per forward kernel variant."""
    monkeypatch.setitem(globals(), "VARIANT", request.param)
    return request.param


def qstage1_view(g) -> ViewConfig:
    """The forward view of the config of :data:`VARIANT` for ``g`` (Dv 256: of d256, its only variant)."""
    config = select_fwd_config(
        head_dim_qk=g.head_dim_qk, head_dim_v=g.head_dim_v, dtype=KERNEL_DTYPE_NAMES[g.dtype],
        qhead_per_kvhead=g.num_heads_q // g.num_heads_kv, varlen=g.varlen,
        variant=VARIANT if g.head_dim_v <= 128 else None,
    )  # fmt: skip
    return ViewConfig(signature=config.plan_signature(), layout=config.payload_layout)


def sm100_plan(mask_func, q, k, v, **varlen):
    """A forward-only plan with the SM100 qstage1 view (reference planner, CUDA tensors)."""
    return reference_plan(mask_func, q, k, v, consumer=Sm100Consumer.name, forward=qstage1_view, **varlen)


def check(mask_func, q, k, v, *, varlen=None, scale=None):
    plan = sm100_plan(mask_func, q, k, v, **(varlen or {}))
    check_forward(run_forward, plan.view("forward"), q, k, v, scale=scale)
    return plan


#: the cases shared with the SM90 suite (maskplan_core.testing), on this consumer's check
CASES = ForwardCases(check, run_forward, DEV)
DTYPES = [torch.bfloat16, torch.float16]
DIMS = [(32, 32), (64, 64), (128, 128)]
DIM_IDS = [f"d{dv}" for _, dv in DIMS]


# -- masks, fixed length --------------------------------------------------------------------------
@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_causal(dtype, dims):
    CASES.causal(dtype, dims)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_sliding_window(dtype):
    CASES.sliding_window(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_document(dtype):
    CASES.document(dtype)


@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_random_multi_interval_per_head(dtype, dims):
    CASES.random_multi_interval_per_head(dtype, dims)


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
    CASES.varlen_with_empty_samples(dtype, kind)


# -- other head dims ------------------------------------------------------------------------------
@pytest.mark.parametrize("dqk,dv", [(96, 96), (192, 128)])
def test_other_head_dims(dqk, dv):
    if VARIANT == "qstage2-1cta" and dqk > 128:
        pytest.skip("qstage2 keeps two Q tiles in SMEM: Dqk <= 128 (its launcher refuses 192)")
    CASES.head_dims(dqk, dv, "random")


# -- D256: the d256 variant (O over TMEM columns 256..511, one K/V stage) ----------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_d256(dtype, variant):
    """Fixed (causal, per-head random intervals) and varlen (GQA, empty samples) at (256, 256)."""
    if variant != VARIANTS[0]:
        pytest.skip("(256, 256) has one forward variant, d256: it runs under the first parameter only")
    CASES.causal(dtype, (256, 256))
    CASES.random_multi_interval_per_head(dtype, (256, 256))
    CASES.varlen_with_empty_samples(dtype, "random", (256, 256))


def test_softmax_scale_and_reuse():
    """A plan is reused with new values and other scales (a negative one: the launcher negates q);
    two launches agree bit for bit."""
    CASES.softmax_scale_and_reuse(new_value_scales=(0.05, -0.2))


@pytest.mark.parametrize("layout,varlen", STRIDED_CASES.values(), ids=list(STRIDED_CASES))
def test_strided_inputs(layout, varlen):
    """q, k, v as slices of a packed QKV tensor or transposed BHSD tensors, read in place."""
    CASES.strided_inputs(layout, varlen)


def test_many_tasks_exercise_the_clc_queue():
    """More tasks than CTAs fit at once: running CTAs take the rest through CLC cancellation."""
    B, S, H, D = 4, 4096, 8, 64
    q, k, v = qkv((B, S, H), (B, S, H), D, D, torch.bfloat16, seed=12)
    check(masks.causal(S, batch=B, device=DEV), q, k, v)


def test_consumer_forward_runs_the_kernel_and_refuses_other_variants(monkeypatch):
    monkeypatch.setenv("FLEXATTN_SM100_UNVERIFIED", "1")  # the consumer's opt-in to never-run kernels
    B, S, H, D = 1, 300, 2, 128
    q, k, v = qkv((B, S, H), (B, S, H), D, D, torch.bfloat16, seed=13)
    plan = sm100_plan(masks.causal(S, batch=B, device=DEV), q, k, v)
    res = Sm100Consumer().forward(plan, q.view(-1, H, D), k.view(-1, H, D), v.view(-1, H, D),
                                  softmax_scale=0.1, return_max_logit=False)  # fmt: skip
    assert res.out.shape == (S, H, D) and res.max_logit is None
