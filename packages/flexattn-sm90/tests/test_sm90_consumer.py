"""Sm90Consumer.resolve: signatures per head-dim pair, rejections, JSON, no kernels yet."""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace

import pytest
import torch

from flexattn_sm90 import Sm90BwdConfig, Sm90Consumer, Sm90FwdConfig, select_fwd_config
from flexattn_sm90.heuristics import kernel_head_dims
from flexattn_sm90.payload_layout import wgmma_pack_gqa_layout
from maskplan_core.consumer import Consumer, ViewRequest
from maskplan_core.errors import UnsupportedConfigError
from maskplan_core.schema import PayloadLayoutSpec, PlanSignature, Topology

PAIRS = [(32, 32), (64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (256, 256)]


def request(direction="forward", dims=(128, 128), **overrides) -> ViewRequest:
    fields = dict(
        arch_family="sm90",
        direction=direction,
        head_dim_qk=dims[0],
        head_dim_v=dims[1],
        num_heads_q=8,
        num_heads_kv=2,
        mask_heads=1,
        dtype="bfloat16",
        varlen=False,
    )
    fields.update(overrides)
    return ViewRequest(**fields)


def expected(direction: str, dims: tuple[int, int], bit_order: str) -> PlanSignature:
    """``bit_order``: the resolved layout's (test_sm90_payload_layout pins each id's to the PTX rule)."""
    if direction == "forward":
        tile, layout_id, words = ((128, 64), "sm90-wgmma-acc-v1-128x64", 1) if dims[0] == 256 else (
            (128, 128), "sm90-wgmma-acc-v1-128x128", 2)  # fmt: skip
        kernel, scheduler, dq = "sm90-fwd-persistent-v1", "plan-dynamic-persistent-atomic-v1", "none"
    else:
        tile, layout_id, words = (
            ((128, 128), "sm90-wgmma-acc-v1-128x128-kq", 2) if max(dims) <= 64
            else ((64, 128), "sm90-wgmma-acc-v1-64x128-kq", 1) if max(dims) <= 128
            else ((64, 96), "sm90-wgmma-acc-v1-64x96-wg1x2", 1) if dims == (192, 128)
            else ((64, 64), "sm90-wgmma-acc-v1-64x64-wg1x2-kq", 1)
        )  # fmt: skip
        kernel, scheduler, dq = "sm90-bwd-k2q-v1", "k-major-grid-v1", "rank_int32"
    return PlanSignature(
        arch_family="sm90",
        direction=direction,
        kernel_family=kernel,
        topology=Topology(tile_m=tile[0], tile_n=tile[1], qhead_per_kvhead=4),
        mma_layout="wgmma-m64nNk16-acc",
        payload=PayloadLayoutSpec(
            layout_id=layout_id, bit_order=bit_order, physical_subtiles=1, payload_groups=256,
            words_per_group=words,
        ),
        scheduler_layout=scheduler,
        dq_order_format=dq,
    )


def test_consumer_identity():
    c = Sm90Consumer()
    assert isinstance(c, Consumer)
    assert c.name == "flexattn-sm90"
    assert c.arch_families == ("sm90",)


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("dims", PAIRS, ids=[f"{a}x{b}" for a, b in PAIRS])
def test_resolve_signature(direction, dims):
    view = Sm90Consumer().resolve(request(direction, dims, pack_gqa=False))
    want = expected(direction, dims, view.layout.bit_order)
    assert want.diff(view.signature) == []
    assert view.signature == want
    assert view.layout.spec == view.signature.payload
    assert (view.layout.tile_m, view.layout.tile_n) == (view.tile_m, view.tile_n)
    assert view.layout.transposed is (direction == "backward" and dims != (192, 128))  # bwd_tile


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("dims", PAIRS, ids=[f"{a}x{b}" for a, b in PAIRS])
def test_signature_json_round_trip(direction, dims):
    sig = Sm90Consumer().resolve(request(direction, dims)).signature
    again = PlanSignature.model_validate_json(sig.model_dump_json())
    assert again == sig and again.diff(sig) == []


@pytest.mark.parametrize(
    "heads, mask_heads, packs",
    [((8, 2), 1, True), ((16, 1), 1, True), ((32, 1), 1, True), ((64, 1), 1, True), ((4, 2), 1, False),
     ((8, 2), 8, False), ((12, 2), 1, False), ((256, 1), 1, False), ((2, 2), 1, False)],
    ids=["g4", "g16", "g32", "g64", "g2", "per-head-mask", "g6-not-dividing", "g256-past-tile", "mha"],
)  # fmt: skip
def test_pack_gqa_none_packs_a_shared_mask_of_4_to_64_heads_per_kv_head(heads, mask_heads, packs):
    """``pack_gqa=None`` packs where it measured faster (4 <= G <= 64, heuristics.PACK_GQA_*_GROUP)
    and the tile takes it; False never packs, and the backward view is the same either way."""
    c = Sm90Consumer()
    fields = dict(num_heads_q=heads[0], num_heads_kv=heads[1], mask_heads=mask_heads)
    for dims in PAIRS:
        assert c.resolve(request(dims=dims, **fields)).signature.topology.pack_gqa is packs
        assert c.resolve(request(dims=dims, pack_gqa=False, **fields)).signature.topology.pack_gqa is False
        backward = [c.resolve(request("backward", dims, pack_gqa=p, **fields)) for p in (None, False)]
        assert backward[0] == backward[1]
    if packs:
        assert c.resolve(request(**fields)) == c.resolve(request(pack_gqa=True, **fields))


def test_varlen_and_dtype_do_not_change_the_signature():
    c = Sm90Consumer()
    base = c.resolve(request()).signature
    assert c.resolve(request(varlen=True)).signature == base
    assert c.resolve(request(dtype="float16")).signature == base


@pytest.mark.parametrize("dims", [(320, 320), (64, 300), (257, 16)])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_rejects_head_dims(direction, dims):
    with pytest.raises(UnsupportedConfigError, match=r"head_dim_qk, head_dim_v") as info:
        Sm90Consumer().resolve(request(direction, dims))
    assert isinstance(info.value, ValueError)
    assert f"({dims[0]}, {dims[1]})" in str(info.value)
    assert "(192, 128)" in str(info.value) and "zero-padded" in str(info.value)  # lists what runs


@pytest.mark.parametrize(
    "dims, kernel",
    [((72, 72), (80, 80)), ((88, 88), (96, 96)), ((8, 8), (32, 32)), ((48, 48), (64, 64)),
     ((64, 128), (128, 128)), ((128, 64), (128, 128)), ((112, 112), (128, 128)), ((160, 128), (192, 128)),
     ((192, 192), (256, 256)), ((256, 128), (256, 256)), ((96, 96), (96, 96))],
)  # fmt: skip
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_head_dims_without_a_kernel_resolve_to_the_next_kernel_up(direction, dims, kernel):
    """A pair without a kernel of its own plans with the views of the cheapest kernel that holds it
    (and runs on it: test_head_dims_without_a_kernel_run_on_the_next_kernel_up)."""
    assert kernel_head_dims(*dims) == kernel
    c = Sm90Consumer()
    assert c.resolve(request(direction, dims)) == c.resolve(request(direction, kernel))


def test_padded_head_dims_say_so():
    with pytest.warns(UserWarning, match=r"\(72, 72\): they run on the \(80, 80\) kernels") as seen:
        Sm90Consumer().check_head_dims(72, 72)
    assert "copied" not in str(seen[0].message)  # multiples of 8: read in place
    with pytest.warns(UserWarning, match=r"\(36, 60\): they run on the \(64, 64\) kernels.* copied per call"):
        Sm90Consumer().check_head_dims(36, 60)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Sm90Consumer().check_head_dims(128, 128)  # a kernel's own: nothing to say


def _thd(total: int, heads: int, dim: int, seed: int) -> torch.Tensor:
    return torch.randn(total, heads, dim, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize(
    "dims, io, kernel",
    [((72, 72), (72, 72), (80, 80)), ((64, 128), (64, 128), (128, 128)),
     ((128, 64), (128, 64), (128, 128)), ((36, 36), (40, 40), (64, 64)), ((60, 124), (64, 128), (128, 128))],
)  # fmt: skip
def test_head_dims_without_a_kernel_run_on_the_next_kernel_up(monkeypatch, dims, io, kernel):
    """Head dims that are multiples of 8 reach the kernels as they are: the plan's views, the caller's
    tensors and buffers, and configs of the next kernel up whose io head dims are the tensors'
    (TMA fills the tiles' columns past them with zeros). Others go as a view with their head dims
    rounded up to a multiple of 8 and q, k, v, out, dout copied with zero columns up to it; the
    caller gets its columns of the outputs, in its buffers where it gave them. The kernels are
    stood in for (their GPU tests run them): what they receive and what the caller gets is checked
    here."""
    import flexattn_sm90.bwd_launch as bwd_launch
    import flexattn_sm90.fwd_launch as fwd_launch
    from maskplan_core import masks
    from maskplan_core.testing import consumer_plan

    (dqk, dv), (iqk, iv) = dims, io
    total, hq, hkv = 200, 4, 2
    q, k, v = _thd(total, hq, dqk, 0), _thd(total, hkv, dqk, 1), _thd(total, hkv, dv, 2)
    cu = torch.tensor([0, 120, 200], dtype=torch.int32)
    consumer = Sm90Consumer()
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=120, max_seqlen_k=120)
    plan = consumer_plan(consumer, masks.causal(cu_seqlens_q=cu, cu_seqlens_k=cu), q, k, v, **varlen)
    copied = io != dims
    seen = {}

    def kernel_output(given, *shape):  # what a kernel writes, into the buffer it was given if any
        t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape).to(torch.bfloat16)
        return t if given is None else given.copy_(t)

    def forward(view, q, k, v, *, out=None, lse=None, **kwargs):
        seen["forward"] = view, (q, k, v), out
        return kernel_output(out, total, hq, iv), torch.zeros(hq, total), None

    def backward(view, q, k, v, out, lse, dout, dlse, *, dq=None, dk=None, dv=None, **kwargs):
        seen["backward"] = view, (q, k, v, out, dout), (dq, dk, dv)
        shapes = ((dq, hq, iqk), (dk, hkv, iqk), (dv, hkv, iv))
        return tuple(kernel_output(given, total, heads, d) for given, heads, d in shapes)

    def check_view(view, direction):
        plan_view = plan.view(direction)
        assert (view is plan_view) != copied
        assert (view.geometry.head_dim_qk, view.geometry.head_dim_v) == io
        assert view.tensors == plan_view.tensors and view.signature == plan_view.signature
        config = (fwd_launch if direction == "forward" else bwd_launch).config_for_view(view)
        assert (config.head_dim_qk, config.head_dim_v) == kernel and config.io_head_dims == io

    def check_inputs(given, inputs, dims):
        for t, p, d in zip(inputs, given, dims, strict=True):
            assert (p is t) != copied
            assert p.shape[-1] == d and torch.equal(p[..., : t.shape[-1]], t)
            assert not p[..., t.shape[-1] :].any()

    monkeypatch.setattr(fwd_launch, "run_forward", forward)
    monkeypatch.setattr(bwd_launch, "run_backward", backward)
    got = consumer.forward(plan, q, k, v, softmax_scale=0.1, return_max_logit=False)
    view, given, given_out = seen["forward"]
    check_view(view, "forward")
    check_inputs(given, (q, k, v), (iqk, iqk, iv))
    assert given_out is None
    assert torch.equal(got.out, kernel_output(None, total, hq, iv)[..., :dv]) and got.out.is_contiguous()
    out = torch.full((total, hq, dv), float("nan"), dtype=torch.bfloat16)
    assert consumer.forward(plan, q, k, v, softmax_scale=0.1, return_max_logit=False, out=out).out is out
    assert torch.equal(out, got.out)
    assert seen["forward"][0] is view  # one view per plan view
    assert seen["forward"][2] is (None if dv != iv else out)  # the kernel writes out where Dv is its own

    dout = _thd(total, hq, dv, 3)
    call = (plan, q, k, v, got.out, got.lse, dout, None)
    grads = consumer.backward(*call, softmax_scale=0.1, deterministic=True)
    view, given, given_grads = seen["backward"]
    check_view(view, "backward")
    check_inputs(given, (q, k, v, got.out, dout), (iqk, iqk, iv, iv, iv))
    assert given_grads == (None, None, None)
    buffers = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    into = consumer.backward(*call, softmax_scale=0.1, deterministic=True, dq=buffers[0], dk=buffers[1],
                             dv=buffers[2])  # fmt: skip
    for g, b, i, heads, d in zip(grads, buffers, into, (hq, hkv, hkv), (iqk, iqk, iv), strict=True):
        assert torch.equal(g, kernel_output(None, total, heads, d)[..., : b.shape[-1]])
        assert i is b and torch.equal(b, g)
    native = (dqk == iqk, dqk == iqk, dv == iv)
    assert [b is g for b, g in zip(buffers, seen["backward"][2], strict=True)] == list(native)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rejects_dtype(dtype):
    with pytest.raises(UnsupportedConfigError, match=rf"dtype='{dtype}'.*'float16', 'bfloat16'"):
        Sm90Consumer().resolve(request(dtype=dtype))


