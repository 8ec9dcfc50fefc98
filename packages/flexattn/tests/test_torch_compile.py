"""``flex_attn_func`` as ``torch.library`` custom ops: registration, fake tensors, ``torch.compile``.

CPU tensors, the reference consumer. ``torch.compile`` runs with the ``aot_eager`` backend (Dynamo +
AOTAutograd, which is what the custom ops must survive) except one inductor test marked ``slow``
(~25 s cold on the 2-core CI machine, ~6 s with a warm inductor cache).
"""

from __future__ import annotations

import gc
import operator

import pytest
import torch
from consumer_spy import record_calls
from torch._subclasses.fake_tensor import FakeTensorMode

import flexattn
from flexattn import InputValueError, PlanBindingError, masks
from maskplan_core import MaskPlan
from maskplan_core.plan import plan_for_handle

B, S, H, HKV, D = 2, 72, 4, 2, 16
# varlen: q lengths (50, 0, 40), k lengths (30, 20, 70)
CU_Q, CU_K = [0, 50, 50, 90], [0, 30, 50, 120]


def fixed_case(dtype=torch.float64, requires_grad=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, S, H, D), (B, S, HKV, D), (B, S, HKV, D))
    q, k, v = (torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes)
    q, k, v = (t.requires_grad_(requires_grad) for t in (q, k, v))
    mask = masks.sliding_window(S, window_left=20, batch=B)
    return flexattn.create_mask_plan(mask, q, k, v), (q, k, v), {}


