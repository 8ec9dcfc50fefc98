"""Consumer resolution through entry points, planning for another consumer, signature refusal."""

from __future__ import annotations

import warnings

import pytest
import torch

import flexattn
from flexattn import PlanSignatureMismatch, masks
from flexattn.registry import consumer_for, installed_consumers

B, S, H, D = 2, 200, 4, 64


def qkv(dtype=torch.bfloat16):
    return [torch.randn(B, S, H, D, dtype=dtype) for _ in range(3)]


def test_every_installed_consumer_is_found_by_family():
    found = installed_consumers()
    assert {"reference", "sm90", "sm100"} <= set(found)
    assert found["sm90"].name == "flexattn-sm90"
    assert found["sm100"].hardware_verified is False


@pytest.fixture
def broken_plugin(monkeypatch):
    """The installed plugins plus one whose module does not import, as another package may register."""
    from importlib.metadata import EntryPoint

    from flexattn import registry

    real = list(registry.entry_points(group=registry.ENTRY_POINT_GROUP))
    broken = EntryPoint("broken", "no_such_module_for_flexattn:Consumer", registry.ENTRY_POINT_GROUP)
    # a module that imports, and a factory that raises
    raising = EntryPoint("raising", "flexattn.registry:arch_family", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group: [*real, broken, raising])
    registry._registry.cache_clear()
    yield
    registry._registry.cache_clear()


def test_a_plugin_that_fails_to_load_takes_no_other_consumer_down(broken_plugin, caplog):
    with caplog.at_level("WARNING", logger="flexattn"):
        found = installed_consumers()
    assert {"reference", "sm90", "sm100"} <= set(found)
    assert "no_such_module_for_flexattn" in caplog.text and "flexattn.registry:arch_family" in caplog.text
    q, k, v = qkv()
    plan = flexattn.create_mask_plan(masks.causal(S, batch=B), q, k, v)
    assert flexattn.flex_attn_func(q, k, v, mask_plan=plan).shape == q.shape
    # a family nothing serves: the failure may be why, so the error names it
    failures = "failed to load: broken = no_such_module.*raising"
    with pytest.raises(flexattn.ConsumerNotFoundError, match=failures):
        consumer_for("sm999")


