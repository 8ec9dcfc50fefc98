"""The kernel config a plan view was planned for: the one check every SM100 launcher runs first.

A view is runnable by an SM100 kernel only if re-selecting the config from the view's geometry and
its kernel family (the variant) gives exactly the signature the view carries
(:func:`maskplan_core.consumer.require_view_signature`); anything else is a plan for another
consumer (or another direction) and is refused with the differing fields. The kernels read the
tensors at their own head dims, so a view of a pair they only hold (:func:`heuristics.kernel_head_dims`)
is refused too: the consumer runs it as a view at the kernels' head dims, on zero-padded copies.
"""

from __future__ import annotations

from maskplan_core.consumer import require_view_signature, view_problem
from maskplan_core.errors import UnsupportedConfigError
from maskplan_core.plan import PlanView

from .config import BWD_VARIANTS, FWD_VARIANTS, Sm100BwdConfig, Sm100FwdConfig
from .heuristics import kernel_head_dims, select_fwd_config


def fwd_config_for_view(view: PlanView) -> Sm100FwdConfig:
    """The forward config ``view`` was planned for; raises unless it is an SM100 forward view."""
    problem = view_problem(view, "SM100 forward")
    family = view.signature.kernel_family
    variant = next((name for name, v in FWD_VARIANTS.items() if v.kernel_family == family), None)
    config = None
    if variant is not None and view.role == "forward":
        config = select_fwd_config(pack_gqa=view.signature.topology.pack_gqa, variant=variant, **problem)
    config = require_view_signature(view, "forward", config, arch="SM100", note=f"kernel family {family!r}")
    return _at_kernel_head_dims(view, config)


def bwd_config_for_view(view: PlanView) -> Sm100BwdConfig:
    """The backward config ``view`` was planned for (the variant of its kernel family and tile
    topology); raises unless it is an SM100 backward view."""
    problem = view_problem(view, "SM100 backward")
    sig = view.signature
    topo = sig.topology
    variant = next(
        (
            v
            for v in BWD_VARIANTS.values()
            if v.kernel_family == sig.kernel_family
            and (v.tile_m, v.tile_n, v.cta_group_size) == (topo.tile_m, topo.tile_n, topo.cta_group_size)
        ),
        None,
    )
    config = None
    if variant is not None and view.role == "backward":
        dims = kernel_head_dims(problem.pop("head_dim_qk"), problem.pop("head_dim_v"))
        config = Sm100BwdConfig(variant=variant, head_dim_qk=dims[0], head_dim_v=dims[1], **problem)
    config = require_view_signature(
        view, "backward", config, arch="SM100", note=f"kernel family {sig.kernel_family!r}"
    )
    return _at_kernel_head_dims(view, config)


def _at_kernel_head_dims(view: PlanView, config):
    """``config`` where the view's head dims are its kernels' (the tensors' row width they read)."""
    g = view.geometry
    kernel = (config.head_dim_qk, config.head_dim_v)
    if (g.head_dim_qk, g.head_dim_v) != kernel:
        raise UnsupportedConfigError(
            f"the SM100 {config.direction} kernels for (head_dim_qk, head_dim_v)=({g.head_dim_qk}, "
            f"{g.head_dim_v}) are the {kernel} ones, which read q, k, v at their own head dims: run the plan "
            "through flexattn (Sm100Consumer pads the tensors), or launch a view at those head dims "
            "(maskplan_core.head_dim_padding.kernel_view) on zero-padded tensors"
        )
    return config
