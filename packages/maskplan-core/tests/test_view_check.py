"""maskplan_core.view_check: a view whose tensors break the ABI is refused by name (its structure when
it is made, its values by ``validate`` and ``to_dense``), where a consumer would misread it."""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle

import pytest
import torch
from test_plan_properties import small_config

from maskplan_core import HEADER_FIELDS, MaskPlan, PlanSignature, PlanView, masks, validate_plan_inputs
from maskplan_core.errors import InputTypeError, InputValueError, PlanBindingError
from maskplan_core.reference import build_plan
from maskplan_core.view_check import entry_tiles

CU = [0, 70, 70, 150]  # an empty middle sample


def _plan(
    varlen: bool, hmask: int = 2, *, heads: int = 2, backward: bool = True, windows: tuple = (70, 50)
) -> MaskPlan:
    """Sliding windows (one per mask head) over two samples: empty, partial and full tiles at the
    16x32 forward / 32x16 backward blocks."""
    if varlen:
        cu = torch.tensor(CU, dtype=torch.int32)
        shape, extra = dict(cu_seqlens_q=cu, cu_seqlens_k=cu), dict(max_seqlen_q=80, max_seqlen_k=80)
        q = k = torch.randn(CU[-1], heads, 8)
        extra |= shape
    else:
        shape, extra = dict(seqlen_q=90, seqlen_k=100, batch=2), {}
        q, k = torch.randn(2, 90, heads, 8), torch.randn(2, 100, heads, 8)
    ep = torch.cat([masks.sliding_window(**shape, window_left=w) for w in windows[:hmask]])
    g = validate_plan_inputs(ep, q, k, k, **extra)
    bwd = small_config("backward", (32, 16)) if backward else None
    return build_plan(ep, g, small_config("forward", (16, 32)), bwd, "test")


def _remade(view: PlanView, **tensors) -> PlanView:
    return PlanView(view.role, view.signature, view.layout, view.geometry, {**view.tensors, **tensors})


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_planned_views_pass(varlen):
    plan = _plan(varlen)
    for role in plan.roles:
        view = plan.view(role)
        assert view.validate() is view
        assert view.stats()["partial"] and view.stats()["full"]  # the tampering below has both kinds


def _structure_cases(view: PlanView) -> dict:
    t = view.tensors
    idx = t["mask_block_idx"]
    return {
        "tensors lack mask_block_idx": {"mask_block_idx": None},
        "tensors include sequence_desc": {"sequence_desc": torch.zeros(2, 8, dtype=torch.int32)},
        "mask_block_idx is torch.int64": {"mask_block_idx": idx.long()},
        "mask_block_cnt is torch.float32": {"mask_block_cnt": t["mask_block_cnt"].float()},
        "mask_block_offset is int": {"mask_block_offset": 3},
        r"mask_block_cnt has shape \(\d+, 2\)": {"mask_block_cnt": t["mask_block_cnt"].T.contiguous()},
        r"mask_block_cnt has shape \(\d+,\)": {"mask_block_cnt": t["mask_block_cnt"].reshape(-1)},
        "full_block_offset has shape": {"full_block_offset": t["full_block_offset"][:, :-1]},
        "mask_block_idx has shape .* one-dimensional": {"mask_block_idx": idx[None]},
        "mask_block_masks has shape": {"mask_block_masks": t["mask_block_masks"].reshape(idx.numel(), -1)},
        "fwd_work_desc has shape": {"fwd_work_desc": t["fwd_work_desc"][:, :3]},
        "full_block_idx is torch.int32 on meta; .* on the plan's cpu": {
            "full_block_idx": t["full_block_idx"].to("meta")
        },
        # right shape and values, but a kernel reading from the base address would see other entries
        r"fwd_work_desc has strides \(1, \d+\); .* contiguous": {
            "fwd_work_desc": t["fwd_work_desc"].T.contiguous().T
        },
        "mask_block_idx has strides": {"mask_block_idx": torch.stack([idx, idx], 1)[:, 0]},
    }


@pytest.mark.parametrize("case", list(_structure_cases(_plan(False).view("forward"))))
def test_structure_is_checked_when_a_view_is_made(case):
    view = _plan(False).view("forward")
    with pytest.raises(InputValueError, match=f"the forward view's {case}"):
        _remade(view, **_structure_cases(view)[case])


