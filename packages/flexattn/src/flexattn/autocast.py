"""torch.autocast for attention's inputs, as SDPA takes it: inside an autocast region q, k, v reach
attention in the region's dtype (every floating-point input but float64 is cast, as autocast casts
the ops on its lower-precision list), so ``flex_attn_func`` runs, and ``create_mask_plan`` plans,
in that dtype. A model whose RoPE tables are float32 hands attention float32 q and k beside a
bfloat16 v; SDPA, and so flexattn, run all three in bfloat16."""

from __future__ import annotations

import torch

from maskplan_core.validation import autocast_region_dtype


def _region_dtype(q: object) -> torch.dtype | None:
    """The dtype of the autocast region enclosing q's device type, None outside one."""
    if not isinstance(q, torch.Tensor):
        return None  # validation names the argument
    return autocast_region_dtype(q.device)


def _recast(t: object, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the region casts ``t``: a dense floating-point tensor on q's device type, not float64
    (anything else reaches validation as it is, to be named there)."""
    return (
        isinstance(t, torch.Tensor)
        and t.layout == torch.strided
        and t.device.type == device.type
        and t.is_floating_point()
        and t.dtype not in (torch.float64, dtype)
    )


def autocast_dtypes(q: object, k: object, v: object) -> tuple[torch.dtype | None, ...] | None:
    """The dtypes q, k, v reach attention in under the enclosing autocast region (None for what is
    no tensor); None where it casts none of them (a plan reads only their dtypes: nothing is cast or
    allocated for it)."""
    dtype = _region_dtype(q)
    if dtype is None:
        return None
    recast = [(t, _recast(t, dtype, q.device)) for t in (q, k, v)]
    if not any(cast for _, cast in recast):
        return None
    return tuple(dtype if cast else getattr(t, "dtype", None) for t, cast in recast)


def autocast_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as they reach attention under the enclosing autocast region (themselves outside one)."""
    dtypes = autocast_dtypes(q, k, v)
    if dtypes is None:
        return q, k, v
    return tuple(
        t if dtypes[i] == getattr(t, "dtype", None) else t.to(dtypes[i]) for i, t in enumerate((q, k, v))
    )
