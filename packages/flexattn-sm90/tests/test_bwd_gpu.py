"""GPU tests of the SM90 backward (H200) against the fp32 reference on the same plan.

Plans carry the SM90 consumer's own forward and backward ViewConfigs (what
``flexattn.create_mask_plan(..., build_backward=True)`` builds on an SM90 device); most are built
by the reference planner on CUDA tensors, ``test_gpu_planner_plan`` uses the GPU planner. O and
LSE come from the fp32 reference forward (O rounded to the input dtype, as the kernel would see
it), so only the backward is under test. Before every run the outputs are filled with NaN and the
CUDA caching allocator is handed a NaN-filled block (the workspace then starts as NaN): an element
the kernels do not write, or a workspace value they read before initialising it, fails the test.

Tolerance, per gradient, against the fp32 reference: relative L2 error <= 2e-2 (bf16) / 5e-3
(fp16) and max abs error <= 4e-2 (bf16) / 1e-2 (fp16) times the reference's max magnitude; rows
of queries without a visible key, and keys no query sees, must be exactly 0.

    python -m pytest packages/flexattn-sm90/tests/test_bwd_gpu.py -m gpu -q
"""

import functools
import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs an SM90 (Hopper) GPU", allow_module_level=True)

from flexattn_sm90 import Sm90Consumer  # noqa: E402
from flexattn_sm90.bwd_launch import run_backward  # noqa: E402
from maskplan_core import masks, testing, validate_plan_inputs  # noqa: E402
from maskplan_core.reference import attention_backward, attention_forward, build_plan  # noqa: E402
from maskplan_core.testing import resolve_view  # noqa: E402

DEV = torch.device("cuda")
REL_L2 = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
MAX_ABS = {torch.bfloat16: 4e-2, torch.float16: 1e-2}
DTYPES = [torch.bfloat16, torch.float16]
CU_Q = [0, 100, 100, 164, 964, 1300]  # samples: normal, q empty, k empty, long, tail
CU_K = [0, 300, 500, 500, 1400, 1533]


# -- problem builders -----------------------------------------------------------------------------
def sm90_plan(mask_func, q, k, v, *, gpu_planner=False, **varlen):
    """A plan with the SM90 consumer's forward and backward views."""
    g = validate_plan_inputs(mask_func, q, k, v, **varlen)
    consumer = Sm90Consumer()

    def view(direction):
        return resolve_view(consumer, g, direction)

    if gpu_planner:
        return consumer.build_plan(mask_func, g, view("forward"), view("backward"))
    return build_plan(mask_func, g, view("forward"), view("backward"), consumer.name)


qkv = functools.partial(testing.qkv, device=DEV)
random_intervals = functools.partial(testing.random_intervals, device=DEV)


def varlen_args():
    cu_q = torch.tensor(CU_Q, dtype=torch.int32, device=DEV)
    cu_k = torch.tensor(CU_K, dtype=torch.int32, device=DEV)
    return {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 800, "max_seqlen_k": 900}


def varlen_k_len():
    cu_q, cu_k = torch.tensor(CU_Q), torch.tensor(CU_K)
    return (cu_k[1:] - cu_k[:-1]).repeat_interleave(cu_q[1:] - cu_q[:-1])


def varlen_causal():
    """Bottom-right causal endpoints of the varlen samples: ``[1, 1, total_q]``."""
    args = varlen_args()
    return testing.varlen_causal(args["cu_seqlens_q"], args["cu_seqlens_k"])