def test_structure_of_rows_and_role_tensors():
    plan = _plan(False)
    fwd, bwd = plan.view("forward"), plan.view("backward")
    csr = ("mask_block_cnt", "mask_block_offset", "full_block_cnt", "full_block_offset")
    with pytest.raises(InputValueError, match=r"CSR rows are \d+; B x Q blocks is"):
        _remade(fwd, **{name: fwd.tensors[name][:, 1:] for name in csr})
    with pytest.raises(InputValueError, match="lack dq_write_order_full"):
        _remade(bwd, dq_write_order_full=None)
    with pytest.raises(InputValueError, match="dq_write_order has shape"):
        _remade(bwd, dq_write_order=bwd.tensors["dq_write_order"][1:])
    with pytest.raises(InputValueError, match="include fwd_work_desc, which a backward view does not hold"):
        _remade(bwd, fwd_work_desc=fwd.tensors["fwd_work_desc"])
    varlen = _plan(True).view("forward")
    with pytest.raises(InputValueError, match="lack sequence_desc"):
        _remade(varlen, sequence_desc=None)
    with pytest.raises(InputValueError, match=r"sequence_desc has shape \(2, 8\), expected \(3, 8\)"):
        _remade(varlen, sequence_desc=varlen.tensors["sequence_desc"][:2])


def _first_row_with(cnt: torch.Tensor, at_least: int) -> int:
    return int((cnt.reshape(-1) >= at_least).nonzero()[0])


def _value_cases(view: PlanView) -> list[tuple[str, dict]]:
    """Tampered tensors of ``view`` (right structure, wrong values) -> the refusal's words."""
    t = {name: x.clone() for name, x in view.tensors.items() if x is not None}
    cases = []

    def case(words, **changes):
        cases.append((words, changes))

    idx, cnt = t["mask_block_idx"], t["mask_block_cnt"]
    case("mask_block_idx has a block index outside", mask_block_idx=idx - 1 - idx.min())
    case("full_block_idx has a block index outside", full_block_idx=t["full_block_idx"] + 7)
    case("mask_block_cnt has a negative count", mask_block_cnt=cnt - (cnt == cnt.max()).int() * 2 * cnt.max())
    moved = cnt.clone().reshape(-1)
    r = _first_row_with(moved, 1)
    moved[r] -= 1
    moved[-1] += 1  # same total, the entries now belong to other rows
    case("mask_block_offset is not the exclusive scan", mask_block_cnt=moved.view_as(cnt))
    offset = t["mask_block_offset"].clone().reshape(-1)
    offset[_first_row_with(cnt, 1) + 1] = 0  # a row pointing at another's entries (the helper's t6)
    case("mask_block_offset is not the exclusive scan", mask_block_offset=offset.view_as(cnt))
    swapped = idx.clone()
    r = _first_row_with(cnt, 2)
    first = int(t["mask_block_offset"].reshape(-1)[r])
    swapped[first], swapped[first + 1] = idx[first + 1], idx[first]
    case("mask_block_idx is not ascending within a row", mask_block_idx=swapped)
    payload = t["mask_block_masks"].clone()
    every_element = view.layout.pack(torch.ones(1, *view.block_size, dtype=torch.bool))
    payload[:] = every_element  # past q_len / k_len too
    case("mask_block_masks sets a bit past its sample", mask_block_masks=payload)
    empty = t["mask_block_masks"].clone()
    empty[0] = 0
    case("mask_block_masks has an entry with no bit set", mask_block_masks=empty)
    chunks = entry_tiles(view, view.entries("partial"))
    inside = torch.cat([chunk.in_bounds.flatten(1).all(1) for chunk in chunks])
    full = t["mask_block_masks"].clone()
    full[int(inside.nonzero()[0])] = every_element
    case("mask_block_masks has an in-bounds entry with every bit set", mask_block_masks=full)
    if not bool((every_element == -1).all()):  # the layout has padding bits
        case("mask_block_masks sets a padding bit", mask_block_masks=torch.full_like(payload, -1))
    if view.role == "forward":
        work = t["fwd_work_desc"].clone()
        work[1] = work[0]
        case("fwd_work_desc is not one", fwd_work_desc=work)
        work = t["fwd_work_desc"].clone()
        work[:, 3] = 16
        case("fwd_work_desc is not one", fwd_work_desc=work)
    else:
        case("dq_write_order.* is not each entry's K block rank", dq_write_order=t["dq_write_order"].flip(0))
    return cases


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("role", ["forward", "backward"])
def test_values_are_checked_by_validate_and_to_dense(varlen, role):
    """... and by ``block_map``, but for the payloads' bits: it draws the lists without decoding
    a payload (most of validate's work on a plan of many partial tiles)."""
    view = _plan(varlen).view(role)
    cases = _value_cases(view)
    assert len(cases) >= 8
    for words, changes in cases:
        bad = _remade(view, **changes)  # the structure is right: made without complaint
        for check in (bad.validate, bad.to_dense):
            with pytest.raises(InputValueError, match=f"the {role} view's {words}"):
                check()
        if words.startswith("mask_block_masks"):
            assert torch.equal(bad.block_map(), view.block_map())
        else:
            with pytest.raises(InputValueError, match=f"the {role} view's {words}"):
                bad.block_map()


