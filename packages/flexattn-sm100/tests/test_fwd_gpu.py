"""GPU tests of the SM100 forward kernel against the fp32 reference on the same plan.

They run ONLY on a compute-capability 10.x GPU. None was available when the kernel was written:
these tests have never run, and the kernel has only been compiled (``test_fwd_compile.py``).

Plans are built by the reference planner with the SM100 consumer's forward config for the variant
the kernel implements (qstage1 + 1CTA, forced with ``variant=``; the heuristics' defaults for
D64/D128 are variants without a kernel yet), so the kernel consumes exactly the view a plan for
that config carries. Outputs are poisoned with NaN before each run: an element the kernel does not
write fails the test. Tolerance (max abs error vs fp32 on random normal inputs), as for SM90:
bf16 2e-2, fp16 5e-3.

    python -m pytest packages/flexattn-sm100/tests/test_fwd_gpu.py -m gpu -q
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 10:
    pytest.skip("needs a compute-capability 10.x (SM100/SM103) GPU", allow_module_level=True)

from flexattn_sm100 import Sm100Consumer  # noqa: E402
from flexattn_sm100.fwd_launch import run_forward  # noqa: E402
from flexattn_sm100.heuristics import select_fwd_config  # noqa: E402
from maskplan_core import masks, validate_plan_inputs  # noqa: E402
from maskplan_core.consumer import ViewConfig  # noqa: E402
from maskplan_core.reference import attention_forward, build_plan  # noqa: E402

DEV = torch.device("cuda")
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
VARIANT = "qstage1-1cta"


# -- problem builders -----------------------------------------------------------------------------
def sm100_plan(mask_func, q, k, v, **varlen):
    """A forward-only plan with the SM100 qstage1 + 1CTA view (reference planner, CUDA tensors)."""
    g = validate_plan_inputs(mask_func, q, k, v, **varlen)
    config = select_fwd_config(
        head_dim_qk=g.head_dim_qk, head_dim_v=g.head_dim_v, dtype=DTYPE_NAMES[g.dtype],
        qhead_per_kvhead=g.num_heads_q // g.num_heads_kv, varlen=g.varlen, variant=VARIANT,
    )  # fmt: skip
    view = ViewConfig(signature=config.plan_signature(), layout=config.payload_layout)
    return build_plan(mask_func, g, view, None, Sm100Consumer.name)


def qkv(shape_q, shape_k, dqk, dv, dtype, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(*shape_q, dqk, device=DEV, dtype=dtype, generator=gen)
    k = torch.randn(*shape_k, dqk, device=DEV, dtype=dtype, generator=gen)
    v = torch.randn(*shape_k, dv, device=DEV, dtype=dtype, generator=gen)
    return q, k, v


def random_intervals(hmask, nfunc, row_k_len, seed=0):
    """Endpoints ``[hmask, nfunc, rows]``: sorted uniform draws in ``[0, k_len]`` of each row."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    k_len = row_k_len.to(DEV, torch.float64)
    u = torch.rand(hmask, nfunc, k_len.numel(), device=DEV, generator=gen, dtype=torch.float64)
    ep = torch.floor(u * (k_len + 1)).clamp(max=k_len).to(torch.int32)
    return ep.sort(dim=1).values.contiguous()


def varlen_causal(cu_q, cu_k):
    """Bottom-right causal endpoints for varlen samples: ``[1, 1, total_q]``."""
    rows = []
    for b in range(cu_q.numel() - 1):
        q_len, k_len = int(cu_q[b + 1] - cu_q[b]), int(cu_k[b + 1] - cu_k[b])
        i = torch.arange(q_len, device=DEV)
        rows.append((i + 1 + k_len - q_len).clamp(0, k_len))
    return torch.cat(rows).to(torch.int32).view(1, 1, -1).contiguous()


# -- the check ------------------------------------------------------------------------------------
def check(mask_func, q, k, v, *, varlen=None, scale=None):
    varlen = varlen or {}
    plan = sm100_plan(mask_func, q, k, v, **varlen)
    view = plan.view("forward")
    g = plan.geometry
    q3, k3, v3 = (t.reshape(-1, *t.shape[-2:]) for t in (q, k, v))
    scale = 1.0 / math.sqrt(g.head_dim_qk) if scale is None else scale
    out = torch.full((g.total_q, g.num_heads_q, g.head_dim_v), float("nan"), dtype=q.dtype, device=DEV)
    lse = torch.full((g.num_heads_q, g.total_q), float("nan"), dtype=torch.float32, device=DEV)
    out, lse, max_logit = run_forward(
        view, q3, k3, v3, softmax_scale=scale, return_max_logit=True, out=out, lse=lse
    )
    torch.cuda.synchronize()
    ref_out, ref_lse, ref_max = attention_forward(
        view, q3, k3, v3, softmax_scale=scale, return_max_logit=True
    )

    assert not torch.isnan(out).any(), f"{int(torch.isnan(out).sum())} O elements unwritten or NaN"
    assert not torch.isnan(lse).any(), f"{int(torch.isnan(lse).sum())} LSE elements unwritten or NaN"
    err = (out.float() - ref_out).abs().max().item()
    assert err <= TOL[q.dtype], f"max |O - ref| = {err:.3e} > {TOL[q.dtype]}"
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty), "LSE = -inf exactly on rows with no visible key"
    assert (out.float()[empty.transpose(0, 1)] == 0).all(), "rows with no visible key must have O = 0"
    lse_err = (lse[~empty] - ref_lse[~empty]).abs().max().item() if (~empty).any() else 0.0
    assert lse_err <= 1e-2, f"max |LSE - ref| = {lse_err:.3e}"
    assert torch.allclose(max_logit, ref_max, atol=1e-2, rtol=1e-3, equal_nan=False), (max_logit, ref_max)
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
