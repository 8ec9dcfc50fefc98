"""Host side of the SM100 backward: compile cache and the three launches from a plan's backward view.

Compile-verified for sm_100a; NEVER run on SM100 hardware (there is none where it was written).

::

    dq, dk, dv = run_backward(plan.view("backward"), q, k, v, out, lse, dout, dlse,
                              softmax_scale=s, deterministic=False)

Same contract as ``flexattn_sm90.bwd_launch.run_backward``: THD ``q/k/v/out/dout``, the forward's
``[Hq, total_q]`` fp32 LSE, its gradient ``dlse`` or None; returns THD ``dq, dk, dv`` in q's dtype.

Launches, all on the current stream::

    preprocess   (Q blocks, Hq, B)    D = rowsum(dO O) - dlse, LSE2 (+inf: no key), zeroed dQ
                                      accumulator and turnstiles (architecture-neutral, shared)
    main         (K plan rows x CTAs per row, Hkv)  dK, dV stored; dQ bulk-added in fp32  bwd_kernel.py
    postprocess  (Q blocks, Hq, B)    dQ = scale * accumulator                bwd_postprocess.py

The ``k2q-1cta`` variant has a kernel for head dims 32, 64, 96, 128 and 192/128, the ``d256`` variant
(two CTAs per K block, each owning half of the gradients' head-dim columns) for (256, 256); each is
the heuristics' default for its pairs. The ``k2q-2cta`` variant (same head dims; never a default)
runs explicitly built views: the main kernel launches as clusters of 2 CTAs along grid x (grid
``(2 x K plan rows, Hkv)``, deterministic ``(2 x Hkv, K plan rows)``), one pair per 256-row K block.
Views of head dims a variant has no kernel for are refused with :class:`UnsupportedConfigError`.

The preprocess is the architecture-neutral SIMT kernel both consumers share
(:class:`maskplan_kernels.consumer_bwd_preprocess.BwdPreprocess`, at the view's tile_m (128, d256: 64);
same workspace contract: LSE2 / D ``(Hq, n_qblk * tile_m)``, dQ accumulator
``(Hq, n_qblk * tile_m * Dqk)`` zeroed as one contiguous run per block, turnstiles ``(Hq, n_qblk)``).
The host side (input checks, per-view plan tensors, workspace and the three launches) is
:mod:`maskplan_kernels.consumer_launch`, shared with the SM90 backward.
"""


from maskplan_core.errors import UnsupportedConfigError
from maskplan_core.plan import PlanView
from maskplan_kernels.consumer_launch import BackwardCompiler, cached_per_view, kernel_dims

from . import view_config
from .bwd_kernel import HEAD_DIMS, IMPLEMENTED_VARIANTS, Sm100BwdKernel
from .bwd_postprocess import Sm100BwdPostprocess
from .config import Sm100BwdConfig

GPU_ARCH = "sm_100a"
#: packages whose sources the backward kernels are built from (part of their on-disk cache key)
SOURCE_PACKAGES = ("flexattn_sm100", "maskplan_kernels", "maskplan_core")


# -- configuration --------------------------------------------------------------------------------
def config_for_view(view: PlanView) -> Sm100BwdConfig:
    """The backward config ``view`` was planned for; raises unless it is an SM100 backward view of a
    variant and head dims the backward kernel implements."""
    config = view_config.bwd_config_for_view(view)
    g, variant = view.geometry, config.variant
    implemented = "; ".join(
        f"{v!r} (head dims {', '.join(map(str, HEAD_DIMS[v]))})" for v in IMPLEMENTED_VARIANTS
    )
    if variant.name not in IMPLEMENTED_VARIANTS:
        raise UnsupportedConfigError(
            f"the plan's SM100 backward variant {variant.name!r} (tile {variant.tile_m}x{variant.tile_n}, "
            f"cta_group_size={variant.cta_group_size}) has no kernel; implemented: {implemented}"
        )
    if (g.head_dim_qk, g.head_dim_v) not in HEAD_DIMS[variant.name]:
        raise UnsupportedConfigError(
            f"(head_dim_qk, head_dim_v)=({g.head_dim_qk}, {g.head_dim_v}) has no SM100 {variant.name} "
            f"backward kernel; implemented: {implemented}"
        )
    return config


# -- compile --------------------------------------------------------------------------------------
@cached_per_view
def _prepared_config(view: PlanView) -> Sm100BwdConfig:
    return config_for_view(view)


#: the three kernels' compile keys and compiles (maskplan_kernels.consumer_launch.BackwardCompiler)
COMPILER = BackwardCompiler(
    gpu_arch=GPU_ARCH,
    source_packages=SOURCE_PACKAGES,
    key_prefixes=("bwd-pre", "sm100-bwd", "sm100-bwd-post"),
    main_kernel=Sm100BwdKernel,
    config_for_view=_prepared_config,
    # zero_unvisited is always False: this consumer does not store its first dQ (stores_first_dq)
    postprocess=lambda config, zero_unvisited: Sm100BwdPostprocess(
        config.head_dim_qk, config.dtype, tile_m=config.tile_m
    ),
    main_key=lambda config: (config.variant.name, kernel_dims(config)),
    # SM90's split rule, unmeasured here; not the pair variant (Sm100BwdKernel's docstring)
    splits_kv_heads=lambda config: config.variant.cta_group_size == 1,
)
#: kernel_keys(config, *, deterministic, with_dlse) -> {"pre"|"main"|"post": key}
kernel_keys = COMPILER.kernel_keys
#: compile_uncached(kind, config, *, deterministic=False, with_dlse=False, extra_options="")
compile_uncached = COMPILER.compile_uncached
#: compile_backward(config, *, deterministic, with_dlse) -> {"pre"|"main"|"post": compiled}
compile_backward = COMPILER.compile_backward
#: run_backward(view, q, k, v, out, lse, dout, dlse, *, softmax_scale, deterministic=False,
#:              dq=None, dk=None, dv=None) -> (dq, dk, dv)
run_backward = COMPILER.run_backward

__all__ = [
    "COMPILER",
    "GPU_ARCH",
    "compile_backward",
    "compile_uncached",
    "config_for_view",
    "kernel_keys",
    "run_backward",
]