def test_a_tile_in_both_lists_and_a_full_tile_past_the_sample_are_refused():
    view = _plan(False, hmask=1).view("forward")
    t = view.tensors
    full_cnt, full_idx = t["full_block_cnt"].clone().reshape(-1), t["full_block_idx"]
    cnt, idx = t["mask_block_cnt"].reshape(-1), t["mask_block_idx"]
    # move row r's first partial tile into its full list as well (sorted into place)
    r = int(((cnt > 0) & (full_cnt > 0)).nonzero()[0])
    off_p, off_f = int(t["mask_block_offset"].reshape(-1)[r]), int(t["full_block_offset"].reshape(-1)[r])
    row_full = torch.cat([full_idx[off_f : off_f + int(full_cnt[r])], idx[off_p : off_p + 1]]).sort().values
    new_idx = torch.cat([full_idx[:off_f], row_full, full_idx[off_f + int(full_cnt[r]) :]])
    full_cnt[r] += 1
    shared = dict(
        full_block_idx=new_idx,
        full_block_cnt=full_cnt.view_as(t["full_block_cnt"]),
        full_block_offset=(torch.cumsum(full_cnt, 0) - full_cnt).int().view_as(t["full_block_cnt"]),
    )
    with pytest.raises(InputValueError, match="partial and full lists share a tile"):
        _remade(view, **shared).validate()
    # sample 0's last K block (100 keys on 32-column tiles) listed full: past k_len
    last = torch.full_like(full_idx, 3)
    with pytest.raises(InputValueError, match="full_block_idx lists a tile reaching past"):
        _remade(view, full_block_idx=last).validate()


def test_a_geometry_that_contradicts_itself_is_refused():
    """A kernel sizes its workspace from ``max_seqlen`` and reads rows up to the prefixes' end: a
    hand-made geometry whose totals, prefixes and bounds disagree is refused (the facade never makes
    one; a loader of stored plans might)."""
    from maskplan_core.errors import SeqlenError

    for varlen, changes, words in (
        (True, dict(total_q=100), "cu_seqlens_q"),
        (True, dict(max_seqlen_q=40), "cu_seqlens_q"),
        (False, dict(total_q=150), "fixed-length geometry is not B samples of S rows"),
        (False, dict(cu_seqlens_k=torch.tensor([0, 90, 200], dtype=torch.int32)), "fixed-length geometry"),
        (False, dict(cu_seqlens_q=torch.tensor([0, 90, 180])), "geometry's cu_seqlens_q is torch.int64"),
    ):
        view = _plan(varlen).view("forward")
        bad = PlanView(view.role, view.signature, view.layout, dataclasses.replace(view.geometry, **changes),
                       view.tensors)  # fmt: skip
        with pytest.raises((InputValueError, SeqlenError), match=words):
            bad.validate()


def test_varlen_descriptor_must_be_the_geometrys():
    view = _plan(True).view("forward")
    desc = view.tensors["sequence_desc"].clone()
    desc[2, 2] -= 1
    with pytest.raises(InputValueError, match="sequence_desc is not its geometry's"):
        _remade(view, sequence_desc=desc).validate()


def _forward_header(plan: MaskPlan) -> tuple[int, ...]:
    """The header of ``plan`` without its backward view."""
    return tuple(v if "backward" not in k else 0 for k, v in plan.metadata["allocation_header"].items())


def test_a_plan_holds_views_of_its_own_geometry_and_roles():
    plan, other = _plan(False), _plan(False, hmask=1)
    fwd, bwd = plan.view("forward"), plan.view("backward")
    header, g = _forward_header(plan), plan.geometry
    MaskPlan(dataclasses.replace(g), {"forward": fwd}, header, "test")  # an equal geometry will do
    with pytest.raises(InputValueError, match="the backward view was built for .* not for the plan's"):
        MaskPlan(g, {"forward": fwd, "backward": other.view("backward")}, header, "test")
    with pytest.raises(InputValueError, match="needs a forward view"):
        MaskPlan(g, {"backward": bwd}, header, "test")
    with pytest.raises(InputValueError, match="'forward' holds a backward view"):
        MaskPlan(g, {"forward": bwd}, header, "test")


