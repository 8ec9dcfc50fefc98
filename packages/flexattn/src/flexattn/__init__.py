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

from . import masks
from .attention import flex_attn_func
from .explicit import FlexAttentionBwd, FlexAttentionFwd
from .planning import create_mask_plan

__version__ = "0.1.0"

# The "flexattn" logger (compiles, cache hits, warnings) is silent unless the application configures
# logging, e.g. logging.basicConfig(level=logging.INFO).
_log = logging.getLogger("flexattn")
if not any(isinstance(h, logging.NullHandler) for h in _log.handlers):
    _log.addHandler(logging.NullHandler())

#: torch's names a ported call may look for here, and flexattn's way
_TORCH_NAMES = {
    "flex_attention": "flexattn.flex_attn_func(q, k, v, mask_plan=plan) on [B, S, H, D] tensors; "
    "cuDNN's module cudnn.flex_attention is flexattn itself: from flexattn import create_mask_plan, "
    "flex_attn_func, ...",
    "scaled_dot_product_attention": "flexattn.flex_attn_func(q, k, v, mask_plan=plan), a plan of the mask",
    "create_block_mask": "flexattn.masks.from_mask_mod(mask_mod, B, H, Sq, Sk, device=q.device), then "
    "create_mask_plan",
    "create_mask": "flexattn.masks.from_mask_mod(mask_mod, B, H, Sq, Sk, device=q.device) (endpoints)",
    "BlockMask": "flexattn.MaskPlan, from create_mask_plan (masks.from_block_mask converts a BlockMask)",
    **masks.TORCH_NAMES,
}


def __getattr__(name: str):
    if name in _TORCH_NAMES:
        fix = _TORCH_NAMES[name]
        raise AttributeError(f"module 'flexattn' has no attribute {name!r} (torch's name): {fix}")
    raise AttributeError(f"module 'flexattn' has no attribute {name!r}")


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