def test_unknown_family_is_a_clear_error():
    with pytest.raises(flexattn.ConsumerNotFoundError, match="sm999"):
        consumer_for("sm999")


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_plan_for_another_consumer_describes_the_same_mask(target):
    mask = masks.document([[120, 80], [50, 150]], causal=True)
    q, k, v = qkv()
    reference = flexattn.create_mask_plan(mask, q, k, v, build_backward=True)
    other = flexattn.create_mask_plan(mask, q, k, v, build_backward=True, target=target)
    assert other.view("forward").signature.arch_family == target
    for role in ("forward", "backward"):
        assert torch.equal(other.view(role).to_dense(), reference.view(role).to_dense())
        assert other.view(role).stats()["visible"] == reference.view(role).stats()["visible"]  # popcounts


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_pack_gqa_plan_for_sm90_describes_the_same_mask(kv_heads):
    """A PackGQA forward view (G = H / kv_heads q heads per 128-row tile: Q blocks of 128 / G
    positions, the packed payload layout) decodes to the same mask; the backward view is unchanged."""
    mask = masks.sliding_window(S, window_left=70, batch=B)
    q = torch.randn(B, S, H, D, dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, kv_heads, D, dtype=torch.bfloat16) for _ in range(2))
    plain = flexattn.create_mask_plan(mask, q, k, v, build_backward=True, target="sm90")
    packed = flexattn.create_mask_plan(mask, q, k, v, build_backward=True, target="sm90", pack_gqa=True)
    g = H // kv_heads
    topology = packed.view("forward").signature.topology
    assert (topology.pack_gqa, topology.tile_m, topology.qhead_per_kvhead) == (True, 128 // g, g)
    assert torch.equal(packed.view("forward").to_dense(), plain.view("forward").to_dense())
    visible = packed.view("forward").to_dense().sum().item() / (B * S * S)
    assert packed.view("forward").stats()["visible"] == plain.view("forward").stats()["visible"] == visible
    assert packed.view("backward").signature == plain.view("backward").signature
    assert packed.view("forward").signature.payload.layout_id == f"sm90-wgmma-packgqa-v1-128x128-g{g}"


def test_pack_gqa_refusals_name_the_reason():
    mask = masks.causal(S, batch=B)
    q, k, v = qkv()
    with pytest.raises(flexattn.UnsupportedConfigError, match="Hmask=4, PackGQA needs Hmask=1"):
        per_head = mask.expand(H, -1, -1).contiguous()
        flexattn.create_mask_plan(per_head, q, k, v, target="sm90", pack_gqa=True)
    refused = "pack_gqa=True is not supported by flexattn-sm100"
    with pytest.raises(flexattn.UnsupportedConfigError, match=refused):
        flexattn.create_mask_plan(mask, q, k, v, target="sm100", pack_gqa=True)


def test_a_gpu_block_map_from_fp32_tensors_says_which_dtype_to_pass():
    """A laptop prototype in fp32 / fp64 asking for the GPU's plan (``target=``): the refusal of its
    dtype says to pass the tensors in one the target takes (only their dtype is read)."""
    q = torch.randn(B, S, H, D, dtype=torch.float64)
    for target in ("sm90", "sm100"):
        with pytest.raises(flexattn.UnsupportedConfigError, match=r"dtype='float64'.*q\.bfloat16\(\)") as err:
            flexattn.create_mask_plan(masks.causal(S, batch=B), q, q, q, target=target)
        assert err.value.argument == "dtype"
    with pytest.raises(flexattn.UnsupportedConfigError) as err:  # other refusals stay as they are
        flexattn.create_mask_plan(masks.causal(S, batch=B), *qkv(), target="sm100", pack_gqa=True)
    assert err.value.argument == "pack_gqa" and "bfloat16()" not in str(err.value)


def test_cpu_call_refuses_a_plan_made_for_sm90_naming_the_fields():
    q, k, v = qkv()
    plan = flexattn.create_mask_plan(masks.causal(S, batch=B), q, k, v, target="sm90")
    with pytest.raises(PlanSignatureMismatch) as err:
        flexattn.flex_attn_func(q, k, v, mask_plan=plan)
    fields = {d.field for d in err.value.diffs}
    assert {"arch_family", "kernel_family", "payload.layout_id"} <= fields
    assert "arch_family" in str(err.value) and "flexattn-sm90" in str(err.value)


def test_sm90_and_sm100_views_differ_field_by_field():
    q, k, v = qkv()
    mask = masks.causal(S, batch=B)
    sm90 = flexattn.create_mask_plan(mask, q, k, v, target="sm90").view("forward").signature
    sm100 = flexattn.create_mask_plan(mask, q, k, v, target="sm100").view("forward").signature
    fields = {d.field for d in sm90.diff(sm100)}
    assert {"arch_family", "mma_layout", "payload.layout_id", "scheduler_layout"} <= fields


def test_compiled_signature_mismatch_is_the_eager_error():
    """A signature mismatch is raised by the op at run time: the eager exception in either mode."""

    def attend(q, k, v, plan):
        return flexattn.flex_attn_func(q, k, v, mask_plan=plan)

    q, k, v = (torch.randn(B, S, H, D, dtype=torch.bfloat16) for _ in range(3))  # a shape SM90 plans
    other = flexattn.create_mask_plan(masks.causal(S, batch=B), q, k, v, target="sm90")
    for fullgraph in (False, True):
        torch._dynamo.reset()
        with pytest.raises(PlanSignatureMismatch) as info:
            torch.compile(attend, fullgraph=fullgraph, backend="aot_eager")(q, k, v, other)
        assert "arch_family" in {d.field for d in info.value.diffs}
        assert "built for flexattn-sm90, but maskplan-reference runs these cpu tensors" in str(info.value)
        assert "without target=" in str(info.value)



@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_a_laptop_without_the_cute_dsl_plans_for_the_gpu(monkeypatch, target):
    """The GPU planner's package does not import (no CuTe DSL, as on a Mac): CPU endpoints still plan
    for the GPU's tiles (the reference planner builds every plan off the GPU), the same plan as with
    it; CUDA endpoints, which it would plan, are refused with an error naming the missing module."""
    q, k, v = qkv()
    mask = masks.causal(S, batch=B)
    with_dsl = flexattn.create_mask_plan(mask, q, k, v, target=target)
    consumer = installed_consumers()[target]
    monkeypatch.setitem(__import__("sys").modules, consumer.gpu_planner, None)  # import raises
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say: the GPU's planner is not there to ask
        without = flexattn.create_mask_plan(mask, q, k, v, target=target)
    assert without.view("forward").signature == with_dsl.view("forward").signature
    assert torch.equal(without.view("forward").to_dense(), with_dsl.view("forward").to_dense())
    with pytest.raises(flexattn.ConsumerNotFoundError, match=r"'maskplan_kernels', which cannot be imported"):
        consumer._gpu_planner(required=True)


def test_a_laptop_plan_for_the_gpu_says_what_the_gpu_planner_would():
    """A plan for SM90's tiles made from CPU tensors warns where the GPU's planner kernels would not
    take the mask (more endpoints a row than their shared memory holds: the reference planner then
    builds it on the GPU, slower), as a plan built on the GPU does; a mask they take builds quietly."""
    q, k, v = qkv()
    dilated = masks.from_mask_mod(lambda b, h, qi, kv: (kv <= qi) & ((qi - kv) % 2 == 0), B, None, S, S)
    assert dilated.shape[1] > 75
    with pytest.warns(UserWarning, match=r"nfunc=\d+: on a GPU the reference planner would build this plan"):
        flexattn.create_mask_plan(dilated, q, k, v, target="sm90")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flexattn.create_mask_plan(masks.causal(S, batch=B), q, k, v, target="sm90")