@pytest.mark.parametrize(
    "header, match",
    [((1, 2, 3), "holds 8 counts .* got \\(1, 2, 3\\)"), ((0,) * 7 + (-1,), "holds 8 counts"),
     ((0.0,) * 8, "holds 8 counts"), ((0,) * 7 + (256,), "error_flags 0x100")],
    ids=["short", "negative", "float", "error-flags"],
)
def test_a_plan_header_holds_the_planners_counts(header, match):
    """A plan remade from stored views (pickled views rebuild into a MaskPlan) names a header that is
    not the planner's: eight non-negative int counts, error flags 0."""
    plan = _plan(False)
    with pytest.raises(InputValueError, match=match):
        MaskPlan(plan.geometry, {"forward": plan.view("forward")}, header, "test")


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_a_plan_header_matches_its_views(varlen):
    """The allocation header a plan reports (``metadata["allocation_header"]``) is its views' sizes:
    a planner of one's own that gets it wrong is refused, naming the fields (a varlen backward view's
    Q blocks are not checked: its samples' lengths are on the device)."""
    plan = _plan(varlen)
    views = {role: plan.view(role) for role in plan.roles}
    header = tuple(plan.metadata["allocation_header"].values())
    MaskPlan(plan.geometry, views, header, "test")
    MaskPlan(plan.geometry, {"forward": views["forward"]}, _forward_header(plan), "test")
    for field in range(7):
        wrong = tuple(v + (i == field) for i, v in enumerate(header))
        if varlen and field == 3:  # backward_q_rows
            MaskPlan(plan.geometry, views, wrong, "test")
            continue
        with pytest.raises(InputValueError, match=f"does not match its views: {HEADER_FIELDS[field]}="):
            MaskPlan(plan.geometry, views, wrong, "test")
    with pytest.raises(InputValueError, match="backward_k_rows=.* \\(its views: 0\\)"):
        MaskPlan(plan.geometry, {"forward": views["forward"]}, header, "test")  # no backward view


def test_a_views_signature_fits_its_role_and_geometry():
    """What the planner checks before building, a view made by hand (a planner or loader of one's
    own) is refused for when made: PackGQA in a backward view, over several mask heads or another
    group than the geometry's, a dQ order format not of its role, heads that do not divide."""
    plan = _plan(False, heads=4, hmask=1)
    shared = {role: plan.view(role) for role in plan.roles}
    per_head = _plan(False, hmask=2).view("forward")  # Hq = Hkv = Hmask = 2
    geometry = dataclasses.replace(shared["forward"].geometry, num_heads_kv=2)

    def remade(view, geometry=None, **changes):
        sig = view.signature.model_dump()
        for key, value in changes.items():
            if key in ("pack_gqa", "qhead_per_kvhead"):
                sig["topology"][key] = value
            else:
                sig[key] = value
        return PlanView(view.role, PlanSignature.model_validate(sig), view.layout, geometry or view.geometry,
                        view.tensors)  # fmt: skip

    with pytest.raises(InputValueError, match="backward view's topology has pack_gqa=True"):
        remade(shared["backward"], pack_gqa=True)
    with pytest.raises(InputValueError, match="forward view's topology has pack_gqa=True over Hmask=2"):
        remade(per_head, geometry=dataclasses.replace(per_head.geometry, num_heads_kv=1), pack_gqa=True,
               qhead_per_kvhead=2)  # fmt: skip
    with pytest.raises(InputValueError, match="Hmask 1 or Hq"):
        remade(shared["forward"], geometry=dataclasses.replace(geometry, mask_heads=3))
    with pytest.raises(InputValueError, match="Hq must be a multiple of Hkv"):
        remade(shared["forward"], geometry=dataclasses.replace(geometry, num_heads_kv=3))
    with pytest.raises(InputValueError, match="qhead_per_kvhead=4 is not the geometry's .* = 2"):
        remade(shared["forward"], geometry=geometry, pack_gqa=True, qhead_per_kvhead=4)
    with pytest.raises(InputValueError, match="dq_order_format='none'; a backward view's is 'rank_int32'"):
        remade(shared["backward"], dq_order_format="none")
    with pytest.raises(InputValueError, match="dq_order_format='rank_int32'; a forward view's is 'none'"):
        remade(shared["forward"], dq_order_format="rank_int32")


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_a_backward_view_records_its_longest_row(varlen):
    """The planner reads back the longest K2Q row (partial + full entries) with its header: a launch
    hint (the SM90 backward splits more where rows differ in length), checked by ``validate``,
    kept by pickling and by a copy at other head dims."""
    from maskplan_core.head_dim_padding import kernel_view

    plan = _plan(varlen)
    bwd = plan.view("backward")
    t = bwd.tensors
    assert bwd.longest_row == int((t["mask_block_cnt"] + t["full_block_cnt"]).max()) > 0
    assert plan.view("forward").longest_row is None
    assert pickle.loads(pickle.dumps(bwd)).longest_row == bwd.longest_row
    assert kernel_view(bwd, lambda dqk, dv: (dqk + 8, dv + 8)).longest_row == bwd.longest_row
    wrong = dataclasses.replace(bwd, longest_row=bwd.longest_row + 1)
    with pytest.raises(InputValueError, match=f"longest_row is {bwd.longest_row + 1}; its longest CSR row"):
        wrong.validate()
    with pytest.raises(InputValueError, match="longest_row must be an int >= 0 or None"):
        dataclasses.replace(bwd, longest_row=-1)