# -- the check ------------------------------------------------------------------------------------
def poison_allocator(nbytes: int = 256 << 20) -> None:
    """Hand the caching allocator a NaN-filled block so the next workspace allocations start as NaN."""
    block = torch.full((nbytes // 4,), float("nan"), dtype=torch.float32, device=DEV)
    del block


def run(view, q3, k3, v3, out, lse, dout, dlse, scale, deterministic):
    g = view.geometry
    grads = [
        torch.full((g.total_q, g.num_heads_q, g.head_dim_qk), float("nan"), dtype=q3.dtype, device=DEV),
        torch.full((g.total_k, g.num_heads_kv, g.head_dim_qk), float("nan"), dtype=q3.dtype, device=DEV),
        torch.full((g.total_k, g.num_heads_kv, g.head_dim_v), float("nan"), dtype=q3.dtype, device=DEV),
    ]
    poison_allocator()
    dq, dk, dv = run_backward(
        view, q3, k3, v3, out, lse, dout, dlse, softmax_scale=scale, deterministic=deterministic,
        dq=grads[0], dk=grads[1], dv=grads[2],
    )  # fmt: skip
    torch.cuda.synchronize()
    return dq, dk, dv


def check(mask_func, q, k, v, *, varlen=None, scale=None, deterministic=False, with_dlse=False, repeats=1,
          gpu_planner=False, seed=0):  # fmt: skip
    varlen = varlen or {}
    plan = sm90_plan(mask_func, q, k, v, gpu_planner=gpu_planner, **varlen)
    g = plan.geometry
    q3, k3, v3 = (t.reshape(-1, *t.shape[-2:]) for t in (q, k, v))
    scale = 1.0 / math.sqrt(g.head_dim_qk) if scale is None else scale
    ref_out, lse, _ = attention_forward(plan.view("forward"), q3, k3, v3, softmax_scale=scale)
    out = ref_out.to(q.dtype)
    gen = torch.Generator(device=DEV).manual_seed(seed + 1000)
    dout = torch.randn(out.shape, device=DEV, dtype=q.dtype, generator=gen)
    dlse = torch.randn(lse.shape, device=DEV, dtype=torch.float32, generator=gen) if with_dlse else None
    view = plan.view("backward")
    ref = attention_backward(
        view, q3.float(), k3.float(), v3.float(), out.float(), lse, dout.float(), dlse, softmax_scale=scale
    )
    runs = [run(view, q3, k3, v3, out, lse, dout, dlse, scale, deterministic) for _ in range(repeats)]
    for name, got, want in zip(("dq", "dk", "dv"), runs[0], ref, strict=True):
        compare(name, got, want, q.dtype)
    # exact zeros: queries without a visible key, keys that no query sees
    empty_q = torch.isinf(lse).transpose(0, 1)  # [total_q, Hq]
    assert (runs[0][0][empty_q] == 0).all(), "dq of a query without a visible key must be 0"
    unseen = unseen_keys(plan, g)
    if unseen is not None:
        assert (runs[0][1][unseen] == 0).all() and (runs[0][2][unseen] == 0).all(), "dk/dv of unseen keys"
    for other in runs[1:]:  # deterministic: bit-identical run to run
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], other, strict=True):
            assert torch.equal(a, b), f"{name} differs between runs ({int((a != b).sum())} elements)"
    return plan, runs


def compare(name, got, want, dtype):
    assert not torch.isnan(got).any(), f"{name}: {int(torch.isnan(got).sum())} elements unwritten or NaN"
    got, want = got.float(), want.float()
    scale = want.abs().max().item()
    if scale == 0:
        assert (got == 0).all(), f"{name} must be 0"
        return
    err = (got - want).abs().max().item()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= REL_L2[dtype], f"{name}: relative L2 error {rel:.3e} > {REL_L2[dtype]} (max abs {err:.3e})"
    assert err <= MAX_ABS[dtype] * scale, f"{name}: max |err| = {err:.3e} > {MAX_ABS[dtype]} * {scale:.3e}"


def unseen_keys(plan, g):
    """bool ``[total_k, Hkv]``: keys that no query of any head in their kv group sees (or None)."""
    dense = plan.view("backward").to_dense()  # [Hmask, total_q, Sk]
    cu_q, cu_k = g.cu_seqlens_q.tolist(), g.cu_seqlens_k.tolist()
    seen = torch.zeros(g.total_k, dtype=torch.bool, device=DEV)
    if g.mask_heads > 1:
        return None  # per-head masks: a key may be seen by one head of its group only
    for b in range(len(cu_q) - 1):
        k_len = cu_k[b + 1] - cu_k[b]
        seen[cu_k[b] : cu_k[b + 1]] = dense[0, cu_q[b] : cu_q[b + 1], :k_len].any(0)
    return (~seen)[:, None].expand(g.total_k, g.num_heads_kv)


# -- masks, fixed length --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_causal(dtype, deterministic):
    B, S, H, D = 2, 1000, 4, 128
    q, k, v = qkv((B, S, H), (B, S, H), D, D, dtype)
    check(masks.causal(S, batch=B, device=DEV), q, k, v, deterministic=deterministic)


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


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_random_multi_interval_per_head(dtype):
    B, S, H, D = 2, 700, 4, 128
    q, k, v = qkv((B, S, H), (B, S, H), D, D, dtype, seed=3)
    ep = random_intervals(H, 5, torch.full((B * S,), S), seed=3)  # Hmask = Hq
    check(ep, q, k, v)


def test_all_empty_rows():
    B, S, H, D = 2, 300, 2, 128
    q, k, v = qkv((B, S, H), (B, S, H), D, D, torch.bfloat16, seed=4)
    ep = masks.causal(S, batch=B, device=DEV).clone()
    ep[..., ::3] = 0  # every third row sees nothing
    ep[..., S : S + 64] = 0  # a whole backward Q block of sample 1 sees nothing
    check(ep, q, k, v)
    check(ep, q, k, v, deterministic=True, with_dlse=True)
    _, runs = check(torch.zeros_like(ep), q, k, v)  # nothing visible anywhere
    assert all((g == 0).all() for g in runs[0])


