"""maskplan_core.testing for a third party's consumer: a plain ``Consumer`` (no compute
capabilities), fp32 kernels on the CPU, and checks that pass on a right result and fail on a
wrong one."""

from __future__ import annotations

import pytest
import torch

from maskplan_core import masks
from maskplan_core.reference import attention_backward, attention_forward
from maskplan_core.reference.consumer import ReferenceConsumer
from maskplan_core.testing import check_backward, check_forward, consumer_plan, qkv

B, S, HQ, HKV, D = 2, 96, 4, 2, 16


def forward_run(error: float = 0.0):
    """A stand-in kernel forward in the ``run`` form the checks call: the reference, off by ``error``."""

    def run(view, q, k, v, *, softmax_scale, return_max_logit, out, lse):
        ref_out, ref_lse, max_logit = attention_forward(
            view, q, k, v, softmax_scale=softmax_scale, return_max_logit=return_max_logit
        )
        out.copy_(ref_out + error)
        lse.copy_(ref_lse)
        return out, lse, max_logit

    return run


def backward_run(error: float = 0.0):
    def run(view, q, k, v, out, lse, dout, dlse, *, softmax_scale, deterministic, dq, dk, dv):
        for dst, src in zip((dq, dk, dv), attention_backward(
            view, q, k, v, out, lse, dout, dlse, softmax_scale=softmax_scale
        ), strict=True):  # fmt: skip
            dst.copy_(src)
        dq[dq != 0] += error
        return dq, dk, dv

    return run


@pytest.fixture
def problem():
    q, k, v = qkv((B, S, HQ), (B, S, HKV), D, D, torch.float32, seed=5, device="cpu")
    return (
        consumer_plan(ReferenceConsumer(), masks.sliding_window(S, window_left=20, batch=B), q, k, v),
        q,
        k,
        v,
    )


def test_the_checks_pass_a_right_fp32_result(problem):
    plan, q, k, v = problem
    check_forward(forward_run(), plan.view("forward"), q, k, v)
    check_backward(backward_run(), plan, q, k, v)


def test_the_checks_fail_a_wrong_fp32_result(problem):
    plan, q, k, v = problem
    with pytest.raises(AssertionError, match=r"max \|O - ref\|"):
        check_forward(forward_run(error=1e-3), plan.view("forward"), q, k, v)
    with pytest.raises(AssertionError, match="dq: relative L2 error"):
        check_backward(backward_run(error=1e-2), plan, q, k, v)
