"""The kernel config a plan view was planned for: the one check every SM90 launcher runs first.

A view is runnable by an SM90 kernel only if re-selecting the config from the view's geometry
gives exactly the signature the view carries (:func:`maskplan_core.consumer.require_view_signature`);
anything else is a plan for another consumer (or another direction) and is refused with the
differing fields.
"""

from __future__ import annotations

from maskplan_core.consumer import require_view_signature, view_problem
from maskplan_core.plan import PlanView

from .config import Sm90BwdConfig, Sm90FwdConfig
from .heuristics import select_bwd_config, select_fwd_config


def config_for_view(view: PlanView, direction: str) -> Sm90FwdConfig | Sm90BwdConfig:
    """The ``direction`` ("forward"/"backward") config ``view`` was planned for; raises unless it is
    an SM90 view of that direction."""
    problem = view_problem(view, f"SM90 {direction}")
    if direction == "forward":
        config = select_fwd_config(pack_gqa=view.signature.topology.pack_gqa, **problem)
    else:
        config = select_bwd_config(**problem)
    return require_view_signature(view, direction, config, arch="SM90")
