"""SM90 and SM100 views of the same problem are different ABIs: their signatures must say where.
Cross-package (both consumers), so it runs in the integration session, where every package is
installed (in the sm100 session it had skipped itself, and went stale unseen)."""

from __future__ import annotations

import pytest

import flexattn_sm90 as sm90
from flexattn_sm100 import Sm100Consumer
from maskplan_core.consumer import ViewRequest

PAIRS = [(32, 32), (64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]
ALWAYS_DIFFERENT = {"arch_family", "kernel_family", "mma_layout", "payload.layout_id", "payload.bit_order"}


def resolve(consumer, arch: str, direction: str, dims: tuple[int, int]):
    req = ViewRequest(
        arch_family=arch,
        direction=direction,
        head_dim_qk=dims[0],
        head_dim_v=dims[1],
        num_heads_q=4,
        num_heads_kv=4,
        mask_heads=1,
        dtype="bfloat16",
        varlen=False,
    )
    return consumer.resolve(req).signature


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("dims", PAIRS, ids=[f"{a}x{b}" for a, b in PAIRS])
def test_sm90_and_sm100_signatures_differ(direction, dims):
    a = resolve(sm90.Sm90Consumer(), "sm90", direction, dims)
    b = resolve(Sm100Consumer(), "sm100", direction, dims)
    fields = {d.field for d in a.diff(b)}
    assert ALWAYS_DIFFERENT <= fields
    assert fields == {d.field for d in b.diff(a)}
    assert "direction" not in fields and "abi_version" not in fields
    if direction == "forward":
        assert "scheduler_layout" in fields  # software atomic queue vs hardware CLC queue


def test_forward_d128_diff_is_exact():
    a = resolve(sm90.Sm90Consumer(), "sm90", "forward", (128, 128))
    b = resolve(Sm100Consumer(), "sm100", "forward", (128, 128))
    diffs = {d.field: (d.expected, d.actual) for d in a.diff(b)}
    # the SM100 default for D128 is the qstage1 + 1CTA kernel: same 128 x 128 tile and one subtile,
    # so only the payload grouping differs structurally (heuristics.py)
    assert diffs == {
        "arch_family": ("sm90", "sm100"),
        "kernel_family": ("sm90-fwd-persistent-v1", "sm100-fwd-qstage1-1cta-v1"),
        "mma_layout": ("wgmma-m64nNk16-acc", "tcgen05-tmem-ld32x32b"),
        "payload.layout_id": ("sm90-wgmma-acc-v1-128x128", "sm100-tmem-ld32x32b-v1-128x128"),
        "payload.bit_order": (a.payload.bit_order, b.payload.bit_order),
        "payload.payload_groups": (256, 128),
        "payload.words_per_group": (2, 4),
        "scheduler_layout": ("plan-dynamic-persistent-atomic-v1", "plan-clc-persistent-v1"),
    }


def test_forward_d128_two_cta_diff_is_exact():
    """The (not default) qstage1 + 2CTA variant's signature against SM90's: the M-axis CTA pair."""
    from flexattn_sm100 import select_fwd_config

    a = resolve(sm90.Sm90Consumer(), "sm90", "forward", (128, 128))
    b = select_fwd_config(head_dim_qk=128, head_dim_v=128, dtype="bfloat16", variant="qstage1-2cta")
    diffs = {d.field: (d.expected, d.actual) for d in a.diff(b.plan_signature())}
    assert diffs == {
        "arch_family": ("sm90", "sm100"),
        "kernel_family": ("sm90-fwd-persistent-v1", "sm100-fwd-qstage1-2cta-v1"),
        "topology.tile_m": (128, 256),
        "topology.cta_group_size": (1, 2),
        "topology.cluster_axis": ("none", "m"),
        "mma_layout": ("wgmma-m64nNk16-acc", "tcgen05-tmem-ld32x32b"),
        "payload.layout_id": ("sm90-wgmma-acc-v1-128x128", "sm100-tmem-ld32x32b-v1-256x128"),
        "payload.bit_order": (a.payload.bit_order, b.plan_signature().payload.bit_order),
        "payload.physical_subtiles": (1, 2),
        "payload.payload_groups": (256, 128),
        "payload.words_per_group": (2, 4),
        "scheduler_layout": ("plan-dynamic-persistent-atomic-v1", "plan-clc-persistent-v1"),
    }


def test_backward_d64_diff_is_exact():
    a = resolve(sm90.Sm90Consumer(), "sm90", "backward", (64, 64))
    b = resolve(Sm100Consumer(), "sm100", "backward", (64, 64))
    # the SM90 backward runs 128 x 128 tiles up to head dim 64 too, so the tile and the payload's
    # words per group agree; the ABIs still differ in family, MMA layout and payload layout
    assert [d.field for d in a.diff(b)] == [
        "arch_family",
        "kernel_family",
        "mma_layout",
        "payload.layout_id",
        "payload.bit_order",
    ]