def test_all_full():
    B, S, H, D = 1, 512, 2, 128  # S a multiple of both tile sizes: every block is full
    q, k, v = qkv((B, S, H), (B, S, H), D, D, torch.bfloat16, seed=5)
    plan, _ = check(torch.full((1, 1, B * S), S, dtype=torch.int32, device=DEV), q, k, v, deterministic=True,
                    repeats=2)  # fmt: skip
    assert plan.view("backward").stats()["partial"] == 0


@pytest.mark.parametrize("sq,sk", [(300, 1000), (1000, 300), (129, 127)])
def test_sq_ne_sk(sq, sk):
    q, k, v = qkv((2, sq, 2), (2, sk, 2), 128, 128, torch.bfloat16, seed=6)
    check(masks.causal(sq, sk, batch=2, device=DEV), q, k, v)


@pytest.mark.parametrize("hq,hkv,hmask", [(8, 2, 1), (8, 2, 8), (6, 1, 1)])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_gqa(hq, hkv, hmask, deterministic):
    B, S, D = 2, 600, 128
    q, k, v = qkv((B, S, hq), (B, S, hkv), D, D, torch.bfloat16, seed=7)
    check(random_intervals(hmask, 3, torch.full((B * S,), S), seed=7), q, k, v, deterministic=deterministic)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_dlse_and_scale(dtype):
    """The forward's LSE received a gradient (dlse), with a non-default and a negative scale."""
    B, S, H, D = 2, 500, 2, 128
    q, k, v = qkv((B, S, H), (B, S, H), D, D, dtype, seed=8)
    ep = masks.sliding_window(S, window_left=150, batch=B, device=DEV)
    check(ep, q, k, v, with_dlse=True, scale=0.3)
    check(ep, q, k, v, with_dlse=True, scale=-0.05)


# -- varlen ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["causal", "random"])
def test_varlen_with_empty_samples(dtype, kind):
    H, Hkv, D = 4, 2, 128
    q, k, v = qkv((CU_Q[-1], H), (CU_K[-1], Hkv), D, D, dtype, seed=9)
    ep = varlen_causal() if kind == "causal" else random_intervals(1, 5, varlen_k_len(), seed=9)
    check(ep, q, k, v, varlen=varlen_args())


# -- other head dims ------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 96])
@pytest.mark.parametrize("kind", ["causal", "random"])
def test_head_dims(d, kind):
    B, S, H = 2, 600, 2
    q, k, v = qkv((B, S, H), (B, S, H), d, d, torch.bfloat16, seed=10)
    ep = (
        masks.causal(S, batch=B, device=DEV)
        if kind == "causal"
        else random_intervals(1, 5, torch.full((B * S,), S), seed=10)
    )
    check(ep, q, k, v)


# -- deterministic mode ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_deterministic_bit_identical(dtype):
    """Three runs of deterministic mode give bit-identical dq/dk/dv (varlen, GQA, per-head masks,
    partial and full blocks, a long sample so many K blocks race for each Q block)."""
    H, Hkv, D = 4, 2, 128
    q, k, v = qkv((CU_Q[-1], H), (CU_K[-1], Hkv), D, D, dtype, seed=11)
    ep = random_intervals(H, 5, varlen_k_len(), seed=11)
    check(ep, q, k, v, varlen=varlen_args(), deterministic=True, with_dlse=True, repeats=3)
    B, S = 1, 4096
    q, k, v = qkv((B, S, H), (B, S, Hkv), D, D, dtype, seed=12)
    check(masks.causal(S, batch=B, device=DEV), q, k, v, deterministic=True, repeats=3)


def test_gpu_planner_plan():
    """The production path: the plan built by the GPU planner kernels (build_plan_gpu)."""
    H, Hkv, D = 4, 2, 128
    q, k, v = qkv((CU_Q[-1], H), (CU_K[-1], Hkv), D, D, torch.bfloat16, seed=13)
    ep = random_intervals(1, 5, varlen_k_len(), seed=13)
    check(ep, q, k, v, varlen=varlen_args(), gpu_planner=True)
    check(ep, q, k, v, varlen=varlen_args(), gpu_planner=True, deterministic=True, repeats=2)


def test_small_for_sanitizer():
    """A small case for ``compute-sanitizer --tool memcheck|racecheck|synccheck`` (select with -k small)."""
    B, S, H, D = 1, 200, 2, 128
    q, k, v = qkv((B, S, H), (B, S, 1), D, D, torch.bfloat16, seed=14)
    ep = masks.causal(S, batch=B, device=DEV)
    check(ep, q, k, v)
    check(ep, q, k, v, deterministic=True)
