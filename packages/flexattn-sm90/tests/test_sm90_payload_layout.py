"""The SM90 WGMMA payload layout: bijective, equal to the accumulator ownership rule, round-trips."""

from __future__ import annotations

import pytest
import torch

from flexattn_sm90.payload_layout import (
    WgmmaAccumulatorLayout,
    WgmmaForward128x64Layout,
    WgmmaForward128x128Layout,
    WgmmaPackGqaLayout,
    wgmma_layout,
    wgmma_pack_gqa_layout,
)
from maskplan_core.payload import bit_order_digest

# (tile_m, tile_n, num_warpgroups, transposed, expected layout_id, groups, words, elements per thread)
CASES = [
    (128, 128, None, False, "sm90-wgmma-acc-v1-128x128", 256, 2, 64),  # forward
    (128, 64, None, False, "sm90-wgmma-acc-v1-128x64", 256, 1, 32),  # forward D256
    (128, 128, None, True, "sm90-wgmma-acc-v1-128x128-kq", 256, 2, 64),  # backward D<=64, S^T 128x128
    (64, 128, None, True, "sm90-wgmma-acc-v1-64x128-kq", 256, 1, 32),  # backward D<=128, S^T 128x64
    (64, 64, 2, True, "sm90-wgmma-acc-v1-64x64-wg1x2-kq", 256, 1, 16),  # backward D256, S^T 64x64
    (64, 96, 2, False, "sm90-wgmma-acc-v1-64x96-wg1x2", 256, 1, 24),  # backward (192, 128), S 64x96
    (64, 64, None, True, "sm90-wgmma-acc-v1-64x64-kq", 128, 1, 32),
    (64, 128, None, False, "sm90-wgmma-acc-v1-64x128", 128, 2, 64),
    (192, 96, None, False, "sm90-wgmma-acc-v1-192x96", 384, 2, 48),
]
IDS = [c[4] for c in CASES]


def make(case) -> WgmmaAccumulatorLayout:
    tile_m, tile_n, nwg, transposed = case[:4]
    return WgmmaAccumulatorLayout(tile_m, tile_n, nwg, transposed=transposed)


