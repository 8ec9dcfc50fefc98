"""Host plumbing of the GPU planner: one-allocation arenas, device facts, the stage timer hook.

Nothing here launches a kernel or reads device memory.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Mapping

import torch

from ._cute_args import advance, cuda_index

#: Int32 elements each arena slice is aligned to (128 bytes: bulk copies of payloads need >= 16).
ARENA_ALIGN = 32


class ArenaLayout:
    """Named int32 tensors carved out of ONE ``torch.empty`` (one allocator call per arena), each
    contiguous and starting :data:`ARENA_ALIGN`-aligned.

    A build launches with addresses (``base + offset``, :meth:`addresses`) and makes tensor views
    only of what a plan keeps (:meth:`view`): every view and every ``data_ptr`` call is host time of
    every plan build. The views keep the allocation alive, so an arena holds only tensors that live
    equally long (a build's workspace, or the tensors of one plan).
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]):
        self._views, offset = {}, 0  # name -> (shape, row-major strides, offset)
        for name, shape in shapes.items():
            shape = tuple(int(x) for x in shape)
            strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
            self._views[name] = (shape, strides, offset)
            n = math.prod(shape)
            offset += n + (-n % ARENA_ALIGN)
        self.total = max(offset, 1)
        self._offsets = tuple((name, view[2]) for name, view in self._views.items())

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def of(items: tuple[tuple[str, tuple[int, ...]], ...]) -> ArenaLayout:
        """The layout of ``(name, shape)`` items, cached (a build's exact-size arenas repeat as
        long as the mask does)."""
        return ArenaLayout(dict(items))

    def allocate(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.total, dtype=torch.int32, device=device)

    def view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        shape, stride, offset = self._views[name]
        return buf.as_strided(shape, stride, offset)

    def addresses(self, base) -> dict[str, object]:
        """``name -> advance(base, offset)``; ``base`` is the buffer's :func:`int32_address`."""
        return {name: advance(base, offset) for name, offset in self._offsets}


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_ctas(device: torch.device, items: int, ctas_per_sm: int = 1) -> int:
    """Grid of a persistent kernel: never more CTAs than can be resident (static item striding), or
    than an SM runs at once (items from a ticket counter)."""
    return max(1, min(items, sm_count(cuda_index(device)) * ctas_per_sm))


StageTimer = Callable[[str], contextlib.AbstractContextManager]


def no_timer(_name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class CudaEventTimer:
    """Stage timer for benchmarks: CUDA events (device timeline) and host wall time around each stage.

    ``timer = CudaEventTimer(); build_plan_gpu(..., stage_timer=timer); timer.elapsed_ms()``
    (the read synchronises, so call it after the build, outside the timed region). When the host
    launches slower than the device runs, the device gaps between events are host time too.
    """

    def __init__(self) -> None:
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event, float]] = []

    @contextlib.contextmanager
    def __call__(self, name: str):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        try:
            yield
        finally:
            end.record()
            self._events.append((name, start, end, time.perf_counter() - t0))

    def elapsed_ms(self) -> dict[str, float]:
        """Device milliseconds per stage (start event to end event)."""
        out: dict[str, float] = {}
        for name, start, end, _ in self._events:
            end.synchronize()
            out[name] = out.get(name, 0.0) + start.elapsed_time(end)
        return out

    def host_ms(self) -> dict[str, float]:
        """Host wall milliseconds per stage (Python + launch calls; the header read waits for the GPU)."""
        out: dict[str, float] = {}
        for name, _, _, seconds in self._events:
            out[name] = out.get(name, 0.0) + seconds * 1e3
        return out
