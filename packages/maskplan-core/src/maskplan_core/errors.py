"""Exception types of the plan ABI.

Every public input error is a ``ValueError`` or ``TypeError`` subclass whose message names the
argument (and for values, the row and the value), so callers can catch either the precise class
or the builtin one.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch


class FlexAttnError(Exception):
    """Base of every error raised by maskplan/flexattn."""


class InputTypeError(FlexAttnError, TypeError):
    """An argument has the wrong Python type, tensor dtype or rank."""


class InputValueError(FlexAttnError, ValueError):
    """An argument has the right type but a bad shape, device, layout or value."""


class EndpointError(InputValueError):
    """A mask endpoint is out of ``[0, k_len]`` or out of order."""


class SeqlenError(InputValueError):
    """A ``cu_seqlens`` prefix is malformed (not starting at 0, decreasing, too short, past the
    int32 range) or exceeds ``max_seqlen``: in the planner's inputs and in the mask builders'."""


class PlanBindingError(InputValueError):
    """Q/K/V (or the call) do not match the geometry, dtype or device the plan was built for."""


class PlanDtypeError(PlanBindingError, TypeError):
    """Q/K/V of another dtype than the plan's: a ``TypeError`` too, as ``cudnn.flex_attention``
    raises for it."""


class ScaleTypeError(InputTypeError, ValueError):
    """A ``softmax_scale`` that is not a real number: a ``ValueError`` too, as
    ``cudnn.flex_attention`` raises for it."""


class PlanSignatureMismatch(InputValueError):
    """A plan view was materialised for another consumer; ``diffs`` lists the differing fields."""

    def __init__(self, message: str, diffs: list) -> None:
        super().__init__(message)
        self.diffs = diffs


class MissingBackwardViewError(InputValueError):
    """A training call was made with a plan built without backward views."""


class ConsumerNotFoundError(FlexAttnError, RuntimeError):
    """No installed consumer serves the device / direction / configuration."""


class UnsupportedConfigError(InputValueError):
    """A consumer exists for the device but does not support this configuration; ``argument`` names
    the refused one where a single argument is (``"dtype"``, ``"head_dim"``, ...), else None."""

    def __init__(self, message: str, argument: str | None = None) -> None:
        super().__init__(message)
        self.argument = argument


class UnsupportedCallError(FlexAttnError, RuntimeError):
    """A call the library does not serve in the state it is made in: ``execute()`` before
    ``compile()``, eager ``torch.vmap``, a double backward, a vmapped backward or forward-mode
    derivative through attention, ``torch.jit.trace``, a plan built from fake tensors."""


#: top-level packages whose frames a warning passes over to reach its caller's line (torch's too:
#: a call from a module's forward reaches flexattn through ``nn.Module.__call__``)
_LIBRARY_PACKAGES = frozenset(
    {"maskplan_core", "maskplan_kernels", "flexattn", "flexattn_sm90", "flexattn_sm100", "torch"}
)


_TORCH_DIR = os.path.join(os.path.dirname(torch.__file__), "")  # with its separator: not torchvision


def _in_library(frame) -> bool:
    """A frame of the library's or torch's, or of code torch generates (``torch.compile``'s fx
    graphs, named ``<eval_with_key>.N``) or runs from its directory. A REPL's ``<stdin>`` and a
    notebook's cells are the caller's."""
    if str(frame.f_globals.get("__name__") or "").split(".")[0] in _LIBRARY_PACKAGES:
        return True
    filename = frame.f_code.co_filename
    return filename.startswith("<eval_with_key>") or filename.startswith(_TORCH_DIR)


def warn_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside flexattn's packages and torch, so
    the warning names the caller's line however deep in the library it was raised (and the default
    filter shows it once per such line); where every frame is theirs (a thread the library runs
    on), to this function's caller."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: this function's caller
    while frame is not None and _in_library(frame):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
