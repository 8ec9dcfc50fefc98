"""Masks combined row by row: the keys every mask shows (:func:`intersect`) or any shows
(:func:`union`), torch FlexAttention's ``and_masks`` / ``or_masks`` on endpoints.

Each row's intervals become boundary events, ``+1`` where an interval opens and ``-1`` where it
closes (a mask's ``[0, F0)`` opens at 0); sorted, their running sum is how many masks show the
keys up to the next event, so the combination is a predicate on that count (all of them, or at
least one) read at the last event of each position::

    a: [0, 3) U [5, 9)          events  0:+1  3:-1  5:+1  9:-1
    b: [0, 0) U [2, 6)                  0:+1  0:-1  2:+1  6:-1
    count after each position   0:1  2:2  3:1  5:2  6:1  9:0
    intersect (count == 2)      [2, 3) U [5, 6)   ->  endpoints 0, 2, 3, 5, 6
    union     (count >= 1)      [0, 9)            ->  endpoints 9

Written as endpoints, a row's visibility starts "on" before key 0, so its endpoints are the
positions where it changes (an odd count: it ends "off"); shorter rows repeat their last endpoint
(empty intervals), as the other builders' rows do. Work is linear in the rows (a sort of each row's
events), no ``[rows, keys]`` tensor is made on any device, and rows go in blocks of about
``_CHUNK_EVENTS`` events, which bounds the memory a call takes.
"""

from __future__ import annotations

import functools

import torch

from ..endpoint_samples import Built, describe_lengths, record_samples, recorded
from ..errors import InputValueError
from ..untraced import untraced
from ._args import _endpoint_operand
from .convert import join_rows

#: events (a row's endpoints and one more per mask, times heads) per block of rows: about 40 bytes
#: of working memory each
_CHUNK_EVENTS = 1 << 22


@functools.partial(untraced, name="masks.intersect")  # host reads (the check, widths) and records
def intersect(*masks: torch.Tensor) -> torch.Tensor:
    """The keys every one of ``masks`` shows a row: endpoints ``[Hmask, nfunc, total_q]`` with the
    smallest odd ``nfunc`` (torch FlexAttention's ``and_masks``). A sliding window within each
    packed document, say: ``intersect(document(lens), sliding_window(sum(lens), window_left=w))``.
    See :func:`union` for what the masks must share."""
    return _combine(masks, "intersect")


@functools.partial(untraced, name="masks.union")
def union(*masks: torch.Tensor) -> torch.Tensor:
    """The keys any of ``masks`` shows a row (torch FlexAttention's ``or_masks``): endpoints
    ``[Hmask, nfunc, total_q]`` with the smallest odd ``nfunc``.

    The masks are endpoint tensors of the same rows (``total_q``), on one device, each with one
    mask for every head (``Hmask = 1``) or one per q head (all the same ``Hmask``; a shared mask
    joins each head's). Their endpoints must be sorted in every row (each is checked; the keys past
    a sample's end are the plan's to refuse). Masks that builders made for the same samples give a
    result recorded for those samples (a plan for other samples refuses it, as it would refuse
    theirs), also where some of the masks have no record (a copy, ``from_dense`` of a rank-3
    mask); masks built for different samples are refused. On a GPU the check is read back once,
    and each block of rows' ``nfunc`` once."""
    return _combine(masks, "union")


