"""The device error word of the allocation header, and its translation into exceptions.

Planner stages (reference or GPU) only OR bits into one int32 word; the host reads it once with
the allocation header. Only when a bit is set does :func:`raise_for_error_flags` look at the
metadata again to name the first culprit (row and value) in the message.
"""

from __future__ import annotations

import torch

from .errors import EndpointError, SeqlenError
from .geometry import PlanGeometry

CU_Q_START = 1 << 0
CU_Q_END = 1 << 1
CU_Q_ORDER = 1 << 2
CU_Q_MAX = 1 << 3
CU_K_START = 1 << 4
CU_K_END = 1 << 5
CU_K_ORDER = 1 << 6
CU_K_MAX = 1 << 7
ENDPOINT_RANGE = 1 << 8
ENDPOINT_ORDER = 1 << 9

SEQLEN_FLAGS = CU_Q_START | CU_Q_END | CU_Q_ORDER | CU_Q_MAX | CU_K_START | CU_K_END | CU_K_ORDER | CU_K_MAX


def prefix_error_flags(cu: torch.Tensor, total: int, max_seqlen: int, *, is_q: bool) -> int:
    """The four prefix rules of spec section 3.2 as error bits (0 when the prefix is valid)."""
    shift = 0 if is_q else 4
    lens = cu[1:].to(torch.int64) - cu[:-1].to(torch.int64)
    checks = torch.stack([cu[0] != 0, cu[-1] != total, (lens < 0).any(), (lens > max_seqlen).any()]).cpu()
    return sum(1 << (shift + i) for i in range(4) if bool(checks[i]))


def raise_for_error_flags(flags: int, mask_func: torch.Tensor, geometry: PlanGeometry) -> None:
    """Raise the public exception for the lowest-numbered rule that ``flags`` reports."""
    if flags == 0:
        return
    if flags & SEQLEN_FLAGS:
        _raise_seqlen(flags, geometry)
    sample_k_len = _row_k_len(geometry)
    if flags & ENDPOINT_RANGE:
        bad = (mask_func < 0) | (mask_func > sample_k_len.view(1, 1, -1))
        h, f, row = _first(bad)
        value, k_len = int(mask_func[h, f, row]), int(sample_k_len[row])
        hint = ""
        # a flat document mask counts keys from the batch's first: past k_len in a later sample only,
        # and within the batch's keys
        counted_across = geometry.batch > 1 and row >= int(geometry.cu_seqlens_q[1])
        if k_len < value <= geometry.total_k and counted_across:
            hint = (
                "; if mask_func was built for one sequence of the whole batch's rows (masks.document with "
                "one flat list of lengths), it counts keys across samples: build it per sample "
                "(masks.document([[lengths of sample 0], [lengths of sample 1], ...]))"
            )
        raise EndpointError(
            f"mask_func[{h}, {f}, {row}] = {value} is outside [0, k_len] for query row {row} "
            f"({_in_sample(row, geometry)}), whose sample has k_len = {k_len} (endpoints are key positions "
            f"inside the row's sample, counted from its first key){hint}"
        )
    if flags & ENDPOINT_ORDER:
        bad = mask_func[:, 1:, :] < mask_func[:, :-1, :]
        h, f, row = _first(bad)
        raise EndpointError(
            f"mask_func[{h}, :, {row}] (query row {row}: {_in_sample(row, geometry)}) is not sorted: "
            f"endpoint {f + 1} = {int(mask_func[h, f + 1, row])} "
            f"< endpoint {f} = {int(mask_func[h, f, row])} "
            "(endpoints must satisfy 0 <= F0 <= F1 <= ... <= k_len)"
        )
    raise AssertionError(f"unknown planner error flags 0x{flags:x}")


def sample_of_row(cu_seqlens: torch.Tensor, row: int) -> tuple[int, int]:
    """``(sample, its row)`` of global query row ``row`` under prefixes ``cu_seqlens`` (an empty
    sample owns no row; a read back, for error messages)."""
    cu = cu_seqlens.cpu()
    b = int(torch.searchsorted(cu, torch.tensor(row, dtype=cu.dtype), right=True)) - 1
    return b, row - int(cu[b])


def _in_sample(row: int, g: PlanGeometry) -> str:
    """Where global query row ``row`` lies: its sample and its row there."""
    b, local = sample_of_row(g.cu_seqlens_q, row)
    return f"sample {b}, its row {local}"


def _raise_seqlen(flags: int, g: PlanGeometry) -> None:
    for name, cu, total, max_len, shift in (
        ("cu_seqlens_q", g.cu_seqlens_q, g.total_q, g.max_seqlen_q, 0),
        ("cu_seqlens_k", g.cu_seqlens_k, g.total_k, g.max_seqlen_k, 4),
    ):
        if flags & (0xF << shift):
            rule = broken_prefix_rule(name, cu.cpu().tolist(), total, max_len)
            if rule is None:
                raise AssertionError(f"the planner flagged {name} (0x{flags:x}), whose values break no rule")
            raise SeqlenError(rule)


def sample_lengths(cu: list[int]) -> list[int]:
    """The sample lengths of host prefix values ``cu``."""
    return [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]


def broken_prefix_rule(name: str, cu: list[int], total: int, max_len: int) -> str | None:
    """The message naming the first rule of spec 3.2 that host prefix values ``cu`` (of prefix
    ``name``) break, or None where they keep all four. The rules, in the order of the ``CU_*``
    bits: start at 0, end at ``total``, never decrease, no sample longer than ``max_len``."""
    lens = sample_lengths(cu)
    if cu[0] != 0:
        return f"{name}[0] must be 0, got {cu[0]}"
    if cu[-1] != total:
        return f"{name}[-1] must equal the total token count {total}, got {cu[-1]}"
    for i, n in enumerate(lens):
        if n < 0:
            return f"{name} decreases at index {i + 1}: {cu[i]} -> {cu[i + 1]}"
    for i, n in enumerate(lens):
        if n > max_len:
            return f"{name} gives sample {i} length {n}, more than max_seqlen_{name[-1]} = {max_len}"
    return None


def _row_k_len(g: PlanGeometry) -> torch.Tensor:
    """int64 ``[total_q]``: the k_len of the sample owning each query row."""
    q_lens = (g.cu_seqlens_q[1:] - g.cu_seqlens_q[:-1]).to(torch.int64)
    k_lens = (g.cu_seqlens_k[1:] - g.cu_seqlens_k[:-1]).to(torch.int64)
    return torch.repeat_interleave(k_lens, q_lens, output_size=g.total_q)


def _first(bad: torch.Tensor) -> tuple[int, int, int]:
    """(head, endpoint, row) of the first True in row-major order of (head, row, endpoint)."""
    hits = bad.permute(0, 2, 1).nonzero()
    h, row, f = (int(x) for x in hits[0])
    return h, f, row
