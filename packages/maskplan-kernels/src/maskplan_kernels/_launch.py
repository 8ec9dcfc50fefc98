"""Host plumbing of the GPU planner: one-allocation arenas, device facts, the stage timer hook.

Nothing here launches a kernel or reads device memory.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence

import torch

#: Int32 elements each arena slice is aligned to (128 bytes: bulk copies of payloads need >= 16).
ARENA_ALIGN = 32


class Arena:
    """Several int32 tensors carved out of ONE ``torch.empty`` (one allocator call per arena).

    The views keep the allocation alive, so an arena holds only tensors that live equally long
    (a build's workspace, or one plan view's tensors).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._shapes: list[tuple[int, ...]] = []

    def add(self, *shape: int) -> int:
        self._shapes.append(tuple(int(s) for s in shape))
        return len(self._shapes) - 1

    def allocate(self) -> list[torch.Tensor]:
        offsets, total = [], 0
        for shape in self._shapes:
            offsets.append(total)
            n = 1
            for s in shape:
                n *= s
            total += -(-n // ARENA_ALIGN) * ARENA_ALIGN
        buf = torch.empty(max(total, 1), dtype=torch.int32, device=self.device)
        out = []
        for shape, off in zip(self._shapes, offsets, strict=True):
            n = 1
            for s in shape:
                n *= s
            out.append(buf[off : off + n].view(shape))
        return out


def arena(device: torch.device, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    a = Arena(device)
    for shape in shapes:
        a.add(*shape)
    return a.allocate()


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_ctas(device: torch.device, items: int, ctas_per_sm: int = 1) -> int:
    """Grid of a persistent kernel: never more CTAs than can be resident (static item striding)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(1, min(items, sm_count(index) * ctas_per_sm))


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
