"""Reference attention (forward, LSE, max logit, gradients) against a dense float64 attention
written here with an explicit softmax over the boolean mask: end to end through
``flexattn.flex_attn_func`` with autograd (128x128 reference tiles), and directly through
``maskplan_core.reference.attention_forward/backward`` on small-tile plans (many blocks and tails).

Rows with no visible key must give ``O = 0``, ``LSE = -inf`` and zero gradients.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mask_oracle import decode_within_samples

from maskplan_core import PlanSignature, RowMajorLayout, Topology, ViewConfig, validate_plan_inputs
from maskplan_core.reference import attention_backward, attention_forward, build_plan, unary_dispatch

try:
    import flexattn
except ImportError:  # maskplan-core installed alone: only the planner-level tests run
    flexattn = None

needs_flexattn = pytest.mark.skipif(flexattn is None, reason="flexattn (the facade) is not installed")

NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------------
# problems
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    varlen: bool
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    hq: int = 2
    hkv: int = 1
    kinds: tuple[str, ...] = ("random",)  # one per mask head (Hmask = len(kinds)), applied to every sample
    nfunc: int = 3
    dqk: int = 16
    dv: int = 8
    seed: int = 0

    @property
    def hmask(self) -> int:
        return len(self.kinds)

    @property
    def cu_q(self) -> list[int]:
        return [sum(self.q_lens[:i]) for i in range(len(self.q_lens) + 1)]

    @property
    def cu_k(self) -> list[int]:
        return [sum(self.k_lens[:i]) for i in range(len(self.k_lens) + 1)]

    @property
    def max_k(self) -> int:
        return max(self.k_lens)


def fixed(batch: int, sq: int, sk: int, **kw) -> Case:
    return Case(False, (sq,) * batch, (sk,) * batch, **kw)


def make_endpoints(c: Case) -> torch.Tensor:
    """int32 [Hmask, nfunc, total_q]; ``random`` rows are sorted random endpoints with ~1/4 of
    the rows forced empty, ``causal``/``window`` are bottom-right aligned, ``empty`` has no key."""
    gen = torch.Generator().manual_seed(c.seed + 1000)
    ep = torch.zeros(c.hmask, c.nfunc, c.cu_q[-1], dtype=torch.int64)
    for h, kind in enumerate(c.kinds):
        for b, (ql, kl) in enumerate(zip(c.q_lens, c.k_lens, strict=True)):
            i = torch.arange(ql)
            vals = torch.full((c.nfunc, ql), kl, dtype=torch.int64)
            if kind == "random":
                vals = torch.randint(0, kl + 1, (c.nfunc, ql), generator=gen).sort(0).values
                vals[:, torch.rand(ql, generator=gen) < 0.25] = 0
            elif kind == "causal" or (kind == "window" and c.nfunc == 1):
                vals[0] = (i + 1 + kl - ql).clamp(0, kl)
            elif kind == "window":
                vals[0] = 0
                vals[1] = (i + kl - ql - 37).clamp(0, kl)
                vals[2] = (i + kl - ql + 1).clamp(0, kl)
            elif kind == "empty":
                vals.zero_()
            ep[h, :, c.cu_q[b] : c.cu_q[b + 1]] = vals
    return ep.to(torch.int32).contiguous()


def dense_mask(ep: torch.Tensor, c: Case) -> torch.Tensor:
    """bool [Hmask, total_q, max_k] decoded from the case's endpoints."""
    return decode_within_samples(ep, c.max_k, c.q_lens, c.k_lens)


