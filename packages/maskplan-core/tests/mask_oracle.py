"""The oracle of maskplan-core's tests: endpoints decoded to dense boolean masks by brute force
(test_mask_builders, test_mask_convert, and within samples test_plan_properties and
test_reference_attention), and the well-formedness every builder's output has."""

from __future__ import annotations

import torch
from hypothesis import settings

FAST = settings(max_examples=50, deadline=None)


def decode(ep: torch.Tensor, sk: int) -> torch.Tensor:
    """endpoints [H, nfunc, T] -> visible[h, row, k] = (k < F0) | OR_j (F_{2j-1} <= k < F_{2j})."""
    k = torch.arange(sk)
    e = ep.long()
    vis = k < e[:, 0, :, None]
    for j in range(1, ep.shape[1], 2):
        vis = vis | ((e[:, j, :, None] <= k) & (k < e[:, j + 1, :, None]))
    return vis


def decode_within_samples(ep: torch.Tensor, sk: int, q_lens, k_lens) -> torch.Tensor:
    """:func:`decode` of the rows of samples of ``q_lens`` query rows, keys from each row's sample's
    ``k_len`` on hidden: bool [H, total_q, sk]."""
    row_klen = torch.repeat_interleave(torch.tensor(k_lens), torch.tensor(q_lens))
    return decode(ep, sk) & (torch.arange(sk) < row_klen[:, None])


def check_wellformed(ep: torch.Tensor, row_klen) -> None:
    """int32, contiguous, rank 3, odd nfunc, sorted endpoints within [0, k_len] of the row's sample."""
    assert isinstance(ep, torch.Tensor)
    assert ep.dtype == torch.int32
    assert ep.is_contiguous()
    assert ep.dim() == 3
    assert ep.shape[1] % 2 == 1
    klen = torch.as_tensor(row_klen, dtype=torch.int64).reshape(-1)
    if klen.numel() == 1:
        klen = klen.expand(ep.shape[2])
    assert klen.numel() == ep.shape[2]
    assert bool((ep >= 0).all())
    assert bool((ep.long() <= klen[None, None, :]).all())
    assert bool((ep[:, 1:] >= ep[:, :-1]).all())


def minimal_nfunc(dense: torch.Tensor) -> int:
    """Smallest odd nfunc representing every row of bool [H, T, Sk], by counting runs in Python."""
    best = 1
    for head in dense.tolist():
        for row in head:
            runs = sum(1 for k, v in enumerate(row) if v and (k == 0 or not row[k - 1]))
            if runs == 0:
                need = 1
            elif row[0]:
                need = 2 * runs - 1
            else:
                need = 2 * runs + 1
            best = max(best, need)
    return best


def dense_from_rule(rows: list, sk: int, rule) -> torch.Tensor:
    """[1, len(rows), sk] bool where rule(row_info, k) says whether key k is visible."""
    return torch.tensor([[[bool(rule(r, k)) for k in range(sk)] for r in rows]], dtype=torch.bool).reshape(
        1, len(rows), sk
    )


def assert_matches(ep: torch.Tensor, ref: torch.Tensor, klen) -> None:
    check_wellformed(ep, klen)
    assert ep.shape[0] == ref.shape[0]
    assert ep.shape[2] == ref.shape[1]
    assert torch.equal(decode(ep, ref.shape[2]), ref)


def random_endpoints(gen: torch.Generator, heads: int, nfunc: int, rows: int, sk: int) -> torch.Tensor:
    """Sorted endpoints in [0, sk], repeats (empty intervals) included."""
    return torch.randint(0, sk + 1, (heads, nfunc, rows), generator=gen).sort(1).values.to(torch.int32)
