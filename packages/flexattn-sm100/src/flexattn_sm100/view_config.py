"""The kernel config a plan view was planned for: the one check every SM100 launcher runs first.

A view is runnable by an SM100 kernel only if re-selecting the config from the view's geometry and
its kernel family (the variant) gives exactly the signature the view carries; anything else is a
plan for another consumer (or another direction) and is refused with the differing fields.
"""

from __future__ import annotations

import torch

from maskplan_core.errors import InputValueError, PlanSignatureMismatch
from maskplan_core.plan import PlanView

from .config import FWD_VARIANTS, Sm100FwdConfig
from .heuristics import select_fwd_config

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def fwd_config_for_view(view: PlanView) -> Sm100FwdConfig:
    """The forward config ``view`` was planned for; raises unless it is an SM100 forward view."""
    g = view.geometry
    dtype = DTYPE_NAMES.get(g.dtype)
    if dtype is None:
        raise InputValueError(f"the SM100 forward kernel takes float16/bfloat16, the plan is {g.dtype}")
    family = view.signature.kernel_family
    variant = next((name for name, v in FWD_VARIANTS.items() if v.kernel_family == family), None)
    diffs = []
    config = None
    if variant is not None and view.role == "forward":
        config = select_fwd_config(
            head_dim_qk=g.head_dim_qk,
            head_dim_v=g.head_dim_v,
            dtype=dtype,
            pack_gqa=view.signature.topology.pack_gqa,
            qhead_per_kvhead=g.qhead_per_kvhead,
            varlen=g.varlen,
            variant=variant,
        )
        diffs = config.plan_signature().diff(view.signature)
    if config is None or diffs:
        listing = "; ".join(str(d) for d in diffs) or f"role is {view.role!r}, kernel family {family!r}"
        raise PlanSignatureMismatch(
            f"this view cannot be run by the SM100 forward kernel ({listing}); rebuild the plan with "
            "create_mask_plan on an SM100 device",
            diffs,
        )
    return config
