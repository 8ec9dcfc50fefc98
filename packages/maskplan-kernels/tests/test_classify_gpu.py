"""GPU tier: Q2K classification on the device equals ``maskplan_core.reference.classify`` bit for bit.

Every output tensor (visible_bits, full_bits, partial_counts, full_counts) and the error flags are
compared for fixed and varlen geometries (empty samples, Sq != Sk), Hmask 1 and > 1, nfunc 1..9,
tile shapes with tails, adjacent intervals that only together cover a block, a multi-chunk K
axis, tiles taller than the CTA, and one S = 32k case. Malformed endpoints must raise the same
error bits as the reference.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from plan_cases import KINDS, make_geometry, make_mask  # noqa: E402

from maskplan_core.error_flags import ENDPOINT_ORDER, ENDPOINT_RANGE  # noqa: E402
from maskplan_core.reference.block_geometry import block_geometry  # noqa: E402
from maskplan_core.reference.classify import classify  # noqa: E402

pytestmark = pytest.mark.gpu

# --------------------------------------------------------------------------------------------------
# problems (generators shared with the builder tests)


def run_both(q_lens, k_lens, *, hmask, nfunc, tile, varlen=True, seed=0, mask=None, config=None):
    from maskplan_kernels import classify_gpu

    device = "cuda"
    g = make_geometry(q_lens, k_lens, hq=hmask, hmask=hmask, nfunc=nfunc, varlen=varlen, device=device)
    geom = block_geometry(g, *tile)
    if mask is None:
        mask = make_mask(q_lens, k_lens, hmask, nfunc, seed)
    mask = mask.to(device)
    return classify(mask, geom), classify_gpu(mask, geom, config=config), geom


def assert_same(ref, got):
    assert got.error_flags == ref.error_flags
    for name in ("visible_bits", "full_bits", "partial_counts", "full_counts"):
        a, b = getattr(ref, name), getattr(got, name)
        assert a.dtype == b.dtype == torch.int32, name
        assert a.shape == b.shape, (name, a.shape, b.shape)
        if not torch.equal(a, b):
            where = (a != b).nonzero()[:5]
            raise AssertionError(f"{name} differs at {where.tolist()}: ref {a[tuple(where.T)].tolist()}, "
                                 f"gpu {b[tuple(where.T)].tolist()}")


# --------------------------------------------------------------------------------------------------
# bit-exact against the reference

TILES = [(128, 128), (64, 128), (128, 80), (16, 32)]


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("nfunc", [1, 3, 5, 9])
@pytest.mark.parametrize("hmask", [1, 3])
def test_fixed_length(tile, nfunc, hmask):
    sq, sk = 1000, 1500  # Sq != Sk, both with tails
    ref, got, _ = run_both([sq] * 2, [sk] * 2, hmask=hmask, nfunc=nfunc, tile=tile, varlen=False, seed=nfunc)
    assert ref.error_flags == 0
    assert_same(ref, got)


VARLEN = [
    ([300, 0, 517, 1, 129], [260, 700, 0, 5, 1024]),  # empty q, empty k, tiny samples
    ([0, 0, 64], [10, 0, 64]),
    ([2048, 777], [777, 2048]),
    ([1], [0]),
]


@pytest.mark.parametrize("lens", VARLEN, ids=lambda x: f"B{len(x[0])}")
@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("nfunc", [1, 7])
def test_varlen(lens, tile, nfunc):
    q_lens, k_lens = lens
    ref, got, _ = run_both(q_lens, k_lens, hmask=2, nfunc=nfunc, tile=tile, seed=len(q_lens) + nfunc)
    assert_same(ref, got)


@pytest.mark.parametrize("nfunc", [3, 5, 9])
def test_adjacent_intervals_cover_blocks_together(nfunc):
    """[0,64) U [64,128) covers block 0 of a 128-wide tile: full, although no single interval does."""
    q_len, k_len = 256, 512
    ref, got, geom = run_both(
        [q_len], [k_len], hmask=1, nfunc=nfunc, tile=(128, 128), seed=3,
        mask=make_mask([q_len], [k_len], 1, nfunc, 3, kinds=("adjacent",)),
    )
    assert_same(ref, got)
    # hand-made: every row sees [0,64) U [64,128) U [192,256)+...; block 0 full, block 1 partial
    ep = torch.full((1, nfunc, q_len), k_len, dtype=torch.int32)
    ep[0, 0], ep[0, 1], ep[0, 2] = 64, 64, 128
    if nfunc > 3:
        ep[0, 3], ep[0, 4] = 192, 256
    ref, got, _ = run_both([q_len], [k_len], hmask=1, nfunc=nfunc, tile=(128, 128), mask=ep)
    assert_same(ref, got)
    assert int(got.full_bits[0, 0, 0]) & 1 == 1


def test_multi_chunk_k_axis_and_tall_tiles():
    """A K chunk of 64 blocks (3 chunks here) and a 192-row tile over a 64-thread CTA."""
    from maskplan_kernels import ClassifyConfig

    q_lens, k_lens = [700, 0, 1500], [3000, 100, 2500]
    for tile, cfg in [
        ((16, 16), dict(chunk_blocks=64)),
        ((192, 32), dict(num_threads=64, chunk_blocks=64)),
    ]:
        config = ClassifyConfig(tile_m=tile[0], tile_n=tile[1], nfunc=5, **cfg)
        ref, got, _ = run_both(q_lens, k_lens, hmask=2, nfunc=5, tile=tile, seed=11, config=config)
        assert_same(ref, got)


@pytest.mark.parametrize("kinds", [("causal",), ("window",), ("document",), KINDS])
def test_long_sequence_32k(kinds):
    s = 32 * 1024
    mask = make_mask([s], [s], 2, 5, seed=7, kinds=kinds)
    ref, got, _ = run_both([s], [s], hmask=2, nfunc=5, tile=(128, 128), mask=mask)
    assert_same(ref, got)


# --------------------------------------------------------------------------------------------------
# malformed endpoints


@pytest.mark.parametrize(
    "corrupt, flags",
    [
        ("above_k_len", ENDPOINT_RANGE),
        ("negative", ENDPOINT_RANGE | ENDPOINT_ORDER),
        ("unordered", ENDPOINT_ORDER),
        ("negative_first", ENDPOINT_RANGE),
        ("both", ENDPOINT_RANGE | ENDPOINT_ORDER),
    ],
)
def test_malformed_endpoints_set_the_reference_error_bits(corrupt, flags):
    q_lens, k_lens, nfunc = [300, 0, 200], [400, 50, 0], 5
    mask = make_mask(q_lens, k_lens, 2, nfunc, seed=5, kinds=("random", "causal"))
    row, k_len = 250, 400  # a row of sample 0
    if corrupt == "above_k_len":
        mask[1, nfunc - 1, row] = k_len + 1
    elif corrupt == "negative":
        mask[0, 2, row] = -3  # also smaller than endpoint 1
        mask[0, :2, row] = 0
    elif corrupt == "unordered":
        mask[0, :, row] = torch.tensor([10, 20, 15, 30, 40])
    elif corrupt == "negative_first":
        mask[0, :, row] = torch.tensor([-1, 20, 25, 30, 40])
    elif corrupt == "both":
        mask[0, :, row] = torch.tensor([10, 20, 15, 30, 40])
        mask[1, 0, 301] = 1  # sample 2 (q rows 300..499) has k_len 0
    ref, got, _ = run_both(q_lens, k_lens, hmask=2, nfunc=nfunc, tile=(64, 128), mask=mask)
    assert ref.error_flags == flags
    assert got.error_flags == flags


def test_error_word_is_or_accumulated():
    from maskplan_kernels import classify_gpu

    q_lens, k_lens = [100], [100]
    g = make_geometry(q_lens, k_lens, hq=1, hmask=1, nfunc=1, varlen=False, device="cuda")
    geom = block_geometry(g, 128, 128)
    word = torch.tensor([1], dtype=torch.int32, device="cuda")  # a prefix error from an earlier stage
    mask = torch.full((1, 1, 100), 101, dtype=torch.int32, device="cuda")
    out = classify_gpu(mask, geom, error_word=word)
    assert out.error_flags == 1 | ENDPOINT_RANGE
    assert int(word.item()) == 1 | ENDPOINT_RANGE


def test_outputs_on_a_side_stream_match():
    q_lens, k_lens = [900, 333], [1200, 4000]
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        ref, got, _ = run_both(q_lens, k_lens, hmask=2, nfunc=3, tile=(128, 128), seed=9)
    s.synchronize()
    assert_same(ref, got)
