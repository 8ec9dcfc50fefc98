"""The plan ABI schema (frozen pydantic models) and the reference payload layout."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from maskplan_core import (
    ABI_VERSION,
    HEADER_FIELDS,
    InputTypeError,
    InputValueError,
    PayloadLayoutSpec,
    PlanSignature,
    PlanView,
    RowMajorLayout,
    SignatureDiff,
    Topology,
)

FAST = settings(max_examples=40, deadline=None, derandomize=True, database=None)


def spec(layout_id: str, groups: int = 1, words: int = 1, bit_order: str = "sha256:" + "0" * 16):
    return PayloadLayoutSpec(
        layout_id=layout_id,
        bit_order=bit_order,
        physical_subtiles=1,
        payload_groups=groups,
        words_per_group=words,
    )


def signature(**overrides) -> PlanSignature:
    fields = dict(
        arch_family="sm90",
        direction="forward",
        kernel_family="fa-generic",
        topology=Topology(tile_m=128, tile_n=128, q_stage=2, cta_group_size=1, pack_gqa=False),
        mma_layout="wgmma-m64nN",
        payload=spec("sm90-v1", groups=256, words=2),
        scheduler_layout="plan-fwd-work-desc-v1",
    )
    fields.update(overrides)
    return PlanSignature(**fields)


def _view_config(direction: str, layout: RowMajorLayout, payload: PayloadLayoutSpec, **topology):
    """A ViewConfig of ``layout``'s 32x32 tiles (``topology``: more Topology fields) whose signature
    names ``payload``."""
    from maskplan_core.consumer import ViewConfig

    fields = dict(direction=direction, topology=Topology(tile_m=32, tile_n=32, **topology), payload=payload)
    if direction == "backward":
        fields["dq_order_format"] = "rank_int32"
    return ViewConfig(signature(**fields), layout)


# --------------------------------------------------------------------------------------------------
# PlanSignature
# --------------------------------------------------------------------------------------------------


def test_signature_json_round_trip():
    sig = signature(dq_order_format="rank_int32", direction="backward")
    text = sig.model_dump_json()
    assert PlanSignature.model_validate_json(text) == sig
    data = json.loads(text)
    assert data["abi_version"] == ABI_VERSION
    assert data["topology"]["tile_m"] == 128 and data["payload"]["payload_groups"] == 256
    assert PlanSignature.model_validate(data) == sig


def test_signature_json_schema_is_published():
    schema = PlanSignature.model_json_schema()
    assert {"arch_family", "direction", "kernel_family", "topology", "payload", "scheduler_layout"} <= set(
        schema["required"]
    )
    json.dumps(schema)  # serialisable as is


def test_every_schema_field_says_what_it_means():
    """A producer or consumer in another language reads the published schema: every field has a
    description, or names a model that has one (``topology``, ``payload``)."""
    schema = PlanSignature.model_json_schema()
    models = {"PlanSignature": schema, **schema["$defs"]}
    for model_name, model in models.items():
        assert model.get("description"), model_name
        for field_name, field in model["properties"].items():
            ref = field.get("$ref", "").rsplit("/", 1)[-1]
            described = field.get("description") or models.get(ref, {}).get("description")
            assert described, (model_name, field_name)


@pytest.mark.parametrize(
    "model, field, value",
    [
        (signature(), "arch_family", "sm100"),
        (signature(), "topology", Topology(tile_m=64, tile_n=64)),
        (Topology(tile_m=128, tile_n=128), "tile_m", 64),
        (spec("x"), "layout_id", "y"),
    ],
)
def test_models_are_frozen(model, field, value):
    before = model.model_dump()
    with pytest.raises(ValidationError):
        setattr(model, field, value)
    assert model.model_dump() == before


def test_nested_models_are_frozen():
    sig = signature()
    with pytest.raises(ValidationError):
        sig.topology.tile_m = 64
    assert sig.topology.tile_m == 128


def test_signatures_are_hashable_and_compare_by_value():
    assert signature() == signature()
    assert hash(signature()) == hash(signature())
    assert signature() != signature(arch_family="sm100")


@pytest.mark.parametrize(
    "model, data",
    [
        (PlanSignature, {**signature().model_dump(), "surprise": 1}),
        (PlanSignature, {**signature().model_dump(), "topology": {"tile_m": 64, "tile_n": 64, "tile_k": 64}}),
        (Topology, {"tile_m": 128, "tile_n": 128, "warps": 4}),
        (PayloadLayoutSpec, {**spec("x").model_dump(), "bits": 32}),
    ],
    ids=["signature", "nested-topology", "topology", "payload"],
)
def test_extra_fields_are_forbidden(model, data):
    with pytest.raises(ValidationError, match="(?i)extra"):
        model.model_validate(data)


@pytest.mark.parametrize(
    "data",
    [
        {"tile_m": 0, "tile_n": 128},
        {"tile_m": 128, "tile_n": -1},
        {"tile_m": 128, "tile_n": 128, "cluster_axis": "k"},
        {"tile_m": 128, "tile_n": 128, "cta_group_size": 3},
        {"tile_m": 128, "tile_n": 128, "cta_group_size": 0},
        # strict: an ABI field is not coerced from another type
        {"tile_m": True, "tile_n": 128},
        {"tile_m": "64", "tile_n": 128},
        {"tile_m": 64.0, "tile_n": 128},
        {"tile_m": 128, "tile_n": 128, "pack_gqa": 1},
    ],
)
def test_topology_rejects_bad_values(data):
    with pytest.raises(ValidationError):
        Topology.model_validate(data)
    with pytest.raises(ValidationError):
        Topology.model_validate_json(json.dumps(data))


@pytest.mark.parametrize("bit_order", ["sha256:" + "0" * 15, "sha256:" + "A" * 16, "0" * 16, "md5:0000"])
def test_payload_spec_rejects_a_bit_order_not_a_digest(bit_order):
    with pytest.raises(ValidationError, match="bit_order"):
        spec("x", bit_order=bit_order)


def test_signature_rejects_unknown_direction_and_dq_format():
    with pytest.raises(ValidationError):
        signature(direction="sideways")
    with pytest.raises(ValidationError):
        signature(dq_order_format="rank_int64")


@pytest.mark.parametrize("version", [ABI_VERSION - 1, ABI_VERSION + 1])
def test_signature_of_another_abi_version_fails_to_parse(version):
    data = {**signature().model_dump(), "abi_version": version}
    with pytest.raises(ValidationError, match="abi_version"):
        PlanSignature.model_validate(data)


def test_a_json_signature_names_its_abi_version():
    """Python may leave ``abi_version`` out (it is this version's), JSON may not, and the published
    schema requires it: a producer in another language cannot write a signature of no version,
    which the next ABI would read with its own meaning."""
    data = signature().model_dump()
    assert PlanSignature.model_validate_json(json.dumps(data)) == signature()
    del data["abi_version"]
    assert PlanSignature(**data) == PlanSignature.model_validate(data) == signature()
    with pytest.raises(ValidationError, match=f"abi_version is missing.*this is {ABI_VERSION}"):
        PlanSignature.model_validate_json(json.dumps(data))
    assert PlanSignature.model_json_schema()["required"][0] == "abi_version"


def test_diff_of_equal_signatures_is_empty():
    assert signature().diff(signature()) == []


def test_diff_names_dotted_nested_fields():
    expected = signature()
    actual = signature(
        kernel_family="fa-other",
        topology=Topology(tile_m=64, tile_n=128, q_stage=2, pack_gqa=True),
        payload=spec("sm90-v2", groups=256, words=2),
    )
    diffs = expected.diff(actual)
    assert all(isinstance(d, SignatureDiff) for d in diffs)
    by_field = {d.field: d for d in diffs}
    assert set(by_field) == {"kernel_family", "topology.tile_m", "topology.pack_gqa", "payload.layout_id"}
    assert (by_field["topology.tile_m"].expected, by_field["topology.tile_m"].actual) == (128, 64)
    assert by_field["payload.layout_id"].actual == "sm90-v2"
    text = str(by_field["topology.tile_m"])
    assert "topology.tile_m" in text and "64" in text and "128" in text


def test_diff_is_directional():
    a, b = signature(), signature(arch_family="sm100")
    (d_ab,) = a.diff(b)
    (d_ba,) = b.diff(a)
    assert d_ab.field == d_ba.field == "arch_family"
    assert (d_ab.expected, d_ab.actual) == ("sm90", "sm100")
    assert (d_ba.expected, d_ba.actual) == ("sm100", "sm90")


def test_header_fields_follow_spec_order():
    assert HEADER_FIELDS == (
        "forward_q_rows",
        "forward_partial_nnz",
        "forward_full_nnz",
        "backward_q_rows",
        "backward_k_rows",
        "backward_partial_nnz",
        "backward_full_nnz",
        "error_flags",
    )


# --------------------------------------------------------------------------------------------------
# RowMajorLayout
# --------------------------------------------------------------------------------------------------


def test_pack_sets_every_byte_pattern_bit_for_bit():
    """Each of the 256 patterns of eight flags becomes its own byte, in every byte of a word (the
    packer's multiply must carry nothing into a neighbour's bits)."""
    layout = RowMajorLayout(4, 32)
    patterns = torch.arange(256)
    flags = ((patterns.view(-1, 1) >> torch.arange(8)) & 1).bool()
    tiles = flags.repeat(1, 16).view(256, 4, 32)  # row m, byte k of its word: the pattern
    words = layout.pack(tiles)[:, 0, :, 0].to(torch.int64) & 0xFFFFFFFF
    for k in range(4):
        assert torch.equal((words >> (8 * k)) & 0xFF, patterns.view(-1, 1).expand(-1, 4)), f"byte {k}"


@pytest.mark.parametrize("tm, tn", [(8, 64), (16, 32), (8, 40)])
def test_pack_takes_tiles_at_any_offset(tm, tn):
    """Packing gathers aligned runs of flags as wider words where the bit order allows (8 per
    row-major word part); tiles starting at any element, e.g. a slice, pack as the whole does."""
    layout = RowMajorLayout(tm, tn)
    tiles = torch.rand(5, tm, tn, generator=torch.Generator().manual_seed(0)) < 0.5
    whole = layout.pack(tiles)
    assert torch.equal(layout.pack(tiles[1:]), whole[1:])
    odd = torch.zeros(5 * tm * tn + 3, dtype=torch.bool)[3:].view(5, tm, tn)  # storage offset 3
    odd.copy_(tiles)
    assert torch.equal(layout.pack(odd), whole)


@FAST
@given(
    tm=st.integers(1, 40),
    tn=st.integers(1, 100),
    n=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_rowmajor_pack_unpack_round_trip(tm, tn, n, seed):
    layout = RowMajorLayout(tm, tn)
    gen = torch.Generator().manual_seed(seed)
    tiles = torch.rand(n, tm, tn, generator=gen) < 0.5
    words = layout.pack(tiles)
    assert words.dtype == torch.int32
    assert tuple(words.shape) == (n, 1, tm, -(-tn // 32))
    assert torch.equal(layout.unpack(words), tiles)
    # padding bits of the last word are zero
    pad = 32 * words.shape[-1] - tn
    if pad:
        last = words[..., -1].to(torch.int64) & 0xFFFFFFFF
        assert bool((last >> (32 - pad) == 0).all())


@pytest.mark.parametrize("tm, tn", [(128, 128), (16, 32), (8, 40), (3, 33)])
def test_rowmajor_spec_and_coords(tm, tn):
    layout = RowMajorLayout(tm, tn)
    spec = layout.spec
    assert (spec.physical_subtiles, spec.payload_groups, spec.words_per_group) == (1, tm, -(-tn // 32))
    assert spec.layout_id == layout.layout_id
    s, g, w, b = layout.element_coords()
    m = torch.arange(tm)[:, None].expand(tm, tn)
    n = torch.arange(tn)[None, :].expand(tm, tn)
    assert bool((s == 0).all())
    assert torch.equal(g, m) and torch.equal(w, n // 32) and torch.equal(b, n % 32)


@pytest.mark.parametrize("m, n", [(0, 0), (0, 31), (5, 32), (15, 63), (7, 45), (15, 0)])
def test_rowmajor_single_bit_position(m, n):
    """Element (m, n) is bit n % 32 of word n // 32 in group m; nothing else is set."""
    layout = RowMajorLayout(16, 64)
    tile = torch.zeros(1, 16, 64, dtype=torch.bool)
    tile[0, m, n] = True
    words = layout.pack(tile)
    expected = torch.zeros_like(words)
    value = 1 << (n % 32)
    expected[0, 0, m, n // 32] = value - (1 << 32) if value >= 1 << 31 else value
    assert torch.equal(words, expected)
    assert torch.equal(layout.unpack(words), tile)


def test_rowmajor_bit31_is_a_negative_int32():
    layout = RowMajorLayout(2, 64)
    tile = torch.zeros(1, 2, 64, dtype=torch.bool)
    tile[0, 1, 31] = True
    tile[0, 1, 63] = True
    words = layout.pack(tile)
    assert words[0, 0, 1].tolist() == [-(2**31), -(2**31)]
    assert words[0, 0, 0].tolist() == [0, 0]
    assert torch.equal(layout.unpack(words), tile)
    full = layout.pack(torch.ones(1, 2, 64, dtype=torch.bool))
    assert bool((full == -1).all())
    assert bool(layout.unpack(full).all())


def test_rowmajor_unpack_reads_raw_words():
    """unpack is the inverse map of the ABI: a hand-written word decodes bit by bit."""
    layout = RowMajorLayout(1, 40)
    words = torch.tensor([[[[0b1011, 0x80]]]], dtype=torch.int32)  # [1, 1, 1, 2]
    keep = layout.unpack(words)[0, 0]
    assert keep.nonzero().flatten().tolist() == [0, 1, 3, 39]


@pytest.mark.parametrize("tm, tn", [(128, 128), (16, 32), (8, 40)])
def test_rowmajor_empty_batch(tm, tn):
    """Zero tiles pack to a [0, 1, groups, words] tensor and back (a plan with no partial blocks)."""
    layout = RowMajorLayout(tm, tn)
    words = layout.pack(torch.zeros(0, tm, tn, dtype=torch.bool))
    assert words.dtype == torch.int32
    assert tuple(words.shape) == (0, 1, tm, -(-tn // 32))
    assert tuple(layout.unpack(words).shape) == (0, tm, tn)


class _OutOfRangeBits(RowMajorLayout):
    """All of a 2 x 32 tile in group 0, word 0, bits 0..63: round-trips through pack / unpack, but
    the ABI's ``(word >> bit) & 1`` cannot read bits past 31."""

    def element_coords(self):
        s, _, _, _ = super().element_coords()
        flat = torch.arange(self.tile_m * self.tile_n).reshape(self.tile_m, self.tile_n)
        return s, torch.zeros_like(flat), torch.zeros_like(flat), flat


def test_layout_coordinates_must_fit_the_payload():
    layout = _OutOfRangeBits(2, 32)
    with pytest.raises(InputValueError, match=r"bit must be .* in \[0, 32\), got .* range \[0, 63\]"):
        layout.pack(torch.ones(1, 2, 32, dtype=torch.bool))


class _Coords(RowMajorLayout):
    """RowMajorLayout's coordinates passed through ``transform`` (a layout author's mistake)."""

    def __init__(self, transform):
        super().__init__(2, 32)
        self.transform = transform

    def element_coords(self):
        return self.transform(super().element_coords())


@pytest.mark.parametrize(
    "transform, words",
    [
        (lambda c: c[:3], "must return 4 tensors .* got 3 values"),
        (lambda c: torch.stack(c), "must return 4 tensors .* got Tensor"),
        (lambda c: (*c[:3], c[3].float()), "bit must be an integer tensor .* got torch.float32"),
        (lambda c: (c[0].tolist(), *c[1:]), "subtile must be an integer tensor .* got list"),
    ],
)
def test_malformed_element_coords_are_refused_by_name(transform, words):
    with pytest.raises(InputTypeError, match=f"payload layout rowmajor.*element_coords.*{words}"):
        _ = _Coords(transform).spec
    assert _Coords(lambda c: list(c)).spec == RowMajorLayout(2, 32).spec  # a list of 4 is as good


def test_bit_order_is_the_documented_digest():
    """``bit_order`` is reproducible from the map alone (the schema's recipe, written out here with
    hashlib and struct), so a producer in another language or process computes the same string."""
    import hashlib
    import struct

    layout = RowMajorLayout(4, 40)  # bit = (m * 2 + n // 32) * 32 + n % 32
    flat = [(m * 2 + n // 32) * 32 + n % 32 for m in range(4) for n in range(40)]
    digest = hashlib.sha256(struct.pack(f"<{2 + len(flat)}q", 4, 40, *flat)).hexdigest()[:16]
    assert layout.bit_order == layout.spec.bit_order == "sha256:" + digest
    assert RowMajorLayout(40, 4).bit_order != layout.bit_order  # the tile shape is hashed too


def test_a_signature_names_the_bit_order_not_only_the_id():
    """Two layouts of one ``layout_id`` whose bits differ (a subclass overriding element_coords and
    keeping its parent's id, or a layout changed without a new version) each pack and unpack in
    their own order, and their signatures differ in ``payload.bit_order``: a plan packed by one is
    refused by a consumer of the other, whichever process built it (the signature is all it
    carries)."""
    from maskplan_core import PlanSignatureMismatch, masks, validate_plan_inputs
    from maskplan_core.consumer import ViewConfig, require_view_signature
    from maskplan_core.reference import build_plan
    from maskplan_core.testing import ReversedColumnsLayout

    tiles = torch.rand(3, 4, 40) < 0.5
    forward, reversed_ = RowMajorLayout(4, 40), ReversedColumnsLayout(4, 40)
    assert forward.layout_id == reversed_.layout_id
    for layout in (forward, reversed_):
        assert torch.equal(layout.unpack(layout.pack(tiles)), tiles)
    assert not torch.equal(forward.pack(tiles), reversed_.pack(tiles))
    assert forward.bit_order != reversed_.bit_order
    assert RowMajorLayout(4, 40).bit_order == forward.bit_order

    def config(layout):
        topology = Topology(tile_m=4, tile_n=40)
        return ViewConfig(signature(topology=topology, payload=layout.spec), layout)

    q = torch.randn(1, 100, 1, 8)
    mask = masks.sliding_window(100, window_left=7)
    plan = build_plan(mask, validate_plan_inputs(mask, q, q, q), config(reversed_), None, "test")
    assert plan.view("forward").stats()["partial"] > 0
    require_view_signature(plan.view("forward"), "forward", config(reversed_), arch="test")
    with pytest.raises(PlanSignatureMismatch, match=r"payload\.bit_order: plan has 'sha256:") as info:
        require_view_signature(plan.view("forward"), "forward", config(forward), arch="test")
    assert [d.field for d in info.value.diffs] == ["payload.bit_order"]


def test_a_view_carries_a_signature_of_its_own_direction_and_layout():
    """The runtime dispatches on a view's signature alone, so a view config whose signature names
    the other direction, or a payload other than the one it packs, is refused when the view is
    made (the reference and GPU builders both make views this way)."""
    from maskplan_core import masks, validate_plan_inputs
    from maskplan_core.consumer import ViewConfig
    from maskplan_core.reference import build_plan

    q = torch.randn(1, 100, 1, 8)
    g = validate_plan_inputs(masks.causal(100), q, q, q)
    layout = RowMajorLayout(32, 32)

    def config(direction, payload=layout.spec):
        return _view_config(direction, layout, payload)

    build_plan(masks.causal(100), g, config("forward"), config("backward"), "test")  # consistent
    with pytest.raises(ValueError, match="forward view was given a backward signature"):
        build_plan(masks.causal(100), g, config("backward"), None, "test")
    with pytest.raises(ValueError, match="backward view was given a forward signature"):
        build_plan(masks.causal(100), g, config("forward"), config("forward"), "test")
    with pytest.raises(ValueError, match="signature.payload .* does not describe the layout"):
        build_plan(masks.causal(100), g, config("forward", RowMajorLayout(16, 64).spec), None, "test")
    with pytest.raises(InputValueError, match="packs 32x32 tiles but the signature's topology tiles 64x48"):
        ViewConfig(signature(topology=Topology(tile_m=64, tile_n=48), payload=layout.spec), layout)
    # a view made by hand (a loader of stored tensors): its layout tiles as its topology does
    view = build_plan(masks.causal(100), g, config("forward"), None, "test").view("forward")
    other = RowMajorLayout(16, 64)
    tensors = dict(view.tensors)
    n = tensors["mask_block_idx"].numel()
    tensors["mask_block_masks"] = torch.zeros(n, other.subtiles, other.groups, other.words_per_group,
                                              dtype=torch.int32)  # fmt: skip
    with pytest.raises(InputValueError, match="the forward view: the layout .* packs 16x64 tiles"):
        PlanView("forward", view.signature.model_copy(update={"payload": other.spec}), other, g, tensors)


def test_a_planner_refuses_pack_gqa_it_cannot_serve():
    """A PackGQA forward view names the geometry's group (a kernel sizes its packed tile by it),
    and a backward view never packs."""
    from maskplan_core import masks, validate_plan_inputs
    from maskplan_core.reference import build_plan

    q, k = torch.randn(1, 64, 4, 8), torch.randn(1, 64, 2, 8)
    g = validate_plan_inputs(masks.causal(64), q, k, k)
    layout = RowMajorLayout(32, 32)

    def config(direction, **topology):
        return _view_config(direction, layout, layout.spec, **topology)

    build_plan(masks.causal(64), g, config("forward", pack_gqa=True, qhead_per_kvhead=2), None, "test")
    with pytest.raises(InputValueError, match=r"qhead_per_kvhead=1 is not .* = 2"):
        build_plan(masks.causal(64), g, config("forward", pack_gqa=True), None, "test")
    with pytest.raises(InputValueError, match="backward view's topology has pack_gqa=True"):
        build_plan(masks.causal(64), g, config("forward"), config("backward", pack_gqa=True), "test")


def test_a_kernel_config_gives_its_compile_key_and_plan_signature():
    """A library's own kernel config, a frozen dataclass on ``consumer.KernelConfig``: the compile
    key lists its CONSTEXPR fields in declaration order (and only those), and the signature is
    assembled from its class attributes, fields and topology."""
    from dataclasses import dataclass, field

    from maskplan_core.consumer import CONSTEXPR, KernelConfig

    @dataclass(frozen=True)
    class MyForward(KernelConfig):
        arch_family = "sm80"
        mma_layout = "mma-m16n8k16"
        direction = "forward"
        kernel_family = "my-fwd-v1"
        scheduler_layout = "plan-fwd-work-desc-v1"
        dq_order_format = "none"
        head_dim: int = field(metadata=CONSTEXPR)
        tile_m: int = field(default=64, metadata=CONSTEXPR)
        note: str = "not compiled in"

        @property
        def payload_layout(self):
            return RowMajorLayout(self.tile_m, 64)

        def topology(self) -> Topology:
            return Topology(tile_m=self.tile_m, tile_n=64, q_stage=1, cta_group_size=1, pack_gqa=False)

    config = MyForward(head_dim=96)
    assert config.compile_key() == (("head_dim", 96), ("tile_m", 64))
    sig = config.plan_signature()
    assert (sig.arch_family, sig.mma_layout, sig.kernel_family) == ("sm80", "mma-m16n8k16", "my-fwd-v1")
    assert sig.topology.tile_m == 64 and sig.payload == RowMajorLayout(64, 64).spec
    assert sig.direction == "forward" and sig.dq_order_format == "none"


def test_fragment_inverse_scatters_register_coords_and_checks_the_holders():
    """A 2x2 tile held by two threads of two registers each (thread = row): the inverse puts each
    register's (subtile, group, word, bit) at its element; a fragment that holds an element twice,
    or whose two holders of an element read different bits, is refused."""
    from types import SimpleNamespace

    from maskplan_core.payload import fragment_inverse

    layout = SimpleNamespace(tile_m=2, tile_n=2, layout_id="toy")
    m = torch.tensor([[0, 0], [1, 1]])
    n = torch.tensor([[0, 1], [0, 1]])
    group, bit = m.clone(), n.clone()
    zero = torch.zeros_like(m)
    s, g, w, b = fragment_inverse(layout, m, n, (zero, group, zero, bit))
    assert g.tolist() == [[0, 0], [1, 1]] and b.tolist() == [[0, 1], [0, 1]]
    with pytest.raises(AssertionError, match="toy: the fragment does not hold every element"):
        fragment_inverse(layout, m, torch.zeros_like(n), (zero, group, zero, bit))
    twice = (torch.cat([m, m]), torch.cat([n, n]))
    assert fragment_inverse(layout, *twice, (zero.repeat(2, 1),) * 3 + (bit.repeat(2, 1),), holders=2)
    with pytest.raises(AssertionError, match="toy: two holders of one element read different bits"):
        fragment_inverse(layout, *twice, (zero.repeat(2, 1),) * 3 + (torch.cat([bit, 1 - bit]),), holders=2)
