"""The public API on an SM90 GPU: planning on CUDA tensors, the forward and backward kernels,
against the CPU reference path of the same public calls."""

from __future__ import annotations

import contextlib
import functools
import warnings

import pytest
import torch
import torch._inductor.config

import flexattn
import flexattn_sm90
from flexattn import masks
from maskplan_core.testing import cuda_arch_major

pytestmark = pytest.mark.gpu

B, S, H, HKV, D = 2, 1000, 4, 2, 128


SM90 = cuda_arch_major() == 9  # the SM90 consumer's kernels can run


MASKS = {
    "causal": lambda dev: masks.causal(S, batch=B, device=dev),
    "sliding": lambda dev: masks.sliding_window(S, window_left=300, batch=B, device=dev),
    "document": lambda dev: masks.document([[400, 600], [1000]], causal=True, device=dev),
    "prefix": lambda dev: masks.prefix_lm(S, [100, 700], device=dev),
}


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
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


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize(
    "mask,deterministic,pack_gqa,dims",
    [("causal", False, None, (D, D)), ("causal", True, None, (D, D)), ("document", False, None, (D, D)),
     ("document", True, None, (D, D)), ("sliding", False, True, (D, D)), ("prefix", True, True, (D, D)),
     ("causal", False, None, (192, 128)), ("sliding", True, None, (256, 256)),
     ("document", True, None, (64, 64)), ("causal", False, None, (72, 72)),
     ("sliding", True, None, (80, 80)),
     ("document", True, True, (48, 48)), ("sliding", False, None, (64, 128)),
     ("prefix", True, None, (160, 128)), ("document", False, None, (36, 60))],
    ids=["causal-atomic", "causal-deterministic", "document-atomic", "document-deterministic",
         "sliding-atomic-packgqa", "prefix-deterministic-packgqa", "causal-atomic-d192",
         "sliding-deterministic-d256", "document-deterministic-d64", "causal-atomic-d72-padded",
         "sliding-deterministic-d80",
         "document-deterministic-packgqa-d48-padded", "sliding-atomic-d64x128-padded",
         "prefix-deterministic-d160x128-padded", "document-atomic-d36x60-copied"],
)  # fmt: skip
def test_training_matches_cpu_reference(mask, deterministic, pack_gqa, dims):
    """flex_attn_func trains on CUDA: its gradients (with an LSE gradient) match the CPU reference
    (``pack_gqa=True``: the packed forward view with the backward view, which packing leaves as is;
    head dims 192/128 and 256: the backward's 64 x 64 tile; 64: its 128 x 128 tile; 80: dQ in 40-column
    halves; 72, 48, 64/128 and 160/128 run on the kernels of 80, 64, 128 and 192/128, which read the
    tensors as they are;
    36/60 on the 64 kernels, q, k, v, out and dout copied with zero columns up to 40/64)."""
    torch.manual_seed(1)
    dtype = torch.bfloat16
    dqk, dv = dims
    q = torch.randn(B, S, H, dqk, dtype=dtype)
    k, v = torch.randn(B, S, HKV, dqk, dtype=dtype), torch.randn(B, S, HKV, dv, dtype=dtype)
    dout, dlse = torch.randn(B, S, H, dv, dtype=dtype), torch.randn(B, H, S)

    def grads(device, cast):
        leaves = [t.to(device=device, dtype=cast).requires_grad_() for t in (q, k, v)]
        pack = pack_gqa if device == "cuda" else None  # the oracle: the CPU reference's plain plan
        plan = flexattn.create_mask_plan(MASKS[mask](device), *leaves, pack_gqa=pack)
        assert plan.view("forward").signature.topology.pack_gqa is bool(pack)
        out, lse = flexattn.flex_attn_func(
            *leaves, mask_plan=plan, return_lse=True, deterministic=deterministic
        )
        torch.autograd.backward((out, lse), (dout.to(device, cast), dlse.to(device)))
        return [t.grad.float().cpu() for t in leaves]

    for name, got, want in zip("qkv", grads("cuda", dtype), grads("cpu", torch.float32), strict=True):
        assert not got.isnan().any(), f"d{name} has NaN"
        rel = ((got - want).norm() / want.norm()).item()
        assert rel <= 2e-2, f"d{name}: relative L2 error {rel:.3e}"


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("mask", ["causal", "document"])
@pytest.mark.parametrize(
    "heads", [(8, 2), (8, 1), (32, 1), (64, 1)], ids=["g4", "mqa-g8", "mqa-g32", "mqa-g64"]
)
def test_a_default_plan_packs_gqa_and_trains(mask, heads):
    """``pack_gqa=None`` packs a shared mask's group of 4 to 64 q heads on SM90 (the default every
    GQA training step gets; MQA's 32 and 64 in Q blocks of 4 and 2 positions): outputs, LSE and
    gradients match the CPU reference, whose consumer does not pack."""
    torch.manual_seed(2)
    hq, hkv = heads
    q = torch.randn(B, S, hq, D, dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, hkv, D, dtype=torch.bfloat16) for _ in "kv")
    dout, dlse = torch.randn_like(q), torch.randn(B, hq, S)

    def run(device, dtype):
        leaves = [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]
        plan = flexattn.create_mask_plan(MASKS[mask](device), *leaves)
        assert plan.view("forward").signature.topology.pack_gqa is (device == "cuda")
        out, lse = flexattn.flex_attn_func(*leaves, mask_plan=plan, return_lse=True)
        torch.autograd.backward((out, lse), (dout.to(device, dtype), dlse.to(device)))
        return [x.detach().float().cpu() for x in (out, lse, *(t.grad for t in leaves))]

    _assert_training_matches(run("cuda", torch.bfloat16), run("cpu", torch.float32))


