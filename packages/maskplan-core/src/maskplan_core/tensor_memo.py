"""What is known about a tensor's values, kept while the tensor lives unchanged.

Keyed by identity (``id``, with a weak reference to tell a reused id apart), not a
WeakKeyDictionary: that compares two references to one tensor with ``==``, which a tensor answers
elementwise. An entry holds while the tensor's version counter stands where it stood when the entry
was made: a write in place (``copy_``, ``fill_``, an indexed store) ends it. Tensors made under
``torch.inference_mode`` have no version counter and are never remembered. Writes that bypass the
counter go unseen: a collective's (``dist.broadcast``), a numpy or DLPack alias's, another
tensor's ``.data``, a custom kernel's raw pointer. So a memo holds only what such a write may
leave stale without harm: what a builder made its own output for (a stale record refuses or
passes what a copy of the tensor would), never the values a check relies on.
"""

from __future__ import annotations

import weakref
from typing import Generic, TypeVar

import torch

Fact = TypeVar("Fact")


class TensorMemo(Generic[Fact]):
    """``tensor -> fact``, for as long as ``tensor`` lives and is not written in place."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, int, Fact]] = {}

    def remember(self, tensor: torch.Tensor, fact: Fact) -> None:
        if tensor.is_inference():
            return
        key = id(tensor)
        entries = self._entries
        gone = lambda ref: entries.pop(key, None) if entries.get(key, (None,))[0] is ref else None  # noqa: E731
        entries[key] = (weakref.ref(tensor, gone), tensor._version, fact)

    def recall(self, tensor: object) -> Fact | None:
        """The fact remembered for ``tensor`` while it is the same tensor, unchanged; else None."""
        ref, version, fact = self._entries.get(id(tensor), (None, 0, None))
        if ref is None or ref() is not tensor or tensor._version != version:  # type: ignore[attr-defined]
            return None
        return fact