def varlen_case(dtype=torch.float64, requires_grad=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(CU_Q[-1], H, D, generator=gen, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(CU_K[-1], HKV, D, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    q, k, v = (t.requires_grad_(requires_grad) for t in (q, k, v))
    k_len = torch.tensor([30] * 50 + [70] * 40)
    ep = torch.stack([k_len // 3, k_len // 2, k_len]).unsqueeze(0).to(torch.int32).contiguous()
    args = dict(
        cu_seqlens_q=torch.tensor(CU_Q, dtype=torch.int32),
        cu_seqlens_k=torch.tensor(CU_K, dtype=torch.int32),
        max_seqlen_q=50,
        max_seqlen_k=70,
    )
    return flexattn.create_mask_plan(ep, q, k, v, **args), (q, k, v), args


CASES = {"fixed": fixed_case, "varlen": varlen_case}


# --------------------------------------------------------------------------------------------------
# registration
# --------------------------------------------------------------------------------------------------


def test_ops_are_registered_with_their_schemas():
    fwd, bwd = torch.ops.flexattn.fwd.default, torch.ops.flexattn.bwd.default
    assert [a.name for a in fwd._schema.arguments] == [
        "q", "k", "v", "plan", "scale", "training", "deterministic", "want_max",
    ]  # fmt: skip
    assert len(fwd._schema.returns) == 3 and len(bwd._schema.returns) == 3
    assert "Tensor? dlse" in str(bwd._schema)
    assert not any(a.alias_info for a in (*fwd._schema.arguments, *bwd._schema.arguments))
    # a CUDA graph replay would not see a new plan behind the same handle input: inductor must run
    # the ops outside its CUDA graphs
    assert all(torch.Tag.cudagraph_unsafe in op.tags for op in (fwd, bwd))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("want_max", [False, True])
def test_opcheck_forward(case, want_max):
    plan, qkv, _ = CASES[case]()
    q, k, v = (t.detach().requires_grad_() for t in qkv)  # the caller's tensors, as flex_attn_func passes
    args = (q, k, v, plan.handle_tensor, 0.3, True, False, want_max)
    torch.library.opcheck(torch.ops.flexattn.fwd.default, args)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("with_dlse", [False, True])
def test_opcheck_backward(case, with_dlse):
    plan, qkv, _ = CASES[case]()
    q, k, v = (t.detach() for t in qkv)
    out, lse, _ = torch.ops.flexattn.fwd(q, k, v, plan.handle_tensor, 0.3, True, False, False)
    gen = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    dlse = torch.randn(lse.shape, generator=gen, dtype=lse.dtype) if with_dlse else None
    args = (q, k, v, out, lse, dout, dlse, plan.handle_tensor, 0.3, False)
    torch.library.opcheck(torch.ops.flexattn.bwd.default, args)


def test_plan_handles_are_unique_and_weak():
    plan, qkv, _ = fixed_case(requires_grad=False)
    other, _, _ = fixed_case(requires_grad=False)
    assert plan.handle != other.handle and plan_for_handle(plan.handle) is plan
    assert int(plan.handle_tensor) == plan.handle and plan.handle_tensor.dtype == torch.int64
    handle, handle_tensor = other.handle, other.handle_tensor
    del other
    gc.collect()
    with pytest.raises(InputValueError, match=f"handle {handle}"):
        plan_for_handle(handle)
    with pytest.raises(InputValueError, match="garbage-collected"):
        torch.ops.flexattn.fwd(*(t.detach() for t in qkv), handle_tensor, 0.25, False, False, False)


_FIRST_HANDLE_SCRIPT = """
import torch, flexattn
q = torch.randn(1, 32, 1, 8)
print(flexattn.create_mask_plan(flexattn.masks.causal(32), q, q, q).handle)
"""


def test_processes_number_their_plans_apart():
    """A handle that leaves its process (a torch.export'ed graph keeps it as a constant) must name
    no plan of another process, which would then run with that plan's mask: two processes' first
    plans get different handles."""
    import subprocess
    import sys

    firsts = set()
    for _ in range(2):
        run = [sys.executable, "-c", _FIRST_HANDLE_SCRIPT]
        proc = subprocess.run(run, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        firsts.add(int(proc.stdout.split()[-1]))
    assert len(firsts) == 2, firsts


# --------------------------------------------------------------------------------------------------
# fake tensors: shapes and dtypes without running anything
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fake_tensor_shapes_and_dtypes_match_the_real_call(case, dtype):
    plan, (q, k, v), _ = CASES[case](dtype=dtype)
    real = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True, return_max_logit=True)
    real[0].sum().backward()
    real_grads = [t.grad for t in (q, k, v)]
    detached = [t.detach() for t in (q, k, v)]
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t).requires_grad_() for t in detached)
        fake = flexattn.flex_attn_func(fq, fk, fv, mask_plan=plan, return_lse=True, return_max_logit=True)
        fake[0].sum().backward()
        fake_grads = [t.grad for t in (fq, fk, fv)]
    for r, f in zip((*real, *real_grads), (*fake, *fake_grads), strict=True):
        assert type(f).__name__ == "FakeTensor"
        assert (f.shape, f.dtype, f.device) == (r.shape, r.dtype, r.device)
    assert fake[0].requires_grad and not fake[2].requires_grad  # max logit is not differentiable


@pytest.mark.parametrize("how", ["mode", "tensors"])
def test_plans_are_not_built_from_fake_tensors(how):
    """The planner reads values: under a FakeTensorMode (or from fake tensors made in one) the
    build is refused with the library's error, and leaves nothing behind that breaks a later real
    build of the same shape (a fake prefix in the shared cache used to)."""
    mask = masks.causal(40, batch=2)
    q = torch.randn(2, 40, 2, 16)
    with pytest.raises(flexattn.UnsupportedCallError, match="built from real tensors") as info:
        with FakeTensorMode() as mode:
            fq = mode.from_tensor(q)
            if how == "mode":
                flexattn.create_mask_plan(mask, fq, fq, fq)
        if how == "tensors":
            flexattn.create_mask_plan(mask, fq, fq, fq)
    assert isinstance(info.value, RuntimeError)
    plan = flexattn.create_mask_plan(mask, q, q, q)
    assert torch.equal(plan.view("forward").to_dense()[0, :40], torch.ones(40, 40).tril().bool())


_EAGER_SCRIPT = """
import sys, torch, flexattn
from flexattn import masks
q = torch.randn(1, 64, 2, 16, dtype=torch.float64, requires_grad=True)
plan = flexattn.create_mask_plan(masks.causal(64), q, q, q)
out, lse = flexattn.flex_attn_func(q, q, q, mask_plan=plan, return_lse=True)
(out.sum() + lse.sum()).backward()
assert q.grad is not None
print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
"""


def test_eager_training_step_does_not_import_dynamo():
    """Eager calls bypass the custom ops, whose Dynamo-disabling shim imports torch._dynamo on its
    first call (seconds of first-call latency no eager program needs)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _EAGER_SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


# --------------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True): no graph break, same outputs and gradients as eager
# --------------------------------------------------------------------------------------------------


class AttentionBlock(torch.nn.Module):
    """Projections around ``flex_attn_func``: the shape of a transformer attention sublayer."""

    def __init__(self, varlen: bool, dtype=torch.float64):
        super().__init__()
        gen = torch.Generator().manual_seed(2)
        self.varlen = varlen
        self.wq = torch.nn.Parameter(torch.randn(H * D, H * D, generator=gen, dtype=dtype) / 8)
        self.wkv = torch.nn.Parameter(torch.randn(H * D, 2 * HKV * D, generator=gen, dtype=dtype) / 8)
        self.wo = torch.nn.Parameter(torch.randn(H * D, H * D, generator=gen, dtype=dtype) / 8)

    def forward(self, x, plan):
        lead = x.shape[:-1]
        q = (x @ self.wq).view(*lead, H, D)
        k, v = (x @ self.wkv).view(*lead, 2, HKV, D).unbind(-3)
        out, lse = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True)
        y = out.reshape(*lead, H * D) @ self.wo
        return y, lse


def _block_inputs(case: str):
    """Self-attention: a fixed sliding-window plan, or a varlen causal plan over documents (50, 0, 40)."""
    gen = torch.Generator().manual_seed(3)
    if case == "fixed":
        plan, _, _ = fixed_case()
        x = torch.randn(B, S, H * D, generator=gen, dtype=torch.float64)
        return AttentionBlock(varlen=False), x.requires_grad_(), plan
    lens = torch.tensor(CU_Q).diff()
    x = torch.randn(CU_Q[-1], H * D, generator=gen, dtype=torch.float64)
    local = torch.cat([torch.arange(n) for n in lens.tolist()])
    q = torch.empty(CU_Q[-1], H, D, dtype=torch.float64)
    kv = torch.empty(CU_Q[-1], HKV, D, dtype=torch.float64)
    cu = torch.tensor(CU_Q, dtype=torch.int32)
    plan = flexattn.create_mask_plan(
        (local + 1).view(1, 1, -1).to(torch.int32), q, kv, kv, cu_seqlens_q=cu, cu_seqlens_k=cu,
        max_seqlen_q=int(lens.max()), max_seqlen_k=int(lens.max()), build_backward=True,
    )  # fmt: skip
    return AttentionBlock(varlen=True), x.requires_grad_(), plan


def _step(module, x, plan):
    y, lse = module(x, plan)
    loss = y.square().sum() + lse[torch.isfinite(lse)].sum()
    grads = torch.autograd.grad(loss, (x, *module.parameters()))
    return y.detach(), lse.detach(), grads


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_block_matches_eager(case):
    module, x, plan = _block_inputs(case)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    want = _step(module, x, plan)
    got = _step(compiled, x, plan)
    for a, b in zip((want[0], want[1], *want[2]), (got[0], got[1], *got[2]), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_ops_take_strided_views_as_they_are(backend, monkeypatch):
    """k and v split from one projection reach the consumer as the same strided views in eager and
    compiled calls, forward and backward (the GPU kernels read such views in place: a compiled
    graph that made them contiguous would add copies)."""
    calls = record_calls(monkeypatch)
    module, x, plan = _block_inputs("fixed")
    if backend == "inductor":
        module, x = module.float(), x.detach().float().requires_grad_()
        plan = flexattn.create_mask_plan(
            masks.sliding_window(S, window_left=20, batch=B), *fixed_case(torch.float32)[1]
        )
    def kv_strides():
        return [(direction, args[2].stride(), args[3].stride()) for direction, args, _ in calls]

    _step(module, x, plan)
    eager = kv_strides()
    kv_rows = (2 * HKV * D, D, 1)  # the THD view of [B, S, 2, HKV, D] split along its 2
    assert eager == [("forward", kv_rows, kv_rows), ("backward", kv_rows, kv_rows)]
    calls.clear()
    torch._dynamo.reset()
    _step(torch.compile(module, fullgraph=True, backend=backend), x, plan)
    assert kv_strides() == eager


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_torch_deterministic_mode_makes_the_backward_deterministic(compiled, monkeypatch):
    """``torch.use_deterministic_algorithms(True)`` in force when the backward runs makes it add dQ
    in the plan's order whatever the call said (torch's rule for its own ops), eager and compiled;
    without it the call's ``deterministic`` holds."""
    calls = record_calls(monkeypatch)
    plan, (q, k, v), _ = fixed_case()

    def step(q, k, v, asked):
        return flexattn.flex_attn_func(q, k, v, mask_plan=plan, deterministic=asked).sum()

    run = torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step
    was = torch.are_deterministic_algorithms_enabled()
    try:
        for enabled, asked in ((False, False), (False, True), (True, False), (True, True)):
            torch.use_deterministic_algorithms(enabled)
            torch.autograd.grad(run(q, k, v, asked), (q, k, v))
    finally:
        torch.use_deterministic_algorithms(was)
    assert [kw["deterministic"] for direction, _, kw in calls if direction == "backward"] == [
        False, True, True, True
    ]  # fmt: skip


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_bshd_views_of_bhsd_reach_the_consumer_as_they_are(compiled, monkeypatch):
    """q, k, v transposed from ``[B, H, S, D]`` (what code applying RoPE in BHSD hands over) have no
    THD view at B > 1: they reach the consumer as those ``[B, S, H, D]`` views, forward and backward,
    eager and compiled (the SM90 kernels read them per sample), and give what contiguous copies give,
    gradients included."""
    calls = record_calls(monkeypatch)
    plan, (q, k, v), _ = fixed_case()
    bhsd = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]

    def attention(q, k, v):
        return flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True)

    run = torch.compile(attention, fullgraph=True, backend="aot_eager") if compiled else attention
    torch._dynamo.reset()
    out, lse = run(*(t.transpose(1, 2) for t in bhsd))
    grads = torch.autograd.grad(out.square().sum() + lse.sum(), bhsd)
    view = ((B, S, H, D), (H * S * D, D, S * D, 1))
    q_views = [(direction, args[1].shape, args[1].stride()) for direction, args, _ in calls]
    assert q_views == [("forward", *view), ("backward", *view)]
    copies = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in bhsd]
    want_out, want_lse = attention(*copies)
    want = torch.autograd.grad(want_out.square().sum() + want_lse.sum(), copies)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w.transpose(1, 2), rtol=0, atol=0)