def _assert_training_matches(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """out, LSE, dQ, dK and dV of a GPU run against the CPU reference's: no NaN, relative L2
    error within bf16's tolerance where the reference is finite (an LSE of -inf: a row seeing no
    key)."""
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert not g.isnan().any(), f"{name} has NaN"
        finite = w.isfinite()
        rel = ((g[finite] - w[finite]).norm() / w[finite].norm()).item()
        assert rel <= 2e-2, f"{name}: relative L2 error {rel:.3e}"


def _spy_copies(monkeypatch) -> list[bool]:
    """Whether each q, k, v the GPU consumer got was copied before its kernels read it (a q, k or v
    it keeps is the tensor it was given, or a view of its memory)."""
    from maskplan_kernels import consumer_launch

    copied, operands = [], consumer_launch.qkv_operands

    def spy(view, *qkv, row_granule):
        *kernel_ready, per_sample = operands(view, *qkv, row_granule=row_granule)
        copied.extend(a.data_ptr() != b.data_ptr() for a, b in zip(qkv, kernel_ready, strict=True))
        return (*kernel_ready, per_sample)

    monkeypatch.setattr(consumer_launch, "qkv_operands", spy)
    return copied


#: q, k, v layouts read in place: slices of one fused projection's output, and [B, H, S, D] tensors
#: transposed to BSHD (no THD view at B = 2: read per sample, S a multiple of the kernels' granule)
IN_PLACE_LAYOUTS = {"fused": (H + 2 * HKV, S), "bhsd": (H, 768)}


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("layout", list(IN_PLACE_LAYOUTS))
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_strided_qkv_trains_without_copies(monkeypatch, layout, deterministic):
    """q, k, v as slices of one fused projection's output, or transposed from ``[B, H, S, D]``: the
    kernels read them in place, in the forward and in the backward, and the gradients match the CPU
    reference."""
    copied = _spy_copies(monkeypatch)
    torch.manual_seed(2)
    heads, seqlen = IN_PLACE_LAYOUTS[layout]
    leaves = [torch.randn(B, seqlen, heads, D, dtype=torch.bfloat16)]
    if layout == "bhsd":
        leaves = [torch.randn(B, h, seqlen, D, dtype=torch.bfloat16) for h in (H, HKV, HKV)]
    dout = torch.randn(B, seqlen, H, D, dtype=torch.bfloat16)

    def grad(device, cast):
        xs = [x.to(device, cast).requires_grad_() for x in leaves]
        if layout == "fused":
            q, k, v = xs[0].split([H, HKV, HKV], dim=2)
        else:
            q, k, v = (x.transpose(1, 2) for x in xs)
        mask = masks.document([[seqlen // 3, seqlen - seqlen // 3], [seqlen]], causal=True, device=device)
        plan = flexattn.create_mask_plan(mask, q, k, v)
        out = flexattn.flex_attn_func(q, k, v, mask_plan=plan, deterministic=deterministic)
        out.backward(dout.to(device, cast))
        return torch.cat([x.grad.float().cpu().flatten() for x in xs])

    got, want = grad("cuda", torch.bfloat16), grad("cpu", torch.float32)
    assert copied == [False] * 6, copied  # q, k, v of the forward, then of the backward
    assert not got.isnan().any()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= 2e-2, f"relative L2 error {rel:.3e}"


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
def test_plan_build_inside_a_capture_is_refused_by_name():
    """A build reads its sizes back to the host, which a capture forbids (torch's own error would
    invalidate the capture with a CUDA message): it is refused before touching the GPU, also for a
    shape no plan had before (whose validation syncs a stream), and a build after the capture works."""
    b, s = 3, 777  # a shape of this test's own: its sample prefixes are not cached yet
    q = torch.randn(b, s, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, s, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    mask = masks.causal(s, batch=b, device="cuda")
    torch.cuda.synchronize()
    with pytest.raises(flexattn.UnsupportedCallError, match="inside a CUDA graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            flexattn.create_mask_plan(mask, q, k, v)
    plan = flexattn.create_mask_plan(mask, q, k, v)
    assert torch.isfinite(flexattn.flex_attn_func(q, k, v, mask_plan=plan)).all()


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
def test_cuda_graph_capture_and_replay():
    """A training step's attention (forward, then backward, deterministic) captured in a CUDA graph
    replays on new q/k/v/dout values and gives exactly what eager calls give on them: nothing
    inside synchronises with the host, and each call's workspace comes from the graph's pool."""
    torch.manual_seed(2)
    dtype = torch.bfloat16

    def values():
        q = torch.randn(B, S, H, D, device="cuda", dtype=dtype)
        k, v = (torch.randn(B, S, HKV, D, device="cuda", dtype=dtype) for _ in range(2))
        return q, k, v, torch.randn(B, S, H, D, device="cuda", dtype=dtype)

    *qkv, dout = values()
    leaves = [t.clone().requires_grad_() for t in qkv]
    plan = flexattn.create_mask_plan(MASKS["document"]("cuda"), *leaves)

    def step(tensors, grad):
        out = flexattn.flex_attn_func(*tensors, mask_plan=plan, deterministic=True)
        out.backward(grad)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels compiled, the plan's signatures checked
        for _ in range(2):
            step(leaves, dout)
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None  # allocated by the captured backward, in the graph's pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(leaves, dout)
    for _ in range(2):
        *new, new_dout = values()
        with torch.no_grad():
            for t, value in zip([*leaves, dout], [*new, new_dout], strict=True):
                t.copy_(value)
        graph.replay()
        eager = [t.clone().requires_grad_() for t in new]
        want = step(eager, new_dout)
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        for name, got, ref in zip("qkv", leaves, eager, strict=True):
            assert torch.equal(got.grad, ref.grad), f"d{name} differs after replay"


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
def test_a_view_first_used_inside_a_capture_serves_eager_calls():
    """A plan whose backward view is first used inside a CUDA graph capture (its warm-up ran the
    forward only): the launch arguments derived there run only when the graph replays, so an eager
    step right after the capture, before any replay, makes its own; its gradients equal those of
    a plan never captured (deterministic)."""
    torch.manual_seed(6)
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    plans = [flexattn.create_mask_plan(MASKS["document"]("cuda"), *leaves) for _ in range(2)]

    def step(tensors, plan):
        out = flexattn.flex_attn_func(*tensors, mask_plan=plan, deterministic=True)
        out.backward(dout)
        return [t.grad.clone() for t in tensors]

    want = step(leaves, plans[1])  # the kernels compiled, outside the capture
    with torch.no_grad():
        flexattn.flex_attn_func(*leaves, mask_plan=plans[0])  # the forward view's arguments only
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        step(leaves, plans[0])
    fresh = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    got = step(fresh, plans[0])
    for name, a, b in zip("qkv", got, want, strict=True):
        assert torch.equal(a, b), f"d{name}"


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
def test_max_logit_is_fp32_under_a_float64_default_dtype():
    """The max logit the kernels write is fp32 whatever torch's default dtype (a float64 default
    made its buffer fp64, which the kernels filled with fp32 bit patterns)."""
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    plan = flexattn.create_mask_plan(MASKS["causal"]("cuda"), q, k, v)
    _, want = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_max_logit=True)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _, got = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_max_logit=True)
    finally:
        torch.set_default_dtype(default)
    assert got.dtype == torch.float32 and torch.equal(got, want) and got.isfinite().all()


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_torch_deterministic_mode_trains_bit_identically(compiled):
    """Under ``torch.use_deterministic_algorithms(True)`` a plan builds and a training step runs (no
    torch op of ours refuses the mode) and a call that leaves ``deterministic`` False gives the same
    bits every run, as the deterministic backward does."""
    torch.manual_seed(5)
    leaves = [torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16) for h in (H, HKV, HKV)]
    dout = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)

    def step(q, k, v, plan, deterministic):
        return flexattn.flex_attn_func(q, k, v, mask_plan=plan, deterministic=deterministic)

    run = torch.compile(step, fullgraph=True) if compiled else step

    def grads(deterministic):
        xs = [x.clone().requires_grad_() for x in leaves]
        plan = flexattn.create_mask_plan(MASKS["document"]("cuda"), *xs)
        run(*xs, plan, deterministic).backward(dout)
        return [x.grad for x in xs]

    want = grads(True)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [grads(False) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(was)
    for got in runs:
        for name, a, b in zip("qkv", got, want, strict=True):
            assert torch.equal(a, b), f"d{name} differs from the deterministic backward's"


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
def test_torch_deterministic_mode_builds_every_mask_on_the_device():
    """Under ``torch.use_deterministic_algorithms(True)`` the converters and combinators run on CUDA
    tensors (none of their ops refuses the mode) and a mask of more endpoints than the planner
    kernels hold plans on the device through the reference planner: the plans the CPU makes."""
    s = 512
    stripes = (torch.arange(s) // 3 % 2 == 0).expand(B, 1, s, s)  # 86 runs a row: nfunc 171
    ids = (torch.arange(s) // 100).expand(B, s)
    q = torch.randn(B, s, H, D, dtype=torch.bfloat16)
    k, v = (torch.randn(B, s, HKV, D, dtype=torch.bfloat16) for _ in "kv")

    def plans(device):
        built = {
            "from_dense": masks.from_dense(stripes.to(device)),
            "from_mask_mod": masks.from_mask_mod(lambda b, h, i, j: j <= i, B, None, s, s, device=device),
            "intersect": masks.intersect(
                masks.document_ids(ids.to(device)),
                masks.sliding_window(s, window_left=70, batch=B, device=device),
            ),
        }
        qkv = [t.detach().to(device).requires_grad_() for t in (q, k, v)]
        return {name: flexattn.create_mask_plan(m, *qkv) for name, m in built.items()}, qkv

    want, _ = plans("cpu")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*the reference planner builds this plan")
            got, qkv = plans("cuda")
        for name, plan in got.items():
            for role in ("forward", "backward"):
                dense = plan.view(role).to_dense().cpu()
                assert torch.equal(dense, want[name].view(role).to_dense()), f"{name} {role}"
            flexattn.flex_attn_func(*qkv, mask_plan=plan).float().sum().backward()
            assert all(t.grad.isfinite().all() for t in qkv), name
    finally:
        torch.use_deterministic_algorithms(was)


@pytest.mark.skipif(not SM90 or torch.cuda.device_count() < 2, reason="needs two SM90 GPUs")
def test_tensors_on_a_gpu_that_is_not_the_current_one():
    """q, k, v on cuda:1 while cuda:0 is the current device: the plan and both directions run on
    cuda:1 (the kernels take raw addresses and launch on the current device, so the library
    switches it around them) and give what the same calls on cuda:0 give; the current device
    stays cuda:0."""
    torch.manual_seed(7)
    torch.cuda.set_device(0)
    q = torch.randn(B, S, H, D, dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, HKV, D, dtype=torch.bfloat16) for _ in "kv")
    dout = torch.randn_like(q)
    results = []
    for dev in ("cuda:0", "cuda:1"):
        leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
        plan = flexattn.create_mask_plan(MASKS["document"](dev), *leaves)
        out = flexattn.flex_attn_func(*leaves, mask_plan=plan, deterministic=True)
        out.backward(dout.to(dev))
        assert torch.cuda.current_device() == 0
        results.append([t.cpu() for t in (out, *(x.grad for x in leaves))])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize(
    "mode, partition",
    [(None, True), ("reduce-overhead", True), ("reduce-overhead", False)],
    ids=["default", "reduce-overhead", "reduce-overhead-no-partition"],
)
def test_compiled_training_with_a_new_plan_per_batch(mode, partition):
    """torch.compile (inductor) of attention taking the batch's plan: every plan of the geometry,
    each called twice, gives eager's outputs and gradients bit for bit (deterministic). Under
    reduce-overhead the ops run between inductor's CUDA graphs (tagged cudagraph_unsafe): a replay
    of recorded launches would keep the first plan's mask. Without inductor's graph partitioning
    the graph holding them runs without CUDA graphs."""
    torch.manual_seed(5)
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, S, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")

    def attend(q, k, v, plan):
        return flexattn.flex_attn_func(q, k, v, mask_plan=plan, deterministic=True) * 2

    def run(fn, plan):
        out = fn(q, k, v, plan)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        return [t.clone() for t in (out, *grads)]  # before a CUDA graph replay reuses the outputs

    torch._dynamo.reset()
    compiled = torch.compile(attend, mode=mode)
    plans = [flexattn.create_mask_plan(MASKS[m]("cuda"), q, k, v, build_backward=True) for m in MASKS]
    with torch._inductor.config.patch(graph_partition=partition):
        for plan in plans * 2:
            got, want = run(compiled, plan), run(attend, plan)
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
                assert torch.equal(a, b), name


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("dims", [(D, D), (64, 64), (72, 72), (64, 128), (128, 64)], ids=str)
def test_explicit_api_writes_in_place(dims):
    """FlexAttentionFwd / FlexAttentionBwd on the SM90 kernels write o, lse and dq/dk/dv into the
    caller's tensors, bit for bit what flex_attn_func gives (deterministic backward; 72, 64/128 and
    128/64: through the (80, 80) / (128, 128) kernels, narrower in one head dim or both)."""
    torch.manual_seed(3)
    dqk, dv = dims
    q = torch.randn(B, S, H, dqk, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, S, HKV, dqk, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, S, HKV, dv, device="cuda", dtype=torch.bfloat16)
    plan = flexattn.create_mask_plan(MASKS["causal"]("cuda"), q, k, v, build_backward=True)
    # NaN-filled buffers: one the kernels leave unwritten fails (a reused allocation could hold the
    # very values expected)
    o = torch.full((B, S, H, dv), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((B, H, S), float("nan"), device="cuda")
    fwd = flexattn.FlexAttentionFwd(q, k, v, o, plan, lse)
    fwd.compile()
    fwd.execute(q, k, v, o, plan, lse, current_stream=torch.cuda.current_stream())
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want, want_lse = flexattn.flex_attn_func(*leaves, mask_plan=plan, return_lse=True, deterministic=True)
    assert torch.equal(o, want) and torch.equal(lse, want_lse)
    for via_smem in (True, False):  # cuDNN's payload delivery switch: the same bits either way
        o2 = torch.full_like(o, float("nan"))
        flexattn.FlexAttentionFwd(q, k, v, o2, plan, sm90_use_smem_mask_pipeline=via_smem)(q, k, v, o2, plan)
        assert torch.equal(o2, o), f"sm90_use_smem_mask_pipeline={via_smem}"
    do = torch.randn_like(o)
    want.backward(do)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    dq, dk, dv_buffer = grads
    bwd = flexattn.FlexAttentionBwd(q, k, v, o, do, lse, dq, dk, dv_buffer, plan, deterministic=True)
    bwd.compile()
    bwd.execute(q, k, v, o, do, lse, dq, dk, dv_buffer, plan)
    for name, got, leaf in zip("qkv", grads, leaves, strict=True):
        assert torch.equal(got, leaf.grad), f"d{name}"


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
def test_explicit_api_on_packed_buffers():
    """cuDNN-style fused buffers: q, k, v slices of one projection (read in place), o a slice of a
    wider buffer and dq, dk, dv slices of one packed gradient buffer (written through copies): bit
    for bit what flex_attn_func gives (deterministic backward)."""
    torch.manual_seed(4)
    qkv = torch.randn(B, S, H + 2 * HKV, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.split([H, HKV, HKV], dim=2)
    plan = flexattn.create_mask_plan(MASKS["document"]("cuda"), q, k, v, build_backward=True)
    o = torch.full((B, S, 2 * H, D), float("nan"), device="cuda", dtype=torch.bfloat16)[:, :, H:]
    lse = torch.empty(B, H, S, device="cuda")
    flexattn.FlexAttentionFwd(q, k, v, o, plan, lse)(q, k, v, o, plan, lse)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = flexattn.flex_attn_func(*leaves, mask_plan=plan, deterministic=True)
    assert torch.equal(o, want)
    do = torch.randn_like(want)
    want.backward(do)
    dqkv = torch.full_like(qkv, float("nan"))
    grads = dqkv.split([H, HKV, HKV], dim=2)
    bwd = flexattn.FlexAttentionBwd(q, k, v, o, do, lse, *grads, plan, deterministic=True)
    bwd(q, k, v, o, do, lse, *grads, plan)
    for name, got, leaf in zip("qkv", grads, leaves, strict=True):
        assert torch.equal(got, leaf.grad), f"d{name}"


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
def test_explicit_api_on_two_streams_with_a_new_plan():
    """A new plan's first backward on a stream still busy, then one on a second stream: the launch
    arguments the first call derives from the plan (on its stream, behind the busy work) are
    waited for by the second stream, whose gradients match those of the ambient stream."""
    torch.manual_seed(4)
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    plan, twin = (
        flexattn.create_mask_plan(MASKS["document"]("cuda"), q, k, v, build_backward=True) for _ in range(2)
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = flexattn.flex_attn_func(*leaves, mask_plan=twin, return_lse=True, deterministic=True)
    do = torch.randn_like(o)
    o.backward(do)  # the want, from an equal plan; compiles the kernels (no compile while busy)
    o, lse = o.detach(), lse.detach()
    bwd = flexattn.FlexAttentionBwd(q, k, v, o, do, lse, *(torch.empty_like(t) for t in (q, k, v)), plan,
                                    deterministic=True)  # fmt: skip
    bwd.compile()
    busy, other = torch.cuda.Stream(), torch.cuda.Stream()
    grads = {}
    for stream in (busy, other):
        stream.wait_stream(torch.cuda.current_stream())  # the inputs and the plan
        grads[stream] = [torch.empty_like(t) for t in (q, k, v)]
    with torch.cuda.stream(busy):
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s: the plan's launch arguments are made after it
    bwd.execute(q, k, v, o, do, lse, *grads[busy], plan, current_stream=busy)
    bwd.execute(q, k, v, o, do, lse, *grads[other], plan, current_stream=other)
    torch.cuda.synchronize()
    for stream in (busy, other):
        for name, got, leaf in zip("qkv", grads[stream], leaves, strict=True):
            assert torch.equal(got, leaf.grad), f"d{name} on {'busy' if stream is busy else 'other'}"


def _causal_samples(lens: list[int]):
    """Causal endpoints of varlen samples of ``lens`` and the create_mask_plan arguments for them."""
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    endpoints = masks.causal(cu_seqlens_q=cu, cu_seqlens_k=cu, device="cuda")
    return endpoints, dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))


def _packed_batch(lens: list[int], varlen: bool):
    """q/k/v and causal document endpoints of one batch of ``lens`` (documents of one sequence
    when fixed, samples when varlen), with the create_mask_plan arguments for it."""
    total = sum(lens)
    if varlen:
        endpoints, args = _causal_samples(lens)
        shape = (total,)
    else:
        endpoints, args, shape = masks.document([lens], causal=True, device="cuda"), {}, (1, total)
    q = torch.randn(*shape, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(*shape, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv"
    )
    return endpoints, (q, k, v), args


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_a_new_plan_trains_without_waiting_for_the_device(varlen, deterministic):
    """A team builds a plan per batch. Once the kernels are compiled, forward and backward with a
    new plan (other documents, other lengths) never wait for the device: torch's sync debug mode
    raises on any synchronising call. Only create_mask_plan reads sizes back."""
    torch.manual_seed(4)

    def step(lens):
        endpoints, qkv, args = _packed_batch(lens, varlen)
        plan = flexattn.create_mask_plan(endpoints, *qkv, **args)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = flexattn.flex_attn_func(*qkv, mask_plan=plan, deterministic=deterministic)
            out.backward(torch.ones_like(out))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return [t.grad for t in qkv]

    with pytest.raises(RuntimeError, match="synchroniz"):  # the check itself is live
        torch.cuda.set_sync_debug_mode("error")
        try:
            torch.zeros(1, device="cuda").item()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    step([700, 300, 1000])  # compiles
    grads = step([130, 900, 1, 969] if varlen else [130, 900, 970])
    assert all(not g.isnan().any() for g in grads)


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("first_use", ["training", "backward"])
def test_a_plan_built_on_a_side_stream(monkeypatch, first_use):
    """A team builds the next batch's plan on a side stream while the step runs. The build's
    stages after its host read are held back there (a GPU sleep, ~0.5 s, before they start), and
    the main stream waits for them without being told: forward and backward through autograd, or
    (``backward``, so that the backward view's own wait is what is tested) the explicit backward
    as the plan's first use, give exactly what a plan built on the main stream gives."""
    import maskplan_kernels

    torch.manual_seed(5)
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    dout = torch.randn_like(q)
    endpoints = MASKS["document"]("cuda")

    def training(plan):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = flexattn.flex_attn_func(*leaves, mask_plan=plan, return_lse=True, deterministic=True)
        out.backward(dout)
        return out.detach(), lse.detach(), [t.grad for t in leaves]

    here = flexattn.create_mask_plan(endpoints, q, k, v, build_backward=True)
    out, lse, want = training(here)
    bwd = flexattn.FlexAttentionBwd(q, k, v, out, dout, lse, *(torch.empty_like(t) for t in (q, k, v)), here,
                                    deterministic=True)  # fmt: skip
    bwd.compile()

    @contextlib.contextmanager
    def late(stage):
        if stage == "materialize_q2k":  # the first stage after the header read
            torch.cuda._sleep(1_000_000_000)
        yield

    held_back = functools.partial(maskplan_kernels.build_plan_gpu, stage_timer=late)
    monkeypatch.setattr(maskplan_kernels, "build_plan_gpu", held_back)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the endpoints
    with torch.cuda.stream(side):
        plan = flexattn.create_mask_plan(endpoints, q, k, v, build_backward=True)
    assert not side.query()  # the plan's last stages are still queued behind the sleep
    if first_use == "training":
        got_out, got_lse, got = training(plan)
        assert torch.equal(got_out, out) and torch.equal(got_lse, lse)
    else:
        got = [torch.empty_like(t) for t in (q, k, v)]
        bwd.execute(q, k, v, out, dout, lse, *got, plan)
    for name, g, w in zip("qkv", got, want, strict=True):
        assert torch.equal(g, w), f"d{name} differs with the plan built on a side stream"


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_sm100_plans_build_on_the_device(monkeypatch, varlen):
    """``target="sm100"`` with CUDA tensors (what a Blackwell GPU runs) builds with the GPU planner
    kernels, one build, and the plan holds the blocks the CPU reference plans for the same call."""
    import maskplan_kernels

    calls = []
    counted = maskplan_kernels.build_plan_gpu

    def counting(*args, **kwargs):
        calls.append(args[-1])
        return counted(*args, **kwargs)

    monkeypatch.setattr(maskplan_kernels, "build_plan_gpu", counting)
    lens = [300, 700, 1000]
    plans = {}
    for dev in ("cpu", "cuda"):
        if varlen:
            q = torch.randn(sum(lens), H, D, device=dev, dtype=torch.bfloat16)
            k, v = (torch.randn(sum(lens), HKV, D, device=dev, dtype=torch.bfloat16) for _ in "kv")
            cu = torch.tensor([0, 300, 1000, 2000], dtype=torch.int32, device=dev)
            extra = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1000, max_seqlen_k=1000)
            endpoints = masks.sliding_window(window_left=200, cu_seqlens_q=cu, cu_seqlens_k=cu, device=dev)
        else:
            q = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16)
            k, v = (torch.randn(B, S, HKV, D, device=dev, dtype=torch.bfloat16) for _ in "kv")
            extra = {}
            endpoints = MASKS["document"](dev)
        plans[dev] = flexattn.create_mask_plan(endpoints, q, k, v, build_backward=True, target="sm100",
                                               **extra)  # fmt: skip
    assert calls == ["flexattn-sm100"]
    cpu, gpu = plans["cpu"], plans["cuda"]
    assert gpu.view("forward").signature == cpu.view("forward").signature
    for direction in ("forward", "backward"):
        assert torch.equal(gpu.view(direction).to_dense().cpu(), cpu.view(direction).to_dense()), direction


_PROMPTS = (torch.arange(2000) % 700 < 90).expand(B, -1)  # prompt tokens, for document_ids(prefix=)


@pytest.mark.parametrize(
    "options", [{}, {"pad_id": 2}, {"chunk_size": 256, "causal": True}, {"prefix": _PROMPTS}],
    ids=["plain", "pad_id", "chunked", "prefix"],
)  # fmt: skip
def test_document_ids_builds_on_the_device_without_a_sync(options):
    """Document endpoints from per-token ids already on the GPU (a data loader's) never read them
    back: only create_mask_plan's header read waits for the device. They equal the CPU builder's,
    padding rows (``pad_id``), chunks (``chunk_size``) and prompts (``prefix``) included."""
    lens = [300, 700, 1000]
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lens)).expand(B, -1)
    on_device = ids.to("cuda")
    options_on_device = {k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        endpoints = masks.document_ids(on_device, **options_on_device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(endpoints.cpu(), masks.document_ids(ids, **options))
    if not options:
        assert torch.equal(endpoints.cpu(), masks.document([lens] * B))


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("pad_start", [768, 700], ids=["whole-blocks", "a-block-shared"])
def test_padding_rows_of_document_ids_give_zero_output_and_gradients(pad_start):
    """``pad_id`` rows see no key on the GPU kernels too (from row 768: whole empty Q and K blocks;
    from 700: also a block shared with a document): out 0, LSE -inf, no gradient through them or
    their keys; the other rows match the CPU reference."""
    torch.manual_seed(3)
    lens = torch.tensor([384, pad_start - 384, S - pad_start])
    ids = torch.repeat_interleave(torch.tensor([0, 1, -1]), lens).expand(B, -1)
    q = torch.randn(B, S, H, D, dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, HKV, D, dtype=torch.bfloat16) for _ in "kv")
    dout = torch.randn_like(q)

    def run(device, dtype):
        leaves = [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]
        endpoints = masks.document_ids(ids.to(device), causal=True, pad_id=-1)
        plan = flexattn.create_mask_plan(endpoints, *leaves)
        out, lse = flexattn.flex_attn_func(*leaves, mask_plan=plan, return_lse=True)
        out.backward(dout.to(device, dtype))
        return [x.detach().float().cpu() for x in (out, lse, *(t.grad for t in leaves))]

    got, want = run("cuda", torch.bfloat16), run("cpu", torch.float32)
    out, lse, dq, dk, dv = got
    pad = slice(pad_start, None)
    assert torch.equal(lse[..., pad], torch.full_like(lse[..., pad], float("-inf")))
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.equal(t[:, pad], torch.zeros_like(t[:, pad])), f"{name} of the padding"
    _assert_training_matches(got, want)


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("pack_gqa", [False, True], ids=["", "packgqa"])
def test_forward_keeps_samples_apart(bad, pack_gqa):
    """S = 1000 is not a multiple of the tiles: sample 0's last K block holds sample 1's first rows.
    With sample 1's q, k and v non-finite, sample 0's outputs equal those of a clean run."""
    torch.manual_seed(0)
    q = torch.randn(B, S, H, D, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(B, S, HKV, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    plan = flexattn.create_mask_plan(MASKS["causal"]("cuda"), q, k, v, pack_gqa=pack_gqa)
    clean = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True)
    for t in (q, k, v):
        t[1] = bad
    dirty = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True)
    for name, c, d in zip(("out", "lse"), clean, dirty, strict=True):
        assert torch.equal(d[0], c[0]), f"sample 0's {name} changed with sample 1 at {bad}"
    assert not torch.isfinite(dirty[0][1]).all()  # the poison took


# (head dims, layout, deterministic): every head dim on fixed samples, varlen (odd lengths, an empty
# sample) on three, and the atomic dQ on both layouts.
_APART_CASES = [
    *(((dqk, dv), "fixed", True) for dqk, dv in flexattn_sm90.SUPPORTED_HEAD_DIMS),
    *(((d, d), "varlen", True) for d in (32, 96, 128)),
    *(((128, 128), layout, False) for layout in ("fixed", "varlen")),
]


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize(("dims", "layout", "deterministic"), _APART_CASES, ids=str)
@pytest.mark.parametrize("poisoned", ["qkv", "dout"])
def test_backward_keeps_samples_apart(dims, layout, deterministic, poisoned):
    """Samples end inside a tile: a sample's last K and Q blocks hold the next sample's first rows.
    With one sample's q, k, v (or its dout) non-finite, every other sample's gradients equal those
    of a clean run: bit for bit when deterministic, within rounding (and finite) when atomic."""
    torch.manual_seed(0)
    dqk, dv = dims
    if layout == "fixed":
        lens, shape, victim = [S] * B, (B, S), 1
        endpoints, args = MASKS["causal"]("cuda"), {}
    else:
        lens, victim = [700, 0, 333, 967], 2  # only sample 0's last blocks reach into sample 2
        shape = (sum(lens),)
        endpoints, args = _causal_samples(lens)
    starts = torch.tensor([0, *lens]).cumsum(0).tolist()

    def sample(t, i):
        return t[i] if layout == "fixed" else t[starts[i] : starts[i + 1]]

    q = torch.randn(*shape, H, dqk, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(*shape, HKV, dqk, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(*shape, HKV, dv, dtype=torch.bfloat16, device="cuda")
    dout = torch.randn(*shape, H, dv, dtype=torch.bfloat16, device="cuda")
    plan = flexattn.create_mask_plan(endpoints, q, k, v, build_backward=True, **args)

    def grads(tensors):
        qkv = [t.clone().requires_grad_() for t in tensors[:3]]
        out = flexattn.flex_attn_func(*qkv, mask_plan=plan, deterministic=deterministic)
        return torch.autograd.grad(out, qkv, tensors[3])

    clean = grads((q, k, v, dout))
    for t in (q, k, v) if poisoned == "qkv" else (dout,):
        sample(t, victim).fill_(float("nan"))
    dirty = grads((q, k, v, dout))
    for name, c, d in zip(("dq", "dk", "dv"), clean, dirty, strict=True):
        for i in range(len(lens)):
            if i == victim:
                continue
            got, want = sample(d, i), sample(c, i)
            where = f"sample {i}'s {name} with sample {victim}'s {poisoned} at nan"
            if deterministic:
                assert torch.equal(got, want), f"{where} changed"
            else:
                assert torch.isfinite(got).all(), f"{where} is not finite"
                torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=f"{where} moved")
    assert not torch.isfinite(sample(dirty[0], victim)).all()  # the poison took


#: the longest packed batch of the LLM team's story: 128k tokens in documents of uneven lengths,
#: one a single token (``LONG_DOCS`` sums to ``1 << 17``)
LONG_DOCS = [45_000, 1, 20_479, 30_000, 8192, 27_400]
#: name -> (endpoints, the create_mask_plan arguments of the batch's layout)
LONG_MASKS = {
    "document": lambda: (masks.document([LONG_DOCS], causal=True, device="cuda"), {}),
    "document-sliding-4096": lambda: (
        masks.document([LONG_DOCS], causal=True, window_left=4096, device="cuda"), {}
    ),
    "varlen": lambda: _causal_samples(LONG_DOCS),
}


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("mask", list(LONG_MASKS))
def test_a_128k_token_batch_trains_like_the_reference(mask):
    """128k tokens (one fixed-length sequence of documents, or varlen samples): the GPU planner's
    plan equals the reference planner's tensor for tensor, and flex_attn_func's output, LSE and
    gradients match the fp32 reference consumer run on the GPU over that plan (the CPU reference
    of the other tests would take hours here)."""
    from flexattn_sm90 import Sm90Consumer
    from maskplan_core.reference import attention_backward, attention_forward
    from maskplan_core.testing import consumer_plan, thd

    torch.manual_seed(5)
    total = sum(LONG_DOCS)
    endpoints, args = LONG_MASKS[mask]()
    varlen = bool(args)
    shape = (total,) if varlen else (1, total)
    q = torch.randn(*shape, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(*shape, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv"
    )
    plan = flexattn.create_mask_plan(endpoints, q, k, v, **args)
    ref_plan = consumer_plan(Sm90Consumer(), endpoints, q, k, v, **args)
    assert plan.roles == ref_plan.roles == ("forward", "backward")
    for role in plan.roles:
        tensors, want_tensors = plan.view(role).tensors, ref_plan.view(role).tensors
        assert tensors.keys() == want_tensors.keys(), role
        for name, want in want_tensors.items():
            got = tensors[name]
            assert (got is None) == (want is None), f"{role}.{name}"
            assert want is None or torch.equal(got, want), f"{role}.{name} differs from the reference plan"

    scale = D**-0.5
    out, lse = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    q3, k3, v3, do3 = (t.detach().float() for t in thd(q, k, v, dout))
    ref_out, ref_lse, _ = attention_forward(ref_plan.view("forward"), q3, k3, v3, softmax_scale=scale)
    # a long row's outputs are small (~ 1 / sqrt(keys)): the relative error catches what the
    # absolute one would let pass
    err = thd(out)[0].float() - ref_out
    assert err.abs().max().item() <= 2e-2
    assert (err.norm() / ref_out.norm()).item() <= 1e-2
    got_lse = lse.reshape(H, total) if varlen else lse[0]
    assert torch.allclose(got_lse, ref_lse, atol=1e-3, rtol=1e-4)
    ref_grads = attention_backward(
        ref_plan.view("backward"), q3, k3, v3, ref_out, ref_lse, do3, None, softmax_scale=scale
    )
    for name, leaf, want in zip("qkv", (q, k, v), ref_grads, strict=True):
        got = thd(leaf.grad)[0].float()
        assert not got.isnan().any(), f"d{name} has NaN"
        rel = ((got - want).norm() / want.norm()).item()
        assert rel <= 2e-2, f"d{name}: relative L2 error {rel:.3e}"


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_ring_attention_merge_trains_on_rows_without_keys(deterministic):
    """packages/flexattn/README.md's ring-attention merge on the GPU: each step's LSE enters the
    merge, and torch's logsumexp backward hands a NaN dlse to rows no step shows a key (padding):
    their gradients stay 0 and the merged gradients are one call's (bf16 rounding of each step's
    output apart)."""
    torch.manual_seed(3)
    world = 2
    ids = torch.tensor([[1] * 600 + [2] * 300 + [-1] * 100, [3] * 1000]).cuda()
    mask = masks.document_ids(ids, causal=True, window_left=200, pad_id=-1)
    q, k, v, dout = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    chunk = S // (2 * world)
    halves = [torch.arange(c * chunk, (c + 1) * chunk, device="cuda") for c in range(2 * world)]
    positions = [torch.cat([halves[r], halves[2 * world - 1 - r]]) for r in range(world)]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    outs = []
    for mine in positions:
        rows, q_mine = masks.select_rows(mask, mine), leaves[0][:, mine]
        steps = []
        for keys in positions:
            k_j, v_j = leaves[1][:, keys], leaves[2][:, keys]
            plan = flexattn.create_mask_plan(masks.select_keys(rows, keys), q_mine, k_j, v_j)
            steps.append(flexattn.flex_attn_func(
                q_mine, k_j, v_j, mask_plan=plan, return_lse=True, deterministic=deterministic
            ))  # fmt: skip
        lses = torch.stack([lse for _, lse in steps])
        lse = torch.logsumexp(lses, 0)
        weight = torch.exp(lses - lse.nan_to_num(neginf=0.0))
        out = (torch.stack([o for o, _ in steps]).float() * weight.transpose(-1, -2).unsqueeze(-1)).sum(0)
        (out * dout[:, mine].float()).sum().backward()
        outs.append(out)
    ring = torch.cat(outs, 1)[:, torch.argsort(torch.cat(positions))]
    once = [t.clone().requires_grad_() for t in (q, k, v)]
    plan = flexattn.create_mask_plan(mask, *once)
    o = flexattn.flex_attn_func(*once, mask_plan=plan, deterministic=deterministic)
    (o.float() * dout.float()).sum().backward()
    assert (ring[0, 900:] == 0).all()
    grads = zip(("dq", "dk", "dv"), (t.grad for t in leaves), (t.grad for t in once), strict=True)
    for name, got, want in (("out", ring, o), *grads):
        assert not got.isnan().any(), name
        close = functools.partial(torch.testing.assert_close, atol=6e-2, rtol=5e-2)
        close(got.float(), want.float(), msg=lambda m, n=name: f"{n}: {m}")
    assert (leaves[0].grad[0, 900:] == 0).all()