def make_inputs(c: Case, dtype=torch.float64):
    gen = torch.Generator().manual_seed(c.seed)
    tq, tk = c.cu_q[-1], c.cu_k[-1]
    shapes = [(tq, c.hq, c.dqk), (tk, c.hkv, c.dqk), (tk, c.hkv, c.dv)]
    if not c.varlen:
        b = len(c.q_lens)
        shapes = [(b, s[0] // b, *s[1:]) for s in shapes]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() for s in shapes]


def plan_kwargs(c: Case) -> dict:
    if not c.varlen:
        return {}
    return dict(
        cu_seqlens_q=torch.tensor(c.cu_q, dtype=torch.int32),
        cu_seqlens_k=torch.tensor(c.cu_k, dtype=torch.int32),
        max_seqlen_q=max(max(c.q_lens), 1),
        max_seqlen_k=max(max(c.k_lens), 1),
    )


# --------------------------------------------------------------------------------------------------
# dense reference
# --------------------------------------------------------------------------------------------------


def dense_attention(q, k, v, mask: torch.Tensor, c: Case, scale: float):
    """THD float64: out [total_q, Hq, Dv], lse [Hq, total_q], max logit [Hq] (-inf if nothing visible)."""
    unary_dispatch.settle(torch.exp, torch.log)  # as the reference does (see the test of it below)
    q, k, v = (t.reshape(-1, *t.shape[-2:]).to(torch.float64) for t in (q, k, v))
    group = c.hq // c.hkv
    outs, lses, maxes = [], [], []
    for b, (ql, kl) in enumerate(zip(c.q_lens, c.k_lens, strict=True)):
        qs = q[c.cu_q[b] : c.cu_q[b + 1]]  # [ql, Hq, D]
        ks = k[c.cu_k[b] : c.cu_k[b + 1]].repeat_interleave(group, dim=1)  # [kl, Hq, D]
        vs = v[c.cu_k[b] : c.cu_k[b + 1]].repeat_interleave(group, dim=1)
        m = mask[:, c.cu_q[b] : c.cu_q[b + 1], :kl].expand(c.hq, ql, kl)  # [Hq, ql, kl]
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        s = s.masked_fill(~m, NEG_INF)
        row_max = s.amax(-1, keepdim=True) if kl else s.new_full((c.hq, ql, 1), NEG_INF)
        shift = torch.where(torch.isinf(row_max), 0.0, row_max).detach()
        p = torch.exp(s - shift)  # exactly 0 where masked
        denom = p.sum(-1, keepdim=True)
        safe = torch.where(denom > 0, denom, torch.ones_like(denom))
        outs.append(torch.einsum("hqk,khd->qhd", p / safe, vs))
        lses.append(torch.where(denom > 0, shift + torch.log(safe), NEG_INF).squeeze(-1))
        maxes.append(row_max.detach().reshape(c.hq, -1))
    max_logit = torch.cat(maxes, 1).amax(1) if sum(c.q_lens) else torch.full((c.hq,), NEG_INF)
    return torch.cat(outs, 0), torch.cat(lses, 1), max_logit


def to_public_layout(c: Case, out, lse):
    """THD reference outputs in flex_attn_func's layout (BSHD out, [B, Hq, Sq] lse for fixed)."""
    if c.varlen:
        return out, lse
    b, sq = len(c.q_lens), c.q_lens[0]
    return out.reshape(b, sq, c.hq, c.dv), lse.reshape(c.hq, b, sq).transpose(0, 1)


def grads(loss, inputs):
    got = torch.autograd.grad(loss, inputs, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(got, inputs, strict=True)]


TOL = {
    torch.float64: dict(atol=1e-10, rtol=1e-9),
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def run_and_compare(c: Case, *, dtype=torch.float64, scale=None, a=1.0, b=0.5, deterministic=False):
    """Forward (out, lse, max logit) and gradients of ``a * <out, W> + b * <lse[finite], U>``."""
    ep = make_endpoints(c)
    q, k, v = make_inputs(c, dtype)
    plan = flexattn.create_mask_plan(ep, q, k, v, **plan_kwargs(c))
    assert plan.has_backward  # build_backward=None + requires_grad
    out, lse, max_logit = flexattn.flex_attn_func(
        q, k, v, mask_plan=plan, softmax_scale=scale, return_lse=True, return_max_logit=True,
        deterministic=deterministic,
    )
    eff_scale = 1.0 / math.sqrt(c.dqk) if scale is None else scale
    ref_thd_out, ref_thd_lse, ref_max = dense_attention(q, k, v, dense_mask(ep, c), c, eff_scale)
    ref_out, ref_lse = to_public_layout(c, ref_thd_out, ref_thd_lse)

    assert out.dtype == dtype and out.shape == ref_out.shape
    assert lse.shape == ref_lse.shape and max_logit.shape == (c.hq,)
    if dtype != torch.float64:
        assert lse.dtype == max_logit.dtype == torch.float32
    assert not max_logit.requires_grad
    tol = TOL[dtype]
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "rows with no visible key must have lse = -inf"
    torch.testing.assert_close(out.to(torch.float64), ref_out.detach(), **tol)
    torch.testing.assert_close(lse[finite].to(torch.float64), ref_lse[finite].detach(), **tol)
    torch.testing.assert_close(max_logit.to(torch.float64), ref_max, **tol)
    empty_rows = ~finite  # [.., Hq, ..] rows: O must be exactly zero there
    out_rows = out.transpose(-2, -3)  # [B, Hq, Sq, Dv] / [Hq, T, Dv], indexed like lse
    assert bool((out_rows[empty_rows] == 0).all()), "rows with no visible key must give O = 0"

    gen = torch.Generator().manual_seed(7)
    w = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    u = torch.randn(lse.shape, generator=gen, dtype=torch.float64)

    def loss(o, s):
        return a * (o.to(torch.float64) * w).sum() + b * (s.to(torch.float64)[finite] * u[finite]).sum()

    got = grads(loss(out, lse), (q, k, v))
    want = grads(loss(ref_out, ref_lse), (q, k, v))
    for name, g, r in zip("qkv", got, want, strict=True):
        assert g.dtype == dtype and g.shape == r.shape, name
        assert bool(torch.isfinite(g).all()), f"d{name} has non-finite values"
        torch.testing.assert_close(
            g.to(torch.float64), r.to(torch.float64), **tol, msg=lambda m, n=name: f"d{n}: {m}"
        )
    return ep, plan, (q, k, v), (out, lse), got


# --------------------------------------------------------------------------------------------------
# float64 against dense
# --------------------------------------------------------------------------------------------------

CASES = {
    "fixed-gqa-dqk48-dv32": fixed(2, 300, 270, hq=4, hkv=2, kinds=("random",), nfunc=3, dqk=48, dv=32),
    "fixed-per-head-masks": fixed(1, 200, 333, hq=4, hkv=2, kinds=("causal", "window", "random", "empty")),
    "fixed-sq-lt-sk-nfunc9": fixed(1, 130, 400, hq=2, hkv=2, kinds=("random", "window"), nfunc=9, seed=3),
    "varlen-gqa": Case(True, (130, 0, 257), (200, 17, 0), hq=4, hkv=1, kinds=("random",), nfunc=5, seed=1),
    "varlen-per-head": Case(True, (1, 300, 64), (383, 1, 128), hq=2, kinds=("window", "random"), seed=2),
    # samples far shorter than a tile: the reference trims its partial tiles to the kept extent
    "varlen-tiny-samples": Case(
        True, (5, 17, 0, 3, 9, 1, 12), (7, 2, 4, 0, 9, 30, 12), hq=2, kinds=("causal", "random"), seed=4
    ),
}


@needs_flexattn
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_matches_dense_attention(case):
    run_and_compare(case)


@needs_flexattn
def test_partial_tiles_are_trimmed_to_what_they_keep():
    """Tiles of samples shorter than a tile are cut after the last row and column that any tile of
    the chunk keeps, so the reference does not compute 128 x 128 scores for a 5-token sample."""
    from maskplan_core.reference.attention import _tiles

    c = CASES["varlen-tiny-samples"]
    plan = flexattn.create_mask_plan(make_endpoints(c), *make_inputs(c), **plan_kwargs(c))
    chunks = list(_tiles(plan.view("forward")))
    partial = [tl for tl in chunks if tl.keep is not None]
    assert partial and all(tl.keep.shape[1:] == (tl.q_tok.shape[1], tl.k_tok.shape[1]) for tl in partial)
    assert max(tl.q_tok.shape[1] for tl in partial) <= max(c.q_lens)
    assert max(tl.k_tok.shape[1] for tl in partial) <= max(c.k_lens)


@needs_flexattn
@pytest.mark.parametrize("scale", [0.3, 0.0, -0.5])
def test_custom_softmax_scale(scale):
    c = fixed(1, 150, 140, hq=2, hkv=1, kinds=("random", "causal"), seed=4)
    if scale < 0:  # a negative scale is legal, just not together with return_max_logit
        ep = make_endpoints(c)
        q, k, v = make_inputs(c)
        plan = flexattn.create_mask_plan(ep, q, k, v)
        out, lse = flexattn.flex_attn_func(q, k, v, mask_plan=plan, softmax_scale=scale, return_lse=True)
        ref_out, ref_lse = to_public_layout(c, *dense_attention(q, k, v, dense_mask(ep, c), c, scale)[:2])
        torch.testing.assert_close(out, ref_out, **TOL[torch.float64])
        finite = torch.isfinite(ref_lse)
        torch.testing.assert_close(lse[finite], ref_lse[finite], **TOL[torch.float64])
    else:
        run_and_compare(c, scale=scale)


@needs_flexattn
def test_gradient_through_lse_only():
    """loss = sum(lse[finite]): the out gradient is zero, so only the dlse path drives dq/dk/dv."""
    run_and_compare(fixed(1, 140, 260, hq=2, hkv=2, kinds=("random", "window"), seed=5), a=0.0, b=1.0)
    run_and_compare(Case(True, (70, 150), (150, 90), hq=2, hkv=1, seed=6), a=0.0, b=-2.0)


@needs_flexattn
def test_deterministic_flag_reaches_the_backward_and_gives_identical_results(monkeypatch):
    """``deterministic`` is handed to the consumer's backward as given, and the reference (one order
    of adds always) gives bit-identical results either way."""
    from maskplan_core.reference.consumer import ReferenceConsumer

    seen, backward = [], ReferenceConsumer.backward

    def recording(self, *args, deterministic, **kwargs):
        seen.append(deterministic)
        return backward(self, *args, deterministic=deterministic, **kwargs)

    monkeypatch.setattr(ReferenceConsumer, "backward", recording)
    c = fixed(1, 200, 180, hq=2, hkv=1, kinds=("random",), seed=8)
    *_, (out_a, lse_a), grads_a = run_and_compare(c, deterministic=True)
    *_, (out_b, lse_b), grads_b = run_and_compare(c, deterministic=False)
    assert seen == [True, False]
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
    assert all(torch.equal(x, y) for x, y in zip(grads_a, grads_b, strict=True))


@needs_flexattn
def test_all_rows_empty():
    """A mask with no visible key anywhere: O = 0, LSE = -inf, max logit -inf, zero gradients."""
    c = Case(True, (140, 33), (150, 0), hq=2, hkv=1, kinds=("empty", "empty"), seed=9)
    ep = make_endpoints(c)
    q, k, v = make_inputs(c)
    plan = flexattn.create_mask_plan(ep, q, k, v, **plan_kwargs(c))
    out, lse, max_logit = flexattn.flex_attn_func(
        q, k, v, mask_plan=plan, return_lse=True, return_max_logit=True
    )
    assert bool((out == 0).all())
    assert bool(torch.isneginf(lse).all())
    assert bool(torch.isneginf(max_logit).all())
    dq, dk, dv = grads(out.sum() + lse[torch.isfinite(lse)].sum(), (q, k, v))
    for g in (dq, dk, dv):
        assert bool((g == 0).all())


@needs_flexattn
def test_max_logit_without_query_tokens():
    """Varlen with every sample's q_len = 0 (total_q = 0) is a valid plan; asking for the max logit
    must give -inf per head (nothing is visible), like the out/lse path, not crash."""
    c = Case(True, (0, 0), (5, 9), hq=2, hkv=1, kinds=("random",), seed=17)
    ep = make_endpoints(c)
    q, k, v = make_inputs(c)
    plan = flexattn.create_mask_plan(ep, q, k, v, **plan_kwargs(c))
    out, lse = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True)
    assert out.shape == (0, c.hq, c.dv) and lse.shape == (c.hq, 0)
    out, max_logit = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_max_logit=True)
    assert max_logit.shape == (c.hq,) and bool(torch.isneginf(max_logit).all())


@needs_flexattn
def test_partly_empty_rows_get_zero_gradients():
    """Query rows with no visible key contribute nothing: zero dq there; k/v grads only from others."""
    c = fixed(1, 200, 200, hq=2, hkv=2, kinds=("random", "random"), seed=10)
    ep = make_endpoints(c)
    ep[:, :, :50] = 0  # first 50 query rows see nothing, in both heads
    q, k, v = make_inputs(c)
    plan = flexattn.create_mask_plan(ep, q, k, v)
    out, lse = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True)
    assert bool((out[:, :50] == 0).all()) and bool(torch.isneginf(lse[:, :, :50]).all())
    dq, dk, dv = grads((out * out).sum() + lse[torch.isfinite(lse)].sum(), (q, k, v))
    assert bool((dq[:, :50] == 0).all())
    ref = dense_attention(q, k, v, dense_mask(ep, c), c, 1 / math.sqrt(c.dqk))
    ref_out, ref_lse = to_public_layout(c, *ref[:2])
    want = grads((ref_out * ref_out).sum() + ref_lse[torch.isfinite(ref_lse)].sum(), (q, k, v))
    for g, r in zip((dq, dk, dv), want, strict=True):
        torch.testing.assert_close(g, r, **TOL[torch.float64])