class _PlanHolder(torch.nn.Module):
    """A model that keeps its batch's plan as an attribute (set before each call)."""

    def forward(self, q, k, v):
        return flexattn.flex_attn_func(q, k, v, mask_plan=self.plan) * 2


def _attend_twice(q, k, v, plan):
    return flexattn.flex_attn_func(q, k, v, mask_plan=plan) * 2


def _compiled_holding_the_plan(passed_as: str, graphs: list, **options):
    """``_attend_twice`` compiled (fullgraph, a backend counting into ``graphs``), taking the plan
    as an argument or, ``"module attribute"``, from a :class:`_PlanHolder` it is set on first."""

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    if passed_as == "argument":
        return torch.compile(_attend_twice, fullgraph=True, backend=counting_backend, **options)
    holder = _PlanHolder()
    compiled_holder = torch.compile(holder, fullgraph=True, backend=counting_backend, **options)

    def compiled(q, k, v, plan):
        holder.plan = plan
        return compiled_holder(q, k, v)

    return compiled


@pytest.mark.parametrize("passed_as", ["argument", "module attribute"])
def test_new_plans_of_one_geometry_reuse_the_graph(passed_as):
    """The plan enters the graph as its handle tensor, a graph input: every plan of one geometry
    runs the first graph, whether it is an argument or an attribute of the model (an int would be
    a constant, and each new plan a recompile)."""
    graphs = []
    compiled, attend = _compiled_holding_the_plan(passed_as, graphs), _attend_twice
    _, (q, k, v), _ = fixed_case(requires_grad=False)
    for window in (3, 9, 17, 33, 65, 5, 7, 11, 13, 15):  # more plans than Dynamo's recompile limit
        plan = flexattn.create_mask_plan(masks.sliding_window(S, window_left=window, batch=B), q, k, v)
        assert torch.equal(compiled(q, k, v, plan), attend(q, k, v, plan))
    assert len(graphs) == 1


