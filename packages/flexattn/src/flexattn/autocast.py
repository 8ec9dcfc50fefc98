"""torch.autocast for attention's inputs, as SDPA takes it: inside an autocast region q, k, v reach
attention in the region's dtype (every floating-point input but float64 is cast, as autocast casts
the ops on its lower-precision list), so ``flex_attn_func`` runs, and ``create_mask_plan`` plans,
in that dtype. A model whose RoPE tables are float32 hands attention float32 q and k beside a
bfloat16 v; SDPA, and so flexattn, run all three in bfloat16."""

from __future__ import annotations

import torch


def _region_dtype(q: object) -> torch.dtype | None:
    """The dtype of the autocast region enclosing q's device type, None outside one."""
    if not isinstance(q, torch.Tensor):
        return None  # validation names the argument
    device = q.device.type
    if not (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)):
        return None
    return torch.get_autocast_dtype(device)


def _cast(t: object, dtype: torch.dtype, device: torch.device) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.device.type == device.type  # another device's tensor is refused as it is, by validation
        and t.is_floating_point()
        and t.dtype not in (torch.float64, dtype)
    )


def autocast_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, values: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as they reach attention under the enclosing autocast region (themselves outside one).
    ``values=False`` (a plan reads only shapes, strides, dtype and device) gives uninitialised
    stand-ins of the region's dtype instead of copies: no kernel reads q, k, v on a plan's stream."""
    dtype = _region_dtype(q)
    if dtype is None:
        return q, k, v

    def reach(t):
        if not _cast(t, dtype, q.device):
            return t
        if values:
            return t.to(dtype)
        stand_in = torch.empty_strided(t.size(), t.stride(), dtype=dtype, device=t.device)
        return stand_in.requires_grad_(t.requires_grad)  # build_backward=None reads it

    return reach(q), reach(k), reach(v)
