"""The one argument convention of the planner kernels: raw global pointers plus int32 sizes.

A kernel's ``@cute.jit`` host entry takes ``cute.Pointer`` arguments (int32, global memory, 4-byte
aligned) and the sizes as ``Int32``, and derives every layout itself from the sizes (all planner
tensors are contiguous and row-major). Compared with passing ``cute.Tensor`` arguments built by
``from_dlpack(...).mark_layout_dynamic()``:

* the calling convention cannot drift: a compiled function unpacks tensor descriptors by their
  compile-time type without checking it, whereas a pointer is a pointer;
* it is cheap: ``make_ptr`` costs ~2 us per argument on the build machine, ``from_dlpack`` +
  ``mark_layout_dynamic`` ~20 us (the planner launches several kernels per plan build);
* compiling needs no tensor at all: :func:`placeholder_ptr` stands in for every pointer, so
  ``cute.compile`` runs in CI without a GPU and without allocating.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import torch
from cutlass import Int32

ALIGN_BYTES = 4


def placeholder_ptr() -> cute.Pointer:
    """A compile-time stand-in for any :func:`int32_ptr` argument (same type, no memory behind it)."""
    return cute.runtime.make_ptr(Int32, 0, cute.AddressSpace.gmem, assumed_align=ALIGN_BYTES)


def int32_ptr(t: torch.Tensor) -> cute.Pointer:
    """The device address of a contiguous int32 tensor, typed like :func:`placeholder_ptr`."""
    if t.dtype != torch.int32:
        raise TypeError(f"planner kernels take int32 tensors, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"planner kernels take contiguous tensors, got strides {t.stride()} "
                         f"for shape {tuple(t.shape)}")
    return cute.runtime.make_ptr(Int32, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=ALIGN_BYTES)


def fake_stream():
    return cute.runtime.make_fake_stream()


def torch_stream(device: torch.device) -> cuda.CUstream:
    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)
