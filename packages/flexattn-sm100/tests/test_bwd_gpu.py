"""GPU tests of the SM100 backward (k2q-1cta) against the fp32 reference on the same plan, mirroring
``flexattn-sm90/tests/test_bwd_gpu.py``.

They run ONLY on a compute-capability 10.x GPU. None was available when the kernel was written: these
tests have never run, and the kernel has only been compiled (``test_bwd_compile.py``).

Plans carry the SM100 forward view the forward kernel implements (qstage1 + 1CTA) and the k2q-1cta
backward view (forced: the heuristics' default backward for D128 is k2q-2cta, which has no kernel);
the reference planner builds them on CUDA tensors. O and LSE come from the fp32 reference forward (O
rounded to the input dtype), so only the backward is under test. Outputs are NaN-poisoned, and the
caching allocator is handed a NaN block so the workspace starts as NaN. Tolerance per gradient:
relative L2 <= 2e-2 (bf16) / 5e-3 (fp16), max abs <= 4e-2 / 1e-2 times the reference's max; queries
without a visible key and keys no query sees get exactly 0. Needs the backward preprocess in
``maskplan_kernels`` (see ``bwd_launch``).

    python -m pytest packages/flexattn-sm100/tests/test_bwd_gpu.py -m gpu -q
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 10:
    pytest.skip("needs a compute-capability 10.x (SM100/SM103) GPU", allow_module_level=True)

from flexattn_sm100 import Sm100Consumer  # noqa: E402
from flexattn_sm100.bwd_launch import run_backward  # noqa: E402
from flexattn_sm100.config import BWD_VARIANTS, Sm100BwdConfig  # noqa: E402
from flexattn_sm100.heuristics import select_fwd_config  # noqa: E402
from maskplan_core import masks  # noqa: E402
from maskplan_core.consumer import ViewConfig  # noqa: E402
from maskplan_core.reference import attention_backward, attention_forward  # noqa: E402
from maskplan_core.testing import qkv, random_intervals, reference_plan, varlen_causal  # noqa: E402

DEV = torch.device("cuda")
REL_L2 = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
MAX_ABS = {torch.bfloat16: 4e-2, torch.float16: 1e-2}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES = [torch.bfloat16, torch.float16]
CU_Q = [0, 100, 100, 164, 964, 1300]  # samples: normal, q empty, k empty, long, tail
CU_K = [0, 300, 500, 500, 1400, 1533]


def views(g):
    dims = {"head_dim_qk": g.head_dim_qk, "head_dim_v": g.head_dim_v, "dtype": DTYPE_NAMES[g.dtype],
            "qhead_per_kvhead": g.num_heads_q // g.num_heads_kv, "varlen": g.varlen}  # fmt: skip
    fwd = select_fwd_config(variant="qstage1-1cta", **dims)
    bwd = Sm100BwdConfig(variant=BWD_VARIANTS["k2q-1cta"], **dims)
    return (ViewConfig(signature=c.plan_signature(), layout=c.payload_layout) for c in (fwd, bwd))


def sm100_plan(mask_func, q, k, v, **varlen):
    f = lambda g: list(views(g))[0]  # noqa: E731
    b = lambda g: list(views(g))[1]  # noqa: E731
    return reference_plan(mask_func, q, k, v, consumer=Sm100Consumer.name, forward=f, backward=b, **varlen)


def varlen_args():
    cu_q = torch.tensor(CU_Q, dtype=torch.int32, device=DEV)
    cu_k = torch.tensor(CU_K, dtype=torch.int32, device=DEV)
    return {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 800, "max_seqlen_k": 900}


def varlen_k_len():
    cu_q, cu_k = torch.tensor(CU_Q), torch.tensor(CU_K)
    return (cu_k[1:] - cu_k[:-1]).repeat_interleave(cu_q[1:] - cu_q[:-1])


def run(view, q3, k3, v3, out, lse, dout, dlse, scale, deterministic):
    g = view.geometry
    grads = [
        torch.full((g.total_q, g.num_heads_q, g.head_dim_qk), float("nan"), dtype=q3.dtype, device=DEV),
        torch.full((g.total_k, g.num_heads_kv, g.head_dim_qk), float("nan"), dtype=q3.dtype, device=DEV),
        torch.full((g.total_k, g.num_heads_kv, g.head_dim_v), float("nan"), dtype=q3.dtype, device=DEV),
    ]
    block = torch.full((64 << 20,), float("nan"), dtype=torch.float32, device=DEV)
    del block  # the workspace allocated next starts as NaN
    out = run_backward(
        view, q3, k3, v3, out, lse, dout, dlse, softmax_scale=scale, deterministic=deterministic,
        dq=grads[0], dk=grads[1], dv=grads[2],
    )  # fmt: skip
    torch.cuda.synchronize()
    return out


def compare(name, got, want, dtype):
    assert not torch.isnan(got).any(), f"{name}: {int(torch.isnan(got).sum())} elements unwritten or NaN"
    got, want = got.float(), want.float()
    top = want.abs().max().item()
    if top == 0:
        assert (got == 0).all(), f"{name} must be 0"
        return
    err = (got - want).abs().max().item()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= REL_L2[dtype], f"{name}: relative L2 error {rel:.3e} > {REL_L2[dtype]} (max abs {err:.3e})"
    assert err <= MAX_ABS[dtype] * top, f"{name}: max |err| = {err:.3e} > {MAX_ABS[dtype]} * {top:.3e}"


def check(
    mask_func, q, k, v, *, varlen=None, scale=None, deterministic=False, with_dlse=False, repeats=1, seed=0
):
    plan = sm100_plan(mask_func, q, k, v, **(varlen or {}))
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
    empty_q = torch.isinf(lse).transpose(0, 1)
    assert (runs[0][0][empty_q] == 0).all(), "dq of a query without a visible key must be 0"
    for other in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], other, strict=True):
            assert torch.equal(a, b), f"{name} differs between runs ({int((a != b).sum())} elements)"
    return plan, runs


@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_causal(dtype, d, deterministic):
    B, S, H = 2, 1000, 4
    q, k, v = qkv((B, S, H), (B, S, H), d, d, dtype, device=DEV)
    check(masks.causal(S, batch=B, device=DEV), q, k, v, deterministic=deterministic)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_random_multi_interval_per_head(dtype):
    B, S, H, D = 2, 700, 4, 128
    q, k, v = qkv((B, S, H), (B, S, H), D, D, dtype, seed=3, device=DEV)
    check(random_intervals(H, 5, torch.full((B * S,), S), seed=3, device=DEV), q, k, v)


def test_all_empty_rows_and_nothing_visible():
    B, S, H, D = 2, 300, 2, 128
    q, k, v = qkv((B, S, H), (B, S, H), D, D, torch.bfloat16, seed=4, device=DEV)
    ep = masks.causal(S, batch=B, device=DEV).clone()
    ep[..., ::3] = 0
    ep[..., S : S + 128] = 0  # a whole backward Q block of sample 1 sees nothing
    check(ep, q, k, v)
    check(ep, q, k, v, deterministic=True, with_dlse=True)
    _, runs = check(torch.zeros_like(ep), q, k, v)
    assert all((x == 0).all() for x in runs[0])


def test_all_full():
    B, S, H, D = 1, 512, 2, 128
    q, k, v = qkv((B, S, H), (B, S, H), D, D, torch.bfloat16, seed=5, device=DEV)
    plan, _ = check(torch.full((1, 1, B * S), S, dtype=torch.int32, device=DEV), q, k, v, deterministic=True,
                    repeats=2)  # fmt: skip
    assert plan.view("backward").stats()["partial"] == 0


@pytest.mark.parametrize("sq,sk", [(300, 1000), (1000, 300), (129, 127)])
def test_sq_ne_sk(sq, sk):
    q, k, v = qkv((2, sq, 2), (2, sk, 2), 128, 128, torch.bfloat16, seed=6, device=DEV)
    check(masks.causal(sq, sk, batch=2, device=DEV), q, k, v)


@pytest.mark.parametrize("hq,hkv,hmask", [(8, 2, 1), (8, 2, 8), (6, 1, 1)])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_gqa(hq, hkv, hmask, deterministic):
    B, S, D = 2, 600, 128
    q, k, v = qkv((B, S, hq), (B, S, hkv), D, D, torch.bfloat16, seed=7, device=DEV)
    check(random_intervals(hmask, 3, torch.full((B * S,), S), seed=7, device=DEV), q, k, v,
          deterministic=deterministic)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_dlse_and_scale(dtype):
    B, S, H, D = 2, 500, 2, 128
    q, k, v = qkv((B, S, H), (B, S, H), D, D, dtype, seed=8, device=DEV)
    ep = masks.sliding_window(S, window_left=150, batch=B, device=DEV)
    check(ep, q, k, v, with_dlse=True, scale=0.3)
    check(ep, q, k, v, with_dlse=True, scale=-0.05)


@pytest.mark.parametrize("kind", ["causal", "random"])
def test_varlen_with_empty_samples(kind):
    H, Hkv, D = 4, 2, 128
    q, k, v = qkv((CU_Q[-1], H), (CU_K[-1], Hkv), D, D, torch.bfloat16, seed=9, device=DEV)
    cu = varlen_args()
    ep = (
        varlen_causal(cu["cu_seqlens_q"], cu["cu_seqlens_k"])
        if kind == "causal"
        else random_intervals(1, 5, varlen_k_len(), seed=9, device=DEV)
    )
    check(ep, q, k, v, varlen=cu)


def test_head_dim_96():
    B, S, H = 2, 600, 2
    q, k, v = qkv((B, S, H), (B, S, H), 96, 96, torch.bfloat16, seed=10, device=DEV)
    check(random_intervals(1, 5, torch.full((B * S,), S), seed=10, device=DEV), q, k, v)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_deterministic_bit_identical(dtype):
    H, Hkv, D = 4, 2, 128
    q, k, v = qkv((CU_Q[-1], H), (CU_K[-1], Hkv), D, D, dtype, seed=11, device=DEV)
    ep = random_intervals(H, 5, varlen_k_len(), seed=11, device=DEV)
    check(ep, q, k, v, varlen=varlen_args(), deterministic=True, with_dlse=True, repeats=3)
    B, S = 1, 4096
    q, k, v = qkv((B, S, H), (B, S, Hkv), D, D, dtype, seed=12, device=DEV)
    check(masks.causal(S, batch=B, device=DEV), q, k, v, deterministic=True, repeats=3)


def test_small_for_sanitizer():
    """A small case for ``compute-sanitizer --tool memcheck|racecheck|synccheck`` (select with -k small)."""
    B, S, H, D = 1, 200, 2, 128
    q, k, v = qkv((B, S, H), (B, S, 1), D, D, torch.bfloat16, seed=14, device=DEV)
    check(masks.causal(S, batch=B, device=DEV), q, k, v)
    check(masks.causal(S, batch=B, device=DEV), q, k, v, deterministic=True)