@pytest.mark.parametrize("passed_as", ["argument", "module attribute"])
def test_plans_of_other_shapes_recompile_as_any_input_however_the_model_holds_them(passed_as):
    """Batches of other B and S (a plan each) take a few graphs with dynamic=True, the plan an
    argument or an attribute of the model alike. Held as an attribute, the plan's geometry is a
    constant to Dynamo, so the traced binding check and the output view once pinned q's sizes to it:
    a graph per shape, past Dynamo's recompile limit (then eager)."""
    graphs = []
    compiled, attend = _compiled_holding_the_plan(passed_as, graphs, dynamic=True), _attend_twice
    gen = torch.Generator().manual_seed(3)
    for b, s in ((2, 64), (2, 32), (3, 48), (4, 16), (1, 64), (2, 48), (3, 32), (2, 16), (4, 32), (3, 64)):
        q, k, v = (torch.randn(b, s, H, D, generator=gen, dtype=torch.float64) for _ in "qkv")
        plan = flexattn.create_mask_plan(masks.causal(s, batch=b), q, k, v)
        assert torch.equal(compiled(q, k, v, plan), attend(q, k, v, plan))
    assert len(graphs) <= 3


def test_batch_and_sequence_marked_dynamic_take_one_graph():
    """``torch._dynamo.mark_dynamic`` on B and S of q, k and v: one graph serves every batch shape
    (the traced binding check compared them with the plan's, which raised here)."""
    graphs = []
    compiled, attend = _compiled_holding_the_plan("argument", graphs), _attend_twice
    gen = torch.Generator().manual_seed(4)
    for b, s in ((2, 64), (3, 48), (4, 32), (2, 96)):
        q, k, v = (torch.randn(b, s, H, D, generator=gen, dtype=torch.float64) for _ in "qkv")
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(t, 1)
        plan = flexattn.create_mask_plan(masks.causal(s, batch=b), q, k, v)
        assert torch.equal(compiled(q, k, v, plan), attend(q, k, v, plan))
    assert len(graphs) == 1


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_float_scale_traces_without_a_graph_break(dynamic):
    """Dynamo turns a float argument that changes between calls (or any, with dynamic=True) into a
    SymFloat; the scale checks must take one (math.isfinite of a SymFloat broke the graph)."""
    plan, (q, k, v), _ = fixed_case()

    def attend(q, k, v, plan, scale):
        return flexattn.flex_attn_func(q, k, v, mask_plan=plan, softmax_scale=scale)

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for scale in (0.125, 0.25, 0.7):
        out, want = compiled(q, k, v, plan, scale), attend(q, k, v, plan, scale)
        assert torch.equal(out, want)
        grads, wanted = (torch.autograd.grad(o.sum(), (q, k, v)) for o in (out, want))
        assert all(torch.equal(a, b) for a, b in zip(grads, wanted, strict=True))


