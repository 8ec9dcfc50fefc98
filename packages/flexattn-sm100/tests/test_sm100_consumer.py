"""Sm100Consumer.resolve: variants per head-dim pair, rejections, JSON, no kernels, never on hardware."""

from __future__ import annotations

import dataclasses
import re
import types

import pytest

from flexattn_sm100 import (
    BWD_VARIANTS,
    FWD_VARIANTS,
    Sm100BwdConfig,
    Sm100Consumer,
    Sm100FwdConfig,
    select_bwd_config,
    select_fwd_config,
)
from maskplan_core.consumer import Consumer, ViewRequest
from maskplan_core.errors import ConsumerNotFoundError, UnsupportedConfigError
from maskplan_core.schema import PayloadLayoutSpec, PlanSignature, Topology

PAIRS = [(32, 32), (64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]

# dims -> (kernel_family, (tile_m, tile_n), q_stage, cta_group_size, cluster_axis, layout_id suffix,
#          (subtiles, groups, words))
# the defaults are the variants with a kernel (heuristics.py): forward qstage1-1cta for Dv <= 128 and
# d256 for (256, 256), backward k2q-1cta up to (192, 128) and d256 for (256, 256)
FORWARD = {
    (32, 32): ("sm100-fwd-qstage1-1cta-v1", (128, 128), 1, 1, "none", "128x128", (1, 128, 4)),
    (64, 64): ("sm100-fwd-qstage1-1cta-v1", (128, 128), 1, 1, "none", "128x128", (1, 128, 4)),
    (96, 96): ("sm100-fwd-qstage1-1cta-v1", (128, 128), 1, 1, "none", "128x128", (1, 128, 4)),
    (128, 128): ("sm100-fwd-qstage1-1cta-v1", (128, 128), 1, 1, "none", "128x128", (1, 128, 4)),
    (192, 128): ("sm100-fwd-qstage1-1cta-v1", (128, 128), 1, 1, "none", "128x128", (1, 128, 4)),
    (256, 256): ("sm100-fwd-d256-v1", (128, 128), 1, 1, "none", "128x128", (1, 128, 4)),
}  # fmt: skip
BACKWARD = {
    (32, 32): ("sm100-bwd-k2q-v1", (128, 128), 1, 1, "none", "128x128-wg2-kq", (1, 256, 2)),
    (64, 64): ("sm100-bwd-k2q-v1", (128, 128), 1, 1, "none", "128x128-wg2-kq", (1, 256, 2)),
    (96, 96): ("sm100-bwd-k2q-v1", (128, 128), 1, 1, "none", "128x128-wg2-kq", (1, 256, 2)),
    (128, 128): ("sm100-bwd-k2q-v1", (128, 128), 1, 1, "none", "128x128-wg2-kq", (1, 256, 2)),
    (192, 128): ("sm100-bwd-k2q-v1", (128, 128), 1, 1, "none", "128x128-wg2-kq", (1, 256, 2)),
    (256, 256): ("sm100-bwd-d256-k2q-v1", (64, 128), 1, 1, "none", "64x128-kq", (1, 128, 2)),
}  # fmt: skip
# variants that are defined (config, payload layout) but not selected by default: (direction, dims,
# variant) -> the same row format
NOT_DEFAULT = {
    ("forward", (64, 64), "qstage2-1cta"):
        ("sm100-fwd-qstage2-1cta-v1", (256, 128), 2, 1, "none", "256x128", (2, 128, 4)),
    ("forward", (96, 96), "qstage2-1cta"):
        ("sm100-fwd-qstage2-1cta-v1", (256, 128), 2, 1, "none", "256x128", (2, 128, 4)),
    ("forward", (128, 128), "qstage1-2cta"):
        ("sm100-fwd-qstage1-2cta-v1", (256, 128), 1, 2, "m", "256x128", (2, 128, 4)),
    ("backward", (128, 128), "k2q-2cta"):
        ("sm100-bwd-k2q-v1", (128, 256), 1, 2, "n", "128x256-wg2-kq", (2, 256, 2)),
}  # fmt: skip


def request(direction="forward", dims=(128, 128), **overrides) -> ViewRequest:
    fields = dict(
        arch_family="sm100",
        direction=direction,
        head_dim_qk=dims[0],
        head_dim_v=dims[1],
        num_heads_q=8,
        num_heads_kv=8,
        mask_heads=8,
        dtype="float16",
        varlen=True,
    )
    fields.update(overrides)
    return ViewRequest(**fields)


def expected(direction: str, dims: tuple[int, int], bit_order: str, row: tuple | None = None):
    """``bit_order``: the config's layout's (test_sm100_payload_layout pins its map to the TMEM load)."""
    table = FORWARD if direction == "forward" else BACKWARD
    kernel, tile, q_stage, cta, axis, suffix, (s, g, w) = row or table[dims]
    return PlanSignature(
        arch_family="sm100",
        direction=direction,
        kernel_family=kernel,
        topology=Topology(
            tile_m=tile[0], tile_n=tile[1], q_stage=q_stage, cta_group_size=cta, cluster_axis=axis
        ),
        mma_layout="tcgen05-tmem-ld32x32b",
        payload=PayloadLayoutSpec(
            layout_id="sm100-tmem-ld32x32b-v1-" + suffix,
            bit_order=bit_order,
            physical_subtiles=s,
            payload_groups=g,
            words_per_group=w,
        ),
        scheduler_layout="plan-clc-persistent-v1" if direction == "forward" else "k-major-grid-v1",
        dq_order_format="none" if direction == "forward" else "rank_int32",
    )


def test_consumer_identity():
    c = Sm100Consumer()
    assert isinstance(c, Consumer)
    assert c.name == "flexattn-sm100"
    assert c.arch_families == ("sm100",)
    assert Sm100Consumer.hardware_verified is False


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("dims", PAIRS, ids=[f"{a}x{b}" for a, b in PAIRS])
def test_resolve_signature(direction, dims):
    view = Sm100Consumer().resolve(request(direction, dims))
    want = expected(direction, dims, view.layout.bit_order)
    assert want.diff(view.signature) == []
    assert view.signature == want
    assert view.layout.spec == view.signature.payload
    assert (view.layout.tile_m, view.layout.tile_n) == (view.tile_m, view.tile_n)
    assert view.layout.transposed is (direction == "backward")


@pytest.mark.parametrize("key", NOT_DEFAULT, ids=[f"{d}-{v}-{a}x{b}" for d, (a, b), v in NOT_DEFAULT])
def test_not_default_variants_keep_their_signatures(key):
    """Variants without a kernel stay defined (config + payload layout), selectable explicitly."""
    direction, (dq, dv), variant = key
    if direction == "forward":
        cfg = select_fwd_config(head_dim_qk=dq, head_dim_v=dv, dtype="float16", varlen=True, variant=variant)
    else:
        cfg = Sm100BwdConfig(head_dim_qk=dq, head_dim_v=dv, dtype="float16", varlen=True,
                             variant=BWD_VARIANTS[variant])  # fmt: skip
    want = expected(direction, (dq, dv), cfg.payload_layout.bit_order, NOT_DEFAULT[key])
    assert want.diff(cfg.plan_signature()) == []
    assert cfg.plan_signature() == want


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("dims", PAIRS, ids=[f"{a}x{b}" for a, b in PAIRS])
def test_signature_json_round_trip(direction, dims):
    sig = Sm100Consumer().resolve(request(direction, dims)).signature
    again = PlanSignature.model_validate_json(sig.model_dump_json())
    assert again == sig and again.diff(sig) == []


def test_pack_gqa_none_and_false_resolve_to_false():
    for value in (None, False):
        assert Sm100Consumer().resolve(request(pack_gqa=value)).signature.topology.pack_gqa is False


@pytest.mark.parametrize("dims", [(320, 320), (64, 300), (257, 16)])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_rejects_head_dims(direction, dims):
    with pytest.raises(UnsupportedConfigError, match=r"head_dim_qk, head_dim_v") as info:
        Sm100Consumer().resolve(request(direction, dims))
    assert isinstance(info.value, ValueError)
    assert f"({dims[0]}, {dims[1]})" in str(info.value) and "(256, 256)" in str(info.value)
    assert "zero-padded" in str(info.value)  # and what else runs


HELD = [((80, 80), (96, 96)), ((48, 48), (64, 64)), ((64, 128), (128, 128)), ((128, 64), (128, 128)),
        ((160, 128), (192, 128)), ((256, 128), (256, 256)), ((200, 200), (256, 256))]  # fmt: skip


@pytest.mark.parametrize("dims, kernel", HELD, ids=[f"{a}x{b}" for (a, b), _ in HELD])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_head_dims_without_a_kernel_plan_as_the_next_kernel_up(direction, dims, kernel):
    """A pair without a kernel of its own plans with the views of the cheapest kernel that holds it
    (and runs on it, on zero-padded copies: test_held_head_dims_run_on_padded_copies), and a
    warning says so once."""
    c = Sm100Consumer()
    said = rf"=\({dims[0]}, {dims[1]}\): they run on the {re.escape(str(kernel))} kernels.* copied per call"
    with pytest.warns(UserWarning, match=said):
        view = c.resolve(request(direction, dims))
    assert view == c.resolve(request(direction, kernel))


def _held_plan(dims, total=200, hq=4, hkv=2):
    import torch

    from maskplan_core import masks
    from maskplan_core.testing import consumer_plan

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(total, h, dims[0], generator=gen).bfloat16() for h in (hq, hkv))
    v = torch.randn(total, hkv, dims[1], generator=gen).bfloat16()
    cu = torch.tensor([0, 120, total], dtype=torch.int32)
    consumer = Sm100Consumer()
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=120, max_seqlen_k=120)
    plan = consumer_plan(consumer, masks.causal(cu_seqlens_q=cu, cu_seqlens_k=cu), q, k, v, **varlen)
    return consumer, plan, (q, k, v)


