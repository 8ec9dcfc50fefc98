"""The public API on an SM90 GPU: planning on CUDA tensors and the forward kernel, against the
CPU reference path of the same public calls."""

from __future__ import annotations

import pytest
import torch

import flexattn
from flexattn import masks

pytestmark = pytest.mark.gpu

B, S, H, HKV, D = 2, 1000, 4, 2, 128


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


MASKS = {
    "causal": lambda dev: masks.causal(S, batch=B, device=dev),
    "sliding": lambda dev: masks.sliding_window(S, window_left=300, batch=B, device=dev),
    "document": lambda dev: masks.document([[400, 600], [1000]], causal=True, device=dev),
    "prefix": lambda dev: masks.prefix_lm(S, [100, 700], device=dev),
}


@pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_matches_cpu_reference(mask, dtype):
    torch.manual_seed(0)
    q = torch.randn(B, S, H, D, dtype=dtype)
    k, v = (torch.randn(B, S, HKV, D, dtype=dtype) for _ in range(2))
    cpu = flexattn.create_mask_plan(MASKS[mask]("cpu"), q.float(), k.float(), v.float())
    ref, ref_lse = flexattn.flex_attn_func(q.float(), k.float(), v.float(), mask_plan=cpu, return_lse=True)
    qc, kc, vc = (t.cuda() for t in (q, k, v))
    plan = flexattn.create_mask_plan(MASKS[mask]("cuda"), qc, kc, vc)
    assert plan.view("forward").signature.arch_family == "sm90"
    assert torch.equal(plan.view("forward").to_dense().cpu(), cpu.view("forward").to_dense())
    out, lse = flexattn.flex_attn_func(qc, kc, vc, mask_plan=plan, return_lse=True)
    assert out.dtype == dtype and out.shape == (B, S, H, D) and lse.shape == (B, H, S)
    assert not out.isnan().any()
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    assert (out.float().cpu() - ref).abs().max() <= tol
    assert torch.allclose(lse.cpu(), ref_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU")
def test_training_call_is_refused_until_the_backward_kernel_exists():
    q = torch.randn(1, 256, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    plan = flexattn.create_mask_plan(masks.causal(256, device="cuda"), q, q, q)
    assert plan.has_backward
    with pytest.raises(flexattn.ConsumerNotFoundError, match="backward"):
        flexattn.flex_attn_func(q, q, q, mask_plan=plan).sum().backward()
