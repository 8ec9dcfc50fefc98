"""Tests for maskplan_core.masks.combine: intersect / union against the dense AND / OR of their
masks (brute force), the smallest nfunc, the samples they carry, and what they refuse."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from mask_oracle import FAST, decode, random_endpoints

from maskplan_core import masks
from maskplan_core.endpoint_samples import check_samples, recorded
from maskplan_core.errors import InputTypeError, InputValueError

HOW = {"intersect": (masks.intersect, torch.logical_and), "union": (masks.union, torch.logical_or)}


@given(
    seed=st.integers(0, 2**31 - 1),
    count=st.integers(1, 4),
    heads=st.sampled_from([1, 3]),
    rows=st.integers(1, 40),
    sk=st.integers(0, 30),
    how=st.sampled_from(sorted(HOW)),
)
@FAST
def test_matches_the_dense_combination_with_the_fewest_endpoints(seed, count, heads, rows, sk, how):
    """Every key the dense AND / OR shows, and no other, in the encoding from_dense gives that dense
    mask: the smallest odd nfunc, shorter rows repeating their last endpoint. Masks of one head
    join every head of the others."""
    gen = torch.Generator().manual_seed(seed)
    nfuncs = (1 + 2 * torch.randint(0, 4, (count,), generator=gen)).tolist()
    operands = [random_endpoints(gen, heads if i % 2 == 0 else 1, n, rows, sk) for i, n in enumerate(nfuncs)]
    combine, logic = HOW[how]
    dense = decode(operands[0], sk).expand(heads, -1, -1)
    for m in operands[1:]:
        dense = logic(dense, decode(m, sk))
    got = combine(*operands)
    assert got.dtype == torch.int32 and got.is_contiguous()
    assert torch.equal(decode(got, sk), dense)
    assert torch.equal(got, masks.from_dense(dense))


def test_docstring_example():
    a = torch.tensor([3, 5, 9], dtype=torch.int32).view(1, 3, 1)
    b = torch.tensor([0, 2, 6], dtype=torch.int32).view(1, 3, 1)
    assert masks.intersect(a, b).flatten().tolist() == [0, 2, 3, 5, 6]
    assert masks.union(a, b).flatten().tolist() == [9]


def test_a_window_within_documents_is_the_document_builder_s():
    """intersect(document, sliding_window) is document(window_left=): the same keys in as many
    endpoints (document's rows at a sample's start open with an empty [0, 0)), recorded for the
    same samples."""
    lens = [[5, 20, 7], [32]]
    windowed = masks.intersect(masks.document(lens), masks.sliding_window(32, window_left=6, batch=2))
    builder = masks.document(lens, window_left=6)
    assert windowed.shape == builder.shape
    assert torch.equal(decode(windowed, 32), decode(builder, 32))
    check_samples(windowed, lambda: ([32, 32], [32, 32]))  # its own samples pass
    with pytest.raises(InputValueError, match=r"built by masks.intersect for 2 samples of 32 rows"):
        check_samples(windowed, lambda: ([64], [64]))


def test_masks_built_for_other_samples_are_refused():
    with pytest.raises(
        InputValueError,
        match=r"mask 1 was built by masks.sliding_window for 4 samples of 8 rows, mask 0 by masks.causal "
        r"for 2 samples of 16 rows",
    ):
        masks.union(masks.causal(16, batch=2), masks.sliding_window(8, window_left=2, batch=4))
    keys = r"for 1 sample of 32 keys, mask 0 by masks.causal for 1 sample of 16"
    with pytest.raises(InputValueError, match=keys):
        masks.intersect(masks.causal(16), masks.causal(16, 32))


def test_the_recorded_masks_samples_hold_for_the_result():
    """A result holds the samples of the masks that have a record (a copy or a rank-3 from_dense
    has none: the rows are the same, so the record still applies), and says how to rebuild."""
    causal = masks.causal(16, batch=2)
    assert recorded(masks.union(causal.clone(), masks.full(16, batch=2).clone())) is None
    result = masks.union(causal.clone(), masks.full(16, batch=2))
    assert (recorded(result).rows, recorded(result).keys) == ((16, 16), (16, 16))
    with pytest.raises(InputValueError, match=r"built by masks.union .*build each mask masks.union combined"):
        check_samples(result, lambda: ([16, 16], [20, 20]))


def test_the_result_keeps_the_strictest_head_record():
    """A mask_mod evaluated for 2 heads is refused for q of 4 heads, combined or not; one of a
    model of one head too (as torch's and_masks / or_masks of it, evaluated per head, would differ)."""
    from maskplan_core.endpoint_samples import check_heads

    two = masks.from_mask_mod(lambda b, h, q, kv: (h < 2) | (kv == 0), 1, 2, 8, 8)
    four = masks.from_mask_mod(lambda b, h, q, kv: kv <= q + h, 1, 4, 8, 8)
    for combined in (masks.intersect(two, four), masks.union(four, two)):
        with pytest.raises(InputValueError, match="for 2 heads, but q has 4"):
            check_heads(combined, 4)
    one = masks.from_mask_mod(lambda b, h, q, kv: torch.tensor([True])[h] & (kv <= q), 1, 1, 8, 8)
    with pytest.raises(InputValueError, match="for a model of one head"):
        check_heads(masks.union(one, four), 4)
    check_heads(masks.union(masks.causal(8), four), 4)  # builders' masks are every head's


def test_blocks_of_rows_give_the_whole_result(monkeypatch):
    """Rows go in blocks bounded by _CHUNK_EVENTS; blocks of other widths join padded."""
    from maskplan_core.masks import combine

    gen = torch.Generator().manual_seed(7)
    operands = [random_endpoints(gen, 2, n, 50, 30) for n in (3, 7)]
    operands[1][..., :9] = 30  # narrow rows in the first block
    whole = [masks.intersect(*operands), masks.union(*operands)]
    monkeypatch.setattr(combine, "_CHUNK_EVENTS", 2 * 12 * 8)  # 8 rows a block
    for got, want in zip((masks.intersect(*operands), masks.union(*operands)), whole, strict=True):
        assert torch.equal(got, want)


def test_runs_eagerly_under_torch_compile():
    """The check and widths are host reads, the sample records host state: a compiled caller runs
    them eagerly (a graph break), and fullgraph says why."""
    a, b = masks.causal(16), masks.sliding_window(16, window_left=3)
    got = torch.compile(lambda a, b: masks.intersect(a, b), backend="eager")(a, b)
    assert torch.equal(got, masks.intersect(a, b))
    with pytest.raises(Exception, match="masks.union runs outside torch.compile"):
        torch.compile(lambda a, b: masks.union(a, b), backend="eager", fullgraph=True)(a, b)


@pytest.mark.parametrize("how", sorted(HOW))
def test_no_rows(how):
    empty = torch.zeros(1, 3, 0, dtype=torch.int32)
    got = HOW[how][0](empty, torch.zeros(2, 1, 0, dtype=torch.int32))
    assert got.shape == (2, 1, 0) and got.dtype == torch.int32


@pytest.mark.parametrize(
    "operands, error, match",
    [
        ((), InputValueError, "needs at least one mask"),
        (("causal",), InputTypeError, r"mask 0 must be int32 endpoints \[Hmask, nfunc, total_q\], got str$"),
        (([torch.zeros(1, 1, 4, dtype=torch.int32)],), InputTypeError, "got list; pass the masks as"),
        ((lambda b, h, q, kv: kv <= q,), InputTypeError, r"got function; convert a mask_mod with"),
        ((torch.ones(1, 4, 4, dtype=torch.bool),), InputTypeError, r"torch.bool .*with masks.from_dense"),
        ((torch.ones(1, 1, 4, dtype=torch.int64),), InputTypeError, r"int64 .*with .to\(torch.int32\)"),
        ((torch.zeros(0, 1, 4, dtype=torch.int32),), InputValueError, r"mask 0 has no heads"),
        ((torch.zeros(1, 3, 4),), InputTypeError, "must be int32 endpoints"),
        ((torch.zeros(3, 4, dtype=torch.int32),), InputTypeError, r"got torch.int32 of shape \(3, 4\)$"),
        ((torch.zeros(1, 2, 4, dtype=torch.int32),), InputValueError, "even nfunc"),
        ((torch.zeros(1, 1, 4, dtype=torch.int32), torch.zeros(1, 1, 5, dtype=torch.int32)), InputValueError,
         "mask 1 has 5 query rows, mask 0 4"),
        ((torch.zeros(2, 1, 4, dtype=torch.int32), torch.zeros(3, 1, 4, dtype=torch.int32)), InputValueError,
         r"Hmask are \[2, 3\]"),
        ((torch.zeros(1, 1, 4, dtype=torch.int32, device="meta"),), InputValueError, "meta tensor"),
        ((torch.zeros(1, 1, 4, dtype=torch.int32), torch.tensor([[[1, 2, 3, 4]]], dtype=torch.int32),
          torch.tensor([[[0]], [[3]], [[2]]], dtype=torch.int32).view(1, 3, 1).expand(1, 3, 4).contiguous()),
         InputValueError, "mask 2 has a negative or decreasing endpoint"),
        ((torch.full((1, 1, 4), -1, dtype=torch.int32),), InputValueError, "mask 0 has a negative"),
    ],
)  # fmt: skip
def test_refusals_name_the_mask(operands, error, match):
    for how in HOW.values():
        with pytest.raises(error, match=match):
            how[0](*operands)


@pytest.mark.gpu
def test_on_cuda_the_cpu_result_under_deterministic_algorithms():
    """The same endpoints on a GPU, with torch's deterministic mode on (no op of theirs refuses it)."""
    gen = torch.Generator().manual_seed(3)
    operands = [random_endpoints(gen, h, n, 3000, 700) for h, n in ((4, 5), (1, 3), (4, 1))]
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for combine, _ in HOW.values():
            got = combine(*(m.cuda() for m in operands))
            assert got.is_cuda and torch.equal(got.cpu(), combine(*operands))
    finally:
        torch.use_deterministic_algorithms(was)
