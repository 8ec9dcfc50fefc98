"""Public-API errors and plan ownership: ``create_mask_plan`` / ``flex_attn_func`` on CPU tensors.

Every public input error must be the precise ``flexattn``/``maskplan_core`` error class *and*
the builtin ``ValueError``/``TypeError``, with a message naming the culprit.
"""

from __future__ import annotations

import fractions
import functools
import math
import pickle
import re
from contextlib import contextmanager

import pytest
import torch

import flexattn
from flexattn import (
    ConsumerNotFoundError,
    EndpointError,
    FlexAttnError,
    InputTypeError,
    InputValueError,
    MaskPlan,
    MissingBackwardViewError,
    PlanBindingError,
    PlanSignatureMismatch,
    SeqlenError,
    UnsupportedCallError,
    UnsupportedConfigError,
)

B, SQ, SK, HQ, HKV, D = 2, 150, 140, 2, 1, 16


@contextmanager
def expect(cls, builtin, *needles):
    with pytest.raises(cls) as info:
        yield info
    assert isinstance(info.value, builtin), f"{type(info.value).__name__} is not a {builtin.__name__}"
    assert isinstance(info.value, FlexAttnError)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in message {message!r}"


def fixed_qkv(b=B, sq=SQ, sk=SK, hq=HQ, hkv=HKV, dqk=D, dv=D, dtype=torch.float64, requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    shapes = ((b, sq, hq, dqk), (b, sk, hkv, dqk), (b, sk, hkv, dv))
    return tuple(torch.randn(s, generator=gen, dtype=dtype).requires_grad_(requires_grad) for s in shapes)


def causal_mask(b=B, sq=SQ, sk=SK, nfunc=1, hmask=1) -> torch.Tensor:
    i = torch.arange(b * sq) % sq
    ep = torch.full((hmask, nfunc, b * sq), sk, dtype=torch.int32)
    ep[:, 0] = (i + 1 + sk - sq).clamp(0, sk)
    return ep


# varlen: q lengths (130, 0, 70), k lengths (60, 5, 200)
CU_Q, CU_K = [0, 130, 130, 200], [0, 60, 65, 265]


def varlen_case(seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(200, HQ, D, generator=gen, dtype=torch.float64).requires_grad_(requires_grad)
    k = torch.randn(265, HKV, D, generator=gen, dtype=torch.float64).requires_grad_(requires_grad)
    v = torch.randn(265, HKV, D, generator=gen, dtype=torch.float64).requires_grad_(requires_grad)
    k_len = torch.tensor([60] * 130 + [200] * 70)
    ep = torch.stack([k_len // 3, k_len // 2, k_len]).unsqueeze(0).to(torch.int32).contiguous()  # [1, 3, 200]
    args = dict(
        cu_seqlens_q=torch.tensor(CU_Q, dtype=torch.int32),
        cu_seqlens_k=torch.tensor(CU_K, dtype=torch.int32),
        max_seqlen_q=130,
        max_seqlen_k=200,
    )
    return ep, (q, k, v), args


# --------------------------------------------------------------------------------------------------
# create_mask_plan input rules (spec 2 - 4.1), once each through the public entry point
# --------------------------------------------------------------------------------------------------


def _mask(**kw):
    return lambda: (causal_mask(**kw), fixed_qkv(), {})


def _with_endpoint(h, f, row, value, nfunc=3):
    def make():
        ep = causal_mask(nfunc=nfunc)
        ep[h, f, row] = value
        return ep, fixed_qkv(), {}

    return make


def _varlen(drop=(), **changes):
    def make():
        ep, qkv, args = varlen_case()
        for name, value in changes.items():
            args[name] = value(args[name]) if callable(value) else value
        for name in drop:
            del args[name]
        return ep, qkv, args

    return make


def _qkv(**kw):
    def make():
        q, k, v = fixed_qkv(**kw)
        return causal_mask(b=q.shape[0], sq=q.shape[1]), (q, k, v), {}

    return make


def _jagged() -> torch.Tensor:
    """A nested (jagged) batch of two samples of 5 and 7 rows: [2, j, HQ, D]."""
    rows = [torch.randn(n, HQ, D, dtype=torch.float64) for n in (5, 7)]
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


RULES = {
    "mask-not-tensor": (lambda: ([[1, 2]], fixed_qkv(), {}), InputTypeError, ("mask_func", "Tensor")),
    "mask-dtype": (lambda: (causal_mask().long(), fixed_qkv(), {}), InputTypeError, ("mask_func", "int32")),
    "mask-rank": (lambda: (causal_mask()[0], fixed_qkv(), {}), InputValueError, ("mask_func", "rank 3")),
    "mask-non-contiguous": (
        lambda: (causal_mask(b=2 * B)[:, :, ::2], fixed_qkv(), {}), InputValueError,
        ("mask_func", "contiguous"),
    ),
    "hmask": (_mask(hmask=3), InputValueError, ("mask_func", "Hmask=3", f"Hq={HQ}")),
    "even-nfunc": (_mask(nfunc=2), InputValueError, ("mask_func", "nfunc", "2")),
    "total-q": (_mask(sq=SQ - 1), InputValueError, ("mask_func", "total_q", str(B * SQ))),
    "endpoint-above-k-len": (_with_endpoint(0, 1, 170, SK + 1), EndpointError,
                             ("mask_func[0, 1, 170]", "row 170", f"sample 1, its row {170 - SQ}", str(SK + 1),
                              f"k_len = {SK}")),
    "endpoint-negative": (_with_endpoint(0, 2, 3, -1), EndpointError, ("mask_func[0, 2, 3]", "row 3", "-1")),
    "endpoints-unordered": (_with_endpoint(0, 1, 100, 2), EndpointError,
                            ("mask_func[0, :, 100]", "sample 0, its row 100", "sorted", "endpoint 1 = 2",
                             "endpoint 0 = 91")),
    "varlen-partial-args": (_varlen(drop=("max_seqlen_q", "cu_seqlens_k")), InputValueError,
                            ("cu_seqlens_k", "max_seqlen_q")),
    "cu-dtype": (_varlen(cu_seqlens_q=lambda t: t.long()), InputTypeError, ("cu_seqlens_q", "int32")),
    "cu-rank": (_varlen(cu_seqlens_k=lambda t: t[None]), InputValueError, ("cu_seqlens_k", "rank-1")),
    "cu-shape-mismatch": (_varlen(cu_seqlens_k=lambda t: t[:3].contiguous()), InputValueError,
                          ("cu_seqlens_q", "cu_seqlens_k", "same shape")),
    "cu-start": (_varlen(cu_seqlens_q=lambda t: t + 1), SeqlenError, ("cu_seqlens_q[0] must be 0", "got 1")),
    "cu-end": (_varlen(cu_seqlens_k=lambda t: torch.tensor([0, 60, 65, 264], dtype=torch.int32)), SeqlenError,
               ("cu_seqlens_k[-1]", "265", "got 264")),
    "cu-decreasing": (_varlen(cu_seqlens_q=lambda t: torch.tensor([0, 130, 120, 200], dtype=torch.int32)),
                      SeqlenError, ("cu_seqlens_q", "decreases", "130 -> 120")),
    "cu-over-max": (_varlen(max_seqlen_k=199), SeqlenError, ("cu_seqlens_k", "sample 2 length 200", "199")),
    "q-rank": (lambda: (causal_mask(), (fixed_qkv()[0][0], *fixed_qkv()[1:]), {}), InputValueError,
               ("q", "rank 4")),
    "q-thd-without-varlen-args": (lambda: (*varlen_case()[:2], {}), InputValueError,
                                  ("q", "rank 4", "THD", "cu_seqlens_q/k", "max_seqlen_q/k")),
    "q-nested": (lambda: (causal_mask(), (_jagged(), *fixed_qkv()[1:]), {}), InputTypeError,
                 ("q is a nested tensor", "q.values()", "q.offsets()", "cu_seqlens_q/k")),
    "q-sparse": (lambda: (causal_mask(), (fixed_qkv()[0].to_sparse(), *fixed_qkv()[1:]), {}), InputTypeError,
                 ("q", "dense (strided)", "sparse_coo")),
    "qkv-dtype-mismatch": (lambda: (causal_mask(), (*fixed_qkv()[:2], fixed_qkv(dtype=torch.float32)[2]), {}),
                           InputTypeError, ("v", "float32", "float64")),
    "head-dim-mismatch": (lambda: (causal_mask(), (fixed_qkv()[0], *fixed_qkv(dqk=2 * D)[1:]), {}),
                          InputValueError, ("head dims", str(2 * D))),
    "hq-not-multiple": (_qkv(hq=3, hkv=2), InputValueError, ("q heads (3)", "k/v heads (2)")),
    "kv-mismatch": (lambda: (causal_mask(), (*fixed_qkv()[:2], fixed_qkv(sk=SK - 1)[2]), {}), InputValueError,
                    ("k and v", str(SK - 1))),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_create_mask_plan_rejects(rule):
    make, cls, needles = RULES[rule]
    ep, (q, k, v), args = make()
    builtin = TypeError if issubclass(cls, TypeError) else ValueError
    with expect(cls, builtin, *needles):
        flexattn.create_mask_plan(ep, q, k, v, **args)


@pytest.mark.parametrize(
    "kw, cls, needles",
    [
        (dict(build_backward="yes"), InputTypeError, ("build_backward", "bool")),
        (dict(build_backward=1), InputTypeError, ("build_backward",)),
        (dict(pack_gqa=0), InputTypeError, ("pack_gqa", "bool")),
        (dict(target=3), InputTypeError, ("target", "int")),
    ],
    ids=["build_backward-str", "build_backward-int", "pack_gqa-int", "target-int"],
)
def test_create_mask_plan_option_errors(kw, cls, needles):
    builtin = TypeError if issubclass(cls, TypeError) else ValueError
    with expect(cls, builtin, *needles):
        flexattn.create_mask_plan(causal_mask(), *fixed_qkv(), **kw)


def test_pack_gqa_needs_a_shared_mask_and_a_dividing_ratio():
    """The CPU reference plans PackGQA as a packing kernel would, and refuses what packing cannot
    do, naming why."""
    q, k, v = fixed_qkv()
    with expect(UnsupportedConfigError, ValueError, "pack_gqa", f"Hmask={HQ}"):
        flexattn.create_mask_plan(causal_mask(hmask=HQ), q, k, v, pack_gqa=True)
    q3 = torch.zeros(B, SQ, 3, D, dtype=torch.float64)
    with expect(UnsupportedConfigError, ValueError, "pack_gqa", "3 q heads", "dividing 128"):
        flexattn.create_mask_plan(causal_mask(), q3, k, v, pack_gqa=True)


def test_pack_gqa_on_cpu_plans_the_packed_blocks_and_computes_the_same():
    q, k, v = fixed_qkv(requires_grad=True)
    plain = flexattn.create_mask_plan(causal_mask(), q, k, v)
    packed = flexattn.create_mask_plan(causal_mask(), q, k, v, pack_gqa=True)
    topology = packed.view("forward").signature.topology
    group = HQ // HKV
    assert (topology.pack_gqa, topology.tile_m, topology.qhead_per_kvhead) == (True, 128 // group, group)
    assert packed.view("backward").block_size == plain.view("backward").block_size
    outs = [flexattn.flex_attn_func(q, k, v, mask_plan=p) for p in (plain, packed)]
    assert torch.equal(*outs)
    grads = [torch.autograd.grad(o.sum(), (q, k, v)) for o in outs]
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_device_without_a_consumer_is_named_before_any_dtype_rule(dtype):
    """On meta tensors the error names the device, whatever the dtype (fp32 used to be told to
    become fp16 / bf16 first, which then failed on the device)."""
    q = torch.empty(1, 128, 2, 64, device="meta", dtype=dtype)
    with expect(ConsumerNotFoundError, RuntimeError, "meta", "CPU", "CUDA"):
        flexattn.create_mask_plan(flexattn.masks.causal(128, device="meta"), q, q, q)


def test_a_cpu_plan_with_tensors_elsewhere_names_the_device_first():
    """A laptop prototype's plan (CPU, fp32) called with tensors of another device and dtype (a
    GPU's bf16; meta here, which reaches the same check): the device is named first, with what to
    do, not the dtype (whose fix, a bf16 CPU plan, then failed on the device); and the plan
    refuses to move."""
    q, k, v = fixed_qkv()
    plan = flexattn.create_mask_plan(causal_mask(), q, k, v)
    elsewhere = [t.to("meta", torch.bfloat16) for t in (q, k, v)]
    with expect(PlanBindingError, ValueError, "q is on meta but the plan was built on cpu", "does not move",
                "device=", "tensors on meta"):  # fmt: skip
        flexattn.flex_attn_func(*elsewhere, mask_plan=plan)
    for elsewhere in (("cuda",), (torch.bfloat16,), ("cpu", torch.float16)):
        with expect(UnsupportedCallError, RuntimeError, "does not move", f"{q.dtype} on cpu", "device="):
            plan.to(*elsewhere)
    # a batch mover (accelerate's send_to_device, Lightning's) calls .to on what has one: the plan's
    # own device and dtype give the plan back
    for same in (("cpu",), (torch.device("cpu"), q.dtype), (q,)):
        assert plan.to(*same, non_blocking=True) is plan


def test_unknown_target_has_no_consumer():
    with pytest.raises(ConsumerNotFoundError, match="sm999") as info:
        flexattn.create_mask_plan(causal_mask(), *fixed_qkv(), target="sm999")
    assert "'reference'" in str(info.value)  # the names a target can take
    for name in ("hopper", "SM90"):  # a name nothing claims: the installed ones are listed
        with pytest.raises(ConsumerNotFoundError, match=f"'{name}'.*installed consumers serve 'reference'"):
            flexattn.create_mask_plan(causal_mask(), *fixed_qkv(), target=name)


# --------------------------------------------------------------------------------------------------
# build_backward=None, missing backward views
# --------------------------------------------------------------------------------------------------


def test_build_backward_default_follows_autograd():
    ep = causal_mask()
    assert not flexattn.create_mask_plan(ep, *fixed_qkv()).has_backward
    assert flexattn.create_mask_plan(ep, *fixed_qkv(requires_grad=True)).has_backward
    q, k, v = fixed_qkv()
    assert flexattn.create_mask_plan(ep, q, k.requires_grad_(), v).has_backward  # any input
    with torch.no_grad():
        assert not flexattn.create_mask_plan(ep, *fixed_qkv(requires_grad=True)).has_backward
    assert flexattn.create_mask_plan(ep, *fixed_qkv(), build_backward=True).has_backward
    plan = flexattn.create_mask_plan(ep, *fixed_qkv(requires_grad=True), build_backward=False)
    assert not plan.has_backward
    plan = flexattn.create_mask_plan(ep, *fixed_qkv(requires_grad=True))
    assert plan.roles == ("forward", "backward")
    assert plan.metadata["allocation_header"]["backward_k_rows"] > 0


def test_training_call_needs_backward_view():
    ep = causal_mask()
    q, k, v = fixed_qkv(requires_grad=True)
    with torch.no_grad():
        plan = flexattn.create_mask_plan(ep, q, k, v)
    assert not plan.has_backward
    with expect(MissingBackwardViewError, ValueError, "build_backward=True"):
        flexattn.flex_attn_func(q, k, v, mask_plan=plan)
    with expect(MissingBackwardViewError, ValueError, "build_backward=True"):
        plan.view("backward")
    with expect(InputValueError, ValueError, "'backwards'", "['forward']"):
        plan.view("backwards")
    with expect(InputTypeError, TypeError, "role", "['forward']"):
        plan.view(["forward"])
    with torch.no_grad():  # inference with the same tensors is fine
        out = flexattn.flex_attn_func(q, k, v, mask_plan=plan)
    assert out.shape == (B, SQ, HQ, D)
    out2 = flexattn.flex_attn_func(q.detach(), k.detach(), v.detach(), mask_plan=plan)
    assert torch.equal(out, out2)


@pytest.fixture
def one_rank_mesh():
    """A 1-D device mesh of this process alone (gloo, an in-memory store: no port)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensors_are_refused_with_the_local_route(one_rank_mesh):
    """A DTensor's shape is the global one and torch has no sharding rule for flexattn's ops: q/k/v
    from tensor-parallel projections with use_local_output=False failed on a shape mismatch against
    a local plan (whose advice, a plan for these tensors, then failed inside torch's sharding
    propagation), and a DTensor mask was planned as if global."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    q, k, v = fixed_qkv()
    dq = distribute_tensor(q, one_rank_mesh, [Shard(2)])
    needles = ("q is a DTensor", "Shard(dim=2)", "q.to_local()", "use_local_output=True", "per-head mask")
    with expect(InputTypeError, TypeError, *needles):
        flexattn.create_mask_plan(causal_mask(), dq, k, v)
    plan = flexattn.create_mask_plan(causal_mask(), q, k, v)
    with expect(InputTypeError, TypeError, *needles):
        flexattn.flex_attn_func(dq, k, v, mask_plan=plan)
    replicated = functools.partial(distribute_tensor, device_mesh=one_rank_mesh, placements=[Replicate()])
    with expect(InputTypeError, TypeError, "mask_func is a DTensor", "Replicate()", "mask_func.to_local()"):
        flexattn.create_mask_plan(replicated(causal_mask()), q, k, v)
    ep, (q3, k3, v3), args = varlen_case()
    cu_q, cu_k = args["cu_seqlens_q"], args["cu_seqlens_k"]
    with expect(InputTypeError, TypeError, "cu_seqlens_k is a DTensor", "cu_seqlens_k.to_local()"):
        flexattn.create_mask_plan(ep, q3, k3, v3, **{**args, "cu_seqlens_k": replicated(cu_k)})
    with expect(InputTypeError, TypeError, "cu_seqlens_q is a DTensor"):
        flexattn.masks.causal(cu_seqlens_q=replicated(cu_q), cu_seqlens_k=cu_k)
    with expect(InputTypeError, TypeError, "doc_lens is a DTensor"):
        flexattn.masks.document(replicated(torch.tensor([100, 50])))
    fwd = flexattn.FlexAttentionFwd(q, k, v, torch.empty_like(q), plan)
    fwd.compile()
    with expect(InputTypeError, TypeError, "o is a DTensor"):
        fwd.execute(q, k, v, replicated(torch.empty_like(q)), plan)
    local = flexattn.flex_attn_func(dq.to_local(), k, v, mask_plan=plan)
    assert torch.equal(local, flexattn.flex_attn_func(q, k, v, mask_plan=plan))


def test_unknown_view_role():
    plan = flexattn.create_mask_plan(causal_mask(), *fixed_qkv())
    with expect(InputValueError, ValueError, "sideways", "forward"):
        plan.view("sideways")


# --------------------------------------------------------------------------------------------------
# plan binding (spec 8)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, needles",
    [
        (lambda: fixed_qkv(sq=SQ + 1), ("q", "shape", str(SQ + 1))),
        (lambda: fixed_qkv(sk=SK - 1), ("k", "shape", str(SK - 1))),
        (lambda: fixed_qkv(b=B + 1), ("q", "shape", "build one for these tensors")),
        (lambda: fixed_qkv(hq=2 * HQ), ("q", "shape")),
        (lambda: fixed_qkv(hkv=HQ), ("k", "shape")),
        (lambda: fixed_qkv(dv=2 * D), ("v", "shape", str(2 * D))),
        (lambda: fixed_qkv(dtype=torch.float32), ("q", "float32", "float64", "tensors of torch.float32")),
        (lambda: (*fixed_qkv()[:2], fixed_qkv(dtype=torch.float32)[2]), ("v", "float32", "share one dtype")),
        (lambda: tuple(t.reshape(-1, *t.shape[2:]) for t in fixed_qkv()), ("q", "shape")),
        (lambda: (torch.randn(B, SQ, HQ, 2 * D, dtype=torch.float64)[..., ::2], *fixed_qkv()[1:]),
         ("q", "contiguous", "q.contiguous()")),
        (lambda: (fixed_qkv()[0].transpose(1, 2).contiguous(), *fixed_qkv()[1:]),
         ("q", "[B, H, S, D] (SDPA's layout)", "q.transpose(1, 2)")),
    ],
    ids=["sq", "sk", "batch", "hq", "hkv", "dv", "dtype", "v-dtype", "thd-for-fixed", "strided-q", "bhsd-q"],
)
def test_plan_refuses_other_geometry_or_dtype(make, needles):
    plan = flexattn.create_mask_plan(causal_mask(), *fixed_qkv())
    q, k, v = make()
    with expect(PlanBindingError, ValueError, *needles):
        flexattn.flex_attn_func(q, k, v, mask_plan=plan)


def test_a_head_dim_of_one_is_contiguous_whatever_its_stride():
    """A transposed ``[..., 1]`` tensor keeps its old stride on the size-1 dimension (and
    ``.contiguous()`` returns it as it is): its head dimension is still contiguous."""
    q, k, _ = fixed_qkv(hkv=2)
    v = torch.randn(B, SK, 1, 2, dtype=torch.float64).transpose(-1, -2)  # Dv = 1, strides (.., 2, 1, 2)
    assert v.stride(-1) == 2 and v.contiguous() is v
    plan = flexattn.create_mask_plan(causal_mask(), q, k, v)
    out = flexattn.flex_attn_func(q, k, v, mask_plan=plan)
    v_plain = v.new_empty(v.shape).copy_(v)
    assert v_plain.stride(-1) == 1
    assert torch.equal(out, flexattn.flex_attn_func(q, k, v_plain, mask_plan=plan))


def test_varlen_plan_refuses_other_totals():
    ep, (q, k, v), args = varlen_case()
    plan = flexattn.create_mask_plan(ep, q, k, v, **args)
    with expect(PlanBindingError, ValueError, "k", "shape", "266"):
        flexattn.flex_attn_func(q, torch.cat([k, k[:1]]), torch.cat([v, v[:1]]), mask_plan=plan)
    with expect(PlanBindingError, ValueError, "q", "shape"):
        flexattn.flex_attn_func(q.reshape(1, 200, HQ, D), k, v, mask_plan=plan)
    with expect(InputTypeError, TypeError, "v must be a torch.Tensor, got NoneType"):
        flexattn.flex_attn_func(q, k, None, mask_plan=plan)


def test_signature_mismatch_names_the_fields():
    """A view materialised for another consumer topology is refused, never reinterpreted."""
    from maskplan_core import PlanSignature, RowMajorLayout, Topology, ViewConfig, validate_plan_inputs
    from maskplan_core.reference import build_plan

    def cfg(direction):
        layout = RowMajorLayout(64, 64)
        sig = PlanSignature(
            arch_family="reference", direction=direction, kernel_family="reference-torch-v1",
            topology=Topology(tile_m=64, tile_n=64), mma_layout="none", payload=layout.spec,
            scheduler_layout="k-major" if direction == "backward" else "plan-fwd-work-desc-v1",
            dq_order_format="rank_int32" if direction == "backward" else "none",
        )
        return ViewConfig(sig, layout)

    ep, qkv = causal_mask(), fixed_qkv()
    geometry = validate_plan_inputs(ep, *qkv)
    plan = build_plan(ep, geometry, cfg("forward"), cfg("backward"), "maskplan-reference")
    with pytest.raises(PlanSignatureMismatch) as info:
        flexattn.flex_attn_func(*qkv, mask_plan=plan)
    assert isinstance(info.value, ValueError)
    fields = {d.field for d in info.value.diffs}
    assert {"topology.tile_m", "topology.tile_n", "payload.layout_id"} <= fields
    assert "topology.tile_m" in str(info.value) and "forward" in str(info.value)


# --------------------------------------------------------------------------------------------------
# ownership: cloned prefixes, read-only plan, snapshot clones
# --------------------------------------------------------------------------------------------------


def test_varlen_plan_survives_caller_mutating_cu_seqlens():
    ep, (q, k, v), args = varlen_case(requires_grad=True)
    plan = flexattn.create_mask_plan(ep, q, k, v, **args)
    out1, lse1 = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True)
    g1 = torch.autograd.grad(out1.sum() + lse1[torch.isfinite(lse1)].sum(), (q, k, v))
    args["cu_seqlens_q"][1] = 7  # in-place edits of the caller's prefixes
    args["cu_seqlens_k"].zero_()
    assert plan.geometry.cu_seqlens_q.tolist() == CU_Q and plan.geometry.cu_seqlens_k.tolist() == CU_K
    out2, lse2 = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True)
    g2 = torch.autograd.grad(out2.sum() + lse2[torch.isfinite(lse2)].sum(), (q, k, v))
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    for a, b in zip(g1, g2, strict=True):
        assert torch.equal(a, b)


def test_mask_plan_is_read_only():
    plan = flexattn.create_mask_plan(causal_mask(), *fixed_qkv())
    for name in ("_views", "_geometry", "_header", "_consumer", "geometry", "new_attribute"):
        with pytest.raises(AttributeError):
            setattr(plan, name, None)
    assert plan.roles == ("forward",) and plan.geometry.batch == B


def test_mask_plan_attributes_cannot_be_deleted():
    """Read-only includes deletion: ``del plan._views`` must not strip a plan of its views."""
    plan = flexattn.create_mask_plan(causal_mask(), *fixed_qkv())
    for name in ("_views", "_geometry", "_header", "_consumer"):
        with pytest.raises(AttributeError):
            delattr(plan, name)
    assert plan.roles == ("forward",) and plan.geometry.batch == B


def test_mask_plan_copies_are_the_plan_and_pickling_is_refused():
    """A model holding a plan deep-copies (an EMA copy) and shares the read-only plan; pickling
    names what to do instead."""
    import copy
    import pickle

    plan = flexattn.create_mask_plan(causal_mask(), *fixed_qkv())
    module = torch.nn.Linear(2, 2)
    module.plan = plan
    assert copy.deepcopy(module).plan is plan and copy.copy(plan) is plan
    with pytest.raises(TypeError, match="MaskPlan cannot be pickled.*create_mask_plan"):
        pickle.dumps(plan)


def test_debug_snapshot_returns_clones():
    ep = causal_mask(nfunc=3)
    ep[0, 1, ::3] = ep[0, 0, ::3]  # some holes so there are partial blocks with payloads
    q, k, v = fixed_qkv()
    plan = flexattn.create_mask_plan(ep, q, k, v, build_backward=True)
    out_before = flexattn.flex_attn_func(q, k, v, mask_plan=plan)
    dense_before = plan.view("forward").to_dense()
    snap = plan.debug_snapshot()
    assert set(snap) == {"metadata", "forward", "backward", "dq", "cu_seqlens_q", "cu_seqlens_k", "geometry"}
    assert snap["dq"] is None and snap["cu_seqlens_q"] is None  # cuDNN's, at fixed length
    assert snap["metadata"].total_q == plan.metadata.total_q
    fwd = plan.view("forward")
    assert snap["forward"]["sequence_desc"] is None and snap["forward"]["dq_write_order"] is None
    for name, t in snap["forward"].items():
        if t is None:
            assert fwd.tensors.get(name) is None, name
            continue
        assert torch.equal(t, fwd.tensors[name]), name
        assert t.data_ptr() != fwd.tensors[name].data_ptr() or t.numel() == 0, f"{name} is not a clone"
    for role in ("forward", "backward", "geometry"):
        for t in snap[role].values():
            if t is not None and t.numel():
                t.fill_(-7)  # scribble over everything the snapshot returned
    assert torch.equal(plan.view("forward").to_dense(), dense_before)
    assert plan.geometry.cu_seqlens_q.tolist() == [0, SQ, 2 * SQ]
    assert torch.equal(flexattn.flex_attn_func(q, k, v, mask_plan=plan), out_before)
    assert plan.debug_snapshot()["forward"]["mask_block_idx"].tolist() == fwd.mask_block_idx.tolist()


def test_debug_snapshot_of_a_forward_only_varlen_plan():
    """cuDNN's keys: the backward view the plan lacks is None, a varlen plan's prefixes are given."""
    cu = torch.tensor([0, 30, 80], dtype=torch.int32)
    q = torch.randn(80, 2, 16)
    plan = flexattn.create_mask_plan(
        flexattn.masks.causal(cu_seqlens_q=cu, cu_seqlens_k=cu), q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu,
        max_seqlen_q=50, max_seqlen_k=50, build_backward=False,
    )  # fmt: skip
    snap = plan.debug_snapshot()
    assert snap["backward"] is None and snap["forward"]["sequence_desc"] is not None
    assert snap["cu_seqlens_q"].tolist() == snap["geometry"]["cu_seqlens_k"].tolist() == [0, 30, 80]
    snap["cu_seqlens_q"].fill_(0)
    assert plan.geometry.cu_seqlens_q.tolist() == [0, 30, 80]


def test_plan_repr_and_metadata():
    plan = flexattn.create_mask_plan(causal_mask(), *fixed_qkv(), build_backward=True)
    text = repr(plan)
    assert "forward" in text and "backward" in text and "128x128" in text
    meta = plan.metadata
    assert meta["consumer"] == plan.consumer
    assert set(meta["signatures"]) == {"forward", "backward"}
    assert meta["allocation_header"]["error_flags"] == 0


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_plan_metadata_has_cudnn_fields(varlen):
    """Code written for cudnn.flex_attention reads plan.metadata.<field>; a forward-only plan, and
    a varlen one with GQA packing, say so."""
    if varlen:
        q, k, v = (torch.randn(700, h, 32) for h in (4, 2, 2))
        cu = torch.tensor([0, 300, 700], dtype=torch.int32)
        seqlens = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=400, max_seqlen_k=400)
        mask = flexattn.masks.causal(cu_seqlens_q=cu, cu_seqlens_k=cu)
    else:
        q, k, v = (torch.randn(2, 300, h, 32) for h in (4, 2, 2))
        seqlens, mask = {}, flexattn.masks.causal(300, batch=2)
    meta = flexattn.create_mask_plan(mask, q, k, v, build_backward=False, pack_gqa=varlen, **seqlens).metadata
    got = {name: getattr(meta, name) for name in (
        "mode", "arch", "device", "dtype", "batch_size", "total_q", "total_k", "max_seqlen_q", "max_seqlen_k",
        "num_q_heads", "num_kv_heads", "head_dim", "head_dim_v", "hmask", "nfunc", "pack_gqa", "has_backward",
    )}  # fmt: skip
    total, longest = (700, 400) if varlen else (600, 300)
    assert got == {
        "mode": "varlen" if varlen else "fixed", "arch": None, "device": torch.device("cpu"),
        "dtype": torch.float32, "batch_size": 2, "total_q": total, "total_k": total, "max_seqlen_q": longest,
        "max_seqlen_k": longest, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 32, "head_dim_v": 32,
        "hmask": 1, "nfunc": 1, "pack_gqa": varlen, "has_backward": False,
    }  # fmt: skip
    assert meta["consumer"] == "maskplan-reference"  # and still the dict it was
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        again = pickle.loads(pickle.dumps(meta, protocol))
        assert again == meta and again.total_q == total, protocol
    with pytest.raises(AttributeError, match="no field 'total_kv'.*total_k"):
        getattr(meta, "total_kv")  # noqa: B009 - the attribute lookup is what is tested


# --------------------------------------------------------------------------------------------------
# flex_attn_func options
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, cls, needles",
    [
        (dict(deterministic=1), InputTypeError, ("deterministic", "bool", "int")),
        (dict(deterministic=None), InputTypeError, ("deterministic", "bool")),
        (dict(return_lse="yes"), InputTypeError, ("return_lse", "bool")),
        (dict(return_max_logit=0), InputTypeError, ("return_max_logit", "bool")),
        (dict(softmax_scale=math.nan), InputValueError, ("softmax_scale", "finite", "nan")),
        (dict(softmax_scale=math.inf), InputValueError, ("softmax_scale", "finite")),
        (dict(softmax_scale=10**400), InputValueError, ("softmax_scale", "finite", "past the float range")),
        (dict(softmax_scale=fractions.Fraction(10**400)), InputValueError, ("softmax_scale", "finite")),
        (dict(softmax_scale="0.1"), flexattn.ScaleTypeError, ("softmax_scale", "str")),
        (dict(softmax_scale=True), flexattn.ScaleTypeError, ("softmax_scale", "bool")),
        (dict(softmax_scale=torch.tensor(0.1)), flexattn.ScaleTypeError, ("softmax_scale", ".item()")),
        (dict(softmax_scale=-0.25, return_max_logit=True), InputValueError,
         ("return_max_logit", "softmax_scale", "-0.25")),
    ],
    ids=["det-int", "det-none", "lse-str", "maxlogit-int", "scale-nan", "scale-inf", "scale-huge-int",
         "scale-huge-fraction", "scale-str", "scale-bool", "scale-tensor", "maxlogit-negative-scale"],
)
def test_flex_attn_func_option_errors(kw, cls, needles):
    q, k, v = fixed_qkv()
    plan = flexattn.create_mask_plan(causal_mask(), q, k, v)
    builtin = TypeError if issubclass(cls, TypeError) else ValueError
    with expect(cls, builtin, *needles):
        flexattn.flex_attn_func(q, k, v, mask_plan=plan, **kw)
    if cls is flexattn.ScaleTypeError:  # cuDNN raises ValueError: its callers catch it
        with pytest.raises(ValueError):
            flexattn.flex_attn_func(q, k, v, mask_plan=plan, **kw)


@pytest.mark.parametrize("scale", [1e39, -1e39])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scale_past_the_accumulation_dtype_is_refused(dtype, scale):
    """fp16 / bf16 / fp32 inputs accumulate in fp32 on the CPU as on the GPU: a scale past its range
    would make every score infinite (NaN outputs), so both refuse it; fp64 inputs hold it."""
    q, k, v = fixed_qkv(dtype=dtype)
    plan = flexattn.create_mask_plan(causal_mask(), q, k, v)
    with expect(InputValueError, ValueError, f"softmax_scale={scale!r}", "fp32 range"):
        flexattn.flex_attn_func(q, k, v, mask_plan=plan, softmax_scale=scale)
    q, k, v = (t.detach().requires_grad_() for t in fixed_qkv())  # fp64
    plan = flexattn.create_mask_plan(causal_mask(), q, k, v)
    out = flexattn.flex_attn_func(q, k, v, mask_plan=plan, softmax_scale=1e39)
    out.sum().backward()
    assert all(torch.isfinite(t).all() for t in (out, q.grad, k.grad, v.grad))


@pytest.mark.parametrize("kind", ["fraction", "float32", "float64"])
def test_flex_attn_func_takes_a_real_scale_of_any_type(kind):
    """A numpy scalar or another real number works as ``softmax_scale``, as its float does (fp64
    reference; two CPU calls may differ in the last bits, so not ``torch.equal``)."""
    # numpy only where a test needs it: the facade's test extra installs it, a GPU machine may not
    if kind == "fraction":
        scale = fractions.Fraction(1, 8)
    else:
        scale = getattr(pytest.importorskip("numpy"), kind)(0.125)
    q, k, v = fixed_qkv()
    plan = flexattn.create_mask_plan(causal_mask(), q, k, v)
    want = flexattn.flex_attn_func(q, k, v, mask_plan=plan, softmax_scale=0.125)
    torch.testing.assert_close(flexattn.flex_attn_func(q, k, v, mask_plan=plan, softmax_scale=scale), want)


def test_varlen_lengths_and_block_map_take_numpy_integers():
    """``max_seqlen_*`` (and ``block_map``'s sample / head) accept numpy integers, as ints."""
    np = pytest.importorskip("numpy")
    ep, qkv, args = varlen_case()
    want = flexattn.create_mask_plan(ep, *qkv, **args)
    args.update(max_seqlen_q=np.int64(args["max_seqlen_q"]), max_seqlen_k=np.int32(args["max_seqlen_k"]))
    plan = flexattn.create_mask_plan(ep, *qkv, **args)
    assert type(plan.geometry.max_seqlen_q) is int and type(plan.geometry.max_seqlen_k) is int
    view, want_view = plan.view("forward"), want.view("forward")
    assert torch.equal(view.block_map(np.int64(1), np.int32(0)), want_view.block_map(1, 0))


@pytest.mark.parametrize("layout", ["fixed", "varlen"])
def test_a_plan_whose_prefixes_were_written_is_refused(layout):
    """Spec 8's versioned binding: the plan's own sample prefixes (handed out through
    ``plan.geometry``) written in place would move its samples, so the plan refuses to run; a new
    plan of the same shape gets prefixes of its own (fixed-length plans share theirs) and runs."""
    if layout == "fixed":
        ep, qkv, args = causal_mask(), fixed_qkv(), {}
    else:
        ep, qkv, args = varlen_case()
    plan = flexattn.create_mask_plan(ep, *qkv, **args)
    want = flexattn.flex_attn_func(*qkv, mask_plan=plan)
    plan.geometry.cu_seqlens_k[1] += 0  # any in-place write counts
    with expect(PlanBindingError, ValueError, "cu_seqlens", "written in place", "build a new one"):
        flexattn.flex_attn_func(*qkv, mask_plan=plan)
    fresh = flexattn.create_mask_plan(ep, *qkv, **args)
    assert fresh.geometry.cu_seqlens_k is not plan.geometry.cu_seqlens_k
    assert torch.equal(flexattn.flex_attn_func(*qkv, mask_plan=fresh), want)


@pytest.mark.parametrize("role", ["forward", "backward"])
def test_a_plan_whose_view_tensors_were_written_is_refused(role):
    """A view's tensors are plan storage handed out read-only (``plan.view(role).mask_block_idx``):
    written in place, they would change the blocks attention reads, so the plan refuses to run,
    naming the tensor, whichever view (the forward's or the backward's) was written."""
    q, k, v = fixed_qkv(requires_grad=True)
    plan = flexattn.create_mask_plan(causal_mask(), q, k, v)
    flexattn.flex_attn_func(q, k, v, mask_plan=plan).sum().backward()
    plan.view(role).full_block_idx.fill_(0)
    with expect(PlanBindingError, ValueError, f"view('{role}').full_block_idx", "written in place"):
        flexattn.flex_attn_func(q, k, v, mask_plan=plan)


def test_a_plan_whose_handle_tensor_was_written_is_refused():
    """``handle_tensor`` names the plan where only tensors travel; overwritten with another plan's
    handle, the call would run that plan's mask. The plan refuses instead."""
    q, k, v = fixed_qkv()
    plan = flexattn.create_mask_plan(causal_mask(), q, k, v)
    everything = torch.full((1, 1, B * SQ), SK, dtype=torch.int32)  # every key visible
    other = flexattn.create_mask_plan(everything, q, k, v)
    plan.handle_tensor.fill_(other.handle)
    with expect(PlanBindingError, ValueError, "handle_tensor", "written in place"):
        flexattn.flex_attn_func(q, k, v, mask_plan=plan)


def test_a_prefix_write_under_inference_mode_is_counted():
    """The prefixes are normal tensors even when the plan (and the shared fixed-length prefixes) are
    made under ``inference_mode``, so a write there is seen too: the plan refuses, and the next plan
    of that shape gets prefixes of its own."""
    ep, qkv = causal_mask(b=3, sq=40, sk=40), fixed_qkv(b=3, sq=40, sk=40)
    with torch.inference_mode():
        plan = flexattn.create_mask_plan(ep, *qkv)
        plan.geometry.cu_seqlens_q[1] = 7
    with expect(PlanBindingError, ValueError, "written in place"):
        flexattn.flex_attn_func(*qkv, mask_plan=plan)
    assert flexattn.create_mask_plan(ep, *qkv).geometry.cu_seqlens_q.tolist() == [0, 40, 80, 120]


def test_plans_made_under_inference_mode():
    """Inference tensors keep no version counter: plans built and run under ``inference_mode``
    work, and a fixed-length plan of the same shape built after it trains."""
    ep, qkv, args = varlen_case()
    with torch.inference_mode():
        for e, tensors, a in ((causal_mask(), fixed_qkv(), {}), (ep, qkv, args)):
            flexattn.flex_attn_func(*tensors, mask_plan=flexattn.create_mask_plan(e, *tensors, **a))
    q, k, v = fixed_qkv(requires_grad=True)
    plan = flexattn.create_mask_plan(causal_mask(), q, k, v)
    flexattn.flex_attn_func(q, k, v, mask_plan=plan).sum().backward()
    assert q.grad is not None


def test_a_plan_made_under_inference_mode_trains():
    """A plan built in a planning step under ``inference_mode`` (a data loader's) serves training
    steps, eager and compiled: what they save of it for the backward is a normal tensor."""
    q, k, v = fixed_qkv(requires_grad=True)
    with torch.inference_mode():
        plan = flexattn.create_mask_plan(causal_mask(), q, k, v, build_backward=True)
    assert not plan.handle_tensor.is_inference()
    want = None
    for attend in (flexattn.flex_attn_func, torch.compile(flexattn.flex_attn_func, backend="aot_eager")):
        grads = torch.autograd.grad(attend(q, k, v, mask_plan=plan).square().sum(), (q, k, v))
        want = want or grads
        assert all(torch.equal(g, w) for g, w in zip(grads, want, strict=True))


def test_to_dense_is_as_wide_as_the_longest_sample_not_a_loose_max_seqlen():
    """A generous ``max_seqlen_k`` (a model's context length) bounds the samples; the decoded mask
    is as wide as the longest one, as with the exact bound (it used to allocate the bound's width)."""
    ep, qkv, args = varlen_case()
    want = flexattn.create_mask_plan(ep, *qkv, **args).view("forward").to_dense()
    args.update(max_seqlen_q=1 << 30, max_seqlen_k=1 << 30)
    dense = flexattn.create_mask_plan(ep, *qkv, **args).view("forward").to_dense()
    assert dense.shape == (1, 200, 200) and torch.equal(dense, want)


@pytest.mark.parametrize("bad", [None, {}, "plan", causal_mask()])
def test_flex_attn_func_needs_a_mask_plan(bad):
    with expect(InputTypeError, TypeError, "mask_plan", "MaskPlan"):
        flexattn.flex_attn_func(*fixed_qkv(), mask_plan=bad)


def test_a_mask_in_place_of_the_plan_names_the_plan_to_build():
    """Someone moving from torch FlexAttention passes its BlockMask where the plan goes (or an
    endpoint tensor): the error names the call that makes a plan of it, as create_mask_plan's does."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    block_mask = fa.create_block_mask(lambda b, h, q, kv: kv <= q, B, None, SQ, SK, device="cpu")
    cases = ((block_mask, "masks.from_block_mask(block_mask)"), (causal_mask(), "create_mask_plan("))
    for mask, remedy in cases:
        with expect(InputTypeError, TypeError, "mask_plan must be a MaskPlan", remedy):
            flexattn.flex_attn_func(*fixed_qkv(), mask_plan=mask)


@pytest.mark.parametrize(
    "keyword, value, remedy",
    [
        ("scale", 0.5, "pass softmax_scale="),
        ("enable_gqa", True, "Hq a multiple of Hkv is GQA"),
        ("block_mask", object(), "masks.from_block_mask(block_mask)"),
        ("score_mod", lambda s, b, h, q, kv: s, "masks only"),
        ("return_aux", object(), "return_lse=True"),
        ("kernel_options", {}, "the plan fixes the kernels' tiles"),
        ("attn_mask", torch.ones(1), "masks.from_dense(attn_mask)"),
        ("is_causal", True, "create_mask_plan(masks.causal(Sq, Sk, batch=B, align='top_left'"),
        ("dropout_p", 0.1, "no attention dropout"),
        ("query", torch.ones(1), "pass q, k, v positionally"),
    ],
)
def test_a_keyword_of_torch_attention_names_what_flexattn_takes(keyword, value, remedy):
    """A call ported from torch's flex_attention or SDPA that keeps one of their keywords is refused
    with what to do instead (Python's own error names the keyword only); the signature stays cuDNN's,
    and another unknown keyword gets Python's error."""
    import inspect

    q, k, v = fixed_qkv()
    plan = flexattn.create_mask_plan(causal_mask(), q, k, v)
    with expect(InputTypeError, TypeError, f"flex_attn_func() got {keyword}=", remedy):
        flexattn.flex_attn_func(q, k, v, mask_plan=plan, **{keyword: value})
    with pytest.raises(TypeError, match="unexpected keyword argument 'scal'"):
        flexattn.flex_attn_func(q, k, v, mask_plan=plan, scal=0.5)
    assert "scale" not in inspect.signature(flexattn.flex_attn_func).parameters


@pytest.mark.parametrize(
    "keyword, value, remedy",
    [
        ("cu_seqlens_q", torch.zeros(2, dtype=torch.int32), "the plan carries the samples"),
        ("max_seqlen_k", 128, "to create_mask_plan (with the mask and q, k, v in THD)"),
        ("cu_seqlens_k", torch.zeros(2, dtype=torch.int32), "build one plan per batch"),
        ("causal", True, "masks.causal(Sq, Sk, batch=B, device=q.device)"),
        ("window_size", (64, 0), "masks.sliding_window(Sq, Sk, batch=B, window_left=64, device=q.device)"),
        ("stream", object(), "torch's current stream"),
        ("causal", False, "drop it: causal=False is FlashAttention's no mask"),
        ("window_size", (-1, -1), "drop it: window_size=(-1, -1) is FlashAttention's no mask"),
        ("seqused_k", torch.ones(2, dtype=torch.int32), "pass seqused_k= to the builder"),
        ("softcap", 30.0, "no logit softcapping"),
        ("softcap", 0.0, "drop it: 0.0 is FlashAttention's default"),
        ("alibi_slopes", torch.ones(2), "no ALiBi"),
        ("block_table", torch.zeros(2, 1, dtype=torch.int32), "no paged KV cache"),
        ("return_attn_probs", True, "pass return_lse=True"),
        ("return_softmax_lse", True, "pass return_lse=True"),
        ("leftpad_k", torch.zeros(2, dtype=torch.int32), "no left-padded k"),
    ],
)
def test_a_keyword_of_flash_attention_names_what_flexattn_takes(keyword, value, remedy):
    """A call ported from FlashAttention's (varlen) functions, which take the samples and the mask
    per call, is told where they go here (Python's own error named the keyword only)."""
    q, k, v = fixed_qkv()
    plan = flexattn.create_mask_plan(causal_mask(), q, k, v)
    said = f"flex_attn_func() got {keyword}=, FlashAttention's keyword"
    with expect(InputTypeError, TypeError, said, remedy):
        flexattn.flex_attn_func(q, k, v, mask_plan=plan, **{keyword: value})


def test_flash_attention_positional_samples_are_named():
    """flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) in
    FlashAttention's positions: the 1-D integer tensor after v is named as its cu_seqlens_q, with
    where the samples go here (endpoints, 3-D, keep their own hint)."""
    _, (q, k, v), args = varlen_case()
    cu_q, cu_k = args["cu_seqlens_q"], args["cu_seqlens_k"]
    for cu in (cu_q, cu_q.long()):
        with expect(InputTypeError, TypeError, "argument 4 is Tensor: FlashAttention's cu_seqlens_q?",
                    "the plan carries the samples"):  # fmt: skip
            flexattn.flex_attn_func(q, k, v, cu, cu_k, args["max_seqlen_q"], args["max_seqlen_k"])
    with expect(InputTypeError, TypeError, "argument 4 is Tensor: interval endpoints?"):
        flexattn.flex_attn_func(*fixed_qkv(), causal_mask())


def flash_visible(sq: int, sk: int, causal: bool, window: tuple[int, int], used: int) -> torch.Tensor:
    """FlashAttention's mask of one sample of which the first ``used`` keys are in use: key
    ``j < used`` is visible to query i where ``i + used - sq - left <= j <= i + used - sq + right``
    (bottom-right; -1: no limit), ``right`` 0 where ``causal``."""
    left, right = window
    right = 0 if causal else right
    i, j = torch.arange(sq)[:, None] + used - sq, torch.arange(sk)[None, :]
    lo = (j >= i - left) if left >= 0 else torch.ones(sq, sk, dtype=torch.bool)
    hi = (j <= i + right) if right >= 0 else torch.ones(sq, sk, dtype=torch.bool)
    return lo & hi & (j < used)


@pytest.mark.parametrize(
    "given",
    [
        {"causal": True},
        {"causal": True, "window_size": (3, 3)},  # FlashAttention takes the right side as 0
        {"causal": True, "window_size": (-1, 5)},
        {"window_size": (3, 2)},
        {"window_size": (-1, 4)},
        {"window_size": (6, -1)},
    ],
    ids=str,
)
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("seqused", [False, True], ids=["all-keys", "seqused_k"])
def test_flash_attention_mask_keywords_are_read_together_and_their_hint_runs(given, varlen, seqused):
    """causal= and window_size= (with seqused_k=, which moves the diagonal to the used keys) are
    read together, as FlashAttention's kernels read them, and the hint names one mask in q's
    layout (THD: its samples' boundaries); built as written, its plan shows FlashAttention's keys,
    samples of Sq != Sk included."""
    import re

    if varlen:
        _, (q, k, v), args = varlen_case()
        cu_q, cu_k = args["cu_seqlens_q"], args["cu_seqlens_k"]
        max_q, max_k = args["max_seqlen_q"], args["max_seqlen_k"]
        samples = list(zip((cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist(), strict=True))
    else:
        q, k, v = fixed_qkv()
        samples = [(SQ, SK)] * B
    used = [max(sk - 7 * b - 3, 0) if seqused else sk for b, (_, sk) in enumerate(samples)]
    call = dict(given, seqused_k=torch.tensor(used, dtype=torch.int32)) if seqused else given
    names = " and ".join(f"{name}=" for name in call)
    with expect(InputTypeError, TypeError, f"got {names}, FlashAttention's keyword") as info:
        flexattn.flex_attn_func(q, k, v, **call)
    hint = re.search(r"mask_plan=(create_mask_plan\(.*\)) \(aligned", str(info.value)).group(1)
    scope = {"create_mask_plan": flexattn.create_mask_plan, "masks": flexattn.masks}
    scope |= {"q": q, "k": k, "v": v, "seqused_k": call.get("seqused_k")}
    if varlen:
        scope |= {"cu_q": cu_q, "cu_k": cu_k, "max_q": max_q, "max_k": max_k}
    else:
        scope |= {"Sq": SQ, "Sk": SK, "B": B}
    dense = eval(hint, scope).view("forward").to_dense()[0]  # noqa: S307 (the library's own text)
    row = 0
    for (sq, sk), u in zip(samples, used, strict=True):
        want = flash_visible(sq, sk, given.get("causal", False), given.get("window_size", (-1, -1)), u)
        assert torch.equal(dense[row : row + sq, :sk], want), (sq, sk, u)
        row += sq


@pytest.mark.parametrize(
    "given, said",
    [
        ({"causal": "no"}, "causal= takes True or False, got 'no'"),
        ({"causal": torch.tensor([True, False])}, "causal= takes True or False"),
        ({"window_size": (3.7, 0)}, "window_size= takes (left, right), two ints"),
        ({"window_size": (math.inf, 0)}, "two ints (-1: no limit), got (inf, 0)"),
        ({"window_size": None}, "got None"),
        ({"window_size": (1, 2, 3)}, "got (1, 2, 3)"),
        ({"causal": True, "window_size": "3,0"}, "got '3,0'"),
    ],
    ids=str,
)
def test_flash_attention_mask_keywords_of_other_values_are_named(given, said):
    """A causal= or window_size= value FlashAttention would not take gets its own refusal, not a
    crash or a hint read from a coerced value."""
    q, k, v = fixed_qkv()
    with expect(InputTypeError, TypeError, "FlashAttention's keyword", said):
        flexattn.flex_attn_func(q, k, v, **given)


def test_torch_defaults_of_its_keywords_are_refused_as_asking_nothing():
    """torch's defaults (score_mod=None, is_causal=False, dropout_p=0.0, ...) ask for nothing: the
    refusal says to drop them, and a mask keyword's default without a mask_plan (torch's "no mask")
    names the plan of no mask; SDPA's is_causal=True names the plan of the top-left causal mask."""
    q, k, v = fixed_qkv()
    plan = flexattn.create_mask_plan(causal_mask(), q, k, v)
    for keyword, value in (("score_mod", None), ("is_causal", False), ("scale", None)):
        with expect(InputTypeError, TypeError, f"got {keyword}=", "drop it", "torch's default"):
            flexattn.flex_attn_func(q, k, v, mask_plan=plan, **{keyword: value})
    both = "torch's and FlashAttention's default"
    with expect(InputTypeError, TypeError, "got dropout_p=", "drop it", both):
        flexattn.flex_attn_func(q, k, v, mask_plan=plan, dropout_p=0.0)
    for keyword, value in (("block_mask", None), ("attn_mask", None), ("is_causal", False)):
        with expect(InputTypeError, TypeError, f"got {keyword}=", "torch's no mask", "masks.full(Sq, Sk"):
            flexattn.flex_attn_func(q, k, v, **{keyword: value})
    top_left = "create_mask_plan(masks.causal(Sq, Sk, batch=B, align='top_left', device=q.device), q, k, v)"
    with expect(InputTypeError, TypeError, top_left, "top-left"):
        flexattn.flex_attn_func(q, k, v, mask_plan=plan, is_causal=True)
    with expect(InputTypeError, TypeError, "needs mask_plan=", "masks.full(Sq, Sk"):
        flexattn.flex_attn_func(q, k, v)
    with expect(InputTypeError, TypeError, "got NoneType", "masks.full(Sq, Sk"):
        flexattn.flex_attn_func(q, k, v, mask_plan=None)
    # varlen THD: the plan of no mask takes the samples' boundaries, which Sq, Sk, B do not say
    q, k, v = varlen_case()[1]
    thd_full = "masks.full(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k), q, k, v, cu_seqlens_q=cu_q"
    for call in ({}, {"mask_plan": None}, {"block_mask": None}):
        with expect(InputTypeError, TypeError, thd_full):
            flexattn.flex_attn_func(q, k, v, **call)
    with expect(InputTypeError, TypeError, thd_full):
        flexattn.flex_attn_func(q=q, k=k, v=v)
    with expect(InputTypeError, TypeError, thd_full):
        flexattn.flex_attn_func(q, k, v, None, None)


def test_torch_positional_arguments_are_named():
    """flex_attention(q, k, v, score_mod, block_mask) and SDPA(q, k, v, attn_mask) in torch's
    positions: the error says what the extra argument looks like and what to pass instead."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = fixed_qkv()
    plan = flexattn.create_mask_plan(causal_mask(), q, k, v)
    block_mask = fa.create_block_mask(lambda b, h, q, kv: kv <= q, B, None, SQ, SK, device="cpu")
    for args, needles in (
        ((None, block_mask), ("argument 5 is BlockMask", "masks.from_block_mask(block_mask)")),
        ((lambda s, b, h, q, kv: s,), ("argument 4 is function", "score_mod?")),
        ((torch.zeros(SQ, SK),), ("argument 4 is Tensor", "SDPA's attn_mask?", "attn_mask == 0")),
        ((plan,), ("argument 4 is MaskPlan", "pass it as mask_plan=")),
        ((causal_mask(),), ("argument 4 is Tensor", "endpoints?", "create_mask_plan(mask_func, q, k, v)")),
        ((torch.zeros(SQ, SK, dtype=torch.bool),), ("a bool tensor", "from_dense(attn_mask), q, k, v)")),
        ((None, 0.0, True), ("argument 6 is bool", "SDPA's is_causal?", "top-left")),
        ((None, None, 0.5), ("argument 6 is float", "softmax_scale=")),
        ((None, False), ("pass mask_plan=create_mask_plan(masks.full(",)),
    ):
        with expect(InputTypeError, TypeError, "takes q, k, v positionally", *needles):
            flexattn.flex_attn_func(q, k, v, *args)
    with expect(InputTypeError, TypeError, "drop them: torch's defaults ask for nothing"):
        flexattn.flex_attn_func(q, k, v, None, 0.0, False, mask_plan=plan)


def test_torch_names_looked_up_on_the_package_name_flexattns_way():
    """... and cuDNN's module name: flexattn is what cudnn.flex_attention was."""
    for name, needle in (
        ("flex_attention", "flex_attn_func("),
        ("flex_attention", "cudnn.flex_attention is flexattn itself"),
        ("create_block_mask", "from_mask_mod("),
        ("and_masks", "flexattn.masks.intersect("),
        ("or_masks", "flexattn.masks.union("),
    ):
        said = rf"no attribute '{name}' \(torch's name\).*{re.escape(needle)}"
        with pytest.raises(AttributeError, match=said):
            getattr(flexattn, name)
        if name.endswith("_masks"):  # also where the mask builders are
            with pytest.raises(AttributeError, match=said):
                getattr(flexattn.masks, name)
    assert not hasattr(flexattn, "flex_attention")
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'$"):
        flexattn.nothing_here  # noqa: B018


def test_flex_attn_func_return_arity():
    q, k, v = fixed_qkv()
    plan = flexattn.create_mask_plan(causal_mask(), q, k, v)
    assert isinstance(plan, MaskPlan)
    out = flexattn.flex_attn_func(q, k, v, mask_plan=plan)
    assert isinstance(out, torch.Tensor) and out.shape == (B, SQ, HQ, D)
    out, lse = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True)
    assert lse.shape == (B, HQ, SQ)
    out, mx = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_max_logit=True)
    assert mx.shape == (HQ,)
    out, lse, mx = flexattn.flex_attn_func(q, k, v, mask_plan=plan, return_lse=True, return_max_logit=True)
    assert lse.shape == (B, HQ, SQ) and mx.shape == (HQ,)
    # a zero or integer scale and a negative scale without max logit are all legal
    flexattn.flex_attn_func(q, k, v, mask_plan=plan, softmax_scale=0)
    flexattn.flex_attn_func(q, k, v, mask_plan=plan, softmax_scale=-1.0)
