"""The library's own tensors (payload tables, plan handles, prefixes) do not follow torch's default
device: a script that calls ``torch.set_default_device`` (or works in a ``with torch.device(...)``
block) plans and attends as without it. The default device here is ``meta``, where any tensor that
followed it fails at its first value read, standing in for ``cuda`` on a machine without a GPU."""

from __future__ import annotations

import pytest
import torch

import flexattn


def run(mask, qkv, **plan_args):
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv)
    plan = flexattn.create_mask_plan(mask, q, k, v, **plan_args)
    out, lse = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True)
    out.sum().backward()
    view = plan.view("forward")
    return out, lse, q.grad, k.grad, v.grad, view.to_dense(), view.block_map(0, 0), plan.handle_tensor.device


def fixed():
    gen = torch.Generator().manual_seed(1)
    qkv = tuple(torch.randn(2, 150, 2, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    return flexattn.masks.sliding_window(150, window_left=40, batch=2), qkv, {}


def varlen():
    gen = torch.Generator().manual_seed(2)
    cu_q = torch.tensor([0, 90, 90, 200], dtype=torch.int32)
    cu_k = torch.tensor([0, 60, 65, 265], dtype=torch.int32)
    qkv = (torch.randn(200, 2, 16, generator=gen, dtype=torch.float64),
           *(torch.randn(265, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2)))  # fmt: skip
    mask = flexattn.masks.causal(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    return mask, qkv, dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=110, max_seqlen_k=200)


@pytest.mark.parametrize("case", [fixed, varlen])
def test_a_default_device_changes_nothing(case):
    mask, qkv, args = case()
    want = run(mask, qkv, **args)
    with torch.device("meta"):
        got = run(mask, qkv, **args)
    assert got[-1] == torch.device("cpu")  # the plan handle stays the host tensor the docs promise
    for a, b in zip(got[:-1], want[:-1], strict=True):
        assert a.device == b.device and torch.equal(a, b)
