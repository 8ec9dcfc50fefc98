"""The samples a mask builder made its endpoints for.

Endpoints ``[Hmask, nfunc, total_q]`` do not say how their rows split into samples: a mask made
for 2 samples of 64 query rows has the row count of one sample of 128, and read as that sample,
its rows 64-127 would see keys counted from 64 positions too early. So the builders
(``maskplan_core.masks``) record the split of the tensor they return, weakly by identity, and
:func:`check_samples` refuses plan inputs of another split, as torch refuses a ``BlockMask`` made
for other lengths. Samples of no rows hold no endpoints and do not count. A tensor made from a
builder's output (``torch.cat``, slicing, ``.to()`` another device or dtype), one written in place
since (a reused buffer), or one made under ``torch.inference_mode`` (no version counter to tell)
has no record and is taken as it is.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from .errors import InputValueError

#: id(endpoints) -> (a weak reference to them, their version counter when recorded, the builder
#: that returned them, their samples' query rows). Keyed by id, not a WeakKeyDictionary: that
#: compares two references to one tensor with ==, which a tensor answers elementwise
_SAMPLES: dict[int, tuple[weakref.ref, int, str, tuple[int, ...]]] = {}


def record_samples(endpoints: torch.Tensor, builder: str, q_lens: Sequence[int]) -> torch.Tensor:
    """``endpoints``, recorded as ``builder``'s for samples of ``q_lens`` query rows."""
    if not endpoints.is_inference():
        key = id(endpoints)
        gone = lambda ref: _SAMPLES.pop(key, None) if _SAMPLES.get(key, (None,))[0] is ref else None  # noqa: E731
        rows = tuple(int(n) for n in q_lens if n)
        _SAMPLES[key] = (weakref.ref(endpoints, gone), endpoints._version, builder, rows)
    return endpoints


def _describe(q_lens: tuple[int, ...]) -> str:
    if len(set(q_lens)) <= 1:
        return f"{len(q_lens)} sample{'s' if len(q_lens) != 1 else ''} of {q_lens[0] if q_lens else 0} rows"
    shown = ", ".join(str(n) for n in q_lens[:6]) + (", ..." if len(q_lens) > 6 else "")
    return f"{len(q_lens)} samples of {shown} rows"


def check_samples(mask_func: torch.Tensor, q_lens) -> None:
    """Refuse ``mask_func`` where a builder recorded it for samples other than q's (those with
    rows). ``q_lens``: a zero-argument callable giving q's per-sample query rows (only called for
    a recorded mask, so a varlen batch reads its ``cu_seqlens_q`` back only then)."""
    ref, version, builder, built = _SAMPLES.get(id(mask_func), (None, 0, "", ()))
    if ref is None or ref() is not mask_func or mask_func._version != version:
        return
    actual = tuple(int(n) for n in q_lens() if n)
    if built != actual:
        how = " (one list of document lengths per sample)" if builder == "masks.document" else ""
        raise InputValueError(
            f"mask_func was built by {builder} for {_describe(built)}, but q has {_describe(actual)}: "
            "its endpoints are sample-local to the samples it was built for, so here they would show "
            f"other keys; build it for q's samples{how}"
        )