def test_compiled_vmap_runs_one_call_per_slice():
    """Compiled, ``torch.vmap`` reaches the custom op, not the eager Function that refuses it, and
    torch's batching fallback calls the op once per slice: every slice has the plan's geometry, so
    the result is the loop's, bit for bit."""
    plan, (q, k, v), _ = fixed_case(requires_grad=False)
    stacked = torch.stack([q, 2 * q, -q])

    def attend(qs):
        return torch.vmap(lambda x: flexattn.flex_attn_func(x, k, v, mask_plan=plan))(qs)

    torch._dynamo.reset()
    got = torch.compile(attend, backend="aot_eager")(stacked)
    assert torch.equal(got, torch.stack([flexattn.flex_attn_func(x, k, v, mask_plan=plan) for x in stacked]))


def _packed_documents(lens: tuple[int, ...], requires_grad: bool = True):
    """A varlen batch of causal documents ``lens`` (THD), its plan and tensors."""
    gen = torch.Generator().manual_seed(sum(lens))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    q = torch.randn(total, H, D, generator=gen, dtype=torch.float64, requires_grad=requires_grad)
    k, v = (
        torch.randn(total, HKV, D, generator=gen, dtype=torch.float64, requires_grad=requires_grad)
        for _ in "kv"
    )
    args = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    plan = flexattn.create_mask_plan(masks.causal(cu_seqlens_q=cu, cu_seqlens_k=cu), q, k, v, **args)
    return plan, (q, k, v)


@pytest.mark.parametrize("dynamic, graphs", [(True, 1), (None, 2)])
def test_varlen_batches_of_other_token_totals_reuse_the_graph(dynamic, graphs):
    """Packed documents take another token total every batch: one graph serves every total
    (dynamic=True; automatic dynamic shapes: after one recompile), more totals than Dynamo's
    recompile limit, forward and backward as eager. The fake forward once took the total as
    ``numel()``, a fixed number to Dynamo: a graph per total."""
    traced = []

    def counting_backend(gm, example_inputs):
        traced.append(gm)
        return gm.forward

    def attend(q, k, v, plan):
        out, lse = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True)
        return out * 2, lse

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, backend=counting_backend, dynamic=dynamic)
    for lens in (
        (30, 20),
        (25, 40),
        (10, 10, 50),
        (60,),
        (33, 17),
        (5, 70),
        (12, 12, 12),
        (80, 1),
        (9, 9, 9, 9),
    ):
        plan, qkv = _packed_documents(lens)
        got, want = compiled(*qkv, plan), attend(*qkv, plan)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        grads = torch.autograd.grad(got[0].sum(), qkv)
        torch.testing.assert_close(grads, torch.autograd.grad(want[0].sum(), qkv), rtol=0, atol=0)
    assert len(traced) == graphs


