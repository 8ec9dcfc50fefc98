"""Mask builders returning int32 endpoints ``[Hmask, nfunc, total_q]`` (maskplan-core's, run
eagerly where ``torch.compile`` traces a call to one: :func:`maskplan_core.untraced.untraced`)."""

from collections.abc import Callable
from typing import ParamSpec, TypeVar

import maskplan_core.masks as _builders
from maskplan_core.masks import __all__  # noqa: F401
from maskplan_core.untraced import untraced as _untraced

from . import torch_names as _torch_names

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _builder(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` run eagerly under torch.compile, under this module's name (so that it pickles)."""
    run = _untraced(fn, f"{__name__}.{fn.__name__}")
    run.__module__ = __name__
    return run


causal = _builder(_builders.causal)
chunked = _builder(_builders.chunked)
document = _builder(_builders.document)
document_ids = _builder(_builders.document_ids)
from_block_mask = _builder(_builders.from_block_mask)
from_dense = _builder(_builders.from_dense)
from_mask_mod = _builder(_builders.from_mask_mod)
full = _builder(_builders.full)
intersect = _builder(_builders.intersect)
prefix_lm = _builder(_builders.prefix_lm)
select_keys = _builder(_builders.select_keys)
select_rows = _builder(_builders.select_rows)
sliding_window = _builder(_builders.sliding_window)
union = _builder(_builders.union)


__getattr__ = _torch_names.missing_attribute(__name__, _torch_names.MASKS)
