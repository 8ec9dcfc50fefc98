"""Host side of the SM90 backward: compile cache and the three launches from a plan's backward view.

::

    dq, dk, dv = run_backward(plan.view("backward"), q, k, v, out, lse, dout, dlse,
                              softmax_scale=s, deterministic=False)

``q/k/v/out/dout`` are THD (``[total, H, D]``; a fixed BSHD tensor is passed as its ``[B*S, H, D]``
view; ``q/k/v`` may also be ``[B, S, H, D]``, read in place per sample where their samples are not
``S`` rows apart: ``maskplan_kernels.consumer_inputs.qkv_operands``), ``lse`` is the forward's
``[Hq, total_q]`` fp32 LSE, ``dlse`` its gradient or None. Returns THD ``dq [total_q, Hq, Dqk]``,
``dk [total_k, Hkv, Dqk]``, ``dv [total_k, Hkv, Dv]`` in q's dtype.

Launches, all on the current stream::

    preprocess   (Q blocks, Hq, B)    D = rowsum(dO O) - dlse, LSE in log2 (+inf: no key), dQ
                                      accumulator (atomic mode, dense K2Q rows) and turnstiles
                                      zeroed                                  (shared with SM100:
                                                          maskplan_kernels.consumer_bwd_preprocess)
    main         (K plan rows, Hkv)   dK, dV stored; dQ bulk-stored / added   bwd_kernel.py
                                      in fp32 (first_dq_stored)
    postprocess  (Q blocks, Hq, B)    dQ = scale * accumulator, input dtype   bwd_postprocess.py

Like the forward, every kernel takes raw pointers and int32 sizes, so it is compiled once per
:func:`kernel_keys` entry against placeholder pointers (no GPU needed to compile; the project's
compile cache keeps it in process and on disk) and no plan, length or head count triggers a
recompile. Plan-derived tensors (the plan's int32 tensors on the
device, the sample of each K row, the first padded Q block of each sample) are built once per
(view, device), the workspace (fp32 LSE2 / D / dQ accumulator, int32 turnstiles) per call, both
by :mod:`maskplan_kernels.consumer_launch` (shared with the SM100 backward): ``run_backward``
is :meth:`maskplan_kernels.consumer_launch.BackwardCompiler.run_backward` of :data:`COMPILER`.
"""

from maskplan_core.plan import PlanView
from maskplan_kernels.consumer_launch import BackwardCompiler, cached_per_view, kernel_dims

from . import view_config
from .bwd_kernel import Sm90BwdKernel
from .bwd_postprocess import Sm90BwdPostprocess
from .config import Sm90BwdConfig

GPU_ARCH = "sm_90a"
#: packages whose sources the backward kernels are built from (part of their on-disk cache key)
SOURCE_PACKAGES = ("flexattn_sm90", "maskplan_kernels", "maskplan_core")


# -- configuration --------------------------------------------------------------------------------
def config_for_view(view: PlanView) -> Sm90BwdConfig:
    """The backward config a view was planned for; raises unless it is an SM90 backward view (every
    head-dim pair the SM90 consumer plans for has a backward kernel: heuristics.SUPPORTED_HEAD_DIMS)."""
    return view_config.config_for_view(view, "backward")


# -- compile --------------------------------------------------------------------------------------
def _main_key(config: Sm90BwdConfig) -> tuple:
    tile = (
        ("tile_m", config.tile_m),
        ("tile_n", config.tile_n),
        ("warpgroups", config.num_consumer_warpgroups),
        ("transposed_scores", config.transposed_scores),
    )
    stages = (
        ("q_stages", config.q_stages),
        ("do_stages", config.do_stages),
        ("mask_pipeline_stages", config.mask_pipeline_stages),
    )
    return (kernel_dims(config), tile, stages)


def _postprocess(config: Sm90BwdConfig, zero_unvisited: bool) -> Sm90BwdPostprocess:
    return Sm90BwdPostprocess(
        config.head_dim_qk, config.dtype, tile_m=config.tile_m, num_warpgroups=config.num_consumer_warpgroups,
        zero_unvisited=zero_unvisited, io_head_dim=config.io_head_dims[0],
    )  # fmt: skip


@cached_per_view
def _prepared_config(view: PlanView) -> Sm90BwdConfig:
    return config_for_view(view)


#: the three kernels' compile keys and compiles (maskplan_kernels.consumer_launch.BackwardCompiler)
COMPILER = BackwardCompiler(
    gpu_arch=GPU_ARCH,
    source_packages=SOURCE_PACKAGES,
    key_prefixes=("sm90-bwd-pre", "sm90-bwd", "sm90-bwd-post"),
    main_kernel=Sm90BwdKernel,
    config_for_view=_prepared_config,
    postprocess=_postprocess,
    main_key=_main_key,
    post_key=lambda config: (config.num_consumer_warpgroups,),
    stores_first_dq=True,  # Sm90BwdKernel.write_dq_block
    mirrors_sparse_rows=Sm90BwdKernel.mirrors_sparse_rows,  # bwd_launch_order.py
    io_head_dims=lambda config: config.io_head_dims,
    row_granule=lambda config: config.row_granule,
    splits_kv_heads=lambda config: True,  # Sm90BwdKernel's Items
)
#: kernel_keys(config, *, deterministic, with_dlse, per_sample=False, sparse_rows=False)
#:     -> {"pre"|"main"|"post": key}
kernel_keys = COMPILER.kernel_keys
#: compile_uncached(kind, config, *, deterministic=False, with_dlse=False, per_sample=False,
#:                  sparse_rows=False, extra_options="")
compile_uncached = COMPILER.compile_uncached
#: compile_backward(config, *, deterministic, with_dlse, per_sample=False, sparse_rows=False)
#:     -> {"pre"|"main"|"post": compiled}
compile_backward = COMPILER.compile_backward
#: run_backward(view, q, k, v, out, lse, dout, dlse, *, softmax_scale, deterministic=False,
#:              dq=None, dk=None, dv=None) -> (dq, dk, dv)
run_backward = COMPILER.run_backward

__all__ = [
    "COMPILER",
    "compile_backward",
    "compile_uncached",
    "config_for_view",
    "kernel_keys",
    "run_backward",
]
