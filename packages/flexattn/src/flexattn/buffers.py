"""Whether caller-provided tensors share memory: the explicit API's output buffers must hold
distinct elements, apart from each other and from the inputs, or a result would overwrite
another (or an input the kernels still read).

Tensors whose address ranges meet are compared element by element where they have the same
strides (a packed ``dqkv`` sliced into ``dq``, ``dk``, ``dv`` is apart), else counted as sharing
(views with other strides that interleave without a common element are refused too)."""

from __future__ import annotations

import torch


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two indices of ``t`` name one element (an expanded, stride-0 dimension, or strides
    that fold onto each other). Exact for strides that nest (each one past the reach of the
    smaller ones, as every view of a contiguous buffer); other layouts count as overlapping. An
    empty tensor names no element (torch gives one made by an elementwise op stride 0 where it
    likes, and ``empty_like`` keeps them)."""
    if t.numel() == 0:
        return False
    reach = 0
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have an element in common (see the module docstring)."""
    return shared_pair({"a": a, "b": b}, ("a",)) is not None


def shared_pair(tensors: dict[str, torch.Tensor], outputs: tuple[str, ...]) -> tuple[str, str] | None:
    """The first ``(output, other)`` names of ``tensors`` whose tensors have an element in common,
    or None; every pair with an output is compared, each tensor's address range read once."""
    spans = {name: _address_range(t) for name, t in tensors.items() if t.numel()}
    for name in outputs:
        if name not in spans:
            continue
        a0, a1 = spans[name]
        for other, (b0, b1) in spans.items():
            if other != name and a0 < b1 and b0 < a1:
                if _ranges_meeting_share(tensors[name], tensors[other], b0 - a0):
                    return name, other
    return None


def _ranges_meeting_share(a: torch.Tensor, b: torch.Tensor, distance: int) -> bool:
    """Whether ``a`` and ``b``, whose address ranges meet, ``b`` starting ``distance`` bytes after
    ``a``, share an element: exact for equal strides, else assumed."""
    size = a.element_size()
    d, rem = divmod(distance, size)
    if size == b.element_size() and not rem and a.stride() == b.stride() and not overlaps_itself(a):
        return _same_strides_meet(a.stride(), a.shape, b.shape, d)
    return True


def _address_range(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last + 1)`` bytes of ``t``'s elements (strides are never negative in torch)."""
    last = sum(st * (sz - 1) for st, sz in zip(t.stride(), t.shape, strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _same_strides_meet(strides, a_shape, b_shape, d: int) -> bool:
    """Whether index vectors ``i < a_shape`` and ``j < b_shape`` exist with
    ``sum(strides * (i - j)) == d``. Largest stride first, each dimension's ``i - j`` must leave
    ``d`` within what the smaller dimensions reach; with nested strides at most one value does
    (more than one: counted as meeting)."""
    dims = sorted(
        (dim for dim in zip(strides, a_shape, b_shape, strict=True) if dim[0] and max(dim[1:]) > 1),
        reverse=True,
    )
    for k, (stride, na, nb) in enumerate(dims):
        lo = -sum(st * (nb_ - 1) for st, _, nb_ in dims[k + 1 :])  # reach of the smaller dimensions
        hi = sum(st * (na_ - 1) for st, na_, _ in dims[k + 1 :])
        first = max(-(nb - 1), -((hi - d) // stride))  # ceil((d - hi) / stride)
        last = min(na - 1, (d - lo) // stride)
        if first > last:
            return False
        if first < last:
            return True
        d -= stride * first
    return d == 0
