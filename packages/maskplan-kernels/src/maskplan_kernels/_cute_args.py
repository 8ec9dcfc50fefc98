"""The one argument convention of the project's kernels: raw global addresses plus int32 sizes.

A kernel's ``@cute.jit`` host entry takes ``cute.Pointer`` arguments (global memory, with the
alignment the kernel assumes) and the sizes as ``Int32``, and derives every layout itself from the
sizes (all planner tensors are contiguous and row-major). Every kernel is compiled with TVM-FFI
(:data:`maskplan_kernels.compile_cache.CALL_OPTIONS`), so a launch passes plain Python values: an
``int`` device address per pointer (:func:`int32_address`), ``int`` sizes, ``float`` scalars and
the stream as an ``int`` handle (:func:`torch_stream`). Compared with ``cute.Tensor`` arguments built by
``from_dlpack(...).mark_layout_dynamic()``:

* the calling convention cannot drift: a compiled function unpacks tensor descriptors by their
  compile-time type without checking it, whereas an address is an address;
* it is cheap: on the H200 host a launch of the 12-argument scan/header kernel took 55 us through
  the DSL's default executor (``make_ptr`` objects, ~1 us each, plus its argument packing) and
  13 us through TVM-FFI with ints;
* compiling needs no tensor at all: :func:`placeholder_ptr` stands in for every pointer, so
  ``cute.compile`` runs in CI without a GPU and without allocating.
"""

from __future__ import annotations

import cutlass.cute as cute
import torch
from cutlass import Int32, Int64

from maskplan_core.consumer import cuda_index

INT32_BYTES = 4
#: the alignment every planner pointer assumes (one element)
ALIGN_BYTES = INT32_BYTES


def row_major(ptr: cute.Pointer, *shape, wide: bool = False) -> cute.Tensor:
    """The contiguous row-major tensor ``shape`` at ``ptr``; ``wide``: strides past the innermost are
    64-bit (where a product of sizes may pass 2^31)."""
    if len(shape) == 1:
        return cute.make_tensor(ptr, cute.make_layout(shape[0]))
    strides = []
    for axis in range(1, len(shape)):
        stride = Int64(shape[axis]) if wide else shape[axis]
        for n in shape[axis + 1 :]:
            stride = stride * n
        strides.append(stride)
    return cute.make_tensor(ptr, cute.make_layout(tuple(shape), stride=(*strides, 1)))


def placeholder_ptr() -> cute.Pointer:
    """A compile-time stand-in for any :func:`int32_address` argument (same type, no memory behind it)."""
    return cute.runtime.make_ptr(Int32, 0, cute.AddressSpace.gmem, assumed_align=ALIGN_BYTES)


def int32_address(t: torch.Tensor) -> int:
    """The device address of a contiguous int32 tensor: the launch value of a :func:`placeholder_ptr`
    argument."""
    if t.dtype != torch.int32:
        raise TypeError(f"planner kernels take int32 tensors, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"planner kernels take contiguous tensors, got strides {t.stride()} "
                         f"for shape {tuple(t.shape)}")
    return t.data_ptr()


def advance(address: int, elements: int) -> int:
    """The address ``elements`` int32 elements past ``address`` (an arena slice, a counts plane)."""
    return address + INT32_BYTES * elements


def fake_stream():
    return cute.runtime.make_fake_stream()


def torch_stream(device: torch.device) -> int:
    """The launch value of a stream argument: the handle of ``device``'s current torch stream.

    Read through the raw-handle accessor torch's own compiled code uses (no ``Stream`` object:
    ~0.3 instead of ~5 us, and every plan build and attention call reads it)."""
    return _current_raw_stream(cuda_index(device))


def _stream_handle(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _stream_handle)
