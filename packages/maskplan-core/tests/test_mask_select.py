"""Tests for maskplan_core.masks.select: select_rows / select_keys against the dense rows and key
columns of their masks (brute force), the samples their results carry, and what they refuse."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from mask_oracle import FAST, check_wellformed, decode, random_endpoints

from maskplan_core import masks
from maskplan_core.endpoint_samples import check_samples, recorded
from maskplan_core.errors import InputTypeError, InputValueError

#: a random mask's draws: its seed, heads and endpoints per row
MASK = dict(seed=st.integers(0, 2**31 - 1), heads=st.sampled_from([1, 3]), nfunc=st.sampled_from([1, 3, 5]))


@given(**MASK, batch=st.integers(1, 3), seqlen=st.integers(1, 24), sk=st.integers(0, 24), data=st.data())
@FAST
def test_select_rows_is_the_dense_rows_of_each_sample(seed, heads, nfunc, batch, seqlen, sk, data):
    gen = torch.Generator().manual_seed(seed)
    mask = random_endpoints(gen, heads, nfunc, batch * seqlen, sk)
    positions = data.draw(st.lists(st.integers(0, seqlen - 1), max_size=2 * seqlen))
    got = masks.select_rows(mask, positions, batch=batch)
    assert got.shape == (heads, nfunc, batch * len(positions)) and got.is_contiguous()
    rows = [b * seqlen + p for b in range(batch) for p in positions]
    assert torch.equal(decode(got, sk), decode(mask, sk)[:, rows])


@given(**MASK, rows=st.integers(0, 20), sk=st.integers(1, 24), data=st.data())
@FAST
def test_select_keys_is_the_dense_key_columns(seed, heads, nfunc, rows, sk, data):
    """Each row sees the shard's keys it saw, counted over the shard; endpoints stay sorted."""
    gen = torch.Generator().manual_seed(seed)
    mask = random_endpoints(gen, heads, nfunc, rows, sk)
    keys = sorted(data.draw(st.sets(st.integers(0, sk - 1))))
    got = masks.select_keys(mask, torch.tensor(keys, dtype=torch.int64))
    assert got.dtype == torch.int32 and got.shape == mask.shape
    assert torch.equal(decode(got, len(keys)), decode(mask, sk)[..., keys])
    check_wellformed(got, torch.full((rows,), len(keys)))


def test_a_context_parallel_shard_of_a_document_mask():
    """Zig-zag shards of 2 samples of documents (+ causal): the rows of each shard's positions, the
    ranks' rows together every row once, recorded for the shard's rows and all the keys; the ring
    step's keys of a shard give the mask over them."""
    docs = [[40, 24], [10, 30, 24]]
    mask = masks.document(docs, causal=True)
    world, s = 2, 64
    chunk = s // (2 * world)
    every = []
    for rank in range(world):
        last = 2 * world - 1 - rank
        mine = [*range(rank * chunk, (rank + 1) * chunk), *range(last * chunk, (last + 1) * chunk)]
        rows = masks.select_rows(mask, mine)  # the batch from the record
        every += [(b, p) for b in range(2) for p in mine]
        dense = decode(mask, s).unflatten(1, (2, s))[:, :, mine].flatten(1, 2)
        assert torch.equal(decode(rows, s), dense)
        assert recorded(rows).rows == (len(mine),) * 2 and recorded(rows).keys == (s, s)
        n = len(mine)
        check_samples(rows, lambda n=n: ([n] * 2, [s] * 2))
        with pytest.raises(InputValueError, match="built by masks.select_rows of masks.document"):
            check_samples(rows, lambda: ([s] * 2, [s] * 2))
        shard = masks.select_keys(rows, mine)
        assert torch.equal(decode(shard, len(mine)), dense[..., mine])
        assert recorded(shard).rows == (len(mine),) * 2 and recorded(shard).keys == (len(mine),) * 2
        with pytest.raises(InputValueError, match="k has 2 samples of 64 keys"):
            check_samples(shard, lambda n=n: ([n] * 2, [s] * 2))
    assert sorted(every) == [(b, p) for b in range(2) for p in range(s)]


def test_select_rows_takes_what_a_builder_recorded_or_is_told():
    mask = masks.causal(8, batch=3)
    assert torch.equal(masks.select_rows(mask, [7]), torch.tensor([[[8, 8, 8]]], dtype=torch.int32))
    assert recorded(masks.select_rows(mask.clone(), [7], batch=3)) is None  # a copy has no record
    with pytest.raises(InputValueError, match="batch=5 samples do not split evenly"):
        masks.select_rows(mask.clone(), [0], batch=5)
    with pytest.raises(InputValueError, match="for 3 samples of 8 rows, not batch=2: leave batch unset"):
        masks.select_rows(mask, [0], batch=2)
    with pytest.raises(InputValueError, match="takes samples of equal rows"):
        masks.select_rows(masks.causal(cu_seqlens_q=[0, 3, 8], cu_seqlens_k=[0, 3, 8]), [0])
    with pytest.raises(InputValueError, match=r"positions\[1\] = 8 is outside the samples' 8 rows"):
        masks.select_rows(mask, [0, 8])
    with pytest.raises(InputValueError, match=r"positions\[0\] = -1"):
        masks.select_rows(mask, [-1])


def test_select_keys_refuses_unsorted_or_outside_keys():
    mask = masks.causal(8)
    refusals = {(3, 3): r"key_positions\[1\] = 3 after 3", (4, 2): "must increase", (-1, 2): "negative"}
    for bad, said in refusals.items():
        with pytest.raises(InputValueError, match=said):
            masks.select_keys(mask, bad)
    with pytest.raises(InputValueError, match="past the keys of mask_func's samples"):
        masks.select_keys(mask, [2, 8])
    assert masks.select_keys(mask.clone(), [2, 8]).tolist() == [[[0, 0, 1, 1, 1, 1, 1, 1]]]  # no record
    for builder in (masks.select_rows, masks.select_keys):
        with pytest.raises(InputTypeError, match=r"int32 endpoints \[Hmask, nfunc, total_q\]"):
            builder(mask.long(), [0])
        with pytest.raises(InputTypeError, match="got list"):
            builder([[[1]]], [0])
        with pytest.raises(InputValueError, match=r"mask_func has an even nfunc \(2\)"):
            builder(torch.zeros(1, 2, 8, dtype=torch.int32), [0])


def test_select_edge_cases():
    """A builder's mask of no rows selects none; a strided mask is read as it is (no torch warning
    about searchsorted's input); key positions past int32 are refused by name."""
    assert masks.select_rows(masks.causal(0, 8, batch=3), []).shape == (1, 1, 0)
    strided = masks.causal(8, batch=2)[..., ::2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = masks.select_keys(strided, [1, 3])
    assert torch.equal(got, masks.select_keys(strided.contiguous(), [1, 3]))
    with pytest.raises(InputValueError, match="past the int32 key range"):
        masks.select_keys(masks.causal(8).clone(), [1, 2**31])