@needs_flexattn
def test_forward_only_plan_under_no_grad():
    c = fixed(2, 160, 100, hq=2, hkv=1, kinds=("causal",), nfunc=1, seed=11)
    ep = make_endpoints(c)
    q, k, v = make_inputs(c)
    with torch.no_grad():
        plan = flexattn.create_mask_plan(ep, q, k, v)
        assert not plan.has_backward
        out = flexattn.flex_attn_func(q, k, v, mask_plan=plan)
    ref = dense_attention(q, k, v, dense_mask(ep, c), c, 1 / math.sqrt(c.dqk))
    ref_out, _ = to_public_layout(c, *ref[:2])
    assert isinstance(out, torch.Tensor) and not out.requires_grad
    torch.testing.assert_close(out, ref_out.detach(), **TOL[torch.float64])


@needs_flexattn
def test_plan_is_reused_with_new_values():
    """Q/K/V identity is not bound: the same plan serves new tensors of the same geometry."""
    c = Case(True, (100, 60), (90, 130), hq=2, hkv=1, seed=12)
    ep = make_endpoints(c)
    q, k, v = make_inputs(c)
    plan = flexattn.create_mask_plan(ep, q, k, v, build_backward=False, **plan_kwargs(c))
    for seed in (13, 14):
        q2, k2, v2 = make_inputs(Case(**{**c.__dict__, "seed": seed}))
        with torch.no_grad():
            out = flexattn.flex_attn_func(q2, k2, v2, mask_plan=plan)
            ref, _, _ = dense_attention(q2, k2, v2, dense_mask(ep, c), c, 1 / math.sqrt(c.dqk))
        torch.testing.assert_close(out, ref, **TOL[torch.float64])