def _stand_in_launchers(monkeypatch, launches):
    """The SM100 launchers, stood in for: record what they get, return zero outputs of the view's
    shapes (what a kernel writes is for SM100 hardware to show)."""
    import torch

    from flexattn_sm100 import bwd_launch, fwd_launch

    def forward(view, q, k, v, *, out=None, lse=None, **options):
        g = view.geometry
        launches.append(("forward", view, (q, k, v), out))
        return torch.zeros(g.total_q, g.num_heads_q, g.head_dim_v, dtype=q.dtype), lse, None

    def backward(view, *tensors, dq=None, dk=None, dv=None, **options):
        launches.append(("backward", view, tensors, (dq, dk, dv)))
        given = zip(tensors[:3], (dq, dk, dv), strict=True)
        return tuple(torch.zeros_like(t) if b is None else b.zero_() for t, b in given)

    monkeypatch.setattr(fwd_launch, "run_forward", forward)
    monkeypatch.setattr(bwd_launch, "run_backward", backward)


@pytest.mark.parametrize(
    "dims, kernel", [((80, 80), (96, 96)), ((64, 128), (128, 128)), ((200, 200), (256, 256)), ((96, 96),) * 2]
)
def test_held_head_dims_run_on_padded_copies(monkeypatch, dims, kernel):
    """The launchers get the plan's views at the kernel's head dims (their configs re-selected from
    those views are the kernel's) and q, k, v, out, dout zero-padded to them; the caller gets its
    head dims back, in its buffers where it gave them. The plan's own view of a held pair is
    refused by the launchers' config check: the kernels would read its tensors at their head dims."""
    import torch

    from flexattn_sm100 import consumer as sm100_consumer
    from flexattn_sm100 import view_config

    monkeypatch.setattr(sm100_consumer, "_on_sm100", lambda t: True)
    monkeypatch.setenv(sm100_consumer.UNVERIFIED_ENV, "1")
    consumer, plan, (q, k, v) = _held_plan(dims)
    launches = []
    _stand_in_launchers(monkeypatch, launches)
    out = torch.full((q.shape[0], q.shape[1], dims[1]), float("nan"), dtype=q.dtype)
    got = consumer.forward(plan, q, k, v, softmax_scale=0.1, return_max_logit=False, out=out)
    assert got.out is out and not out.isnan().any()
    dout = torch.randn_like(out)
    buffers = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    lse = torch.zeros(q.shape[1], q.shape[0])
    grads = consumer.backward(
        plan, q, k, v, out, lse, dout, None, softmax_scale=0.1, deterministic=True,
        dq=buffers[0], dk=buffers[1], dv=buffers[2],
    )  # fmt: skip
    assert all(g is b and not b.isnan().any() for g, b in zip(grads, buffers, strict=True))
    padded = dims != kernel
    selectors = {"forward": view_config.fwd_config_for_view, "backward": view_config.bwd_config_for_view}
    for direction, view, tensors, buffers_given in launches:
        assert (view.geometry.head_dim_qk, view.geometry.head_dim_v) == kernel
        assert (view is plan.view(direction)) is not padded
        config = selectors[direction](view)
        assert (config.head_dim_qk, config.head_dim_v) == kernel
        inputs = (q, k, v) + ((out, dout) if direction == "backward" else ())
        if direction == "backward":  # (q, k, v, out, lse, dout, dlse)
            tensors = tensors[:4] + tensors[5:6]
        widths = (kernel[0], kernel[0]) + (kernel[1],) * (len(inputs) - 2)
        for t, given, width in zip(inputs, tensors, widths, strict=True):
            assert given.shape[-1] == width and torch.equal(given[..., : t.shape[-1]], t)
            assert not given[..., t.shape[-1] :].any() and (given is t) == (width == t.shape[-1])
        # a caller's buffer reaches the kernel only where its head dim is the kernel's
        if direction == "forward":
            callers, got, native = (out,), (buffers_given,), (dims[1] == kernel[1],)
        else:
            callers, got = buffers, buffers_given
            native = (dims[0] == kernel[0],) * 2 + (dims[1] == kernel[1],)
        assert [b is c for b, c in zip(got, callers, strict=True)] == list(native)
    for direction, select in selectors.items() if padded else ():
        refusal = rf"{direction} kernels for .*\({dims[0]}, {dims[1]}\) are the {re.escape(str(kernel))} ones"
        with pytest.raises(UnsupportedConfigError, match=refusal):
            select(plan.view(direction))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rejects_dtype(dtype):
    with pytest.raises(UnsupportedConfigError, match=rf"dtype='{dtype}'.*'float16', 'bfloat16'"):
        Sm100Consumer().resolve(request(dtype=dtype))


