"""Tests for maskplan_core.masks.combine: intersect / union against the dense AND / OR of their
masks (brute force), the smallest nfunc, the samples they carry, and what they refuse."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from mask_oracle import FAST, decode

from maskplan_core import masks
from maskplan_core.endpoint_samples import check_samples, recorded
from maskplan_core.errors import InputTypeError, InputValueError

HOW = {"intersect": (masks.intersect, torch.logical_and), "union": (masks.union, torch.logical_or)}


def random_endpoints(gen: torch.Generator, heads: int, nfunc: int, rows: int, sk: int) -> torch.Tensor:
    """Sorted endpoints in [0, sk], repeats (empty intervals) included."""
    return torch.randint(0, sk + 1, (heads, nfunc, rows), generator=gen).sort(1).values.to(torch.int32)


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
    with pytest.raises(InputValueError, match="mask 1 was built by masks.sliding_window for other samples"):
        masks.union(masks.causal(16, batch=2), masks.sliding_window(8, window_left=2, batch=4))


def test_an_unrecorded_mask_leaves_the_result_unrecorded():
    causal = masks.causal(16, batch=2)
    assert recorded(masks.union(causal, masks.full(16, batch=2))) is not None
    assert recorded(masks.union(causal, masks.full(16, batch=2).clone())) is None


@pytest.mark.parametrize("how", sorted(HOW))
def test_no_rows(how):
    empty = torch.zeros(1, 3, 0, dtype=torch.int32)
    got = HOW[how][0](empty, torch.zeros(2, 1, 0, dtype=torch.int32))
    assert got.shape == (2, 1, 0) and got.dtype == torch.int32


@pytest.mark.parametrize(
    "operands, error, match",
    [
        ((), InputValueError, "needs at least one mask"),
        (("causal",), InputTypeError, r"masks\[0\] must be a torch.Tensor"),
        ((torch.zeros(1, 3, 4),), InputTypeError, "must be int32 endpoints"),
        ((torch.zeros(3, 4, dtype=torch.int32),), InputTypeError, "must be int32 endpoints"),
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
