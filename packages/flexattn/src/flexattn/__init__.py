"""flexattn: attention with arbitrary static interval masks through reusable MaskPlans.

import flexattn
mask = flexattn.masks.causal(4096, batch=2)
plan = flexattn.create_mask_plan(mask, q, k, v)
out = flexattn.flex_attn_func(q, k, v, mask_plan=plan)
"""

import logging

from maskplan_core import (
    ConsumerNotFoundError,
    EndpointError,
    FlexAttnError,
    InputTypeError,
    InputValueError,
    MaskPlan,
    MissingBackwardViewError,
    PlanBindingError,
    PlanDtypeError,
    PlanMetadata,
    PlanSignatureMismatch,
    PlanView,
    ScaleTypeError,
    SeqlenError,
    UnsupportedCallError,
    UnsupportedConfigError,
)

from . import masks, torch_names
from .attention import flex_attn_func
from .explicit import FlexAttentionBwd, FlexAttentionFwd
from .planning import create_mask_plan

__version__ = "0.1.0"

# The "flexattn" logger (compiles, cache hits, warnings) is silent unless the application configures
# logging, e.g. logging.basicConfig(level=logging.INFO).
_log = logging.getLogger("flexattn")
if not any(isinstance(h, logging.NullHandler) for h in _log.handlers):
    _log.addHandler(logging.NullHandler())

__getattr__ = torch_names.missing_attribute("flexattn", torch_names.PACKAGE)


__all__ = [
    "ConsumerNotFoundError",
    "EndpointError",
    "FlexAttentionBwd",
    "FlexAttentionFwd",
    "FlexAttnError",
    "InputTypeError",
    "InputValueError",
    "MaskPlan",
    "MissingBackwardViewError",
    "PlanBindingError",
    "PlanDtypeError",
    "PlanMetadata",
    "PlanSignatureMismatch",
    "PlanView",
    "ScaleTypeError",
    "SeqlenError",
    "UnsupportedCallError",
    "UnsupportedConfigError",
    "create_mask_plan",
    "flex_attn_func",
    "masks",
]
