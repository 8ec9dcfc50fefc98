"""Exception types of the plan ABI.

Every public input error is a ``ValueError`` or ``TypeError`` subclass whose message names the
argument (and for values, the row and the value), so callers can catch either the precise class
or the builtin one.
"""

from __future__ import annotations


class FlexAttnError(Exception):
    """Base of every error raised by maskplan/flexattn."""


class InputTypeError(FlexAttnError, TypeError):
    """An argument has the wrong Python type, tensor dtype or rank."""


class InputValueError(FlexAttnError, ValueError):
    """An argument has the right type but a bad shape, device, layout or value."""


class EndpointError(InputValueError):
    """A mask endpoint is out of ``[0, k_len]`` or out of order."""


class SeqlenError(InputValueError):
    """A ``cu_seqlens`` prefix is malformed or exceeds ``max_seqlen``."""


class PlanBindingError(InputValueError):
    """Q/K/V (or the call) do not match the geometry, dtype or device the plan was built for."""


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
    """A consumer exists for the device but does not support this configuration."""


class UnsupportedCallError(FlexAttnError, RuntimeError):
    """A call the library does not serve in the state it is made in: ``execute()`` before
    ``compile()``, eager ``torch.vmap``, a double backward, a vmapped backward or forward-mode
    derivative through attention, a plan built from fake tensors."""
