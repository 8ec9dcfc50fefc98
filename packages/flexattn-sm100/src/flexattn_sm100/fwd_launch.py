"""Host side of the SM100 forward kernel: compile cache and launch from a MaskPlan's forward view.

Compile-verified for sm_100a; NEVER run on SM100 hardware (there is none where it was written).
The view's variant picks the kernel: ``qstage1-1cta`` (one CTA per 128 x 128 block, direct payload
loads), ``qstage2-1cta`` (one CTA per 256 x 128 block as two q stages, direct payload loads;
Dqk <= 128), ``qstage1-2cta`` (a CTA pair per 256 x 128 block, tcgen05 cta_group::2, SMEM payload
ring) or ``d256`` (qstage1 + 1CTA at (Dqk, Dv) = (256, 256), one K/V stage), all
:class:`Sm100FwdKernel` configured by the variant; a view of head dims without a kernel (qstage2
with Dqk 192) is refused with :class:`UnsupportedConfigError` naming them.

::

    out, lse, max_logit = run_forward(plan.view("forward"), q, k, v, softmax_scale=s)

Same contract as ``flexattn_sm90.fwd_launch.run_forward``: ``q/k/v`` are THD (``[total, H, D]``; a
fixed BSHD tensor is passed as its ``[B*S, H, D]`` view); ``out`` is ``[total_q, Hq, Dv]`` in q's
dtype, ``lse`` ``[Hq, total_q]`` fp32 (natural log; -inf and O = 0 on rows with no visible key),
``max_logit`` ``[Hq]`` fp32 (or None). The grid is one CTA per task of ``fwd_work_desc``; the
hardware CLC queue turns the running CTAs (clusters) into persistent ones, so there is no counter to zero.

The kernel is launched through :meth:`Sm100FwdKernel.from_pointers` (raw global pointers plus int32
sizes), so it is compiled once per :func:`kernel_key` against placeholder pointers: no GPU and no
memory is needed to compile, and a plan, a sequence length, a head count or a batch size never
triggers a recompile.
"""

import cutlass.cute as cute
import torch

from maskplan_core.errors import UnsupportedConfigError
from maskplan_core.plan import PlanView
from maskplan_kernels import compile_cache
from maskplan_kernels._cute_args import torch_stream
from maskplan_kernels.consumer_launch import cached_per_view, forward_io, fwd_placeholders, fwd_view_args

from . import view_config
from .config import Sm100FwdConfig
from .fwd_kernel import IMPLEMENTED_VARIANTS, Sm100FwdKernel, unsupported

GPU_ARCH = "sm_100a"
#: packages whose sources the forward kernel is built from (part of its on-disk cache key)
SOURCE_PACKAGES = ("flexattn_sm100", "maskplan_kernels", "maskplan_core")


# -- configuration --------------------------------------------------------------------------------
def config_for_view(view: PlanView) -> Sm100FwdConfig:
    """The forward config a view was planned for; raises unless the view is an SM100 forward view."""
    return view_config.fwd_config_for_view(view)


def kernel_key(config: Sm100FwdConfig, *, with_max_logit: bool) -> tuple:
    """Everything the compiled kernel depends on. GQA ratio and varlen-ness are runtime values."""
    static = ("head_dim_qk", "head_dim_v", "dtype", "tile_m", "tile_n", "pack_gqa")
    return (
        "sm100-fwd",
        config.variant.kernel_family,
        tuple((name, getattr(config, name)) for name in static),
        ("max_logit", with_max_logit),
    )


def supports(config: Sm100FwdConfig) -> bool:
    """Whether a kernel for ``config`` (its variant, head dims, PackGQA) exists (compiles; none has
    run on hardware)."""
    return unsupported(config) is None


# -- compile --------------------------------------------------------------------------------------
def compile_forward(config: Sm100FwdConfig, *, with_max_logit: bool = False):
    """The compiled kernel for ``config``: compiled on first use, then served by the project's
    compile cache (:mod:`maskplan_kernels.compile_cache`: in process, and on disk across
    processes). Thread-safe, one compile per key."""
    key = kernel_key(config, with_max_logit=with_max_logit)

    def build():
        kernel = Sm100FwdKernel(config)
        return (kernel.from_pointers, *fwd_placeholders(kernel, with_max_logit=with_max_logit))

    options = f"--gpu-arch {GPU_ARCH}"
    return compile_cache.compile_cached(key, build, options=options, packages=SOURCE_PACKAGES)


def compile_uncached(config: Sm100FwdConfig, *, with_max_logit: bool = False, extra_options: str = ""):
    """Trace and compile one kernel for sm_100a (no GPU needed); ``extra_options`` e.g. ``--keep-ptx``."""
    kernel = Sm100FwdKernel(config)
    args = fwd_placeholders(kernel, with_max_logit=with_max_logit)
    options = f"--gpu-arch {GPU_ARCH} {extra_options}".strip()
    return cute.compile(kernel.from_pointers, *args, options=options)


# -- launch ---------------------------------------------------------------------------------------
def require_kernel(config: Sm100FwdConfig) -> Sm100FwdConfig:
    """``config`` if a forward kernel implements it, else :class:`UnsupportedConfigError` naming the
    variant, why (:func:`fwd_kernel.unsupported`) and what exists."""
    reason = unsupported(config)
    if reason is not None:
        v = config.variant
        raise UnsupportedConfigError(
            f"the plan's SM100 forward variant {v.name!r} (tile {v.tile_m}x{v.tile_n}, q_stage={v.q_stage}, "
            f"cta_group_size={v.cta_group_size}, head dims ({config.head_dim_qk}, {config.head_dim_v}), "
            f"pack_gqa={config.pack_gqa}) has no kernel: {reason}; implemented: "
            f"{', '.join(repr(n) for n in IMPLEMENTED_VARIANTS)}, no PackGQA; rebuild the plan for one of "
            "them (heuristics.select_fwd_config(variant=...))"
        )
    return config


@cached_per_view
def _prepared_config(view: PlanView) -> Sm100FwdConfig:
    return require_kernel(config_for_view(view))


def run_forward(
    view: PlanView,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    return_max_logit: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Attention forward of ``view`` (an SM100 forward plan view) on THD ``q/k/v``.

    Returns ``(out [total_q, Hq, Dv], lse [Hq, total_q] fp32, max_logit [Hq] fp32 or None)``;
    ``out``/``lse`` may be given (contiguous, of those shapes) to be written in place. Every element
    of them is written. Needs a compute-capability 10.x GPU; never run on one so far.
    """
    config = _prepared_config(view)
    io = forward_io(
        view, q, k, v, softmax_scale=softmax_scale, return_max_logit=return_max_logit, out=out, lse=lse
    )
    if io.nothing_visible:
        return io.out, io.lse, io.max_logit
    prep = fwd_view_args(view, q.device)
    compiled = compile_forward(config, with_max_logit=return_max_logit)
    compiled(*io.arguments(prep, tile_counter=None, num_ctas=prep.num_tasks, stream=torch_stream(q.device)))
    return io.out, io.lse, io.max_logit


__all__ = [
    "compile_forward",
    "compile_uncached",
    "config_for_view",
    "kernel_key",
    "require_kernel",
    "run_forward",
    "supports",
]
