"""Test support shared by the consumers' GPU test suites (and usable by a third party's): problem
generators, the forward and backward checks against the fp32 reference, and the test cases both
consumers run (:class:`ForwardCases`, :class:`BackwardCases`: each builds one problem and hands it
to the suite's own ``check``). Torch only; importing it needs no GPU.

::

    q, k, v = qkv((B, S, H), (B, S, H), 128, 128, torch.bfloat16, seed=3, device=dev)
    ep = random_intervals(H, 5, torch.full((B * S,), S), seed=3, device=dev)
    plan = consumer_plan(c, ep, q, k, v, backward=False)
    check_forward(run_forward, plan.view("forward"), q, k, v)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from . import consumer, masks
from .consumer import Consumer, ViewConfig, ViewRequest
from .geometry import PlanGeometry
from .payload import WORD_BITS, RowMajorLayout
from .plan import MaskPlan, PlanView
from .reference import attention_backward, attention_forward, build_plan
from .validation import validate_plan_inputs


class ReversedColumnsLayout(RowMajorLayout):
    """:class:`~maskplan_core.payload.RowMajorLayout`'s id and tile with each row's columns on the
    bits in reverse order: a layout that keeps another's ``layout_id`` but not its bit order, whose
    plans that layout's consumer must refuse (the signatures differ in ``payload.bit_order``)."""

    def element_coords(self):
        s, g, _, _ = super().element_coords()
        n = (self.tile_n - 1 - torch.arange(self.tile_n)).expand(self.tile_m, self.tile_n)
        return s, g, n // WORD_BITS, n % WORD_BITS


def cuda_arch_major() -> int | None:
    """The compute-capability major of the current CUDA device (9: Hopper, 10: Blackwell), or None
    without one: a consumer's GPU tests run where it is the consumer's."""
    return torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else None


#: max |O - O_ref| of a kernel forward against the fp32 reference on random normal inputs (fp32 and
#: fp64: a third party's kernels in those dtypes, whose sums run in another order than the
#: reference's)
FWD_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4, torch.float64: 1e-4}
#: per gradient of a kernel backward against the fp32 reference: relative L2 error, and max abs
#: error as a fraction of the reference's max magnitude
BWD_REL_L2 = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4, torch.float64: 1e-4}
BWD_MAX_ABS = {torch.bfloat16: 4e-2, torch.float16: 1e-2, torch.float32: 1e-4, torch.float64: 1e-4}
#: the varlen batch of the test cases: samples normal, q empty, k empty (its rows see nothing),
#: long, a tail that is not a multiple of 128
VARLEN_CU_Q = (0, 100, 100, 164, 964, 1300)
VARLEN_CU_K = (0, 300, 500, 500, 1400, 1533)
VARLEN_MAX_SEQLEN = (800, 900)


