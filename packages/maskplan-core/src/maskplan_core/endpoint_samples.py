"""The samples a mask builder made its endpoints for.

Endpoints ``[Hmask, nfunc, total_q]`` do not say how their rows split into samples, nor how many
keys each sample has: a mask made for 2 samples of 64 query rows has the row count of one sample
of 128, and read as that sample, its rows 64-127 would see keys counted from 64 positions too
early; ``causal(64)`` planned with 128 keys hides keys 64-127 where ``causal(64, 128)`` shows them.
So the builders (``maskplan_core.masks``) record the query rows and keys of the samples they
returned, weakly by identity, and :func:`check_samples` refuses plan inputs of other samples, as
torch refuses a ``BlockMask`` made for other lengths. Samples of no query rows hold no endpoints
and do not count. A tensor made from a builder's output (``torch.cat``, slicing, ``.to()`` another
device or dtype), one written in place since (a reused buffer), or one made under
``torch.inference_mode`` (no version counter to tell) has no record and is taken as it is.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from .errors import InputValueError

#: id(endpoints) -> (a weak reference to them, their version counter when recorded, the builder
#: that returned them, their samples' query rows, and those samples' keys). Keyed by id, not a
#: WeakKeyDictionary: that compares two references to one tensor with ==, which a tensor answers
#: elementwise
_SAMPLES: dict[int, tuple[weakref.ref, int, str, tuple[int, ...], tuple[int, ...]]] = {}

#: how to give a builder the key length, where it takes one
_KEY_LENGTH_HINTS = {
    "masks.causal": "masks.causal(Sq, Sk), or cu_seqlens_k",
    "masks.full": "masks.full(Sq, Sk), or cu_seqlens_k",
    "masks.sliding_window": "masks.sliding_window(Sq, Sk, ...), or cu_seqlens_k",
    "masks.from_mask_mod": "its Sk / KV_LEN",
    "masks.from_block_mask": "create_block_mask's KV_LEN",
    "masks.from_dense": "a mask of k's key columns",
}


def record_samples(
    endpoints: torch.Tensor, builder: str, q_lens: Sequence[int], k_lens: Sequence[int]
) -> torch.Tensor:
    """``endpoints``, recorded as ``builder``'s for samples of ``q_lens`` query rows and ``k_lens``
    keys."""
    if not endpoints.is_inference():
        key = id(endpoints)
        gone = lambda ref: _SAMPLES.pop(key, None) if _SAMPLES.get(key, (None,))[0] is ref else None  # noqa: E731
        rows, keys = _with_rows(q_lens, k_lens)
        _SAMPLES[key] = (weakref.ref(endpoints, gone), endpoints._version, builder, rows, keys)
    return endpoints


def _with_rows(q_lens: Sequence[int], k_lens: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The query rows and keys of the samples that have query rows."""
    pairs = [(int(q), int(k)) for q, k in zip(q_lens, k_lens, strict=True) if q]
    return tuple(q for q, _ in pairs), tuple(k for _, k in pairs)


def _describe(lens: tuple[int, ...], unit: str) -> str:
    if len(set(lens)) <= 1:
        return f"{len(lens)} sample{'s' if len(lens) != 1 else ''} of {lens[0] if lens else 0} {unit}"
    shown = ", ".join(str(n) for n in lens[:6]) + (", ..." if len(lens) > 6 else "")
    return f"{len(lens)} samples of {shown} {unit}"


def check_samples(
    mask_func: torch.Tensor, lens: Callable[[], tuple[Sequence[int], Sequence[int]] | None]
) -> None:
    """Refuse ``mask_func`` where a builder recorded it for samples other than q's and k's (those
    with query rows). ``lens``: a zero-argument callable giving the per-sample query rows and keys,
    or None where the prefixes are not valid ones (the planner's prefix check then names them);
    only called for a recorded mask, so a varlen batch reads its ``cu_seqlens`` back only then."""
    ref, version, builder, rows, keys = _SAMPLES.get(id(mask_func), (None, 0, "", (), ()))
    if ref is None or ref() is not mask_func or mask_func._version != version:
        return
    given = lens()
    if given is None:
        return
    actual_rows, actual_keys = _with_rows(*given)
    if rows != actual_rows:
        how = ""
        if builder == "masks.document":
            how = (
                " (one list of document lengths per sample; varlen samples of other lengths: "
                "torch.cat([masks.document(lens_b) for each sample b], dim=2), or masks.causal("
                "cu_seqlens_q=..., cu_seqlens_k=...) where each sample is one document)"
            )
        raise InputValueError(
            f"mask_func was built by {builder} for {_describe(rows, 'rows')}, but q has "
            f"{_describe(actual_rows, 'rows')}: its endpoints are sample-local to the samples it was "
            f"built for, so here they would show other keys; build it for q's samples{how}"
        )
    if keys != actual_keys:
        how = _KEY_LENGTH_HINTS.get(builder, f"{builder} makes self-attention masks: k's length is q's")
        raise InputValueError(
            f"mask_func was built by {builder} for {_describe(keys, 'keys')}, but k has "
            f"{_describe(actual_keys, 'keys')}: its endpoints are key positions for the lengths it was "
            f"built for (keys past them are hidden, and a diagonal aligned to the last key moves with "
            f"the length); build it for k's lengths ({how}), or, to hide padded keys on purpose, pass "
            f"a copy (mask_func.clone() is taken as it is)"
        )
