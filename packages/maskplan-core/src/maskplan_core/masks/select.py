"""Parts of a mask: some query positions of each sample (:func:`select_rows`) or some of its keys
(:func:`select_keys`), as context parallelism and chunked prefill split a sequence.

A rank that gathers every key but holds some query positions plans their rows of the whole
sequence's mask: a row's endpoints already count the sample's keys from its first. A ring step
that attends one shard of the keys counts each row's endpoints over the shard's keys instead: an
endpoint ``e`` becomes the number of the shard's key positions below ``e``::

    keys           0 1 2 3 4 5 6 7      a row's endpoints [5, 6, 8]: keys 0-4 and 6-7
    key_positions      2 3     6 7      the shard's keys, sorted
    over the shard     0 1     2 3      endpoints [2, 2, 4]: shard keys 0-1 and 2-3
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ..endpoint_samples import describe_lengths, record_samples, recorded
from ..errors import InputValueError
from ..untraced import untraced
from ..validation import MAX_SEQLEN
from ._args import _as_int, _endpoint_operand, _int_list


@functools.partial(untraced, name="masks.select_rows")  # host reads (positions) and records
def select_rows(
    mask_func: torch.Tensor, positions: torch.Tensor | Sequence[int], *, batch: int | None = None
) -> torch.Tensor:
    """The rows of query positions ``positions`` of each sample of ``mask_func``, in that order:
    a context-parallel rank's positions of a long sequence, or a chunk of a prefill, from the whole
    sequence's mask. ``mask_func`` holds ``batch`` samples of ``S`` rows each (``[Hmask, nfunc,
    batch * S]``, batch-major; None: the samples a builder recorded it for, else 1); the result is
    ``[Hmask, nfunc, batch * len(positions)]``. Its endpoints still count each sample's keys from
    its first: plan it against k of all ``Sk`` keys (``create_mask_plan(rows, q_mine, k, v)``).

    Building a mask of ``len(positions)`` rows instead shows the wrong keys: ``masks.causal(Sq,
    Sk)`` is aligned bottom-right, the sequence's last ``Sq`` positions. A builder's mask gives a
    result recorded for its positions, so a plan for other q or k refuses it."""
    mask_func = _endpoint_operand("masks.select_rows: mask_func", mask_func)
    rows = _int_list("positions", positions)
    built = recorded(mask_func)
    total = mask_func.shape[2]
    if built is not None and not built.rows:  # a builder's mask of no rows: nothing to select
        built = None
    if batch is None:
        batch = len(built.rows) if built is not None else 1
    batch = _as_int("batch", batch, 1)
    if total % batch:
        raise InputValueError(f"mask_func has {total} rows, which batch={batch} samples do not split evenly")
    seqlen = total // batch
    if built is not None and len(set(built.rows)) == 1 and len(built.rows) != batch:
        raise InputValueError(
            f"mask_func was built by {built.builder} for {describe_lengths(built.rows, 'rows')}, not "
            f"batch={batch}: leave batch unset"
        )
    if built is not None and built.rows != (seqlen,) * batch:
        raise InputValueError(
            f"masks.select_rows takes samples of equal rows, but mask_func was built by {built.builder} for "
            f"{describe_lengths(built.rows, 'rows')} (batch={batch}): for other samples take global "
            "rows, mask_func[..., rows].contiguous()"
        )
    outside = [(i, p) for i, p in enumerate(rows) if not 0 <= p < seqlen]
    if outside:
        i, p = outside[0]
        raise InputValueError(f"positions[{i}] = {p} is outside the samples' {seqlen} rows [0, {seqlen})")
    index = torch.tensor(rows, dtype=torch.int64, device=mask_func.device)
    result = mask_func.unflatten(-1, (batch, seqlen))[..., index].flatten(-2).contiguous()
    if built is None:
        return result
    return record_samples(
        result, f"masks.select_rows of {built.builder}", [len(rows)] * batch, built.keys,
        rows_hint=" (masks.select_rows(mask, positions) of the whole sequence's mask, for q's positions)",
        keys_hint="plan it against k of every key of its samples, or take k's keys with masks.select_keys",
        heads=built.heads, every_head=built.every_head,
    )  # fmt: skip


@functools.partial(untraced, name="masks.select_keys")
def select_keys(mask_func: torch.Tensor, key_positions: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``mask_func`` over some keys of each sample: the sorted, distinct sample-local
    ``key_positions`` (a ring step's shard of the keys; a zig-zag shard's two chunks) become keys
    ``0 .. len(key_positions) - 1``, each row seeing the shard's keys it saw. Plan the result
    against k of those keys (``Sk = len(key_positions)``). The keys of every sample are the same
    positions. A builder's mask gives a result recorded for its rows and the shard's keys.

    Merging the partial results of the shards: each step's ``(out, lse)`` (``return_lse=True``)
    weighs ``exp(lse_step - lse)`` with ``lse = logsumexp`` over the steps; a row that no step
    shows a key has ``lse = -inf`` and output 0 (packages/flexattn/README.md, context
    parallelism)."""
    mask_func = _endpoint_operand("masks.select_keys: mask_func", mask_func)
    keys = _int_list("key_positions", key_positions)
    for i, (a, b) in enumerate(zip(keys[:-1], keys[1:], strict=True)):
        if b <= a:
            raise InputValueError(f"key_positions must increase: key_positions[{i + 1}] = {b} after {a}")
    if keys and keys[0] < 0:
        raise InputValueError(f"key_positions[0] = {keys[0]} is negative")
    if keys and keys[-1] >= MAX_SEQLEN:
        raise InputValueError(f"key_positions reach {keys[-1]}, past the int32 key range (< {MAX_SEQLEN})")
    built = recorded(mask_func)
    if built is not None and keys and keys[-1] >= min(built.keys, default=keys[-1] + 1):
        raise InputValueError(
            f"key_positions reach {keys[-1]}, past the keys of mask_func's samples: it was built by "
            f"{built.builder} for {describe_lengths(built.keys, 'keys')}"
        )
    shard = torch.tensor(keys, dtype=torch.int32, device=mask_func.device)
    result = torch.searchsorted(shard, mask_func.contiguous(), out_int32=True)
    if built is None:
        return result
    return record_samples(
        result, f"masks.select_keys of {built.builder}", built.rows, [len(keys)] * len(built.rows),
        rows_hint=built.rows_hint,
        keys_hint="plan it against k of the shard's keys (Sk = len(key_positions))",
        heads=built.heads, every_head=built.every_head,
    )  # fmt: skip