def ownership_rule(layout: WgmmaAccumulatorLayout) -> dict[tuple[int, int], tuple[int, int, int]]:
    """(m, n) -> (group, word, bit), written from the PTX rule with plain loops.

    Warp w of a warpgroup owns rows 16w..16w+15; lane l holds rows 16w + l//4 (+8) and, in 8-column
    group j, columns 8j + 2(l%4) (+1); element e = 4j + 2*half + c. Warpgroups: WM along M (64 rows
    each), the rest along N, wg = wm + WM * wn.
    """
    acc_rows, acc_cols = (
        (layout.tile_n, layout.tile_m) if layout.transposed else (layout.tile_m, layout.tile_n)
    )
    n_wg = layout.num_warpgroups
    wg_along_m = acc_rows // 64
    wg_along_n = n_wg // wg_along_m
    cols_per_wg = acc_cols // wg_along_n
    out = {}
    for wg in range(n_wg):
        wm, wn = wg % wg_along_m, wg // wg_along_m
        for warp in range(4):
            for lane in range(32):
                thread = 128 * wg + 32 * warp + lane
                for j in range(cols_per_wg // 8):
                    for half in range(2):
                        for c in range(2):
                            row = 64 * wm + 16 * warp + lane // 4 + 8 * half
                            col = cols_per_wg * wn + 8 * j + 2 * (lane % 4) + c
                            e = 4 * j + 2 * half + c
                            key = (col, row) if layout.transposed else (row, col)
                            assert key not in out, f"rule assigns {key} twice"
                            out[key] = (thread, e // 32, e % 32)
    return out


def rule_bit_order(layout: WgmmaAccumulatorLayout) -> str:
    """The ``bit_order`` digest of the PTX rule's map: what a plan of this layout's id names."""
    flat = torch.empty(layout.tile_m, layout.tile_n, dtype=torch.int64)
    for (m, n), (g, w, b) in ownership_rule(layout).items():
        flat[m, n] = (g * layout.words_per_group + w) * 32 + b
    return bit_order_digest(flat)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_shape_and_id(case):
    layout = make(case)
    _, _, _, _, layout_id, groups, words, per_thread = case
    assert layout.layout_id == layout_id
    assert (layout.subtiles, layout.groups, layout.words_per_group) == (1, groups, words)
    assert layout.elements_per_thread == per_thread
    assert layout.spec.model_dump() == {
        "layout_id": layout_id,
        "bit_order": rule_bit_order(layout),
        "physical_subtiles": 1,
        "payload_groups": groups,
        "words_per_group": words,
    }


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bijection_onto_valid_slots(case):
    layout = make(case)
    s, g, w, b = layout.element_coords()
    for x in (s, g, w, b):
        assert x.dtype == torch.int64 and x.shape == (layout.tile_m, layout.tile_n)
    assert bool((s == 0).all())
    assert 0 <= int(g.min()) and int(g.max()) < layout.groups
    assert 0 <= int(w.min()) and int(w.max()) < layout.words_per_group
    assert 0 <= int(b.min()) and int(b.max()) < 32
    slot = ((g * layout.words_per_group + w) * 32 + b).reshape(-1)
    assert slot.unique().numel() == layout.tile_m * layout.tile_n  # no collisions
    per_group = torch.bincount(g.reshape(-1), minlength=layout.groups)
    assert bool((per_group == layout.elements_per_thread).all())
    # the used bits of a group are exactly its first elements_per_thread bits (e = 32*word + bit)
    e = (w * 32 + b).reshape(-1)
    assert int(e.max()) == layout.elements_per_thread - 1


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_ownership_rule(case):
    layout = make(case)
    rule = ownership_rule(layout)
    assert len(rule) == layout.tile_m * layout.tile_n
    _, g, w, b = layout.element_coords()
    got = {(m, n): (int(g[m, n]), int(w[m, n]), int(b[m, n])) for m, n in rule}
    assert got == rule


def test_thread_elements_golden_128x128():
    layout = WgmmaForward128x128Layout()
    # warp 0 lane 5: rows 1 / 9, columns 2,3 of every 8-column group (cross-checked with CuTe's TiledMma)
    assert layout.thread_elements(5)[:8] == [
        (1, 2),
        (1, 3),
        (9, 2),
        (9, 3),
        (1, 10),
        (1, 11),
        (9, 10),
        (9, 11),
    ]
    # warpgroup 1, warp 2, lane 8: row 64 + 32 + 2 = 98
    assert layout.thread_elements(200)[:4] == [(98, 0), (98, 1), (106, 0), (106, 1)]
    assert layout.thread_elements(0)[-2:] == [(8, 120), (8, 121)]  # lane 0: columns 8j, 8j+1
    assert layout.thread_elements(3)[-2:] == [(8, 126), (8, 127)]  # lane 3: columns 8j+6, 8j+7
    with pytest.raises(IndexError, match="thread=256"):
        layout.thread_elements(256)


def test_thread_elements_transposed_swaps_roles():
    fwd_like = WgmmaAccumulatorLayout(128, 64)  # accumulator 128 x 64, not transposed
    bwd = WgmmaAccumulatorLayout(64, 128, transposed=True)  # accumulator S^T: 128 K rows x 64 Q cols
    for t in (0, 5, 77, 130, 255):
        assert bwd.thread_elements(t) == [(n, m) for m, n in fwd_like.thread_elements(t)]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_thread_elements_agree_with_element_coords(case):
    layout = make(case)
    _, g, w, b = layout.element_coords()
    for t in range(0, layout.groups, 37):
        for e, (m, n) in enumerate(layout.thread_elements(t)):
            assert (int(g[m, n]), int(w[m, n] * 32 + b[m, n])) == (t, e)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("density", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_pack_unpack_round_trip(case, density):
    layout = make(case)
    gen = torch.Generator().manual_seed(1234)
    tiles = torch.rand(5, layout.tile_m, layout.tile_n, generator=gen) < density
    words = layout.pack(tiles)
    assert words.dtype == torch.int32
    assert words.shape == (5, 1, layout.groups, layout.words_per_group)
    assert torch.equal(layout.unpack(words), tiles)
    # padding bits (past the fragment) stay zero
    used = layout.elements_per_thread - 32 * (layout.words_per_group - 1)
    if used < 32:
        last = words[..., -1].to(torch.int64) & 0xFFFFFFFF
        assert bool((last >> used == 0).all())


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_kernel_bit_select(case):
    """The kernel's read of the packed words: register e of thread t (``thread_elements``, which the
    golden and CuTe ownership tests pin) keeps the score iff bit e%32 of word e//32 is set, for the
    words ``pack`` writes. A consistency check of the two directions of one map, not of the map."""
    layout = make(case)
    gen = torch.Generator().manual_seed(7)
    tile = torch.rand(1, layout.tile_m, layout.tile_n, generator=gen) < 0.5
    words = layout.pack(tile)[0, 0].to(torch.int64) & 0xFFFFFFFF  # [groups, words]
    for t in range(0, layout.groups, 19):
        for e, (m, n) in enumerate(layout.thread_elements(t)):
            assert bool((words[t, e // 32] >> (e % 32)) & 1) == bool(tile[0, m, n])


def test_all_ones_words():
    words = WgmmaForward128x128Layout().pack(torch.ones(1, 128, 128, dtype=torch.bool))
    assert bool((words == -1).all())  # 64 elements: both words full
    words = WgmmaForward128x64Layout().pack(torch.ones(1, 128, 64, dtype=torch.bool))
    assert bool((words == -1).all())  # 32 elements: one full word
    words = WgmmaAccumulatorLayout(64, 64, 2, transposed=True).pack(torch.ones(1, 64, 64, dtype=torch.bool))
    assert bool((words == 0xFFFF).all())  # 16 elements + 16 padding bits


def test_named_layouts_and_cache():
    assert WgmmaForward128x128Layout() == WgmmaAccumulatorLayout(128, 128) == wgmma_layout(128, 128, 2)
    assert WgmmaForward128x64Layout().layout_id == "sm90-wgmma-acc-v1-128x64"
    assert wgmma_layout(64, 128, 2, True) is wgmma_layout(64, 128, 2, True)
    assert WgmmaAccumulatorLayout(64, 64, transposed=True) != WgmmaAccumulatorLayout(
        64, 64, 2, transposed=True
    )
    assert "256 groups x 2 words" in repr(WgmmaForward128x128Layout())


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((100, 128), {}, "multiple of 64"),
        ((128, 12), {}, "multiple of 8"),
        ((128, 128, 3), {}, "num_warpgroups"),
        ((128, 128, 0), {}, "num_warpgroups"),
        ((64, 24, 2), {"transposed": False}, "column"),
    ],
)
def test_invalid_geometry(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        WgmmaAccumulatorLayout(*args, **kwargs)


# -- PackGQA -------------------------------------------------------------------------------------
PACK_CASES = [(128, 128, 2), (128, 128, 4), (128, 128, 8), (128, 128, 16), (128, 64, 8), (128, 128, 128)]
PACK_IDS = [f"{r}x{n}-g{g}" for r, n, g in PACK_CASES]


@pytest.mark.parametrize("case", PACK_CASES, ids=PACK_IDS)
def test_pack_gqa_shape(case):
    rows, tile_n, g = case
    layout = wgmma_pack_gqa_layout(rows, tile_n, g)
    assert (layout.tile_m, layout.tile_n) == (rows // g, tile_n)
    assert (layout.groups, layout.words_per_group, layout.register_words) == (4 * rows // g, 1, 2)
    assert layout.threads == 256 and layout.elements_per_thread == tile_n // 2
    assert layout.words_per_tile * 4 % 16 == 0  # one cp.async.bulk plane per stage


@pytest.mark.parametrize("case", PACK_CASES, ids=PACK_IDS)
def test_pack_gqa_coordinates_follow_the_lane_rule(case):
    """Position p's column n is held by lane quad member ``(n % 8) // 2`` of the rows of p, as bit
    ``2 (n // 8) + n % 2`` of its register (the WGMMA rule of ``ownership_rule``, one row per
    position): group ``4 p + (n % 8) // 2``, word 0. A plan of this id names this order's digest."""
    rows, tile_n, g = case
    layout = wgmma_pack_gqa_layout(rows, tile_n, g)
    p = torch.arange(layout.tile_m)[:, None].expand(layout.tile_m, layout.tile_n)
    n = torch.arange(layout.tile_n)[None, :].expand(layout.tile_m, layout.tile_n)
    group, bit = 4 * p + (n % 8) // 2, 2 * (n // 8) + n % 2
    s, gr, w, b = layout.element_coords()
    assert bool((s == 0).all()) and bool((w == 0).all())
    assert torch.equal(gr, group) and torch.equal(b, bit)
    assert layout.spec.bit_order == bit_order_digest(group * 32 + bit)


@pytest.mark.parametrize("case", PACK_CASES, ids=PACK_IDS)
def test_pack_gqa_kernel_view_of_a_packed_tile(case):
    """What the kernel does, simulated: every consumer thread loads its registers through
    ``register_source`` from a plane packed by ``element_coords`` and tests ``register_bit(e)``
    for its accumulator element e at row R, column n; that must be the mask of position R // G."""
    rows, tile_n, g = case
    layout = wgmma_pack_gqa_layout(rows, tile_n, g)
    gen = torch.Generator().manual_seed(11)
    tile = torch.rand(1, layout.tile_m, layout.tile_n, generator=gen) < 0.5
    plane = layout.pack(tile)[0, 0].to(torch.int64) & 0xFFFFFFFF  # [groups, words]
    row, col = layout._accumulator
    for t in range(layout.threads):
        regs = []
        for slot in range(layout.register_words):
            group, word = layout.register_source(t, slot)
            assert 0 <= group < layout.groups and 0 <= word < layout.words_per_group
            regs.append(int(plane[group, word]))
        for e in range(layout.elements_per_thread):
            slot, bit = layout.register_bit(e)
            r, n = int(row[t, e]), int(col[t, e])
            assert bool((regs[slot] >> bit) & 1) == bool(tile[0, r // g, n]), (t, e, r, n)


def test_pack_gqa_reads_the_rows_of_its_positions():
    """Golden: G = 4, thread 5 (warp 0, lane 5) holds rows 1 and 9 = positions 0 and 2, lane quad
    member 1: groups 1 and 9; its element e = 4j + 2*half + c is bit 2j + c of register half."""
    layout = wgmma_pack_gqa_layout(128, 128, 4)
    assert [layout.register_source(5, s) for s in (0, 1)] == [(1, 0), (9, 0)]
    bits = [layout.register_bit(e) for e in (0, 1, 2, 3, 4, 63)]
    assert bits == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (1, 31)]


def test_pack_gqa_layout_rejects_non_divisors():
    with pytest.raises(ValueError, match="qhead_per_kvhead=3 must divide"):
        WgmmaPackGqaLayout(128, 128, 3)


def test_unpacked_registers_are_the_thread_words():
    layout = wgmma_layout(128, 128)
    assert [layout.register_source(77, s) for s in range(layout.register_words)] == [(77, 0), (77, 1)]
    assert layout.register_bit(45) == (1, 13)
