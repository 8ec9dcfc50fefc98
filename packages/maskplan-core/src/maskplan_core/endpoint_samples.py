"""The samples a mask builder made its endpoints for.

Endpoints ``[Hmask, nfunc, total_q]`` do not say how their rows split into samples, nor how many
keys each sample has: a mask made for 2 samples of 64 query rows has the row count of one sample
of 128, and read as that sample, its rows 64-127 would see keys counted from 64 positions too
early; ``causal(64)`` planned with 128 keys hides keys 64-127 where ``causal(64, 128)`` shows them.
So the builders (``maskplan_core.masks``) record the query rows and keys of the samples they
returned, weakly by identity, and :func:`check_samples` refuses plan inputs of other samples, as
torch refuses a ``BlockMask`` made for other lengths. The mask_mod builders also record the heads
they evaluated it for, which :func:`check_heads` holds against q's. Samples of no query rows hold no endpoints
and do not count. A tensor made from a builder's output (``torch.cat``, slicing, ``.to()`` another
device or dtype), one written in place since (a reused buffer), or one made under
``torch.inference_mode`` (no version counter to tell) has no record and is taken as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .errors import InputValueError
from .tensor_memo import TensorMemo


@dataclass(frozen=True)
class Built:
    """What a builder made its endpoints for: its name, its samples' query rows and keys (the
    samples with rows), how to make it for other rows or keys (``rows_hint``, ``keys_hint``:
    the builder's own arguments, said in the refusal) and the heads it evaluated a mask_mod for
    (``heads``; 1 stands for every head where ``every_head``, else for a model of one head: a
    mask_mod that raised at head 1, or a block mask converted for ``heads=1``)."""

    builder: str
    rows: tuple[int, ...]
    keys: tuple[int, ...]
    rows_hint: str = ""
    keys_hint: str = ""
    heads: int = 1
    every_head: bool = True


#: endpoints -> what they were built for
_SAMPLES: TensorMemo[Built] = TensorMemo()


def record_samples(
    endpoints: torch.Tensor,
    builder: str,
    q_lens: Sequence[int],
    k_lens: Sequence[int],
    *,
    rows_hint: str = "",
    keys_hint: str,
    heads: int = 1,
    every_head: bool = True,
) -> torch.Tensor:
    """``endpoints``, recorded as ``builder``'s for samples of ``q_lens`` query rows and ``k_lens``
    keys; ``keys_hint`` says how the builder takes other key lengths, ``rows_hint`` anything the
    refusal of other query rows should add, ``heads`` how many heads it evaluated a mask_mod for
    and ``every_head`` whether one head stands for every head (:func:`check_heads`)."""
    built = Built(builder, *_with_rows(q_lens, k_lens), rows_hint, keys_hint, heads, every_head)
    _SAMPLES.remember(endpoints, built)
    return endpoints


def recorded(mask_func: torch.Tensor) -> Built | None:
    """What a builder recorded ``mask_func`` for, while it is that builder's output unchanged."""
    return _SAMPLES.recall(mask_func)


def built_rows_hint(mask_func: torch.Tensor, q_samples: str = "") -> str:
    """For a ``mask_func`` whose row count is not q's (refused before :func:`check_samples` could
    name its samples), recorded by a builder: ``"; it was built by ... for ...: build it for q's
    samples ..."``. Without ``q_samples`` only for a builder with a ``rows_hint`` (how it takes
    other rows, which the refusal's generic hints, naming other builders' arguments, do not say);
    with it (what q holds, e.g. ``"2 samples of 200 rows"``: where no generic hint fits) for any
    builder. Else ``""``."""
    built = recorded(mask_func)
    if built is None or not (built.rows_hint or q_samples):
        return ""
    how = built.rows_hint or f" ({q_samples})"
    rows = describe_lengths(built.rows, "rows")
    return f"; it was built by {built.builder} for {rows}: build it for q's samples{how}"


def check_heads(mask_func: torch.Tensor, num_heads_q: int) -> None:
    """Refuse ``mask_func`` where a builder evaluated its mask_mod for fewer heads than q's, but
    more than one (``H = Hkv``, say). A mask_mod's head index is a q head's, as in torch, so q's
    other heads were never evaluated, even where the evaluated ones agreed and the result kept one
    mask for every head (``Hmask = 1``). More heads than q's (a tensor-parallel rank's share of
    a model's heads) evaluated every head q has. One head stands for every head only where the
    builder found the mask_mod not reading its head index: a model of one head (a mask_mod that
    raised at head 1, as torch would at q's head 1) is refused for q of more heads."""
    built = recorded(mask_func)
    if built is None:
        return
    if built.heads == 1 and not built.every_head and num_heads_q > 1:
        raise InputValueError(
            f"mask_func was built by {built.builder} for a model of one head (its mask_mod was not "
            f"evaluated past head 0, or raised at head 1), but q has {num_heads_q} heads, for which "
            f"torch's flex_attention calls the mask_mod with each head's index: build it for "
            f"H={num_heads_q} (heads={num_heads_q} for a block mask) with a mask_mod that takes every head"
        )
    if 1 < built.heads < num_heads_q:
        raise InputValueError(
            f"mask_func was built by {built.builder} for {built.heads} heads, but q has {num_heads_q}: a "
            f"mask_mod's head index is a q head's (as in torch's create_block_mask), so build it for "
            f"H={num_heads_q}, or H=1 where the mask does not depend on the head"
        )


def _with_rows(q_lens: Sequence[int], k_lens: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The query rows and keys of the samples that have query rows."""
    pairs = [(int(q), int(k)) for q, k in zip(q_lens, k_lens, strict=True) if q]
    return tuple(q for q, _ in pairs), tuple(k for _, k in pairs)


def describe_lengths(lens: tuple[int, ...], unit: str) -> str:
    """``"2 samples of 200 rows"``, or the first six lengths where the samples' differ."""
    if len(set(lens)) <= 1:
        return f"{len(lens)} sample{'s' if len(lens) != 1 else ''} of {lens[0] if lens else 0} {unit}"
    shown = ", ".join(str(n) for n in lens[:6]) + (", ..." if len(lens) > 6 else "")
    return f"{len(lens)} samples of {shown} {unit}"


def check_samples(
    mask_func: torch.Tensor, lens: Callable[[], tuple[Sequence[int], Sequence[int]] | None]
) -> None:
    """Refuse ``mask_func`` where a builder recorded it for samples other than q's and k's (those
    with query rows). ``lens``: a zero-argument callable giving the per-sample query rows and keys,
    or None where the prefixes break a rule of the planner's prefix check (which then names it);
    only called for a recorded mask, so a varlen batch reads its ``cu_seqlens`` back only then."""
    built = recorded(mask_func)
    if built is None:
        return
    given = lens()
    if given is None:
        return
    rows, keys = _with_rows(*given)
    # samples without query rows have no mask rows, so neither side counts them; the message does
    empty = len(given[0]) - len(rows)
    besides = f" (besides {empty} without query rows)" if empty else ""
    if rows != built.rows:
        raise InputValueError(
            f"mask_func was built by {built.builder} for {describe_lengths(built.rows, 'rows')}, but q has "
            f"{describe_lengths(rows, 'rows')}{besides}: its endpoints are sample-local to the samples it "
            f"was built for, so here they would show other keys; build it for q's samples{built.rows_hint}"
        )
    if keys != built.keys:
        fewer = any(k < b for k, b in zip(keys, built.keys, strict=True))
        why = (
            "its endpoints may reach past k's keys"
            if fewer
            else "keys past them are hidden, and a diagonal aligned to the last key moves with the length"
        )
        escape = "" if fewer else "; or, to hide padded keys on purpose, pass a copy (mask_func.clone())"
        raise InputValueError(
            f"mask_func was built by {built.builder} for {describe_lengths(built.keys, 'keys')}, but k has "
            f"{describe_lengths(keys, 'keys')}{besides}: its endpoints are key positions for the lengths it "
            f"was built for ({why}); {built.keys_hint}{escape}"
        )