def test_a_compiled_varlen_call_refuses_a_plan_of_another_token_total():
    """A graph that serves every token total still refuses a plan made for another total than q's,
    on its first call and on later ones, with eager's error: the op checks the binding on the values
    it runs."""
    plan, qkv = _packed_documents((30, 20), requires_grad=False)
    other, _ = _packed_documents((30, 21), requires_grad=False)

    def attend(q, k, v, plan):
        return flexattn.flex_attn_func(q, k, v, mask_plan=plan)

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager", dynamic=True)
    compiled(*qkv, plan)
    sizes = r"q has shape \(50, 4, 16\) but the plan was built for \(51,"
    for _ in range(2):
        with pytest.raises(PlanBindingError, match=sizes):
            compiled(*qkv, other)
    with pytest.raises(PlanBindingError, match=sizes):
        attend(*qkv, other)


def test_compiled_errors_are_the_eager_errors():
    """A plan of other shapes than q's is refused by a compiled call with eager's error, sizes and
    all, with or without fullgraph, on a first call and after a good one: the traced code leaves
    the sizes to the op, which checks them on the values it runs (traced, the check was Dynamo's
    ``Unsupported`` quoting a message without sizes, and a guard on every size)."""
    _, (q, k, v), _ = fixed_case(requires_grad=False)
    plan = flexattn.create_mask_plan(masks.causal(S, batch=B), q, k, v)

    def attend(q, k, v, plan):
        return flexattn.flex_attn_func(q, k, v, mask_plan=plan)

    shorter = f"q has shape \\(2, 50, {H}, {D}\\) but the plan was built for \\(2, {S},"
    for fullgraph in (False, True):
        torch._dynamo.reset()
        with pytest.raises(PlanBindingError, match=shorter):
            compiled = torch.compile(attend, fullgraph=fullgraph, backend="aot_eager")
            compiled(q[:, :50].contiguous(), k, v, plan)
    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    compiled(q, k, v, plan)
    q1 = q.reshape(1, 2 * S, H, D)
    longer = flexattn.create_mask_plan(masks.causal(2 * S), q1, q1, q1)
    with pytest.raises(PlanBindingError, match=f"but the plan was built for \\(1, {2 * S},"):
        compiled(q, k, v, longer)


def test_compiled_calls_refuse_a_plan_of_another_rank_or_split():
    """What the traced code still checks, and what the op checks at run time: a fixed-length plan
    with THD q (another rank) is refused while tracing; a plan of another split of the same rows
    (2 x 64 against 1 x 128, whose THD views agree) by the op, and by the explicit API, which
    calls the consumer without the op, while tracing."""
    q, k, v = (torch.randn(2, 64, H, D, dtype=torch.float64) for _ in "qkv")
    plan = flexattn.create_mask_plan(masks.causal(64, batch=2), q, k, v)
    q1, k1, v1 = (t.reshape(1, 128, H, D) for t in (q, k, v))
    other_split = flexattn.create_mask_plan(masks.causal(128), q1, k1, v1)

    def attend(q, k, v, plan):
        return flexattn.flex_attn_func(q, k, v, mask_plan=plan)

    for fullgraph, error in ((False, PlanBindingError), (True, Exception)):  # Dynamo's Unsupported
        torch._dynamo.reset()
        with pytest.raises(error, match=r"q has (another )?shape"):
            torch.compile(attend, fullgraph=fullgraph, backend="aot_eager")(q.reshape(128, H, D), k, v, plan)
    torch._dynamo.reset()
    split = r"q has shape \(2, 64, 4, 16\) but the plan was built for \(1, 128,"
    with pytest.raises(PlanBindingError, match=split):
        torch.compile(attend, backend="aot_eager", dynamic=True)(q, k, v, other_split)

    out = torch.empty_like(q)
    fwd = flexattn.FlexAttentionFwd(q, k, v, out, plan)
    fwd.compile()

    def run(q, k, v, o, plan):
        fwd.execute(q, k, v, o, plan)
        return o

    torch._dynamo.reset()
    with pytest.raises(PlanBindingError, match=r"q has (another )?shape"):
        torch.compile(run, backend="eager")(q, k, v, out, other_split)


