"""The SM100 TMEM payload layout: bijective, equal to the 32x32b ownership rule, round-trips."""

from __future__ import annotations

import pytest
import torch

from flexattn_sm100.payload_layout import TmemLoadLayout, tmem_layout
from maskplan_core.payload import bit_order_digest

# (tile_m, tile_n, num_warpgroups, transposed, layout_id, subtiles, groups, words, elements per thread)
CASES = [
    (128, 128, 1, False, "sm100-tmem-ld32x32b-v1-128x128", 1, 128, 4, 128),  # qstage1 1CTA, D256 fwd
    (256, 128, 1, False, "sm100-tmem-ld32x32b-v1-256x128", 2, 128, 4, 128),  # qstage2 1CTA / qstage1 2CTA
    (128, 128, 2, True, "sm100-tmem-ld32x32b-v1-128x128-wg2-kq", 1, 256, 2, 64),  # bwd 1CTA
    (128, 256, 2, True, "sm100-tmem-ld32x32b-v1-128x256-wg2-kq", 2, 256, 2, 64),  # bwd 2CTA (K union)
    (64, 128, 1, True, "sm100-tmem-ld32x32b-v1-64x128-kq", 1, 128, 2, 64),  # bwd D256
    (128, 80, 1, False, "sm100-tmem-ld32x32b-v1-128x80", 1, 128, 3, 80),  # padded last word
]
IDS = [c[4] for c in CASES]


def make(case) -> TmemLoadLayout:
    tile_m, tile_n, nwg, transposed = case[:4]
    return TmemLoadLayout(tile_m, tile_n, nwg, transposed=transposed)