@pytest.mark.parametrize("dims", PAIRS, ids=[f"{a}x{b}" for a, b in PAIRS])
@pytest.mark.parametrize("heads", [(8, 2), (16, 1), (2, 2), (128, 1)])
def test_pack_gqa_forward_signature(dims, heads):
    """PackGQA forward views: plan Q blocks of 128 / G positions, the packed layout (one group per
    position and lane quad member, one word), the same kernel family."""
    hq, hkv = heads
    g = hq // hkv
    packed = request(dims=dims, num_heads_q=hq, num_heads_kv=hkv, pack_gqa=True)
    sig = Sm90Consumer().resolve(packed).signature
    tile_n = 64 if dims[0] == 256 else 128
    assert sig.topology == Topology(tile_m=128 // g, tile_n=tile_n, pack_gqa=True, qhead_per_kvhead=g)
    assert sig.payload == PayloadLayoutSpec(
        layout_id=f"sm90-wgmma-packgqa-v1-128x{tile_n}-g{g}",
        bit_order=wgmma_pack_gqa_layout(128, tile_n, g).bit_order,
        physical_subtiles=1,
        payload_groups=4 * 128 // g,
        words_per_group=1,
    )
    assert sig.kernel_family == "sm90-fwd-persistent-v1"
    unpacked = Sm90Consumer().resolve(request(dims=dims, num_heads_q=hq, num_heads_kv=hkv, pack_gqa=False))
    unpacked = unpacked.signature
    fields = {d.field for d in unpacked.diff(sig)}
    assert {"topology.pack_gqa", "payload.layout_id"} <= fields  # never interchangeable


def test_pack_gqa_backward_view_is_the_unpacked_one():
    """The K-major backward visits every q head of its kv head in one CTA: pack_gqa does not change it."""
    c = Sm90Consumer()
    assert c.resolve(request("backward", pack_gqa=True)) == c.resolve(request("backward"))


def test_pack_gqa_refusals():
    c = Sm90Consumer()
    with pytest.raises(UnsupportedConfigError, match="Hmask=8, PackGQA needs Hmask=1"):
        c.resolve(request(pack_gqa=True, num_heads_q=8, mask_heads=8))
    with pytest.raises(UnsupportedConfigError, match=r"= 3 q heads .* dividing 128 \(1, 2, 4"):
        c.resolve(request(pack_gqa=True, num_heads_q=6, num_heads_kv=2))
    with pytest.raises(UnsupportedConfigError, match="= 256 q heads"):
        c.resolve(request(pack_gqa=True, num_heads_q=256, num_heads_kv=1))


@pytest.mark.parametrize(
    "overrides, argument",
    [
        ({"arch_family": "sm100"}, "arch_family"),
        ({"compute_capability": (8, 0)}, "compute_capability"),
        ({"compute_capability": (10, 0)}, "compute_capability"),
        ({"num_heads_q": 6, "num_heads_kv": 4}, "num_heads_q"),
    ],
)
def test_rejects_other_arguments(overrides, argument):
    with pytest.raises(UnsupportedConfigError, match=argument):
        Sm90Consumer().resolve(request(**overrides))


def test_accepts_hopper_compute_capability():
    assert Sm90Consumer().resolve(request(compute_capability=(9, 0))).signature.arch_family == "sm90"


def test_configs_are_frozen_and_keyed():
    cfg = select_fwd_config(head_dim_qk=128, head_dim_v=128, dtype="bfloat16")
    assert isinstance(cfg, Sm90FwdConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tile_m = 64
    key = dict(cfg.compile_key())
    assert key["tile_m"] == 128 and key["mask_pipeline_stages"] == 2 and key["num_consumer_warpgroups"] == 2
    assert all(f.metadata.get("constexpr") for f in dataclasses.fields(cfg))
    assert cfg.mask_smem_bytes == 4096  # spec 6.2: 256 groups x 2 words x 4 B x 2 stages
    d256 = select_fwd_config(head_dim_qk=256, head_dim_v=256, dtype="float16")
    assert (d256.tile_m, d256.tile_n, d256.mask_smem_bytes) == (128, 64, 2048)  # 2 KB across both stages


def test_config_validation():
    with pytest.raises(ValueError, match="tile_m=192 must equal 64"):
        Sm90FwdConfig(head_dim_qk=128, head_dim_v=128, dtype="bfloat16", tile_m=192)
    with pytest.raises(ValueError, match="dtype"):
        Sm90FwdConfig(head_dim_qk=128, head_dim_v=128, dtype="float32")
    bwd = Sm90BwdConfig(head_dim_qk=64, head_dim_v=64, dtype="bfloat16")
    assert bwd.payload_layout.transposed and bwd.payload_layout.groups == 256



def test_view_config_accepts_its_own_views_and_refuses_others():
    import torch

    from flexattn_sm90.view_config import config_for_view
    from maskplan_core import masks, validate_plan_inputs
    from maskplan_core.errors import PlanSignatureMismatch
    from maskplan_core.reference import ReferenceConsumer, build_plan

    q = torch.randn(1, 300, 4, 128, dtype=torch.bfloat16)
    mask = masks.causal(300)
    geometry = validate_plan_inputs(mask, q, q, q)

    def plan_with(consumer, family):
        same = dict(arch_family=family, num_heads_q=4, num_heads_kv=4)
        fwd, bwd = (consumer.resolve(request(d, **same)) for d in ("forward", "backward"))
        return build_plan(mask, geometry, fwd, bwd, consumer.name)

    plan = plan_with(Sm90Consumer(), "sm90")
    assert config_for_view(plan.view("forward"), "forward") == select_fwd_config(
        head_dim_qk=128, head_dim_v=128, dtype="bfloat16"
    )
    assert config_for_view(plan.view("backward"), "backward").payload_layout.transposed
    with pytest.raises(PlanSignatureMismatch, match="kernel_family"):
        config_for_view(plan.view("backward"), "forward")
    reference = plan_with(ReferenceConsumer(), "reference")
    with pytest.raises(PlanSignatureMismatch, match="arch_family") as info:
        config_for_view(reference.view("forward"), "forward")
    assert "rebuild the plan with create_mask_plan for SM90" in str(info.value)


def test_resolve_is_memoised_and_refusals_repeat():
    c = Sm90Consumer()
    assert c.resolve(request()) is c.resolve(request())  # equal requests share the view config
    assert c.resolve(request(pack_gqa=True)) is not c.resolve(request())
    for _ in range(2):  # a refused request is never cached
        with pytest.raises(UnsupportedConfigError, match="Hmask=8"):
            c.resolve(request(pack_gqa=True, mask_heads=8))


def test_softmax_scales_past_fp32_are_refused_where_nothing_is_visible(monkeypatch):
    """A call with no visible key runs no kernel (its outputs are set on the host), yet a scale the
    kernels' fp32 cannot hold is refused there as on every other call, not answered with zeros. The
    device checks are stood in for so the shortcut is reached on the CPU."""
    import flexattn_sm90.bwd_launch as bwd_launch
    import flexattn_sm90.fwd_launch as fwd_launch
    import maskplan_kernels.consumer_launch as consumer_launch
    from maskplan_core.errors import InputValueError
    from maskplan_core.testing import consumer_plan

    total, hq, hkv, d = 64, 2, 1, 64
    q, k, v = _thd(total, hq, d, 0), _thd(0, hkv, d, 1), _thd(0, hkv, d, 2)  # no key
    nothing = torch.zeros(1, 1, total, dtype=torch.int32)
    plan = consumer_plan(Sm90Consumer(), nothing, q[None], k[None], v[None])  # B = 1: THD is [B*S, H, D]
    monkeypatch.setattr(consumer_launch, "check_inputs", lambda view, **tensors: None)
    grads = tuple(torch.zeros_like(t) for t in (q, k, v))
    empty_io = SimpleNamespace(nothing_visible=True, grads=grads)
    monkeypatch.setattr(consumer_launch, "backward_io", lambda *args, **kwargs: empty_io)
    fwd, bwd = plan.view("forward"), plan.view("backward")
    out, lse, _ = fwd_launch.run_forward(fwd, q, k, v, softmax_scale=0.1, return_max_logit=False)
    assert not out.any() and bool((lse == float("-inf")).all())
    assert bwd_launch.run_backward(bwd, q, k, v, out, lse, out, None, softmax_scale=0.1) == grads
    refused = "softmax_scale=1e\\+39 is past the fp32 range"
    with pytest.raises(InputValueError, match=refused):
        fwd_launch.run_forward(fwd, q, k, v, softmax_scale=1e39, return_max_logit=False)
    with pytest.raises(InputValueError, match=refused):
        bwd_launch.run_backward(bwd, q, k, v, out, lse, out, None, softmax_scale=1e39)


@pytest.mark.parametrize(
    "mask, uneven",
    [("causal", True), ("documents", True), ("sliding", False), ("random", False), ("empty", False)],
)
def test_row_spread_of_sm90_backward_views(mask, uneven):
    """The longest K2Q row against the mean (``BwdViewArgs.row_spread``, from the plan's recorded
    ``longest_row``), which ``kv_head_split`` splits more from: causal rows and documents of
    different lengths are uneven, a sliding window's and dense random rows are not."""
    from maskplan_core import masks
    from maskplan_core.testing import consumer_plan
    from maskplan_kernels.consumer_launch import bwd_view_args

    B, S = 2, 2048
    q, k = (torch.empty(B, S, hq, 64, dtype=torch.bfloat16) for hq in (8, 1))
    mask_func = {
        "causal": lambda: masks.causal(S, batch=B),
        "documents": lambda: masks.document([[256, 1536, 256]] * B),
        "sliding": lambda: masks.sliding_window(S, window_left=512, batch=B),
        "random": lambda: torch.randint(0, S + 1, (1, 5, B * S)).sort(dim=1).values.int().contiguous(),
        "empty": lambda: torch.zeros(1, 1, B * S, dtype=torch.int32),
    }[mask]()
    view = consumer_plan(Sm90Consumer(), mask_func, q, k, k).view("backward")
    view.validate()  # longest_row is the view's
    assert (bwd_view_args(view, torch.device("cpu")).row_spread >= 1.5) is uneven
    # per-head masks: an item walks all its kv head's q heads' rows, which one row's length does
    # not bound (per-head sliding windows of different widths made uneven rows of even items)
    per_head = consumer_plan(Sm90Consumer(), mask_func.expand(8, -1, -1).contiguous(), q, k, k)
    assert bwd_view_args(per_head.view("backward"), torch.device("cpu")).row_spread == 1.0