def test_plans_are_built_outside_the_compiled_region():
    """``create_mask_plan`` refuses to be traced (a plan is host-side work on the mask's values):
    with fullgraph, Dynamo's ``Unsupported`` quotes the reason; without, Dynamo breaks the graph
    there and the plan is built eagerly (traced, the planner broke the graph dozens of times)."""
    _, (q, k, v), _ = fixed_case(requires_grad=False)
    mask = masks.causal(S, batch=B)

    def attend(q, k, v):
        plan = flexattn.create_mask_plan(mask, q, k, v)
        return flexattn.flex_attn_func(q, k, v, mask_plan=plan)

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"create_mask_plan runs outside torch.compile"):
        torch.compile(attend, fullgraph=True, backend="aot_eager")(q, k, v)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(attend, backend="aot_eager")(q, k, v), attend(q, k, v))
    torch._dynamo.reset()
    assert torch._dynamo.explain(attend)(q, k, v).graph_break_count <= 1


def test_a_model_whose_layers_build_their_plans_is_compiled_around_the_builds():
    """No fullgraph, each layer building its plan: Dynamo breaks the graph at each build and compiles
    every layer's other ops (an exception raised from the traced build made Dynamo give up on every
    enclosing frame, and only the attention op itself was compiled)."""
    _, (q, k, v), _ = fixed_case(requires_grad=False)
    mask = masks.causal(S, batch=B)

    class Layer(torch.nn.Module):
        def forward(self, q, k, v):
            q = q * 2
            plan = flexattn.create_mask_plan(mask, q, k, v)
            return torch.sin(flexattn.flex_attn_func(q, k, v, mask_plan=plan))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(), Layer()])

        def forward(self, q, k, v):
            for layer in self.layers:
                q = layer(q, k, v)
            return q

    traced = []

    def backend(gm, example_inputs):
        traced.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    model = Model()
    torch._dynamo.reset()
    assert torch.equal(torch.compile(model, backend=backend)(q, k, v), model(q, k, v))
    assert {operator.mul, torch.ops.flexattn.fwd.default, torch.sin} <= set(traced)


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-breaks", "fullgraph"])
def test_compiled_forward_mode_is_refused(fullgraph):
    """``torch.compile`` of ``torch.func.jvp`` (also around a vmap) refuses, as eager does: the custom
    op's tangents came back zero, silently (the vmap's too, where Dynamo traced it)."""
    plan, (q, k, v), _ = fixed_case(requires_grad=False)

    def attend(x):
        return flexattn.flex_attn_func(x, k, v, mask_plan=plan)

    refusal = "no forward-mode derivative"
    for fn, x, match in ((attend, q, refusal), (torch.vmap(attend), q.unsqueeze(0), f"{refusal}|torch.vmap")):
        torch._dynamo.reset()
        compiled = torch.compile(
            lambda x, t, fn=fn: torch.func.jvp(fn, (x,), (t,)), backend="aot_eager", fullgraph=fullgraph
        )
        with pytest.raises(Exception, match=match):  # graph breaks: eager refuses the vmap first
            compiled(x, torch.ones_like(x))


