"""Someone moving from torch FlexAttention converts its mask once and gets the same attention: for
each ``mask_mod``, ``flex_attn_func`` on a plan of ``masks.from_mask_mod`` (and of
``masks.from_block_mask``) returns torch's ``flex_attention`` output and LSE, and the same
gradients, on the CPU in fp64 (torch's eager path; torch refuses a CPU backward up front, in
``_validate_device``, though its eager backward computes one: the gradient test lifts that check)."""

from __future__ import annotations

import warnings

import pytest
import torch

import flexattn
from flexattn import masks

fa = pytest.importorskip("torch.nn.attention.flex_attention")

B, S, D = 2, 200, 16
DOCS = torch.tensor([[0] * 70 + [1] * 90 + [2] * 40, [0] * 200])


def _causal(b, h, q, kv):
    return kv <= q


def _sliding(b, h, q, kv):
    return (kv <= q) & (q - kv < 48)


def _documents(b, h, q, kv):
    return (DOCS[b, q] == DOCS[b, kv]) & (kv <= q)


def _prefix_lm(b, h, q, kv):
    return (kv <= q) | (kv < 30)


def _per_head(b, h, q, kv):
    return (kv <= q) & (q - kv < 20 + 60 * h)


def _rows_without_keys(b, h, q, kv):  # the first 10 rows see nothing
    return (kv <= q) & (q >= 10)


CASES = {  # name: (mask_mod, Hq, Hkv, Sq, Sk, H given to the mask)
    "causal": (_causal, 2, 2, S, S, None),
    "sliding": (_sliding, 2, 2, S, S, None),
    "documents": (_documents, 2, 2, S, S, None),
    "prefix-lm": (_prefix_lm, 2, 2, S, S, None),
    "per-head": (_per_head, 2, 2, S, S, 2),
    "gqa": (_sliding, 4, 2, S, S, None),
    "top-left-sq-lt-sk": (_causal, 2, 2, 150, S, None),
    "top-left-sq-gt-sk": (_causal, 2, 2, S, 150, None),
    "rows-without-keys": (_rows_without_keys, 2, 2, S, S, None),
}


def _inputs(hq, hkv, sq, sk):
    torch.manual_seed(0)
    q = torch.randn(B, sq, hq, D, dtype=torch.float64)
    k, v = (torch.randn(B, sk, hkv, D, dtype=torch.float64) for _ in range(2))
    return q, k, v


def _torch_flex(mask_mod, q, k, v, h, sq, sk):
    """torch's output [B, Sq, Hq, D] and LSE [B, Hq, Sq] for BSHD q, k, v."""
    block_mask = fa.create_block_mask(mask_mod, B, h, sq, sk, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its eager CPU path warns that it is unfused
        out, lse = fa.flex_attention(
            *(t.transpose(1, 2) for t in (q, k, v)),
            block_mask=block_mask,
            enable_gqa=q.shape[2] != k.shape[2],
            return_lse=True,
        )
    return out.transpose(1, 2), lse, block_mask


@pytest.mark.parametrize("name", list(CASES))
def test_same_output_and_lse_as_torch_flex_attention(name):
    mask_mod, hq, hkv, sq, sk, h = CASES[name]
    q, k, v = _inputs(hq, hkv, sq, sk)
    want_out, want_lse, block_mask = _torch_flex(mask_mod, q, k, v, h, sq, sk)
    for mask in (masks.from_mask_mod(mask_mod, B, h, sq, sk), masks.from_block_mask(block_mask)):
        plan = flexattn.create_mask_plan(mask, q, k, v)
        out, lse = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True)
        torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
        assert lse.shape == want_lse.shape
        assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))  # -inf on the same rows
        finite = torch.isfinite(want_lse)
        torch.testing.assert_close(lse[finite], want_lse[finite], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_same_gradients_as_torch_flex_attention(name, monkeypatch):
    """dq, dk, dv of a loss on the output and the (finite) LSE, against torch's eager backward."""
    monkeypatch.setattr(fa, "_validate_device", lambda *tensors: None)  # its CPU-backward refusal
    mask_mod, hq, hkv, sq, sk, h = CASES[name]
    qkv = [t.requires_grad_() for t in _inputs(hq, hkv, sq, sk)]
    torch.manual_seed(1)
    dout, dlse = torch.randn(B, sq, hq, D, dtype=torch.float64), torch.randn(B, hq, sq, dtype=torch.float64)

    def loss(out, lse):
        return (out * dout).sum() + torch.where(torch.isfinite(lse), lse * dlse, 0).sum()

    want_out, want_lse, _ = _torch_flex(mask_mod, *qkv, h, sq, sk)
    want = torch.autograd.grad(loss(want_out, want_lse), qkv)
    plan = flexattn.create_mask_plan(masks.from_mask_mod(mask_mod, B, h, sq, sk), *qkv)
    got = torch.autograd.grad(loss(*flexattn.flex_attn_func(*qkv, mask_plan=plan, return_lse=True)), qkv)
    for name_, a, b in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m, n=name_: f"d{n}: {m}")