def _sample_rows(c: Case, b: int, t: torch.Tensor, keys: bool) -> torch.Tensor:
    """Sample ``b``'s token rows of a public-layout Q-side (``keys=False``) or K-side tensor."""
    if not c.varlen:
        return t[b]
    cu = c.cu_k if keys else c.cu_q
    return t[cu[b] : cu[b + 1]]


@needs_flexattn
@pytest.mark.parametrize("poisoned", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize(
    "case",
    [
        fixed(3, 100, 100, kinds=("causal",), nfunc=1, seed=21),
        Case(True, (100, 77, 130), (90, 150, 60), seed=22),
    ],
    ids=["fixed-tails", "varlen"],
)
def test_non_finite_values_stay_in_their_sample(case, bad, poisoned):
    """A sample's tail tiles index the next sample's tokens; a nan / inf there must not reach the
    other samples' outputs or gradients (0 * inf = nan), as in dense attention per sample."""
    ep = make_endpoints(case)
    q, k, v = make_inputs(case, torch.float32)
    plan = flexattn.create_mask_plan(ep, q, k, v, **plan_kwargs(case))
    dout = torch.randn(*q.shape[:-1], case.dv, generator=torch.Generator().manual_seed(5))

    def run(poison: bool):
        tensors = {"q": q, "k": k, "v": v, "dout": dout}
        tensors = {name: t.detach().clone() for name, t in tensors.items()}
        if poison:
            _sample_rows(case, 1, tensors[poisoned], keys=poisoned in "kv").fill_(bad)
        qq, kk, vv = (tensors[n].requires_grad_() for n in "qkv")
        out = flexattn.flex_attn_func(qq, kk, vv, mask_plan=plan)
        return (out, *torch.autograd.grad(out, (qq, kk, vv), tensors["dout"]))

    clean, dirty = run(False), run(True)
    for b in (0, 2):
        for name, c_t, d_t in zip(("out", "dq", "dk", "dv"), clean, dirty, strict=True):
            keys = name in ("dk", "dv")
            assert torch.equal(_sample_rows(case, b, d_t, keys), _sample_rows(case, b, c_t, keys)), (
                f"sample {b}'s {name} changed when sample 1's {poisoned} became {bad}"
            )
    assert not bool(torch.isfinite(_sample_rows(case, 1, dirty[0], False)).all()) or poisoned == "dout"


@needs_flexattn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_autocast_does_not_change_the_computation(dtype):
    """On CPU the reference computes in its own dtype under an enclosing autocast too (it crashed
    there: its einsums were recast to bf16 next to fp32 buffers). flex_attn_func casts its inputs
    to the region's dtype first; the consumer's own calls (a library's, the explicit API's) do not."""
    from maskplan_core.reference.consumer import ReferenceConsumer

    c = fixed(2, 150, 150, hq=4, hkv=2, kinds=("causal",), nfunc=1, seed=23)
    q, k, v = make_inputs(c, dtype)
    plan = flexattn.create_mask_plan(make_endpoints(c), q, k, v)
    gen = torch.Generator().manual_seed(1)
    dout = torch.randn((*q.shape[:3], c.dv), generator=gen).to(dtype).flatten(0, 1)
    consumer, scale = ReferenceConsumer(), 0.25

    def run():
        fwd = consumer.forward(plan, q, k, v, softmax_scale=scale, return_max_logit=True)
        grads = consumer.backward(
            plan, q, k, v, fwd.out, fwd.lse, dout, None, softmax_scale=scale, deterministic=False
        )
        return (fwd.out, fwd.lse, fwd.max_logit, *grads)

    plain = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = run()
    for a, b in zip(plain, under_autocast, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@needs_flexattn
def test_a_slow_cpu_forward_warns_once_before_it_starts(monkeypatch):
    """A CPU forward of SLOW_CPU_FLOPS or more (2 x the visited tiles' scores x (Dqk + Dv)) says
    so, once a process: it runs for seconds to minutes with no other sign of life."""
    import warnings

    from maskplan_core.reference import consumer as reference

    c = fixed(1, 256, 256, hq=4, hkv=2, kinds=("causal",), nfunc=1, seed=3)
    q, k, v = make_inputs(c, torch.float32)
    plan = flexattn.create_mask_plan(make_endpoints(c), q, k, v)
    scores = 3 * 128 * 128 * 4  # causal over 2 x 2 tiles: 3 visited, each for 4 q heads
    flops = 2 * scores * (c.dqk + c.dv)
    monkeypatch.setattr(reference, "_warned_slow", False)
    monkeypatch.setattr(reference, "SLOW_CPU_FLOPS", flops + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flexattn.flex_attn_func(q, k, v, mask_plan=plan)  # just under the threshold: no warning
    monkeypatch.setattr(reference, "SLOW_CPU_FLOPS", flops)
    said = re.escape(f"computes {scores:.3g} scores ({flops / 1e9:.0f} GFLOP;")
    with pytest.warns(UserWarning, match=said) as w:
        flexattn.flex_attn_func(q, k, v, mask_plan=plan)
    assert w[0].filename == __file__  # the caller's line, not the library's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flexattn.flex_attn_func(q, k, v, mask_plan=plan)  # once a process
    # before it starts: under an error filter the attention never runs, on every such call
    monkeypatch.setattr(reference, "_warned_slow", False)
    monkeypatch.setattr(reference, "attention_forward", None)  # called: a TypeError, not the warning
    for _ in range(2):
        with warnings.catch_warnings(), pytest.raises(UserWarning, match=said):
            warnings.simplefilter("error")
            flexattn.flex_attn_func(q, k, v, mask_plan=plan)


# --------------------------------------------------------------------------------------------------
# lower precision inputs
# --------------------------------------------------------------------------------------------------


@needs_flexattn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "case",
    [
        fixed(1, 200, 170, hq=4, hkv=2, kinds=("random",), seed=15, dqk=64, dv=32),
        Case(True, (150, 0, 40), (129, 7, 200), hq=2, hkv=1, kinds=("window", "random"), seed=16),
    ],
    ids=["fixed", "varlen"],
)
def test_low_precision_inputs_match_within_dtype_tolerance(case, dtype):
    run_and_compare(case, dtype=dtype)


# --------------------------------------------------------------------------------------------------
# the reference kernels on small-tile plans (no facade): many blocks, tails and empty samples
# --------------------------------------------------------------------------------------------------

KINDS = ("random", "causal", "window", "full", "empty")


def small_config(direction: str, tm: int, tn: int) -> ViewConfig:
    layout = RowMajorLayout(tm, tn)
    signature = PlanSignature(
        arch_family="reference", direction=direction, kernel_family="test-small-tiles",
        topology=Topology(tile_m=tm, tile_n=tn), mma_layout="none", payload=layout.spec,
        scheduler_layout="test", dq_order_format="rank_int32" if direction == "backward" else "none",
    )
    return ViewConfig(signature, layout)


@st.composite
def small_cases(draw) -> Case:
    varlen = draw(st.booleans())
    hq, hkv = draw(st.sampled_from([(1, 1), (2, 1), (4, 2), (2, 2)]))
    kinds = (draw(st.sampled_from(KINDS)),)
    if draw(st.booleans()):  # Hmask = Hq: one mask per head
        kinds = tuple(draw(st.lists(st.sampled_from(KINDS), min_size=hq, max_size=hq)))
    batch = draw(st.integers(1, 3))
    if varlen:
        length = st.tuples(st.integers(0, 3), st.integers(1, 70)).map(lambda t: t[1] if t[0] else 0)
        q_lens = tuple(draw(st.lists(length, min_size=batch, max_size=batch)))
        k_lens = tuple(draw(st.lists(length, min_size=batch, max_size=batch)))
        if max(k_lens) == 0:
            k_lens = (1, *k_lens[1:])
    else:
        q_lens, k_lens = (draw(st.integers(1, 70)),) * batch, (draw(st.integers(1, 70)),) * batch
    nfunc = draw(st.sampled_from([1, 3, 5]))
    dqk, dv = draw(st.sampled_from([(8, 8), (12, 4)]))
    return Case(varlen, q_lens, k_lens, hq, hkv, kinds, nfunc, dqk, dv, draw(st.integers(0, 2**20)))


@settings(
    max_examples=40, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(c=small_cases(), tiles=st.sampled_from([((16, 32), (32, 16)), ((8, 40), (16, 16))]),
       scale=st.sampled_from([None, 0.7]))
def test_small_tile_reference_attention_matches_dense(c, tiles, scale):
    ep = make_endpoints(c)
    q, k, v = (t.detach().reshape(-1, *t.shape[-2:]).requires_grad_() for t in make_inputs(c))
    args = plan_kwargs(c) if c.varlen else {}
    if c.varlen:
        geometry = validate_plan_inputs(ep, q, k, v, **args)
    else:
        b = len(c.q_lens)
        geometry = validate_plan_inputs(ep, *(t.detach().reshape(b, -1, *t.shape[-2:]) for t in (q, k, v)))
    fwd, bwd = small_config("forward", *tiles[0]), small_config("backward", *tiles[1])
    plan = build_plan(ep, geometry, fwd, bwd, "test-small-tiles")
    scale = 1 / math.sqrt(c.dqk) if scale is None else scale
    thd = Case(True, c.q_lens, c.k_lens, c.hq, c.hkv, c.kinds, c.nfunc, c.dqk, c.dv, c.seed)  # THD reference

    want_max = sum(c.q_lens) > 0  # total_q == 0 with max logit: see test_max_logit_without_query_tokens
    out, lse, max_logit = attention_forward(
        plan.view("forward"), q, k, v, softmax_scale=scale, return_max_logit=want_max
    )
    ref_out, ref_lse, ref_max = dense_attention(q, k, v, dense_mask(ep, c), thd, scale)
    tol = TOL[torch.float64]
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(out, ref_out.detach(), **tol)
    torch.testing.assert_close(lse[finite], ref_lse[finite].detach(), **tol)
    if want_max:
        torch.testing.assert_close(max_logit, ref_max, **tol)

    gen = torch.Generator().manual_seed(c.seed)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=gen, dtype=torch.float64) * finite
    got = attention_backward(plan.view("backward"), q, k, v, out, lse, dout, dlse, softmax_scale=scale)
    want = grads((ref_out * dout).sum() + (ref_lse[finite] * dlse[finite]).sum(), (q, k, v))
    for name, g, r in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(g, r, **tol, msg=lambda m, n=name: f"d{n}: {m}")


def test_tensors_of_another_problem_are_refused_by_name():
    """Called directly (the facade checks first), the reference attention refuses THD tensors of
    other sizes than its view's plan, naming the tensor: shorter q was an IndexError deep in the tile
    gather, longer q and more heads were accepted with outputs of the plan's sizes."""
    from maskplan_core import masks
    from maskplan_core.errors import InputValueError

    B, S, H, D = 2, 200, 2, 16
    q = torch.randn(B, S, H, D)
    ep = masks.sliding_window(S, window_left=30, batch=B)
    g = validate_plan_inputs(ep, q, q, q)
    plan = build_plan(ep, g, small_config("forward", 64, 48), small_config("backward", 48, 64), "test")
    fwd, bwd = plan.view("forward"), plan.view("backward")
    thd = q.reshape(B * S, H, D)
    out, lse, _ = attention_forward(fwd, thd, thd, thd, softmax_scale=0.25)
    for name, bad in (("q", thd[:200]), ("k", torch.randn(600, H, D)), ("v", torch.randn(B * S, 4, D))):
        args = {"q": thd, "k": thd, "v": thd, name: bad}
        shape = re.escape(str(tuple(bad.shape)))
        with pytest.raises(InputValueError, match=rf"{name} is {shape} on cpu; .* takes THD"):
            attention_forward(fwd, *args.values(), softmax_scale=0.25)
    with pytest.raises(InputValueError, match=r"lse is \(400, 2\) on cpu; the plan's backward view takes"):
        attention_backward(bwd, thd, thd, thd, out, lse.T, out, None, softmax_scale=0.25)


def test_exp_and_log_are_settled_on_one_thread_before_they_run_on_several(monkeypatch):
    """MKL picks a float unary op's CPU kernel on its first call, and a first call on several
    threads at once can run a kernel 1e-4 off on one thread's chunk (pytorch/pytorch#188792). The
    reference's first ``exp`` and ``log`` of each float dtype, forward or backward (whose inputs
    may come from a GPU kernel), are one element on the calling thread, before any sizable one, and
    are made once; under a ``FakeTensorMode`` nothing is computed, and nothing counts as settled."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.exp, torch.ops.aten.log):
                self.seen.append((func.overloadpacket.__name__, args[0].dtype, args[0].numel()))
            return func(*args, **(kwargs or {}))

    c = fixed(2, 40, 40, hq=2, hkv=1)
    ep = make_endpoints(c)
    q, k, v = (t.detach().reshape(-1, *t.shape[-2:]).to(torch.float32) for t in make_inputs(c))
    geometry = validate_plan_inputs(ep, *(t.reshape(2, -1, *t.shape[-2:]) for t in (q, k, v)))
    plan = build_plan(ep, geometry, small_config("forward", 16, 16), small_config("backward", 16, 16), "t")
    out, lse, _ = attention_forward(plan.view("forward"), q, k, v, softmax_scale=0.25)
    dout = torch.ones_like(out)
    runs = {
        "forward": lambda: attention_forward(plan.view("forward"), q, k, v, softmax_scale=0.25),
        "backward": lambda: attention_backward(
            plan.view("backward"), q, k, v, out, lse, dout, None, softmax_scale=0.25
        ),
    }
    settling = [(op, dtype, 1) for op in ("exp", "log") for dtype in (torch.float32, torch.float64)]
    for name, run in runs.items():
        monkeypatch.setattr(unary_dispatch, "_settled", set())  # as in a fresh process
        with FakeTensorMode():
            unary_dispatch.settle(torch.exp, torch.log)
        assert not unary_dispatch._settled, name
        with Calls() as first:
            run()
        with Calls() as again:
            run()
        assert first.seen[:4] == settling, (name, first.seen)
        assert all(n > 1 for *_, n in first.seen[4:] + again.seen), (name, first.seen, again.seen)
