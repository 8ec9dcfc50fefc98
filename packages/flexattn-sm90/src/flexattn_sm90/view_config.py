"""The kernel config a plan view was planned for: the one check every SM90 launcher runs first.

A view is runnable by an SM90 kernel only if re-selecting the config from the view's geometry
gives exactly the signature the view carries; anything else is a plan for another consumer
(or another direction) and is refused with the differing fields.
"""

from __future__ import annotations

import torch

from maskplan_core.errors import InputValueError, PlanSignatureMismatch
from maskplan_core.plan import PlanView

from .config import Sm90BwdConfig, Sm90FwdConfig
from .heuristics import select_bwd_config, select_fwd_config

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def config_for_view(view: PlanView, direction: str) -> Sm90FwdConfig | Sm90BwdConfig:
    """The ``direction`` ("forward"/"backward") config ``view`` was planned for; raises unless it is
    an SM90 view of that direction."""
    g = view.geometry
    dtype = DTYPE_NAMES.get(g.dtype)
    if dtype is None:
        raise InputValueError(f"the SM90 {direction} kernel takes float16/bfloat16, the plan is {g.dtype}")
    problem = dict(
        head_dim_qk=g.head_dim_qk,
        head_dim_v=g.head_dim_v,
        dtype=dtype,
        qhead_per_kvhead=g.qhead_per_kvhead,
        varlen=g.varlen,
    )
    if direction == "forward":
        config = select_fwd_config(pack_gqa=view.signature.topology.pack_gqa, **problem)
    else:
        config = select_bwd_config(**problem)
    diffs = config.plan_signature().diff(view.signature)
    if view.role != direction or diffs:
        listing = "; ".join(str(d) for d in diffs) or f"role is {view.role!r}"
        rebuild = "create_mask_plan" + ("(..., build_backward=True)" if direction == "backward" else "")
        raise PlanSignatureMismatch(
            f"this view cannot be run by the SM90 {direction} kernel ({listing}); rebuild the plan with "
            f"{rebuild} on an SM90 device",
            diffs,
        )
    return config
