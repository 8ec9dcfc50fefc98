"""maskplan_kernels._launch: the one-allocation arena (host only, no GPU)."""

import torch

from maskplan_kernels._cute_args import INT32_BYTES
from maskplan_kernels._launch import ARENA_ALIGN, ArenaLayout


def _carve(shapes):
    layout = ArenaLayout({f"t{i}": s for i, s in enumerate(shapes)})
    buf = layout.allocate(torch.device("cpu"))
    return layout, buf, [layout.view(buf, f"t{i}") for i in range(len(shapes))]


def test_arena_shapes_alignment_and_disjointness():
    shapes = [(3,), (2, 5), (0,), (0, 4), (33,), (1,), (4, 1, 8, 2)]
    _, _, tensors = _carve(shapes)
    assert [tuple(t.shape) for t in tensors] == shapes
    assert all(t.dtype == torch.int32 and t.is_contiguous() for t in tensors)
    base = tensors[0].data_ptr()
    spans = []
    for t in tensors:
        if t.numel():
            offset = (t.data_ptr() - base) // 4
            assert offset % ARENA_ALIGN == 0
            spans.append((offset, offset + t.numel()))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
    for i, t in enumerate(tensors):  # writing one never touches another
        t.fill_(i)
    assert all(bool((t == i).all()) for i, t in enumerate(tensors))


def test_arena_of_empty_tensors_only():
    assert [t.numel() for t in _carve([(0,), (0, 3)])[2]] == [0, 0]


def test_arena_addresses_are_the_views_addresses():
    shapes = [(5,), (3, 7), (0,), (2, 2, 2)]
    layout, buf, tensors = _carve(shapes)
    addresses = layout.addresses(buf.data_ptr())
    assert list(addresses) == [f"t{i}" for i in range(len(shapes))]
    for i, t in enumerate(tensors):
        assert addresses[f"t{i}"] == buf.data_ptr() + INT32_BYTES * t.storage_offset()
