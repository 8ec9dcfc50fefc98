"""When a plan built on a GPU is complete, so that a kernel on another stream waits for it.

A build runs on the caller's current stream, and its last stages are still queued when it returns
(the GPU planner, ``maskplan_kernels.build_plan_gpu``, and the reference planner on CUDA tensors
alike). A training loop may build the next batch's plan on a side stream while the current step
runs on the main one (the build's one host read then waits for the side stream only, not for the
step). :func:`mark_ready` records an event on the building stream at the end of a build;
:func:`wait_ready` makes the stream of a view's first use by a consumer wait for it, before
anything reads the view's tensors there (``maskplan_kernels.consumer_launch.cached_view_args``;
later streams are ordered after that first one). Nothing waits on the host::

    side stream:  geometry, classify, ..., header read, materialise, schedule, [ready]
    main stream:  ... step i ...                 wait(ready) -> attention with the new plan

Other readers of a plan's tensors on another stream (``PlanView.to_dense()``, ``stats()``, a
library's own kernels) order themselves as for any tensor: ``wait_stream`` on the building stream.
"""

from __future__ import annotations

import weakref

import torch

from .plan import PlanView

#: view -> (the building stream's handle, the event recorded after its last stage)
_READY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def mark_ready(views, device: torch.device) -> None:
    """Record, on the current stream of ``device``, that the build of ``views`` is complete (a CUDA
    device; builds on the CPU, the reference's or the planner kernels' emulation, have no streams)."""
    if device.type != "cuda":
        return
    stream = torch.cuda.current_stream(device)
    event = torch.cuda.Event()
    event.record(stream)
    for view in views:
        _READY[view] = (stream.cuda_stream, event)


def share_ready(view: PlanView, derived: PlanView) -> None:
    """``derived`` reads ``view``'s tensors (a consumer's copy of the view with another geometry):
    it is ready when ``view`` is."""
    ready = _READY.get(view)
    if ready is not None:
        _READY[derived] = ready


def wait_ready(view: PlanView, device: torch.device) -> None:
    """Order the current stream of ``device`` after the build of ``view`` where another stream made
    it. Not inside a graph capture, which may not wait for work outside it: there the plan must be
    complete before the capture, as every input of a captured call must be."""
    ready = _READY.get(view)
    if ready is None:
        return
    handle, event = ready
    stream = torch.cuda.current_stream(device)
    if handle != stream.cuda_stream:
        stream.wait_event(event)
