"""Empty problems (a sequence length of 0, fixed or varlen) plan and run as cuDNN's calls do: O is
0 and the LSE and max logit -inf where a row sees no key, and every gradient is 0. On the CPU
reference always; on an SM90 GPU also through the GPU planner and the SM90 consumer (the kernels
are not launched: nothing is visible)."""

from __future__ import annotations

import pytest
import torch

import flexattn
from flexattn import FlexAttentionBwd, FlexAttentionFwd, masks
from maskplan_core.testing import cuda_arch_major

B, H, HKV, D = 2, 4, 2, 64


#: the CUDA cases carry the gpu marker, so that ``nox -s gpu`` (``-m gpu``) runs them
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(cuda_arch_major() != 9, reason="needs an SM90 GPU")],
    ),
]


def _dtype(device: str) -> torch.dtype:
    return torch.float32 if device == "cpu" else torch.bfloat16


def _fixed(sq: int, sk: int, device: str):
    gen = torch.Generator().manual_seed(sq * 100 + sk)
    shapes = ((B, sq, H, D), (B, sk, HKV, D), (B, sk, HKV, D))
    qkv = [torch.randn(s, generator=gen).to(device, _dtype(device)).requires_grad_() for s in shapes]
    return qkv, masks.causal(sq, sk, batch=B, device=device)


def _check(q, k, v, out, lse, max_logit, sq: int, sk: int):
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and out.dtype == q.dtype
    assert torch.equal(out, torch.zeros_like(out))
    assert lse.dtype == torch.float32 and max_logit.shape == (H,)
    if sq:  # every row of a problem without keys: -inf
        assert sk == 0 and bool((lse == float("-inf")).all())
    assert bool((max_logit == float("-inf")).all())
    dout = torch.ones_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout, allow_unused=True)
    for name, t, g in zip("qkv", (q, k, v), grads, strict=True):
        assert g is not None and g.shape == t.shape and torch.equal(g, torch.zeros_like(g)), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sq, sk", [(0, 96), (96, 0), (0, 0)], ids=["no-queries", "no-keys", "neither"])
def test_fixed_length(sq, sk, device):
    (q, k, v), mask = _fixed(sq, sk, device)
    plan = flexattn.create_mask_plan(mask, q, k, v)
    assert plan.view("forward").stats()["partial"] + plan.view("forward").stats()["full"] == 0
    out, lse, max_logit = flexattn.flex_attn_func(
        q, k, v, mask_plan=plan, return_lse=True, return_max_logit=True
    )
    assert lse.shape == (B, H, sq)
    _check(q, k, v, out, lse, max_logit, sq, sk)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("empty", ["q", "k"], ids=["no-queries", "no-keys"])
@pytest.mark.parametrize("exact_max", [False, True], ids=["max-70", "max-of-lengths"])
def test_varlen_all_samples_empty(empty, exact_max, device):
    """Varlen samples whose Q (or K) sides are all empty: total_q (total_k) = 0; the max sequence
    lengths either 70 or each side's longest sample (``seqlens.max()``: 0 on the empty side)."""
    full = torch.tensor([0, 70, 130], dtype=torch.int32, device=device)
    none = torch.zeros(3, dtype=torch.int32, device=device)
    cu_q, cu_k = (none, full) if empty == "q" else (full, none)
    max_q, max_k = (int(cu.diff().max()) for cu in (cu_q, cu_k)) if exact_max else (70, 70)
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
    gen = torch.Generator().manual_seed(3)
    rows_q, rows_k = int(cu_q[-1]), int(cu_k[-1])
    shapes = ((rows_q, H, D), (rows_k, HKV, D), (rows_k, HKV, D))
    q, k, v = (torch.randn(s, generator=gen).to(device, _dtype(device)).requires_grad_() for s in shapes)
    plan = flexattn.create_mask_plan(masks.causal(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k), q, k, v, **args)
    out, lse, max_logit = flexattn.flex_attn_func(
        q, k, v, mask_plan=plan, return_lse=True, return_max_logit=True
    )
    assert lse.shape == (H, rows_q)
    _check(q, k, v, out, lse, max_logit, rows_q, rows_k)


@pytest.mark.parametrize("device", DEVICES)
def test_explicit_api_writes_the_callers_tensors(device):
    """FlexAttentionFwd / FlexAttentionBwd on a problem without keys fill the given tensors (and take
    empty buffers of any strides: they name no element twice)."""
    sq = 40
    (q, k, v), mask = _fixed(sq, 0, device)
    q, k, v = (t.detach() for t in (q, k, v))
    plan = flexattn.create_mask_plan(mask, q, k, v, build_backward=True)
    o = torch.full_like(q, 7.0)
    lse = torch.zeros(B, H, sq, device=device)
    fwd = FlexAttentionFwd(q, k, v, o, plan, lse)
    fwd.compile()
    fwd.execute(q, k, v, o, plan, lse)
    assert torch.equal(o, torch.zeros_like(o)) and bool((lse == float("-inf")).all())
    dq = torch.full_like(q, 7.0)
    # torch gives an elementwise result of some empty shapes stride 0 ((2, 0, 1, 4): (0, 4, 0, 1))
    dk, dv = (torch.empty_like(t).as_strided(t.shape, (0, 0, 0, 1)) for t in (k, v))
    bwd = FlexAttentionBwd(q, k, v, o, torch.ones_like(o), lse, dq, dk, dv, plan)
    bwd.compile()
    bwd.execute(q, k, v, o, torch.ones_like(o), lse, dq, dk, dv, plan)
    assert torch.equal(dq, torch.zeros_like(dq))  # dk, dv have no element


@pytest.mark.parametrize(
    "build",
    [
        lambda: masks.causal(0, 16, batch=2),
        lambda: masks.sliding_window(16, 0, window_left=4, batch=2),
        lambda: masks.prefix_lm(0, 3),
        lambda: masks.chunked(0, 4),
        lambda: masks.from_mask_mod(lambda b, h, q, k: (q >= k) & (h > 0), 2, 3, 16, 0),
        lambda: masks.from_dense(torch.ones(2, 1, 16, 0, dtype=torch.bool)),
        lambda: masks.from_dense(torch.ones(2, 1, 0, 16, dtype=torch.bool)),
        lambda: masks.document([[0], [0, 0]]),
        lambda: masks.document_ids(torch.zeros(2, 0, dtype=torch.int64)),
    ],
    ids=[
        "causal",
        "sliding",
        "prefix-lm",
        "chunked",
        "mask-mod",
        "dense-no-keys",
        "dense-no-queries",
        "document",
        "document-ids",
    ],
)
def test_mask_builders_take_empty_lengths(build):
    """Endpoints of rows without keys are all 0; a problem without queries has no rows."""
    mask = build()
    assert mask.dtype == torch.int32 and mask.dim() == 3
    assert mask.shape[-1] in (0, 32) and not bool(mask.any())
