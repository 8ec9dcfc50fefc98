"""Autograd through the consumers: forward saves what the K2Q backward needs."""

from __future__ import annotations

import torch

from maskplan_core import Consumer, MaskPlan


class FlexAttnFunction(torch.autograd.Function):
    """THD in, THD out: ``(out [total_q, Hq, Dv], lse [Hq, total_q], max_logit [Hq] | None)``."""

    @staticmethod
    def forward(
        ctx, q, k, v, plan: MaskPlan, consumer: Consumer, scale: float, deterministic: bool, want_max: bool
    ):
        res = consumer.forward(plan, q, k, v, softmax_scale=scale, return_max_logit=want_max)
        ctx.save_for_backward(q, k, v, res.out, res.lse)
        ctx.plan, ctx.consumer, ctx.scale, ctx.deterministic = plan, consumer, scale, deterministic
        if res.max_logit is not None:
            ctx.mark_non_differentiable(res.max_logit)
        return res.out, res.lse, res.max_logit

    @staticmethod
    def backward(ctx, dout, dlse, _dmax):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = ctx.consumer.backward(
            ctx.plan,
            q,
            k,
            v,
            out,
            lse,
            dout.contiguous(),
            dlse,
            softmax_scale=ctx.scale,
            deterministic=ctx.deterministic,
        )
        return dq, dk, dv, None, None, None, None, None
