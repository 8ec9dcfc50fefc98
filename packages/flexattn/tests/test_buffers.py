"""``flexattn.buffers``: whether caller buffers share elements, against the elements themselves."""

from __future__ import annotations

import itertools
import random

import torch

from flexattn.buffers import overlaps_itself, shares_memory


def _addresses(t: torch.Tensor) -> set[int]:
    ranges = [range(n) for n in t.shape]
    base = t.data_ptr() // t.element_size()
    return {
        base + sum(i * s for i, s in zip(idx, t.stride(), strict=True)) for idx in itertools.product(*ranges)
    }


def _random_slice(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    bounds = [(a, rng.randrange(a, n) + 1) for n in t.shape for a in [rng.randrange(n)]]
    return t[tuple(slice(a, b) for a, b in bounds)]


def test_slices_of_one_buffer_share_exactly_their_common_elements():
    """Same strides (slices of one buffer): exact both ways. Other strides (a transposed slice):
    never a shared element missed, at worst one counted that is not there."""
    rng = random.Random(0)
    buf = torch.zeros(2, 5, 7, 4)
    for _ in range(1500):
        a, b = _random_slice(buf, rng), _random_slice(buf, rng)
        assert shares_memory(a, b) == bool(_addresses(a) & _addresses(b))
        c = b.transpose(0, 1)
        if _addresses(a) & _addresses(c):
            assert shares_memory(a, c)


def test_a_packed_buffer_split_apart_shares_nothing():
    dqkv = torch.zeros(2, 8, 6, 4)
    dq, dk, dv = dqkv.split([4, 1, 1], dim=2)
    assert not any(shares_memory(x, y) for x, y in ((dq, dk), (dk, dv), (dq, dv)))
    assert shares_memory(dq, dqkv) and shares_memory(dk, dk)
    assert not shares_memory(torch.zeros(3), torch.zeros(3))  # distinct allocations
    assert not shares_memory(dqkv[..., :2], dqkv[..., 2:])  # interleaved halves of each row


def test_elements_named_twice():
    assert overlaps_itself(torch.zeros(1, 4).expand(3, 4))
    assert overlaps_itself(torch.zeros(20).as_strided((2, 3, 4), (12, 2, 1)))
    assert not overlaps_itself(torch.zeros(2, 5, 7).transpose(0, 2))
    assert not overlaps_itself(torch.zeros(2, 5, 7)[:, ::2])
    assert not overlaps_itself(torch.zeros(2, 0, 3, 4).as_strided((2, 0, 3, 4), (0, 4, 0, 1)))
