"""torch's names a ported call may look for on ``flexattn`` or ``flexattn.masks``, and flexattn's
way, which the modules' ``__getattr__`` says in its ``AttributeError``."""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

#: torch's mask combinators
MASKS = {
    "and_masks": "flexattn.masks.intersect(mask, ...) on endpoint masks (from_mask_mod converts a mask_mod)",
    "or_masks": "flexattn.masks.union(mask, ...) on endpoint masks (from_mask_mod converts a mask_mod)",
}
#: torch's attention calls and block masks, and the combinators (looked for on the package too)
PACKAGE = {
    "flex_attention": "flexattn.flex_attn_func(q, k, v, mask_plan=plan) on [B, S, H, D] tensors; "
    "cuDNN's module cudnn.flex_attention is flexattn itself: from flexattn import create_mask_plan, "
    "flex_attn_func, ...",
    "scaled_dot_product_attention": "flexattn.flex_attn_func(q, k, v, mask_plan=plan), a plan of the mask",
    "create_block_mask": "flexattn.masks.from_mask_mod(mask_mod, B, H, Sq, Sk, device=q.device), then "
    "create_mask_plan",
    "create_mask": "flexattn.masks.from_mask_mod(mask_mod, B, H, Sq, Sk, device=q.device) (endpoints)",
    "BlockMask": "flexattn.MaskPlan, from create_mask_plan (masks.from_block_mask converts a BlockMask)",
    **MASKS,
}


def missing_attribute(module: str, table: dict[str, str]) -> Callable[[str], NoReturn]:
    """A module ``__getattr__`` for ``module``: its ``AttributeError`` names flexattn's way for a
    name in ``table``."""

    def __getattr__(name: str) -> NoReturn:
        fix = f" (torch's name): {table[name]}" if name in table else ""
        raise AttributeError(f"module {module!r} has no attribute {name!r}{fix}")

    return __getattr__