def _combine(masks: tuple[torch.Tensor, ...], how: str) -> torch.Tensor:
    heads, total_q, device = _operands(masks, how)
    built = _recorded_samples(masks, how)
    _refuse_unsorted(masks, how)
    events = sum(m.shape[1] + 1 for m in masks)
    step = max(1, _CHUNK_EVENTS // (heads * events))
    rows = range(0, total_q, step)
    blocks = [_combine_rows([m[..., r0 : r0 + step] for m in masks], heads, how) for r0 in rows]
    result = join_rows(blocks) if blocks else torch.zeros(heads, 1, 0, dtype=torch.int32, device=device)
    if built is None:
        return result
    return record_samples(
        result, built.builder, built.rows, built.keys, rows_hint=built.rows_hint, keys_hint=built.keys_hint,
        heads=built.heads, every_head=built.every_head,
    )  # fmt: skip


def _combine_rows(masks: list[torch.Tensor], heads: int, how: str) -> torch.Tensor:
    """One block of rows of :func:`_combine`: ``[heads, nfunc, rows]`` with the block's smallest
    odd ``nfunc``."""
    ordered, count = _events(masks, heads)
    changes = _changes(ordered, count == len(masks) if how == "intersect" else count > 0)
    per_row = changes[..., -1]  # odd: visibility starts shown and ends hidden
    nfunc = int(per_row.amax())
    # endpoint s of a row is its (s + 1)-th change; rows with fewer repeat their last
    wanted = torch.arange(1, nfunc + 1, device=ordered.device).minimum(per_row.unsqueeze(-1))
    return ordered.gather(-1, torch.searchsorted(changes, wanted)).transpose(1, 2).contiguous()


def _events(masks: list[torch.Tensor], heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's events sorted by position ``[heads, total_q, events]`` (each mask's 0, where its
    ``[0, F0)`` opens, then its endpoints, closing and opening in turn), and after each event how
    many masks show the keys up to the next."""
    pos = torch.cat(
        [torch.cat([m.new_zeros(m.shape[0], 1, m.shape[2]), m], 1).expand(heads, -1, -1) for m in masks], 1
    ).transpose(1, 2)
    opens = torch.tensor([1, -1], dtype=torch.int32, device=pos.device)
    step = torch.cat([opens.repeat((m.shape[1] + 1) // 2) for m in masks])
    ordered, order = torch.sort(pos, dim=-1, stable=True)
    return ordered, step[order].cumsum(-1)


def _changes(ordered: torch.Tensor, shown: torch.Tensor) -> torch.Tensor:
    """How many times visibility changed up to each event (its running count of endpoints).
    ``shown``: whether the keys after each event are shown, which only the last event at a position
    decides; visibility counts as shown before key 0."""
    last = torch.ones_like(shown)
    last[..., :-1] = ordered[..., 1:] != ordered[..., :-1]
    idx = torch.arange(shown.shape[-1], device=shown.device)
    decided = torch.where(last, idx, -1).cummax(-1).values  # the latest deciding event at or before each
    state = torch.where(decided >= 0, shown.gather(-1, decided.clamp(min=0)), True)
    before = torch.cat([torch.ones_like(state[..., :1]), state[..., :-1]], -1)
    return (state != before).cumsum(-1)  # only a deciding event can change the carried state


def _refuse_unsorted(masks: tuple[torch.Tensor, ...], how: str) -> None:
    """Refuse a mask with a negative or decreasing endpoint in some row (one read back)."""
    bad = torch.stack([(m[:, :1] < 0).any() | (m[:, 1:] < m[:, :-1]).any() for m in masks]).tolist()
    for i, flag in enumerate(bad):
        if flag:
            raise InputValueError(
                f"masks.{how}: mask {i} has a negative or decreasing endpoint in some row; endpoints "
                "are sorted key positions (maskplan_core.masks)"
            )


def _operand_hint(m: object, how: str) -> str:
    """How to make an endpoint mask of what a ported call passed instead."""
    if isinstance(m, torch.Tensor):
        if m.dtype == torch.bool:
            return "; convert a dense bool mask with masks.from_dense"
        if m.dtype != torch.int32 and not (m.dtype.is_floating_point or m.dtype.is_complex):
            return "; convert integer endpoints with .to(torch.int32)"
        return ""
    if isinstance(m, (list, tuple)):
        return f"; pass the masks as arguments: masks.{how}(*masks)"
    if callable(m):
        return "; convert a mask_mod with masks.from_mask_mod(mask_mod, B, H, Sq, Sk) first"
    return ""


def _operands(masks: tuple[torch.Tensor, ...], how: str) -> tuple[int, int, torch.device]:
    """Check ``masks`` (endpoint tensors of the same rows, on one device, of one ``Hmask`` or 1)
    and return their heads, rows and device."""
    if not masks:
        raise InputValueError(f"masks.{how} needs at least one mask")
    for i, m in enumerate(masks):
        _endpoint_operand(f"masks.{how}: mask {i}", m, _operand_hint(m, how))
    first = masks[0]
    heads = max(m.shape[0] for m in masks)
    for i, m in enumerate(masks):
        if m.shape[2] != first.shape[2]:
            raise InputValueError(
                f"masks.{how}: mask {i} has {m.shape[2]} query rows, mask 0 {first.shape[2]}; the masks "
                "must be of the same rows"
            )
        if m.shape[0] not in (1, heads):
            raise InputValueError(
                f"masks.{how}: the masks' Hmask are {[t.shape[0] for t in masks]}; each must be 1 (one "
                "mask for every head) or the q heads' count, the same for all"
            )
        if m.device != first.device:
            raise InputValueError(f"masks.{how}: mask {i} is on {m.device}, mask 0 on {first.device}")
    return heads, first.shape[2], first.device


def _recorded_samples(masks: tuple[torch.Tensor, ...], how: str) -> Built | None:
    """The samples the recorded masks were built for (None where no mask has a record); masks
    built for different samples are refused (their endpoints are local to different samples).
    The result takes the strictest head record: a model of one head where a mask was evaluated for
    one (``check_heads``), else the fewest heads past one a mask_mod was evaluated for."""
    records = [(i, r) for i, r in enumerate(map(recorded, masks)) if r is not None]
    if not records:
        return None
    i0, first = records[0]
    for i, r in records[1:]:
        for what, mine, theirs in (("rows", r.rows, first.rows), ("keys", r.keys, first.keys)):
            if mine != theirs:
                raise InputValueError(
                    f"masks.{how}: mask {i} was built by {r.builder} for {describe_lengths(mine, what)}, "
                    f"mask {i0} by {first.builder} for {describe_lengths(theirs, what)}: endpoints are "
                    f"local to the samples they were built for; build every mask for one batch"
                )
    one_head = any(r.heads == 1 and not r.every_head for _, r in records)
    evaluated = [r.heads for _, r in records if r.heads > 1]
    heads = 1 if one_head or not evaluated else min(evaluated)
    return Built(
        f"masks.{how}", first.rows, first.keys, f" (each mask masks.{how} combined)",
        f"build each mask masks.{how} combined for k's lengths", heads, not one_head,
    )
