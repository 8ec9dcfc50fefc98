"""Code written for cuDNN's ``cudnn.flex_attention`` runs unchanged on flexattn: the same names and
signatures, and on an SM90 GPU the same calls, run through each library, both give results within
the kernels' tolerance of the fp32 CPU reference (flexattn's CPU path, the oracle of the GPU tests),
in tensors of the same shapes, strides and dtypes.

Runs where cuDNN's frontend (``nvidia-cudnn-frontend``) imports: CI's integration session installs
it (without its CUDA dependencies) for the name and signature checks, which need no GPU; on the GPU
machine the peers' bundle (``gpu-bundle --peers``) installs it.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import flexattn
from flexattn import masks
from maskplan_core.testing import (
    VARLEN_CU_K,
    VARLEN_CU_Q,
    compare_forward,
    compare_gradient,
    cuda_arch_major,
    random_intervals,
    varlen_args,
    varlen_k_len,
)

cfa = pytest.importorskip("cudnn.flex_attention", reason="cuDNN's frontend is not installed")

B, S, HQ, HKV, D = 2, 1000, 4, 2, 128
SCALE = 0.1

ENTRY_POINTS = [
    "create_mask_plan",
    "flex_attn_func",
    "FlexAttentionFwd.__init__",
    "FlexAttentionFwd.execute",
    "FlexAttentionBwd.__init__",
    "FlexAttentionBwd.execute",
]
#: cuDNN parameters whose default flexattn relaxes, and why (a call that passes them works the same)
RELAXED_DEFAULTS = {
    ("FlexAttentionFwd.__init__", "sm90_use_smem_mask_pipeline"): "None: the consumer picks the delivery",
    ("FlexAttentionBwd.execute", "workspace"): "required by cuDNN; flexattn's workspace_size is 0",
}


def _attr(module, dotted: str):
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def test_same_public_names():
    assert set(cfa.__all__) <= set(dir(flexattn)), set(cfa.__all__) - set(dir(flexattn))


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_same_signatures(name):
    """Every public cuDNN parameter is flexattn's too, of the same kind, position and default;
    flexattn's own extra parameters are optional keywords, so a cuDNN-style call never needs them."""
    theirs = inspect.signature(_attr(cfa, name)).parameters
    ours = inspect.signature(_attr(flexattn, name)).parameters
    public = [p for p in theirs.values() if not p.name.startswith("_")]
    positional = [p.name for p in public if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [n for n in ours if ours[n].kind is ours[n].POSITIONAL_OR_KEYWORD] == positional
    for p in public:
        assert p.name in ours, f"{name}: no parameter {p.name!r}"
        mine = ours[p.name]
        assert mine.kind is p.kind, f"{name}({p.name}): {mine.kind} against cuDNN's {p.kind}"
        if (name, p.name) in RELAXED_DEFAULTS:
            assert mine.default is not mine.empty
        else:
            assert mine.default == p.default, f"{name}({p.name}): default {mine.default!r} != {p.default!r}"
    for extra in set(ours) - set(theirs):
        assert ours[extra].kind is ours[extra].KEYWORD_ONLY and ours[extra].default is not ours[extra].empty


SM90 = cuda_arch_major() == 9  # the SM90 consumer's kernels can run


def gpu(test):
    """A test of both libraries' kernels: marked ``gpu`` (the nox gpu session's ``-m gpu`` selects
    it) and skipped but on an SM90 GPU."""
    on_sm90 = pytest.mark.skipif(not SM90, reason="needs an SM90 GPU (both libraries' kernels)")
    return pytest.mark.gpu(on_sm90(test))


def _mask(kind: str, varlen: bool, device) -> torch.Tensor:
    """The endpoints of mask ``kind``, built on the CPU (one random draw for every device)."""
    if kind == "random":
        k_len = varlen_k_len() if varlen else torch.full((B * S,), S)
        ep = random_intervals(1, 5, k_len, seed=3, device="cpu")
    elif varlen:
        cu = varlen_args("cpu")
        ep = masks.causal(cu_seqlens_q=cu["cu_seqlens_q"], cu_seqlens_k=cu["cu_seqlens_k"])
    elif kind == "causal":
        ep = masks.causal(S, batch=B)
    elif kind == "sliding":
        ep = masks.sliding_window(S, window_left=300, batch=B)
    else:
        ep = masks.document([[400, 600], [1000]], causal=True)
    return ep.to(device)


def _problem(varlen: bool, dtype, device):
    gen = torch.Generator().manual_seed(5)
    rows_q, rows_k = ((VARLEN_CU_Q[-1],), (VARLEN_CU_K[-1],)) if varlen else ((B, S), (B, S))
    q = torch.randn(*rows_q, HQ, D, generator=gen)
    k, v = (torch.randn(*rows_k, HKV, D, generator=gen) for _ in range(2))
    dout = torch.randn(*rows_q, HQ, D, generator=gen)
    return [t.to(device, dtype) for t in (q, k, v, dout)]


def _attention(lib, mask, q, k, v, dout, varlen: dict):
    """flex_attn_func forward and backward, as code written for ``lib`` calls it."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    plan = lib.create_mask_plan(mask, q, k, v, **varlen)
    out, lse, max_logit = lib.flex_attn_func(
        q, k, v, mask_plan=plan, softmax_scale=SCALE, return_lse=True, return_max_logit=True
    )
    return (out, lse, max_logit, *torch.autograd.grad(out, (q, k, v), dout))


def _check(name: str, got, want) -> None:
    """``got`` (a GPU library's results) against ``want`` (the fp32 CPU reference's)."""
    out, lse, max_logit, *grads = (t.detach().cpu() for t in got)
    r_out, r_lse, r_max, *r_grads = want
    compare_forward(f"{name}: ", (out, lse, max_logit), (r_out, r_lse, r_max))
    for which, g, r in zip("qkv", grads, r_grads, strict=True):
        compare_gradient(f"{name} d{which}", g, r, out.dtype)


#: (mask, varlen): every mask at fixed length (BSHD); causal per sample and random intervals over
#: the varlen batch (THD, empty samples included)
CASES = [(kind, False) for kind in ("causal", "sliding", "document", "random")] + [
    ("causal", True),
    ("random", True),
]


@gpu
@pytest.mark.parametrize("kind,varlen", CASES, ids=[f"{k}-{'thd' if v else 'bshd'}" for k, v in CASES])
def test_flex_attn_func_same_results(kind, varlen):
    q, k, v, dout = _problem(varlen, torch.bfloat16, "cuda")
    args = varlen_args("cuda") if varlen else {}
    ref = _attention(
        flexattn, _mask(kind, varlen, "cpu"), *(t.float().cpu() for t in (q, k, v, dout)),
        varlen_args("cpu") if varlen else {},
    )  # fmt: skip
    ref = [t.detach() for t in ref]
    results = {
        lib: _attention(lib, _mask(kind, varlen, "cuda"), q, k, v, dout, args) for lib in (flexattn, cfa)
    }
    for lib, got in results.items():
        _check(lib.__name__, got, ref)
    for ours, theirs in zip(results[flexattn], results[cfa], strict=True):  # code may .view() them
        assert (ours.shape, ours.stride(), ours.dtype) == (theirs.shape, theirs.stride(), theirs.dtype)


def _explicit(lib, mask, q, k, v, dout):
    """A forward and a backward through the explicit API, as cuDNN's documentation writes them:
    the caller allocates every output and the workspace ``check_support`` sizes."""
    plan = lib.create_mask_plan(mask, q, k, v, build_backward=True)
    o = torch.empty_like(q)
    lse = torch.empty(B, HQ, S, dtype=torch.float32, device=q.device)
    max_logit = torch.empty(HQ, dtype=torch.float32, device=q.device)
    fwd = lib.FlexAttentionFwd(q, k, v, o, plan, lse, sample_max_logit=max_logit)
    assert fwd.check_support()
    fwd.compile()
    workspace = torch.empty(fwd.workspace_size, dtype=torch.uint8, device=q.device)
    fwd.execute(q, k, v, o, plan, lse, workspace=workspace, softmax_scale=SCALE, max_logit_tensor=max_logit)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    bwd = lib.FlexAttentionBwd(q, k, v, o, dout, lse, dq, dk, dv, plan)
    assert bwd.check_support()
    bwd.compile()
    workspace = torch.empty(bwd.workspace_size, dtype=torch.uint8, device=q.device)
    bwd.execute(q, k, v, o, dout, lse, dq, dk, dv, plan, workspace=workspace, softmax_scale=SCALE)
    torch.cuda.synchronize()
    return o, lse, max_logit, dq, dk, dv


@gpu
def test_explicit_api_same_results():
    q, k, v, dout = _problem(False, torch.bfloat16, "cuda")
    ref = _attention(
        flexattn, _mask("sliding", False, "cpu"), *(t.float().cpu() for t in (q, k, v, dout)), {}
    )
    ref = [t.detach() for t in ref]
    for lib in (flexattn, cfa):
        _check(
            f"{lib.__name__} explicit", _explicit(lib, _mask("sliding", False, "cuda"), q, k, v, dout), ref
        )


@gpu
@pytest.mark.parametrize("sq, sk", [(0, 96), (96, 0), (0, 0)], ids=["no-queries", "no-keys", "neither"])
def test_empty_problems_same_results(sq, sk):
    """A fixed-length problem with a length of 0: both libraries give the same tensors (O = 0, an
    LSE and max logit of -inf, zero gradients), of the same shapes and dtypes, and the same strides
    where they have elements (an empty tensor's strides address nothing: the H200 run gave our
    empty LSE a transposed view's, cuDNN's a new tensor's)."""
    gen = torch.Generator().manual_seed(sq + sk)
    shapes = ((B, sq, HQ, D), (B, sk, HKV, D), (B, sk, HKV, D), (B, sq, HQ, D))
    q, k, v, dout = (torch.randn(s, generator=gen).to("cuda", torch.bfloat16) for s in shapes)
    mask = torch.full((1, 1, B * sq), sk, dtype=torch.int32, device="cuda")
    ours, theirs = (_attention(lib, mask, q, k, v, dout, {}) for lib in (flexattn, cfa))
    for name, a, b in zip(("out", "lse", "max_logit", "dq", "dk", "dv"), ours, theirs, strict=True):
        assert (a.shape, a.dtype) == (b.shape, b.dtype), name
        assert a.numel() == 0 or a.stride() == b.stride(), name
        assert torch.equal(a, b), name