# -- problem generators ---------------------------------------------------------------------------
def qkv(shape_q, shape_k, dqk: int, dv: int, dtype: torch.dtype, seed: int = 0, *, device="cuda"):
    """Random normal ``q [*shape_q, dqk]``, ``k [*shape_k, dqk]``, ``v [*shape_k, dv]``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(*shape_q, dqk, device=device, dtype=dtype, generator=gen)
    k = torch.randn(*shape_k, dqk, device=device, dtype=dtype, generator=gen)
    v = torch.randn(*shape_k, dv, device=device, dtype=dtype, generator=gen)
    return q, k, v


#: how :func:`strided_qkv` lays q, k, v out
STRIDED_LAYOUTS = ("packed", "bhsd")
#: test id -> ``(layout, varlen)`` of the ``strided_inputs`` cases
STRIDED_CASES = {"packed": ("packed", False), "packed-varlen": ("packed", True), "bhsd": ("bhsd", False)}


def strided_qkv(layout: str, shape_q, shape_k, d: int, dtype: torch.dtype, seed: int = 0, *, device="cuda"):
    """Random normal ``q [*rows_q, Hq, d]``, ``k`` and ``v [*rows_k, Hkv, d]`` (``shape_q = (*rows_q,
    Hq)``) as strided views: ``"packed"``, slices along the heads of one ``[*rows, Hq + 2 Hkv, d]``
    tensor (a fused QKV projection's output; q gets one of its own where its rows differ from k's);
    ``"bhsd"``, ``[B, H, S, d]`` tensors transposed to BSHD."""
    gen = torch.Generator(device=device).manual_seed(seed)
    *rows_q, hq = shape_q
    *rows_k, hkv = shape_k

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    if layout == "packed":
        width = hq + 2 * hkv
        packed_k = randn(*rows_k, width, d)
        packed_q = packed_k if rows_q == rows_k else randn(*rows_q, width, d)
        return packed_q[..., :hq, :], packed_k[..., hq : hq + hkv, :], packed_k[..., hq + hkv :, :]
    if layout == "bhsd":
        (b, s), (bk, sk) = rows_q, rows_k
        q, k, v = randn(b, hq, s, d), randn(bk, hkv, sk, d), randn(bk, hkv, sk, d)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    raise ValueError(f"layout must be one of {STRIDED_LAYOUTS}, got {layout!r}")


def random_intervals(hmask: int, nfunc: int, row_k_len: torch.Tensor, seed: int = 0, *, device="cuda"):
    """Endpoints ``[hmask, nfunc, rows]``: sorted uniform draws in ``[0, k_len]`` of each row."""
    gen = torch.Generator(device=device).manual_seed(seed)
    k_len = row_k_len.to(device, torch.float64)
    u = torch.rand(hmask, nfunc, k_len.numel(), device=device, generator=gen, dtype=torch.float64)
    ep = torch.floor(u * (k_len + 1)).clamp(max=k_len).to(torch.int32)
    return ep.sort(dim=1).values.contiguous()


def resolve_view(
    consumer: Consumer, g: PlanGeometry, direction: str, pack_gqa: bool | None = None
) -> ViewConfig:
    """``consumer.resolve`` of the request the facade makes for ``g`` on the consumer's first arch
    family (and compute capability, where it lists them)."""
    capabilities = getattr(consumer, "compute_capabilities", (None,))
    request = ViewRequest.for_geometry(
        g, direction, consumer.arch_families[0], compute_capability=capabilities[0], pack_gqa=pack_gqa
    )
    return consumer.resolve(request)


def reference_plan(
    mask_func,
    q,
    k,
    v,
    *,
    consumer: str,
    forward: Callable[[PlanGeometry], ViewConfig],
    backward: Callable[[PlanGeometry], ViewConfig] | None = None,
    **varlen,
) -> MaskPlan:
    """A plan built by the reference planner (on the tensors' device) with the views a consumer
    resolves for the problem: ``forward(geometry)`` (and ``backward(geometry)``) give them."""
    g = validate_plan_inputs(mask_func, q, k, v, **varlen)
    return build_plan(mask_func, g, forward(g), backward(g) if backward else None, consumer)


def consumer_plan(consumer: Consumer, mask_func, q, k, v, *, backward: bool = True, **varlen) -> MaskPlan:
    """:func:`reference_plan` with the views ``consumer`` resolves for the facade's requests
    (:func:`resolve_view`): forward and, unless ``backward=False``, backward."""
    return reference_plan(
        mask_func, q, k, v, consumer=consumer.name,
        forward=lambda g: resolve_view(consumer, g, "forward"),
        backward=(lambda g: resolve_view(consumer, g, "backward")) if backward else None, **varlen,
    )  # fmt: skip


def thd(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """:func:`maskplan_core.consumer.thd` of each of ``tensors``."""
    return [consumer.thd(t) for t in tensors]


# -- the forward check ----------------------------------------------------------------------------
def check_forward(run: Callable, view: PlanView, q, k, v, *, scale: float | None = None) -> None:
    """Run ``run(view, q, k, v, softmax_scale=, return_max_logit=True, out=, lse=)`` (a consumer's
    ``run_forward``; bind other options with ``functools.partial``) on THD views of ``q/k/v`` into
    NaN-poisoned outputs, and compare with the fp32 reference on the same view: every element
    written, O within :data:`FWD_TOLERANCE`, LSE = -inf exactly and O = 0 on rows with no visible
    key, LSE and max logit within 1e-2."""
    g = view.geometry
    q3, k3, v3 = thd(q, k, v)
    scale = 1.0 / math.sqrt(g.head_dim_qk) if scale is None else scale
    out = torch.full((g.total_q, g.num_heads_q, g.head_dim_v), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((g.num_heads_q, g.total_q), float("nan"), dtype=torch.float32, device=q.device)
    out, lse, max_logit = run(view, q3, k3, v3, softmax_scale=scale, return_max_logit=True, out=out, lse=lse)
    if q.is_cuda:
        torch.cuda.synchronize(q.device)
    ref_out, ref_lse, ref_max = attention_forward(
        view, q3, k3, v3, softmax_scale=scale, return_max_logit=True
    )

    assert not torch.isnan(out).any(), f"{int(torch.isnan(out).sum())} O elements unwritten or NaN"
    assert not torch.isnan(lse).any(), f"{int(torch.isnan(lse).sum())} LSE elements unwritten or NaN"
    compare_forward("", (out, lse, max_logit), (ref_out, ref_lse, ref_max))
    empty = torch.isinf(ref_lse)
    assert (out.float()[empty.transpose(0, 1)] == 0).all(), "rows with no visible key must have O = 0"


def compare_forward(name: str, got, want) -> None:
    """``got = (out, lse, max_logit)`` of a kernel forward against ``want``, the fp32 reference's in
    the same layout: O within :data:`FWD_TOLERANCE`, LSE = -inf exactly on rows with no visible key
    and within 1e-2 elsewhere, max logit within 1e-2. ``name`` prefixes the messages."""
    out, lse, max_logit = got
    ref_out, ref_lse, ref_max = want
    tol = FWD_TOLERANCE[out.dtype]
    err = (out.float() - ref_out).abs().max().item()
    assert err <= tol, f"{name}max |O - ref| = {err:.3e} > {tol}"
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty), (
        f"{name}LSE = -inf exactly on rows with no visible key"
    )
    lse_err = (lse[~empty] - ref_lse[~empty]).abs().max().item() if (~empty).any() else 0.0
    assert lse_err <= 1e-2, f"{name}max |LSE - ref| = {lse_err:.3e}"
    assert torch.allclose(max_logit, ref_max, atol=1e-2, rtol=1e-3, equal_nan=False), (
        name,
        max_logit,
        ref_max,
    )


# -- the backward check ---------------------------------------------------------------------------
def poison_allocator(device, nbytes: int = 256 << 20) -> None:
    """Hand the CUDA caching allocator a NaN-filled block so the next workspace allocations start as
    NaN (nothing on a CPU device)."""
    device = torch.device(device)
    if device.type == "cuda":
        block = torch.full((nbytes // 4,), float("nan"), dtype=torch.float32, device=device)
        del block


def _run_backward_poisoned(
    run: Callable, view: PlanView, q3, k3, v3, out, lse, dout, dlse, scale, deterministic
):
    g = view.geometry
    device = q3.device
    grads = [
        torch.full((g.total_q, g.num_heads_q, g.head_dim_qk), float("nan"), dtype=q3.dtype, device=device),
        torch.full((g.total_k, g.num_heads_kv, g.head_dim_qk), float("nan"), dtype=q3.dtype, device=device),
        torch.full((g.total_k, g.num_heads_kv, g.head_dim_v), float("nan"), dtype=q3.dtype, device=device),
    ]
    poison_allocator(device)
    dq, dk, dv = run(
        view, q3, k3, v3, out, lse, dout, dlse, softmax_scale=scale, deterministic=deterministic,
        dq=grads[0], dk=grads[1], dv=grads[2],
    )  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return dq, dk, dv


def compare_gradient(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` fully written and within :data:`BWD_REL_L2` / :data:`BWD_MAX_ABS` of ``want`` (exactly 0
    where the reference is 0 everywhere)."""
    assert not torch.isnan(got).any(), f"{name}: {int(torch.isnan(got).sum())} elements unwritten or NaN"
    got, want = got.float(), want.float()
    scale = want.abs().max().item()
    if scale == 0:
        assert (got == 0).all(), f"{name} must be 0"
        return
    err = (got - want).abs().max().item()
    rel = ((got - want).norm() / want.norm()).item()
    rel_tol, abs_tol = BWD_REL_L2[dtype], BWD_MAX_ABS[dtype]
    assert rel <= rel_tol, f"{name}: relative L2 error {rel:.3e} > {rel_tol} (max abs {err:.3e})"
    assert err <= abs_tol * scale, f"{name}: max |err| = {err:.3e} > {abs_tol} * {scale:.3e}"


def unseen_keys(plan: MaskPlan) -> torch.Tensor | None:
    """bool ``[total_k, Hkv]``: keys that no query of any head in their kv group sees (None with
    per-head masks: a key may be seen by one head of its group only)."""
    g = plan.geometry
    if g.mask_heads > 1:
        return None
    dense = plan.view("backward").to_dense()  # [Hmask, total_q, Sk]
    cu_q, cu_k = g.cu_seqlens_q.tolist(), g.cu_seqlens_k.tolist()
    seen = torch.zeros(g.total_k, dtype=torch.bool, device=dense.device)
    for b in range(len(cu_q) - 1):
        k_len = cu_k[b + 1] - cu_k[b]
        seen[cu_k[b] : cu_k[b + 1]] = dense[0, cu_q[b] : cu_q[b + 1], :k_len].any(0)
    return (~seen)[:, None].expand(g.total_k, g.num_heads_kv)


def backward_inputs(plan: MaskPlan, q3, k3, v3, scale: float, *, seed: int = 0, with_dlse: bool = False):
    """``(out, lse, dout, dlse)`` a backward runs on for THD ``q3/k3/v3``: O and LSE from the fp32
    reference forward of the plan (O rounded to q's dtype), a random ``dout`` and, ``with_dlse``, a
    random ``dlse`` (else None), both from ``seed``. The ``dlse`` of a row without a visible key
    is NaN, as torch's ``logsumexp`` backward leaves it where every merged LSE is -inf (a ring
    attention's merge): such a row's gradients are still 0."""
    ref_out, lse, _ = attention_forward(plan.view("forward"), q3, k3, v3, softmax_scale=scale)
    out = ref_out.to(q3.dtype)
    gen = torch.Generator(device=q3.device).manual_seed(seed + 1000)
    dout = torch.randn(out.shape, device=q3.device, dtype=q3.dtype, generator=gen)
    dlse = None
    if with_dlse:
        dlse = torch.randn(lse.shape, device=q3.device, dtype=torch.float32, generator=gen)
        dlse = dlse.masked_fill(torch.isneginf(lse), float("nan"))
    return out, lse, dout, dlse


def check_backward(
    run: Callable, plan: MaskPlan, q, k, v, *, scale: float | None = None, deterministic: bool = False,
    with_dlse: bool = False, repeats: int = 1, seed: int = 0,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Run ``run(view, q, k, v, out, lse, dout, dlse, softmax_scale=, deterministic=, dq=, dk=, dv=)``
    (a consumer's ``run_backward``) ``repeats`` times on the plan's backward view, with O and LSE
    from the fp32 reference forward (O rounded to the input dtype) and a random ``dout`` (and
    ``dlse``), into NaN-poisoned gradients with a NaN-poisoned workspace, and compare with the fp32
    reference backward: every element written, each gradient within :func:`compare_gradient`'s
    tolerance, dq = 0 exactly on queries without a visible key, dk = dv = 0 exactly on keys no
    query sees, and (``repeats > 1``) bit-identical runs. Returns the runs' ``(dq, dk, dv)``."""
    g = plan.geometry
    q3, k3, v3 = thd(q, k, v)
    scale = 1.0 / math.sqrt(g.head_dim_qk) if scale is None else scale
    out, lse, dout, dlse = backward_inputs(plan, q3, k3, v3, scale, seed=seed, with_dlse=with_dlse)
    view = plan.view("backward")
    ref = attention_backward(
        view, q3.float(), k3.float(), v3.float(), out.float(), lse, dout.float(), dlse, softmax_scale=scale
    )
    runs = [
        _run_backward_poisoned(run, view, q3, k3, v3, out, lse, dout, dlse, scale, deterministic)
        for _ in range(repeats)
    ]
    for name, got, want in zip(("dq", "dk", "dv"), runs[0], ref, strict=True):
        compare_gradient(name, got, want, q.dtype)
    # exact zeros: queries without a visible key, keys that no query sees
    empty_q = torch.isinf(lse).transpose(0, 1)  # [total_q, Hq]
    assert (runs[0][0][empty_q] == 0).all(), "dq of a query without a visible key must be 0"
    unseen = unseen_keys(plan)
    if unseen is not None:
        assert (runs[0][1][unseen] == 0).all() and (runs[0][2][unseen] == 0).all(), "dk/dv of unseen keys"
    for other in runs[1:]:  # deterministic: bit-identical run to run
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], other, strict=True):
            assert torch.equal(a, b), f"{name} differs between runs ({int((a != b).sum())} elements)"
    return runs


# -- the test cases both consumers run -------------------------------------------------------------
def varlen_args(device) -> dict:
    """The varlen keyword arguments of the test cases' varlen batch (:data:`VARLEN_CU_Q`, ...)."""
    return {
        "cu_seqlens_q": torch.tensor(VARLEN_CU_Q, dtype=torch.int32, device=device),
        "cu_seqlens_k": torch.tensor(VARLEN_CU_K, dtype=torch.int32, device=device),
        "max_seqlen_q": VARLEN_MAX_SEQLEN[0],
        "max_seqlen_k": VARLEN_MAX_SEQLEN[1],
    }


def varlen_k_len() -> torch.Tensor:
    """The K length of each query row of the varlen batch (CPU, ``[total_q]``)."""
    cu_q, cu_k = torch.tensor(VARLEN_CU_Q), torch.tensor(VARLEN_CU_K)
    return (cu_k[1:] - cu_k[:-1]).repeat_interleave(cu_q[1:] - cu_q[:-1])


class _Cases:
    def __init__(self, check: Callable, device):
        self.check = check
        self.device = torch.device(device)

    def qkv(self, *args, **kwargs):
        return qkv(*args, device=self.device, **kwargs)

    def random_intervals(self, *args, **kwargs):
        return random_intervals(*args, device=self.device, **kwargs)

    def strided_problem(self, layout: str, varlen: bool, d: int = 128):
        """``(mask_func, q, k, v, varlen kwargs or None)``: GQA 4 / 2, head dim ``d``, random intervals,
        with q, k, v strided views (:func:`strided_qkv`; ``"bhsd"`` at B = 1, where its THD view is one)."""
        if varlen:
            shapes = ((VARLEN_CU_Q[-1], 4), (VARLEN_CU_K[-1], 2))
            ep, extra = self.varlen_mask("random", seed=15), varlen_args(self.device)
        else:
            B, S = (1, 900) if layout == "bhsd" else (2, 700)
            shapes = ((B, S, 4), (B, S, 2))
            ep, extra = self.random_intervals(1, 5, torch.full((B * S,), S), seed=15), None
        q, k, v = strided_qkv(layout, *shapes, d, torch.bfloat16, seed=15, device=self.device)
        assert not any(t.is_contiguous() for t in thd(q, k, v))
        return ep, q, k, v, extra

    def per_sample_problem(self, seqlen: int, d: int = 128):
        """``(mask_func, q, k, v)``: 2 samples of ``seqlen``, GQA 4 / 2, random intervals, q, k, v
        ``[B, H, S, d]`` tensors transposed to BSHD, which have no THD view (the kernels read them
        per sample where ``seqlen`` is a multiple of their granule, else take copies)."""
        B = 2
        ep = self.random_intervals(1, 5, torch.full((B * seqlen,), seqlen), seed=17)
        shapes = ((B, seqlen, 4), (B, seqlen, 2))
        q, k, v = strided_qkv("bhsd", *shapes, d, torch.bfloat16, seed=17, device=self.device)
        return ep, q, k, v

    def causal_mask(self, sq, sk=None, *, batch=1):
        return masks.causal(sq, sk, batch=batch, device=self.device)

    # -- the problems both directions' cases take: ``(mask_func, q, k, v)`` -----------------------
    def causal_problem(self, dtype, dims):
        B, S, H = 2, 1000, 4
        return self.causal_mask(S, batch=B), *self.qkv((B, S, H), (B, S, H), *dims, dtype)

    def per_head_problem(self, dtype, dims=(128, 128)):
        """5 random endpoints per row, a mask head per q head (Hmask = Hq)."""
        B, S, H = 2, 700, 4
        ep = self.random_intervals(H, 5, torch.full((B * S,), S), seed=3)
        return ep, *self.qkv((B, S, H), (B, S, H), *dims, dtype, seed=3)

    def empty_rows_problem(self, q_block: int):
        """Causal, with every third row and a whole Q block of ``q_block`` rows of sample 1 (a task
        with no block at all) seeing nothing."""
        B, S, H, D = 2, 300, 2, 128
        ep = self.causal_mask(S, batch=B).clone()
        ep[..., ::3] = 0
        ep[..., S : S + q_block] = 0
        return ep, *self.qkv((B, S, H), (B, S, H), D, D, torch.bfloat16, seed=4)

    def all_full_problem(self):
        """S a multiple of every tile size: every block is full."""
        B, S, H, D = 1, 512, 2, 128
        full = torch.full((1, 1, B * S), S, dtype=torch.int32, device=self.device)
        return full, *self.qkv((B, S, H), (B, S, H), D, D, torch.bfloat16, seed=5)

    def sq_ne_sk_problem(self, sq, sk):
        q, k, v = self.qkv((2, sq, 2), (2, sk, 2), 128, 128, torch.bfloat16, seed=6)
        return self.causal_mask(sq, sk, batch=2), q, k, v

    def gqa_problem(self, hq, hkv, hmask, dims):
        B, S = 2, 600
        ep = self.random_intervals(hmask, 3, torch.full((B * S,), S), seed=7)
        return ep, *self.qkv((B, S, hq), (B, S, hkv), *dims, torch.bfloat16, seed=7)

    def varlen_problem(self, kind, dtype, dims, seed):
        """``(mask_func, q, k, v, varlen kwargs)`` on the varlen batch, GQA 4 / 2."""
        q, k, v = self.qkv((VARLEN_CU_Q[-1], 4), (VARLEN_CU_K[-1], 2), *dims, dtype, seed=seed)
        return self.varlen_mask(kind, seed=seed), q, k, v, varlen_args(self.device)

    def head_dims_problem(self, dqk, dv, kind, dtype, seed):
        B, S, H = 2, 600, 2
        ep = (
            self.causal_mask(S, batch=B)
            if kind == "causal"
            else self.random_intervals(1, 5, torch.full((B * S,), S), seed=seed)
        )
        return ep, *self.qkv((B, S, H), (B, S, H), dqk, dv, dtype, seed=seed)

    def varlen_mask(self, kind: str, seed: int):
        """Endpoints on the varlen batch: bottom-right causal, or 5 random endpoints per row."""
        if kind == "causal":
            args = varlen_args(self.device)
            return masks.causal(cu_seqlens_q=args["cu_seqlens_q"], cu_seqlens_k=args["cu_seqlens_k"])
        return self.random_intervals(1, 5, varlen_k_len(), seed=seed)


class ForwardCases(_Cases):
    """The forward test cases of the consumers' GPU suites. ``check(mask_func, q, k, v, *, varlen=None,
    scale=None, **options)`` builds the suite's plan, runs :func:`check_forward` and returns the plan;
    ``run`` is the consumer's ``run_forward``. Options a case takes (``**options``) go to ``check``."""

    def __init__(self, check: Callable, run: Callable, device):
        super().__init__(check, device)
        self.run = run

    def causal(self, dtype, dims=(128, 128), **options):
        self.check(*self.causal_problem(dtype, dims), **options)

    def sliding_window(self, dtype):
        B, S, H, D = 2, 777, 2, 128
        q, k, v = self.qkv((B, S, H), (B, S, H), D, D, dtype, seed=1)
        self.check(masks.sliding_window(S, window_left=200, batch=B, device=self.device), q, k, v)

    def document(self, dtype):
        docs = [[100, 300, 13, 611], [1024]]
        q, k, v = self.qkv((2, 1024, 3), (2, 1024, 3), 128, 128, dtype, seed=2)
        self.check(masks.document(docs, causal=True, device=self.device), q, k, v)

    def random_multi_interval_per_head(self, dtype, dims=(128, 128), **options):
        self.check(*self.per_head_problem(dtype, dims), **options)

    def all_empty_rows(self):
        ep, q, k, v = self.empty_rows_problem(q_block=128)
        self.check(ep, q, k, v)
        self.check(torch.zeros_like(ep), q, k, v)  # nothing visible anywhere

    def all_full(self):
        plan = self.check(*self.all_full_problem())
        assert plan.view("forward").stats()["partial"] == 0

    def sq_ne_sk(self, sq, sk):
        self.check(*self.sq_ne_sk_problem(sq, sk))

    def gqa(self, hq, hkv, hmask):
        self.check(*self.gqa_problem(hq, hkv, hmask, (128, 128)))

    def varlen_with_empty_samples(self, dtype, kind, dims=(128, 128)):
        *problem, varlen = self.varlen_problem(kind, dtype, dims, seed=8)
        self.check(*problem, varlen=varlen)

    def head_dims(self, dqk, dv, kind):
        self.check(*self.head_dims_problem(dqk, dv, kind, torch.bfloat16, seed=9))

    def softmax_scale_and_reuse(self, new_value_scales=(0.05,)):
        """A plan is reused with new values and other scales; two launches agree bit for bit."""
        B, S, H, D = 1, 640, 2, 128
        q, k, v = self.qkv((B, S, H), (B, S, H), D, D, torch.bfloat16, seed=10)
        ep = masks.sliding_window(S, window_left=100, batch=B, device=self.device)
        plan = self.check(ep, q, k, v, scale=0.3)
        q2, k2, v2 = self.qkv((B, S, H), (B, S, H), D, D, torch.bfloat16, seed=11)
        for scale in new_value_scales:
            self.check(ep, q2, k2, v2, scale=scale)
        view = plan.view("forward")
        a = self.run(view, q.view(-1, H, D), k.view(-1, H, D), v.view(-1, H, D), softmax_scale=0.3)
        b = self.run(view, q.view(-1, H, D), k.view(-1, H, D), v.view(-1, H, D), softmax_scale=0.3)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    def strided_inputs(self, layout: str, varlen: bool = False, d: int = 128, **options):
        """q, k, v as strided views (:meth:`strided_problem`), which the kernels read in place: within
        tolerance of the reference, and bit for bit what contiguous copies of them give."""
        ep, q, k, v, extra = self.strided_problem(layout, varlen, d)
        view = self.check(ep, q, k, v, varlen=extra, **options).view("forward")
        strided = thd(q, k, v)
        a = self.run(view, *strided, softmax_scale=0.1, return_max_logit=True)
        b = self.run(view, *(t.contiguous() for t in strided), softmax_scale=0.1, return_max_logit=True)
        for name, x, y in zip(("out", "lse", "max_logit"), a, b, strict=True):
            assert torch.equal(x, y), f"{name} differs from the contiguous inputs' ({int((x != y).sum())})"

    def per_sample_inputs(self, seqlen: int, d: int = 128, **options):
        """q, k, v of 2 samples, ``[B, H, S, D]`` tensors transposed (:meth:`per_sample_problem`),
        given to the consumer as they are: within tolerance of the reference, and bit for bit what
        contiguous THD copies give. Returns ``(view, q, k, v)``."""
        ep, q, k, v = self.per_sample_problem(seqlen, d)
        view = self.check(ep, q, k, v, **options).view("forward")
        a = self.run(view, q, k, v, softmax_scale=0.1, return_max_logit=True)
        b = self.run(view, *thd(q, k, v), softmax_scale=0.1, return_max_logit=True)
        for name, x, y in zip(("out", "lse", "max_logit"), a, b, strict=True):
            assert torch.equal(x, y), f"{name} differs from the THD copies' ({int((x != y).sum())})"
        return view, q, k, v


class BackwardCases(_Cases):
    """The backward test cases of the consumers' GPU suites. ``check(mask_func, q, k, v, *, varlen=None,
    **options)`` builds the suite's plan (forward and backward views), runs :func:`check_backward`
    with ``options`` and returns ``(plan, runs)``; ``run`` is the consumer's ``run_backward``."""

    def __init__(self, check: Callable, run: Callable, device):
        super().__init__(check, device)
        self.run = run

    def causal(self, dtype, deterministic, d=128):
        self.check(*self.causal_problem(dtype, (d, d)), deterministic=deterministic)

    def random_multi_interval_per_head(self, dtype):
        self.check(*self.per_head_problem(dtype))

    def all_empty_rows(self, q_block: int):
        """``q_block``: the backward view's Q block size (a whole Q block of sample 1 sees nothing)."""
        ep, q, k, v = self.empty_rows_problem(q_block)
        self.check(ep, q, k, v)
        self.check(ep, q, k, v, deterministic=True, with_dlse=True)
        _, runs = self.check(torch.zeros_like(ep), q, k, v)  # nothing visible anywhere
        assert all((g == 0).all() for g in runs[0])

    def all_full(self):
        plan, _ = self.check(*self.all_full_problem(), deterministic=True, repeats=2)
        assert plan.view("backward").stats()["partial"] == 0

    def sq_ne_sk(self, sq, sk):
        self.check(*self.sq_ne_sk_problem(sq, sk))

    def gqa(self, hq, hkv, hmask, deterministic, dims=(128, 128)):
        self.check(*self.gqa_problem(hq, hkv, hmask, dims), deterministic=deterministic)

    def dlse_and_scale(self, dtype):
        """The forward's LSE received a gradient (dlse), with a non-default and a negative scale."""
        B, S, H, D = 2, 500, 2, 128
        q, k, v = self.qkv((B, S, H), (B, S, H), D, D, dtype, seed=8)
        ep = masks.sliding_window(S, window_left=150, batch=B, device=self.device)
        self.check(ep, q, k, v, with_dlse=True, scale=0.3)
        self.check(ep, q, k, v, with_dlse=True, scale=-0.05)

    def varlen_with_empty_samples(self, kind, dtype=torch.bfloat16, dims=(128, 128)):
        *problem, varlen = self.varlen_problem(kind, dtype, dims, seed=9)
        self.check(*problem, varlen=varlen)

    def head_dims(self, dqk, dv, kind, dtype=torch.bfloat16, **options):
        self.check(*self.head_dims_problem(dqk, dv, kind, dtype, seed=10), **options)

    def kv_head_splits(self, dqk, dv, runs: dict):
        """MQA 8/1 with each kv head's q heads split over several items (``runs``: split -> the
        consumer's ``run_backward`` forcing it; this small a problem takes 8 by default, a q head an
        item): every split matches the reference, and on the same inputs the deterministic dQ is
        bit-identical across them (its contributions and their order do not depend on the split;
        dK / dV sum the parts, so they differ in rounding only). The same inputs: the reference
        forward behind :func:`check_backward`'s O and LSE adds with ``index_add_``, whose CUDA
        order varies from call to call. Returns the plan."""
        B, S = 2, 600
        q, k, v = self.qkv((B, S, 8), (B, S, 1), dqk, dv, torch.bfloat16, seed=21)
        plan, _ = self.check(self.random_intervals(1, 3, torch.full((B * S,), S), seed=21), q, k, v)
        view, scale, q3, k3, v3 = plan.view("backward"), dqk**-0.5, *thd(q, k, v)
        inputs = backward_inputs(plan, q3, k3, v3, scale)
        dqs = []
        for run in runs.values():
            check_backward(run, plan, q, k, v, deterministic=True)
            dqs.append(run(view, q3, k3, v3, *inputs, softmax_scale=scale, deterministic=True)[0])
        assert all(torch.equal(dqs[0], dq) for dq in dqs[1:]), "dq differs between splits"
        return plan

    def deterministic_bit_identical(self, dtype):
        """Three runs of deterministic mode give bit-identical dq/dk/dv (varlen, GQA, per-head masks,
        partial and full blocks, a long sample so many K blocks race for each Q block)."""
        H, Hkv, D = 4, 2, 128
        q, k, v = self.qkv((VARLEN_CU_Q[-1], H), (VARLEN_CU_K[-1], Hkv), D, D, dtype, seed=11)
        ep = self.random_intervals(H, 5, varlen_k_len(), seed=11)
        varlen = varlen_args(self.device)
        self.check(ep, q, k, v, varlen=varlen, deterministic=True, with_dlse=True, repeats=3)
        B, S = 1, 4096
        q, k, v = self.qkv((B, S, H), (B, S, Hkv), D, D, dtype, seed=12)
        self.check(self.causal_mask(S, batch=B), q, k, v, deterministic=True, repeats=3)

    def strided_inputs(self, layout: str, varlen: bool = False, d: int = 128):
        """q, k, v as strided views (:meth:`strided_problem`), which the kernels read in place: within
        tolerance of the reference, and (deterministic mode) bit for bit what contiguous copies give."""
        ep, q, k, v, extra = self.strided_problem(layout, varlen, d)
        plan, _ = self.check(ep, q, k, v, varlen=extra)
        # one O / LSE / dO for both runs (the fp32 reference on the GPU is not bit-repeatable)
        strided = thd(q, k, v)
        out, lse, dout, _ = backward_inputs(plan, *strided, 0.1, seed=16)
        view = plan.view("backward")
        runs = [
            self.run(view, *qkv3, out, lse, dout, None, softmax_scale=0.1, deterministic=True)
            for qkv3 in (strided, [t.contiguous() for t in strided])
        ]
        for name, x, y in zip(("dq", "dk", "dv"), *runs, strict=True):
            assert torch.equal(x, y), f"{name} differs from the contiguous inputs' ({int((x != y).sum())})"

    def per_sample_inputs(self, seqlen: int, d: int = 128):
        """q, k, v of 2 samples, ``[B, H, S, D]`` tensors transposed (:meth:`per_sample_problem`),
        given to the consumer as they are: within tolerance of the reference, and (deterministic
        mode) bit for bit what contiguous THD copies give. Returns ``(view, q, k, v)``."""
        ep, q, k, v = self.per_sample_problem(seqlen, d)
        plan, _ = self.check(ep, q, k, v)
        copies = thd(q, k, v)
        out, lse, dout, _ = backward_inputs(plan, *copies, 0.1, seed=18)
        view = plan.view("backward")
        runs = [
            self.run(view, *qkv, out, lse, dout, None, softmax_scale=0.1, deterministic=True)
            for qkv in ((q, k, v), copies)
        ]
        for name, x, y in zip(("dq", "dk", "dv"), *runs, strict=True):
            assert torch.equal(x, y), f"{name} differs from the THD copies' ({int((x != y).sum())})"
        return view, q, k, v

    def small_for_sanitizer(self, dims=(128, 128)):
        """A small case for ``compute-sanitizer --tool memcheck|racecheck|synccheck``."""
        B, S, H = 1, 200, 2
        q, k, v = self.qkv((B, S, H), (B, S, 1), *dims, torch.bfloat16, seed=14)
        ep = self.causal_mask(S, batch=B)
        self.check(ep, q, k, v)
        self.check(ep, q, k, v, deterministic=True)


__all__ = [
    "BWD_MAX_ABS",
    "BWD_REL_L2",
    "FWD_TOLERANCE",
    "STRIDED_CASES",
    "STRIDED_LAYOUTS",
    "VARLEN_CU_K",
    "VARLEN_CU_Q",
    "VARLEN_MAX_SEQLEN",
    "BackwardCases",
    "ForwardCases",
    "backward_inputs",
    "check_backward",
    "check_forward",
    "compare_forward",
    "compare_gradient",
    "consumer_plan",
    "cuda_arch_major",
    "poison_allocator",
    "qkv",
    "random_intervals",
    "reference_plan",
    "resolve_view",
    "strided_qkv",
    "thd",
    "unseen_keys",
    "varlen_args",
    "varlen_k_len",
]