def test_a_compiled_step_inside_an_unrelated_dual_level_runs():
    """A forward-mode level open around other code is no jvp: the compiled step runs as without it."""
    plan, (q, k, v), _ = fixed_case()

    def attend(q, k, v):
        return flexattn.flex_attn_func(q, k, v, mask_plan=plan)

    want = torch.autograd.grad(attend(q, k, v).sum(), (q, k, v))
    torch._dynamo.reset()
    with torch.autograd.forward_ad.dual_level():
        out = torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v)
        got = torch.autograd.grad(out.sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mask", ["sliding", "full"])
def test_torchscript_tracing_is_refused(mask):
    """``torch.jit.trace`` crashed inside torch on a plan with partial tiles (its tracer followed
    the reference's payload decoding) and traced a full mask into a program that cannot be saved."""
    plan, (q, k, v), _ = fixed_case(requires_grad=False)
    if mask == "full":
        plan = flexattn.create_mask_plan(masks.full(S, batch=B), q, k, v)
    with pytest.raises(flexattn.UnsupportedCallError, match="torch.jit.trace"):
        torch.jit.trace(lambda q, k, v: flexattn.flex_attn_func(q, k, v, mask_plan=plan), (q, k, v))


def test_mask_builders_run_eagerly_in_a_compiled_region():
    """A mask builder called in a compiled region runs eagerly, as ``create_mask_plan`` does (with
    fullgraph, Dynamo's error names it): its endpoints are eager's, contiguous (traced,
    ``from_dense``'s of a mask with several runs a row came back with inductor's strides, which
    ``create_mask_plan`` refuses, and its host reads broke the graph 7 times). Every builder of
    ``flexattn.masks`` is wrapped, and pickles by its name (a builder in a DataLoader worker's
    ``functools.partial``)."""
    import pickle

    import maskplan_core.masks as core_masks

    for name in core_masks.__all__:
        builder = getattr(masks, name)
        assert builder.__wrapped__ is getattr(core_masks, name)
        assert pickle.loads(pickle.dumps(builder)) is builder
    dense = torch.rand(B, 1, S, S, generator=torch.Generator().manual_seed(0)) < 0.5
    torch._dynamo.reset()
    got = torch.compile(masks.from_dense)(dense)
    assert got.is_contiguous() and torch.equal(got, masks.from_dense(dense))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"flexattn.masks.from_dense runs outside torch.compile"):
        torch.compile(masks.from_dense, fullgraph=True)(dense)
    _, (q, k, v), _ = fixed_case(requires_grad=False)

    def attend(q, k, v):
        plan = flexattn.create_mask_plan(masks.from_dense(dense), q, k, v)
        return flexattn.flex_attn_func(q, k, v, mask_plan=plan)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(attend, backend="aot_eager")(q, k, v), attend(q, k, v))
    torch._dynamo.reset()
    assert torch._dynamo.explain(attend)(q, k, v).graph_break_count <= 2


def _live_plans() -> int:
    gc.collect()
    return sum(type(o) is MaskPlan for o in gc.get_objects())


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_plan_built_inside_the_compiled_region_trains(backend):
    """``create_mask_plan`` inside the compiled function (one graph break): the plan, a local of the
    eager frame between the graphs, lives on with the forward's saved LSE, so the compiled backward
    finds it and gives eager's gradients; once the backward has run, nothing holds it any more."""
    _, (q, k, v), _ = fixed_case()

    def attend(q, k, v):
        plan = flexattn.create_mask_plan(masks.causal(S, batch=B), q, k, v, build_backward=True)
        return flexattn.flex_attn_func(q, k, v, mask_plan=plan)

    want = torch.autograd.grad(attend(q, k, v).square().sum(), (q, k, v))
    torch._dynamo.reset()
    compiled = torch.compile(attend, backend=backend)
    before = _live_plans()
    out = compiled(q, k, v)
    assert _live_plans() == before + 1  # held by the saved LSE's storage alone
    got = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert _live_plans() == before
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_a_copying_saved_tensor_hook_needs_the_callers_reference():
    """The pin goes with the saved LSE's memory: a hook that copies saved tensors (as
    ``save_on_cpu`` does) frees it, so a plan built inside the compiled region is gone by the
    backward, which says what to do."""
    _, (q, k, v), _ = fixed_case()

    def attend(q, k, v):
        plan = flexattn.create_mask_plan(masks.causal(S, batch=B), q, k, v, build_backward=True)
        return flexattn.flex_attn_func(q, k, v, mask_plan=plan)

    torch._dynamo.reset()
    compiled = torch.compile(attend, backend="aot_eager")
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        out = compiled(q, k, v)
        gc.collect()
        with pytest.raises(InputValueError, match="saved-tensor hook"):
            torch.autograd.grad(out.sum(), (q, k, v))


@pytest.mark.slow
def test_inductor_block_matches_eager():
    module, x, plan = _block_inputs("fixed")
    module, x = module.float(), x.detach().float().requires_grad_()
    plan = flexattn.create_mask_plan(
        masks.sliding_window(S, window_left=20, batch=B), *fixed_case(torch.float32)[1]
    )
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    want, got = _step(module, x, plan), _step(compiled, x, plan)
    for a, b in zip((want[0], want[1], *want[2]), (got[0], got[1], *got[2]), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