def test_rejects_pack_gqa():
    with pytest.raises(
        UnsupportedConfigError, match="pack_gqa=True is not supported by flexattn-sm100"
    ):
        Sm100Consumer().resolve(request(pack_gqa=True))


def test_a_refused_request_warns_of_nothing():
    """Head dims without a kernel of their own warn that they run on a larger one, but only for a
    request that is then served: a refused one (pack_gqa here) raises without the warning."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UnsupportedConfigError, match="pack_gqa=True"):
            Sm100Consumer().resolve(request(dims=(16, 16), pack_gqa=True))
    with pytest.warns(UserWarning, match=r"\(16, 16\): they run on the \(32, 32\) kernels"):
        Sm100Consumer().resolve(request(dims=(16, 16)))


@pytest.mark.parametrize(
    "overrides, argument",
    [
        ({"arch_family": "sm90"}, "arch_family"),
        ({"compute_capability": (9, 0)}, "compute_capability"),
        ({"compute_capability": (12, 0)}, "compute_capability"),
        ({"num_heads_q": 6, "num_heads_kv": 4}, "num_heads_q"),
    ],
)
def test_rejects_other_arguments(overrides, argument):
    with pytest.raises(UnsupportedConfigError, match=argument):
        Sm100Consumer().resolve(request(**overrides))


@pytest.mark.parametrize("cc", [(10, 0), (10, 3)])
def test_accepts_sm100_and_sm103(cc):
    assert Sm100Consumer().resolve(request(compute_capability=cc)).signature.arch_family == "sm100"


def test_forward_off_sm100_and_backward_say_so():
    """The forward kernel exists (compiled for sm_100a) but runs only on a CC 10.x GPU; never run yet."""
    c = Sm100Consumer()
    with pytest.raises(
        ConsumerNotFoundError, match="flexattn-sm100 0.1.0 has an SM100 forward kernel compiled for sm_100a"
    ) as info:
        c.forward(None, None, None, None, softmax_scale=1.0, return_max_logit=False)
    assert "never run on SM100 hardware" in str(info.value)
    with pytest.raises(
        ConsumerNotFoundError,
        match=r"backward kernel \(k2q-1cta, k2q-2cta, d256\) compiled for sm_100a.*never run on SM100",
    ):
        c.backward(None, None, None, None, None, None, None, None, softmax_scale=1.0, deterministic=True)


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_on_sm100_the_never_run_kernels_need_an_opt_in(direction, monkeypatch):
    """On a compute-capability 10.x GPU (stood in for here) the kernels run only when the caller
    opts in by name: they have never run on hardware. With the opt-in the call reaches the launch."""
    import torch

    from flexattn_sm100 import consumer as sm100_consumer

    monkeypatch.setattr(sm100_consumer, "_on_sm100", lambda t: True)
    monkeypatch.delenv(sm100_consumer.UNVERIFIED_ENV, raising=False)
    c, plan, (q, k, v) = _held_plan((64, 64))
    o = torch.zeros(q.shape[0], q.shape[1], 64, dtype=q.dtype)
    call = {
        "forward": lambda: c.forward(plan, q, k, v, softmax_scale=1.0, return_max_logit=False),
        "backward": lambda: c.backward(
            plan, q, k, v, o, None, o, None, softmax_scale=1.0, deterministic=True
        ),
    }[direction]
    with pytest.raises(ConsumerNotFoundError, match=f"{direction} kernel .* FLEXATTN_SM100_UNVERIFIED=1"):
        call()
    monkeypatch.setenv(sm100_consumer.UNVERIFIED_ENV, "1")
    launches = []
    _stand_in_launchers(monkeypatch, launches)
    call()
    assert [(d, view) for d, view, *_ in launches] == [(direction, plan.view(direction))]


def test_cuda_endpoints_plan_with_the_gpu_planner(monkeypatch):
    """CUDA endpoints (stood in for here) go to the GPU planner kernels with this consumer's name;
    the planner's results for SM100 views are checked on a GPU (maskplan-kernels
    ``test_builder_gpu.py::test_sm100_consumer_views``, ``tests/test_gpu_end_to_end.py``)."""
    import torch

    import maskplan_kernels

    builds, asked = [], []
    monkeypatch.setattr(maskplan_kernels, "build_plan_gpu", lambda *args: builds.append(args) or "plan")
    monkeypatch.setattr(maskplan_kernels, "unserved", lambda *views: asked.append(views))  # served
    mask = types.SimpleNamespace(device=torch.device("cuda"))
    consumer = Sm100Consumer()
    fwd, bwd = (consumer.resolve(request(direction)) for direction in ("forward", "backward"))
    assert consumer.build_plan(mask, "geometry", fwd, bwd) == "plan"
    assert asked == [("geometry", fwd, bwd)]
    assert builds == [(mask, "geometry", fwd, bwd, "flexattn-sm100")]


def test_variant_override_and_mask_delivery():
    for name in ("qstage1-1cta", "qstage2-1cta", "qstage1-2cta"):
        cfg = select_fwd_config(head_dim_qk=64, head_dim_v=64, dtype="bfloat16", variant=name)
        assert cfg.variant is FWD_VARIANTS[name]
    for dims in ((32, 32), (64, 64), (96, 96), (128, 128), (192, 128)):  # the default: the kernel that exists
        cfg = select_fwd_config(head_dim_qk=dims[0], head_dim_v=dims[1], dtype="bfloat16")
        assert cfg.variant is FWD_VARIANTS["qstage1-1cta"]
        assert cfg.mask_smem_bytes_per_cta == 0  # 1CTA loads payloads GMEM -> registers
    two_cta = select_fwd_config(head_dim_qk=128, head_dim_v=128, dtype="bfloat16", variant="qstage1-2cta")
    assert two_cta.mask_smem_bytes_per_cta == 2 * 2048  # spec 6.2: 128 groups x 4 words x 4 B per stage
    direct = select_fwd_config(head_dim_qk=64, head_dim_v=64, dtype="bfloat16", variant="qstage2-1cta")
    assert direct.mask_smem_bytes_per_cta == 0  # qstage2 + 1CTA loads payloads GMEM -> registers
    d256 = select_fwd_config(head_dim_qk=256, head_dim_v=256, dtype="bfloat16")  # the default, a kernel
    assert d256.variant is FWD_VARIANTS["d256"] and d256.mask_smem_bytes_per_cta == 0  # spec 6.2: direct
    with pytest.raises(UnsupportedConfigError, match="variant='d256'"):
        select_fwd_config(head_dim_qk=64, head_dim_v=64, dtype="bfloat16", variant="d256")
    with pytest.raises(UnsupportedConfigError, match="variant='qstage2-1cta'"):
        select_fwd_config(head_dim_qk=256, head_dim_v=256, dtype="bfloat16", variant="qstage2-1cta")
    # a held pair's refusal names the caller's pair and the kernel it runs on
    with pytest.raises(UnsupportedConfigError, match=r"=\(200, 200\) \(on the \(256, 256\) kernels\)"):
        select_fwd_config(head_dim_qk=200, head_dim_v=200, dtype="bfloat16", variant="qstage1-1cta")


def test_configs_are_frozen_and_keyed():
    default = select_bwd_config(head_dim_qk=128, head_dim_v=128, dtype="float16")
    assert default.variant is BWD_VARIANTS["k2q-1cta"] and (default.tile_m, default.tile_n) == (128, 128)
    cfg = Sm100BwdConfig(head_dim_qk=192, head_dim_v=128, dtype="float16", variant=BWD_VARIANTS["k2q-2cta"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.varlen = True
    key = dict(cfg.compile_key())
    assert key["variant"].cta_group_size == 2 and key["variant"].cluster_axis == "n"
    assert (cfg.tile_m, cfg.tile_n) == (128, 256)
    with pytest.raises(ValueError, match="variant="):
        Sm100FwdConfig(head_dim_qk=64, head_dim_v=64, dtype="float16", variant=cfg.variant)


def test_the_backward_splits_kv_heads_on_single_cta_kernels_only():
    """k2q-1cta and d256 take ``maskplan_kernels.kv_head_split``'s split of a kv head's q heads (the
    kernel reads K / V at the item's head over the split); the k2q-2cta pair does not."""
    from flexattn_sm100.bwd_launch import COMPILER
    from flexattn_sm100.config import BWD_VARIANTS

    splits = {name: COMPILER.splits_kv_heads(types.SimpleNamespace(variant=v))
              for name, v in BWD_VARIANTS.items()}
    assert splits == {"k2q-1cta": True, "k2q-2cta": False, "d256": True}
