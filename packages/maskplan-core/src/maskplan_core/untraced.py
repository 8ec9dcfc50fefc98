"""Host-side work run eagerly where ``torch.compile`` traces a call to it, without importing Dynamo
in eager code."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def untraced(fn: Callable[P, R], name: str) -> Callable[P, R]:
    """``fn`` (called ``name`` in the errors) as a function that runs eagerly where ``torch.compile``
    traces a call to it: host-side work on the mask's values (the planner; a mask builder, which
    traced gave endpoints of inductor's strides, refused by ``create_mask_plan``, and broke the
    graph at each host read). Traced, it calls ``fn`` through Dynamo's ``disable``: without
    fullgraph Dynamo breaks the graph at the call and compiles the code around it (an exception
    raised there instead made Dynamo give up on every enclosing frame, and the whole model ran
    eagerly); with fullgraph, Dynamo's error quotes the reason below. The first trace, before any
    eager call made the disabled function, breaks first at ``graph_break`` (which quotes the
    reason too) and makes it. Eager code never imports Dynamo (1.4 s)."""
    reason = (
        f"{name} runs outside torch.compile and torch.export: build the mask and its plan before the "
        "compiled region (e.g. in the training step) and pass the plan to the compiled model as an argument"
    )

    # torch._dynamo.disable(fn), made once Dynamo is imported; this builder's own (Dynamo guards
    # on what a trace read: a table of every builder's made each new entry recompile the frame)
    disabled: list[Callable[P, R]] = []

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        if not disabled and torch.compiler.is_compiling():
            torch._dynamo.graph_break(msg=reason)
        if not disabled and "torch._dynamo" in sys.modules:
            disabled.append(torch._dynamo.disable(fn, reason=reason))
        return (disabled[0] if disabled else fn)(*args, **kwargs)

    return run