def ownership_rule(layout: TmemLoadLayout) -> dict[tuple[int, int], tuple[int, int, int, int]]:
    """(m, n) -> (subtile, group, word, bit), from the 32x32b rule with plain loops.

    Subtile s holds accumulator rows 128s..128s+127 (TMEM lanes); thread t = 128 wg + r of the
    subtile's warpgroups reads lane r, warpgroup wg reads columns wg*E .. wg*E + E-1 in order.
    """
    acc_rows, acc_cols = (
        (layout.tile_n, layout.tile_m) if layout.transposed else (layout.tile_m, layout.tile_n)
    )
    per_thread = acc_cols // layout.num_warpgroups
    out = {}
    for s in range(acc_rows // 128):
        for wg in range(layout.num_warpgroups):
            for r in range(128):
                for e in range(per_thread):
                    row, col = 128 * s + r, wg * per_thread + e
                    key = (col, row) if layout.transposed else (row, col)
                    assert key not in out
                    out[key] = (s, 128 * wg + r, e // 32, e % 32)
    return out


def rule_bit_order(layout: TmemLoadLayout) -> str:
    """The ``bit_order`` digest of the 32x32b rule's map: what a plan of this layout's id names."""
    flat = torch.empty(layout.tile_m, layout.tile_n, dtype=torch.int64)
    for (m, n), (s, g, w, b) in ownership_rule(layout).items():
        flat[m, n] = ((s * layout.groups + g) * layout.words_per_group + w) * 32 + b
    return bit_order_digest(flat)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_shape_and_id(case):
    layout = make(case)
    _, _, _, _, layout_id, subtiles, groups, words, per_thread = case
    assert layout.layout_id == layout_id
    assert (layout.subtiles, layout.groups, layout.words_per_group) == (subtiles, groups, words)
    assert layout.elements_per_thread == per_thread
    assert layout.spec.physical_subtiles == subtiles and layout.spec.payload_groups == groups
    assert layout.spec.bit_order == rule_bit_order(layout)
    assert layout.hardware_verified is False


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bijection_onto_valid_slots(case):
    layout = make(case)
    s, g, w, b = layout.element_coords()
    for x in (s, g, w, b):
        assert x.dtype == torch.int64 and x.shape == (layout.tile_m, layout.tile_n)
    assert 0 <= int(s.min()) and int(s.max()) < layout.subtiles
    assert 0 <= int(g.min()) and int(g.max()) < layout.groups
    assert 0 <= int(w.min()) and int(w.max()) < layout.words_per_group
    assert 0 <= int(b.min()) and int(b.max()) < 32
    slot = (((s * layout.groups + g) * layout.words_per_group + w) * 32 + b).reshape(-1)
    assert slot.unique().numel() == layout.tile_m * layout.tile_n
    per_group = torch.bincount((s * layout.groups + g).reshape(-1), minlength=layout.subtiles * layout.groups)
    assert bool((per_group == layout.elements_per_thread).all())


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_ownership_rule(case):
    layout = make(case)
    rule = ownership_rule(layout)
    assert len(rule) == layout.tile_m * layout.tile_n
    coords = torch.stack(layout.element_coords(), dim=-1)  # [tile_m, tile_n, 4]
    got = {(m, n): tuple(coords[m, n].tolist()) for m, n in rule}
    assert got == rule


def test_forward_rows_are_threads_columns_in_order():
    layout = tmem_layout(256, 128)
    assert layout.thread_elements(5) == [(5, n) for n in range(128)]
    assert layout.thread_elements(5, subtile=1) == [(133, n) for n in range(128)]  # CTA rank / q stage 1
    _, g, w, b = layout.element_coords()
    assert (int(g[133, 70]), int(w[133, 70]), int(b[133, 70])) == (5, 2, 6)
    with pytest.raises(IndexError, match="subtile=2"):
        layout.thread_elements(0, subtile=2)


def test_backward_transposed_ownership():
    layout = tmem_layout(128, 256, 2, True)  # Q128 x K256 block, S^T in TMEM: K rows on lanes
    # thread 3 of warpgroup 0, subtile 0: K row 3, Q columns 0..63
    assert layout.thread_elements(3) == [(m, 3) for m in range(64)]
    # thread 3 of warpgroup 1, subtile 1 (second CTA of the K pair): K row 131, Q columns 64..127
    assert layout.thread_elements(128 + 3, subtile=1) == [(m, 131) for m in range(64, 128)]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("density", [0.0, 0.3, 0.5, 1.0])
def test_pack_unpack_round_trip(case, density):
    layout = make(case)
    gen = torch.Generator().manual_seed(99)
    tiles = torch.rand(4, layout.tile_m, layout.tile_n, generator=gen) < density
    words = layout.pack(tiles)
    assert words.shape == (4, layout.subtiles, layout.groups, layout.words_per_group)
    assert torch.equal(layout.unpack(words), tiles)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_kernel_bit_select(case):
    """Register e of thread t in subtile s keeps the score iff bit e%32 of word e//32 is set."""
    layout = make(case)
    gen = torch.Generator().manual_seed(3)
    tile = torch.rand(1, layout.tile_m, layout.tile_n, generator=gen) < 0.5
    words = layout.pack(tile)[0].to(torch.int64) & 0xFFFFFFFF  # [subtiles, groups, words]
    for s in range(layout.subtiles):
        for t in range(0, layout.groups, 23):
            for e, (m, n) in enumerate(layout.thread_elements(t, s)):
                assert bool((words[s, t, e // 32] >> (e % 32)) & 1) == bool(tile[0, m, n])


def test_padding_bits_stay_zero():
    layout = tmem_layout(128, 80)  # 80 elements: words 0, 1 full, word 2 has 16 bits
    words = layout.pack(torch.ones(1, 128, 80, dtype=torch.bool))
    assert bool((words[..., :2] == -1).all()) and bool((words[..., 2] == 0xFFFF).all())


def test_cache_and_equality():
    assert tmem_layout(256, 128) is tmem_layout(256, 128)
    assert TmemLoadLayout(128, 128) == tmem_layout(128, 128)
    assert TmemLoadLayout(128, 128) != TmemLoadLayout(128, 128, transposed=True)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [((96, 128), {}, "multiple of the 128 TMEM lanes"), ((128, 128, 3), {}, "num_warpgroups"),
     ((128, 64), {"transposed": True}, "multiple of the 128")],
)  # fmt: skip
def test_invalid_geometry(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        TmemLoadLayout(*args, **kwargs)
