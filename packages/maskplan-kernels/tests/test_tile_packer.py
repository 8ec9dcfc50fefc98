"""CPU tier: the packer's work split (``TilePacker``): every payload word of every slot of a pass is
packed by exactly one warp, and a pass's shared memory stays within the packer's budget."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from maskplan_kernels._primitives import WARP  # noqa: E402
from maskplan_kernels._tile_packer import (  # noqa: E402
    SLOT_SMEM_BYTES,
    MaterializeConfig,
    TilePacker,
    packer_slots,
)

CONFIGS = [
    MaterializeConfig(tile_m=128, tile_n=128, nfunc=1, words_per_tile=512),  # SM90 fwd
    MaterializeConfig(tile_m=64, tile_n=128, nfunc=5, words_per_tile=256),  # SM90 bwd: warps share slots
    MaterializeConfig(tile_m=64, tile_n=64, nfunc=3, words_per_tile=128),  # SM90 bwd D256
    MaterializeConfig(tile_m=128, tile_n=80, nfunc=9, words_per_tile=384),  # blocks not dividing warps
    MaterializeConfig(tile_m=256, tile_n=128, nfunc=5, words_per_tile=1024),  # SM100 qstage2 plan block
    MaterializeConfig(tile_m=16, tile_n=32, nfunc=3, words_per_tile=16, num_warps=4),
    MaterializeConfig(tile_m=64, tile_n=128, nfunc=151, words_per_tile=256),  # long endpoint rows
]


def config_id(c: MaterializeConfig) -> str:
    return f"{c.tile_m}x{c.tile_n}-w{c.words_per_tile}-f{c.nfunc}"


def packed_words(p: TilePacker, n: int) -> list[tuple[int, int]]:
    """(slot, word) pairs the warps store for a pass of ``n`` tiles: ``TilePacker.pack``'s loops over
    the kernel's own ``slot_phase`` and ``block_base``."""
    out = []
    for warp in range(p.num_warps):
        phase = p.slot_phase(warp)
        if phase >= p.slot_phases:
            continue
        for s in range(phase, n, p.slot_phases):
            for g in range(p.groups):
                base = p.block_base(g, warp)
                out += [(s, base + lane) for lane in range(WARP) if base + lane < p.words_per_tile]
    return out


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
@pytest.mark.parametrize("listed", ["q", "k"])
def test_every_word_of_every_slot_is_packed_once(config, listed):
    p = TilePacker(config, listed)
    assert p.slots >= 1 and p.slots * config.tile_m <= max(config.num_threads, config.tile_m)
    for n in range(1, p.slots + 1):
        words = packed_words(p, n)
        assert sorted(words) == [(s, w) for s in range(n) for w in range(config.words_per_tile)]


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
@pytest.mark.parametrize("listed", ["q", "k"])
def test_pass_shared_memory_within_budget(config, listed):
    p = TilePacker(config, listed)
    ends = 4 * config.nfunc * config.tile_m * p.end_slots
    bitmaps = 4 * p.bitmap_words * p.slots
    assert p.end_slots == (p.slots if listed == "q" else 1)
    assert ends + bitmaps <= SLOT_SMEM_BYTES


@pytest.mark.parametrize("listed", ["q", "k"])
@pytest.mark.parametrize("tile_m", [128, 64])
def test_endpoints_past_the_budget_are_refused(tile_m, listed):
    """The largest nfunc whose one tile fits the budget packs; two more endpoints per row are
    refused by name (the builder then leaves the plan to the reference planner)."""

    def config(nfunc):
        return MaterializeConfig(tile_m=tile_m, tile_n=128, nfunc=nfunc, words_per_tile=4 * tile_m)

    largest = max(n for n in range(1, 400, 2) if packer_slots(config(n), listed) > 0)
    assert TilePacker(config(largest), listed).slots >= 1
    assert packer_slots(config(largest + 2), listed) == 0
    with pytest.raises(ValueError, match=f"nfunc={largest + 2} endpoints of a {tile_m}-row tile"):
        TilePacker(config(largest + 2), listed)
    assert largest == {128: 73, 64: 153}[tile_m]


def test_listed_must_name_a_block_axis():
    with pytest.raises(ValueError, match="listed must be 'q' or 'k'"):
        TilePacker(CONFIGS[0], "m")


def test_k2q_pass_needs_a_thread_per_tile_row():
    config = MaterializeConfig(tile_m=256, tile_n=64, nfunc=1, words_per_tile=512, num_warps=4)
    assert TilePacker(config, "k").slots == 1
    with pytest.raises(ValueError, match="tile_m=256 > 128 threads"):
        TilePacker(config, "q")
