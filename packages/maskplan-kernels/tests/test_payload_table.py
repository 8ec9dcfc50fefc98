"""CPU tier: the layout-as-data table the GPU packer reads, and the host-known workspace bounds.

``pack_with_table`` is the pure-torch twin of the device packer (bitmap in shared memory, then one
warp ballot per payload word through ``payload_source_table``); it must equal the consumer's own
``layout.pack`` for every layout the consumers ship, tails and padding bits included.
"""

from __future__ import annotations

import pytest
import torch
from plan_cases import make_geometry

from maskplan_core.payload import RowMajorLayout
from maskplan_core.reference.block_geometry import block_geometry
from maskplan_kernels.geometry import ViewBounds
from maskplan_kernels.payload_table import (
    bitmap_row_stride,
    bitmap_words,
    pack_with_table,
    payload_source_table,
    zero_address,
)


def _layouts():
    out = [RowMajorLayout(128, 128), RowMajorLayout(64, 128), RowMajorLayout(128, 80), RowMajorLayout(16, 32)]
    try:
        from flexattn_sm90.payload_layout import wgmma_layout

        out += [
            wgmma_layout(128, 128),
            wgmma_layout(128, 64),
            wgmma_layout(64, 128, None, True),
            wgmma_layout(64, 64, 2, True),
        ]
    except ImportError:
        pass
    try:
        from flexattn_sm100.payload_layout import tmem_layout

        out += [tmem_layout(128, 128, 1, False), tmem_layout(128, 128, 1, True)]
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("layout", _layouts(), ids=lambda layout: layout.layout_id)
def test_table_packing_equals_the_layout(layout):
    gen = torch.Generator().manual_seed(0)
    tiles = torch.rand(6, layout.tile_m, layout.tile_n, generator=gen) < 0.5
    tiles[0] = True  # padding bits stay 0 even when every element is visible
    tiles[1] = False
    assert torch.equal(pack_with_table(tiles, layout), layout.pack(tiles))


@pytest.mark.parametrize("layout", _layouts(), ids=lambda layout: layout.layout_id)
def test_table_addresses_stay_inside_the_bitmap(layout):
    table = payload_source_table(layout).to(torch.int64)
    assert table.dtype == torch.int64 and table.numel() == layout.words_per_tile * 32
    words = table // 32
    assert int(words.max()) < bitmap_words(layout.tile_m, layout.tile_n)
    real = table != zero_address(layout.tile_m, layout.tile_n)
    assert int(real.sum()) == layout.tile_m * layout.tile_n  # every element feeds exactly one bit
    assert table[real].unique().numel() == layout.tile_m * layout.tile_n
    assert bitmap_row_stride(layout.tile_n) % 2 == 1


def bank_ways(layout) -> list[int]:
    """Per payload word: the most distinct bitmap words one shared-memory bank serves when a warp
    loads that word's 32 source bits (1 = conflict-free)."""
    table = payload_source_table(layout).view(-1, 32).to(torch.int64) // 32
    out = []
    for words in table.tolist():
        banks: dict[int, int] = {}
        for w in set(words):
            banks[w % 32] = banks.get(w % 32, 0) + 1
        out.append(max(banks.values()))
    return out


@pytest.mark.parametrize("layout", _layouts(), ids=lambda layout: layout.layout_id)
def test_pack_loads_are_at_most_two_way_bank_conflicts(layout):
    ways = bank_ways(layout)
    assert max(ways) <= 2
    if layout.layout_id.startswith(("sm90-wgmma-acc-v1-64x128-kq", "sm90-wgmma-acc-v1-128x1", "sm100")):
        assert max(ways) == 1  # the D <= 128 consumers' layouts (the skew word fixed the 64x128-kq one)


CASES = [
    ([100, 100], [160, 160], False),
    ([70, 0, 33, 1, 65], [50, 90, 0, 5, 128], True),
    ([0, 0, 64], [10, 0, 64], True),
    ([1000, 17, 4000], [3, 5000, 129], True),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tile", [(128, 128), (64, 128), (16, 32), (192, 80)])
def test_view_bounds_hold_the_exact_geometry(case, tile):
    q_lens, k_lens, varlen = case
    g = make_geometry(q_lens, k_lens, varlen=varlen)
    exact = block_geometry(g, *tile)
    bounds = ViewBounds.of(g, *tile)
    assert bounds.q_rows >= exact.n_q_rows and bounds.k_rows >= exact.n_k_rows
    assert bounds.max_q_blocks >= exact.max_q_blocks and bounds.max_k_blocks >= exact.max_k_blocks
    assert bounds.k_words >= exact.k_words
    if not varlen:
        assert (bounds.q_rows, bounds.k_rows, bounds.k_words) == (
            exact.n_q_rows,
            exact.n_k_rows,
            exact.k_words,
        )


def _fresh_layout_makers():
    """Makers of new layout instances: the shared ones (``@cache``) may hold their tables already."""
    makers = [("rowmajor", lambda: RowMajorLayout(64, 96))]
    try:
        from flexattn_sm90.payload_layout import wgmma_layout

        fresh = wgmma_layout.__wrapped__
        makers += [("wgmma", lambda: fresh(128, 128)), ("wgmma-transposed", lambda: fresh(64, 64, 2, True))]
    except ImportError:
        pass
    try:
        from flexattn_sm100.payload_layout import tmem_layout

        makers += [("tmem-transposed", lambda: tmem_layout.__wrapped__(128, 128, 1, True))]
    except ImportError:
        pass
    return makers


@pytest.mark.parametrize("name,make", _fresh_layout_makers(), ids=[m[0] for m in _fresh_layout_makers()])
def test_layout_tables_are_host_tensors_whatever_the_default_device(name, make):
    """Made under another default device (``meta`` stands in for ``cuda``), a layout's tables and
    the packer's twin are still the CPU tensors they are outside it."""
    want_layout = make()
    gen = torch.Generator().manual_seed(0)
    tiles = torch.rand(3, want_layout.tile_m, want_layout.tile_n, generator=gen) < 0.5
    with torch.device("meta"):
        layout = make()
        table = payload_source_table(layout)
        packed = pack_with_table(tiles, layout)
        unpacked = layout.unpack(layout.pack(tiles))
    assert torch.equal(table, payload_source_table(want_layout))
    assert torch.equal(packed, want_layout.pack(tiles)) and torch.equal(unpacked, tiles)


def test_device_tables_of_two_orders_under_one_id_are_two_tables():
    """The uploaded table is cached per layout identity, which takes the bit order's digest besides
    the id: a layout keeping its parent's id but not its order gets a table of its own order."""
    from maskplan_core.testing import ReversedColumnsLayout
    from maskplan_kernels.payload_table import device_source_table

    forward, reversed_ = RowMajorLayout(4, 40), ReversedColumnsLayout(4, 40)
    assert forward.layout_id == reversed_.layout_id
    cpu = torch.device("cpu")
    for layout in (forward, reversed_, forward):
        assert torch.equal(device_source_table(layout, cpu), payload_source_table(layout))
    assert not torch.equal(payload_source_table(forward), payload_source_table(reversed_))