def test_check_unwritten_names_a_plan_tensor_written_in_place():
    """A consumer called directly (the maskplan-core README's) runs ``check_unwritten`` before its
    kernel: a payload bit flipped in place still validates, but is named."""
    plan = _plan(False)
    plan.check_unwritten()
    fwd = plan.view("forward")
    fwd.mask_block_masks.view(-1)[0] ^= 1
    with pytest.raises(PlanBindingError, match="mask_block_masks was written in place"):
        plan.check_unwritten()


def test_views_pickle_and_torch_save_and_copy_as_themselves():
    view = _plan(True).view("backward")
    assert copy.copy(view) is view and copy.deepcopy(view) is view  # read-only, as a MaskPlan
    for loaded in (pickle.loads(pickle.dumps(view)), _torch_round_trip(view)):
        assert loaded.signature == view.signature and loaded.geometry.describe() == view.geometry.describe()
        assert loaded.tensors.keys() == view.tensors.keys()
        assert all(torch.equal(loaded.tensors[n], view.tensors[n]) for n in view.tensors)
        assert torch.equal(loaded.to_dense(), view.to_dense())


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_a_rebuilt_plan_has_its_own_handle_and_the_same_fingerprint(varlen):
    """A plan rebuilt from the same inputs has its own handle and the same fingerprint; one of
    another mask, of other heads or without the backward view has another."""
    plan, again = _plan(varlen), _plan(varlen)
    assert plan.handle != again.handle and plan.fingerprint == again.fingerprint
    others = (_plan(varlen, hmask=1), _plan(varlen, hmask=1, heads=4), _plan(varlen, backward=False))
    assert len({plan.fingerprint, *(other.fingerprint for other in others)}) == 4


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_same_mask_compares_the_tensors_beyond_the_fingerprint(varlen):
    """Windows of 50 and 51 keys give the same block counts (one fingerprint) and other payloads:
    only the tensors tell them apart. A plan rebuilt from the same inputs gives the same mask."""
    fifty, again, fifty_one = (_plan(varlen, 1, windows=(w,)) for w in (50, 50, 51))
    assert fifty.fingerprint == fifty_one.fingerprint
    assert fifty.same_mask_as(again) and fifty.same_mask_as(fifty)
    assert not fifty.same_mask_as(fifty_one) and not fifty_one.same_mask_as(fifty)
    assert not fifty.same_mask_as(_plan(varlen, 1, windows=(70,)))  # another fingerprint
    with pytest.raises(InputTypeError, match="other must be a MaskPlan"):
        fifty.same_mask_as(fifty.view("forward"))


def test_same_mask_given_with_more_endpoints_per_row():
    """A mask's endpoint count is no part of it: causal rows as ``[F0]`` and as ``[0, 0, F0]`` (as
    from_mask_mod pads rows) plan to the same tensors, and the plans are the same mask."""
    one = masks.causal(200, batch=2)
    three = torch.cat([torch.zeros_like(one), torch.zeros_like(one), one], dim=1)
    q = torch.randn(2, 200, 2, 8)
    configs = small_config("forward", (16, 32)), small_config("backward", (32, 16))
    a, b = (build_plan(m, validate_plan_inputs(m, q, q, q), *configs, "test") for m in (one, three))
    assert a.fingerprint == b.fingerprint and a.same_mask_as(b) and b.same_mask_as(a)


def _torch_round_trip(view: PlanView) -> PlanView:
    buffer = io.BytesIO()
    torch.save(view, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_block_map_refuses_a_view_that_breaks_the_abi():
    """A view whose counts were written in place is refused by name, not decoded into a torch error."""
    view = _plan(False).view("forward")
    view.tensors["full_block_cnt"].add_(1)
    with pytest.raises(InputValueError, match="full_block_cnt"):
        view.block_map_text()
