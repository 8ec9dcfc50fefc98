"""Host side of the SM90 forward kernel: compile cache and launch from a MaskPlan's forward view.

::

    out, lse, max_logit = run_forward(plan.view("forward"), q, k, v, softmax_scale=s)

``q/k/v`` are THD (``[total, H, D]``, the consumer protocol; a fixed BSHD tensor is passed as its
``[B*S, H, D]`` view, or as itself where it has none: ``[B, S, H, D]`` read per sample, see
``maskplan_kernels.consumer_inputs.qkv_operands``). ``out`` is ``[total_q, Hq, Dv]`` in q's dtype,
``lse`` ``[Hq, total_q]`` fp32, ``max_logit`` ``[Hq]`` fp32 (or None). The scheduler counter is
runtime workspace of the stream the call runs on (:func:`scheduler_counter`), never plan state, so
one plan may run on several streams at once.

The kernel is launched through :meth:`Sm90FwdKernel.from_pointers` (raw global pointers plus
int32 sizes, the convention of the project's planner kernels), so it is compiled once per
:func:`kernel_key` against placeholder pointers: no GPU and no memory is needed to compile, and a
plan, a sequence length, a head count or a batch size never triggers a recompile.
"""

import cutlass.cute as cute
import torch

from maskplan_core.plan import PlanView
from maskplan_kernels import compile_cache
from maskplan_kernels._cute_args import cuda_index, torch_stream
from maskplan_kernels._launch import persistent_ctas
from maskplan_kernels.consumer_launch import (
    cached_per_view,
    capturing,
    forward_io,
    fwd_placeholders,
    fwd_view_args,
)

from . import view_config
from .config import Sm90FwdConfig
from .fwd_kernel import Sm90FwdKernel
from .fwd_mainloop import DEFAULT_SCHEDULE

GPU_ARCH = "sm_90a"
#: packages whose sources the forward kernel is built from (part of its on-disk cache key)
SOURCE_PACKAGES = ("flexattn_sm90", "maskplan_kernels", "maskplan_core")


#: (device index, stream handle) -> that stream's forward scheduler counter (scheduler_counter)
_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def scheduler_counter(device: torch.device, stream: int) -> torch.Tensor:
    """The forward scheduler's int32 atomic counter, zero at launch. Outside CUDA graph capture,
    one per stream: the kernels on a stream run one after the other, and each launch's last ticket
    sets the counter back to zero (:meth:`Sm90FwdKernel.next_task`), so no fill kernel runs before
    every forward and the forward follows its predecessor by programmatic dependent launch. Under
    capture, a fresh zeroed one per call, in the graph's memory: a graph may replay on any stream,
    alongside others captured on the same one. Keyed by the stream's handle: torch's streams live
    as long as the process (an external stream destroyed while its forward runs could pass its
    handle, and its counter, to a new one)."""
    if capturing(device):
        return torch.zeros(1, dtype=torch.int32, device=device)
    key = (cuda_index(device), stream)
    counter = _COUNTERS.get(key)
    if counter is None:
        counter = _COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


# -- configuration --------------------------------------------------------------------------------
def config_for_view(view: PlanView) -> Sm90FwdConfig:
    """The forward config a view was planned for; raises unless the view is an SM90 forward view."""
    return view_config.config_for_view(view, "forward")

def kernel_key(
    config: Sm90FwdConfig, *, mask_via_smem: bool, with_max_logit: bool, schedule: str,
    per_sample: bool = False,
) -> tuple:  # fmt: skip
    """Everything the compiled kernel depends on. Varlen-ness, and the GQA ratio unless the tile
    packs heads (PackGQA), are runtime values."""
    static = ("head_dim_qk", "head_dim_v", "dtype", "tile_m", "tile_n", "num_consumer_warpgroups")
    static += ("pack_gqa", "mask_pipeline_stages", "kv_stages", "q_buffers", "q_after_first_kv")
    static += ("io_head_dim_qk", "io_head_dim_v")
    if config.pack_gqa:  # the heads packed into a tile are compile-time (TMA box, payload layout)
        static += ("qhead_per_kvhead",)
    return (
        "sm90-fwd",
        tuple((name, getattr(config, name)) for name in static),
        ("mask_via_smem", mask_via_smem),
        ("max_logit", with_max_logit),
        ("schedule", schedule),
        ("per_sample", per_sample),
    )


# -- compile --------------------------------------------------------------------------------------
def compile_forward(
    config: Sm90FwdConfig,
    *,
    mask_via_smem: bool = True,
    with_max_logit: bool = False,
    schedule: str = DEFAULT_SCHEDULE,
    per_sample: bool = False,
):
    """The compiled kernel for ``config``: compiled on first use, then served by the project's
    compile cache (:mod:`maskplan_kernels.compile_cache`: in process, and on disk across
    processes). Thread-safe, one compile per key. ``per_sample``: q, k, v rows per sample
    (``maskplan_kernels.consumer_inputs.qkv_operands``)."""
    variant = {"mask_via_smem": mask_via_smem, "schedule": schedule, "per_sample": per_sample}
    key = kernel_key(config, with_max_logit=with_max_logit, **variant)

    def build():
        kernel = Sm90FwdKernel(config, **variant)
        return (kernel.from_pointers, *fwd_placeholders(kernel, with_max_logit=with_max_logit))

    options = f"--gpu-arch {GPU_ARCH}"
    return compile_cache.compile_cached(key, build, options=options, packages=SOURCE_PACKAGES)


def compile_uncached(
    config: Sm90FwdConfig,
    *,
    mask_via_smem: bool,
    with_max_logit: bool,
    schedule: str = DEFAULT_SCHEDULE,
    per_sample: bool = False,
    extra_options: str = "",
):
    """Trace and compile one kernel for sm_90a (no GPU needed); ``extra_options`` e.g. ``--keep-ptx``."""
    kernel = Sm90FwdKernel(config, mask_via_smem=mask_via_smem, schedule=schedule, per_sample=per_sample)
    args = fwd_placeholders(kernel, with_max_logit=with_max_logit)
    options = f"--gpu-arch {GPU_ARCH} {extra_options}".strip()
    return cute.compile(kernel.from_pointers, *args, options=options)


# -- launch ---------------------------------------------------------------------------------------
@cached_per_view
def _prepared_config(view: PlanView) -> Sm90FwdConfig:
    return config_for_view(view)


def run_forward(
    view: PlanView,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    return_max_logit: bool = False,
    mask_via_smem: bool | None = None,
    schedule: str | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Attention forward of ``view`` (an SM90 forward plan view) on THD ``q/k/v``.

    Returns ``(out [total_q, Hq, Dv], lse [Hq, total_q] fp32, max_logit [Hq] fp32 or None)``;
    ``out``/``lse`` may be given (contiguous, of those shapes) to be written in place. Every
    element of them is written. ``mask_via_smem`` picks the payload delivery: the two-stage SMEM
    pipeline (True) or direct GMEM->register loads (False); None: direct where at least half of
    the view's blocks are partial. ``schedule`` the consumer main loop
    (:data:`flexattn_sm90.fwd_mainloop.SCHEDULES`; None: :data:`DEFAULT_SCHEDULE`); results are the
    same.
    """
    config = _prepared_config(view)
    io = forward_io(
        view, q, k, v, softmax_scale=softmax_scale, return_max_logit=return_max_logit, out=out, lse=lse,
        row_granule=config.row_granule,
    )  # fmt: skip
    if io.nothing_visible:
        return io.out, io.lse, io.max_logit
    device = q.device
    prep = fwd_view_args(view, device)
    if mask_via_smem is None:
        # direct loads: +4.5% (D=64) / +1.5% (D=128) on random-5, where every block is partial, but
        # -2..-4% on causal, sliding-1024 and documents (3-38% partial); RESULTS.md, session 22
        mask_via_smem = prep.partial_nnz < prep.full_nnz
    compiled = compile_forward(
        config,
        mask_via_smem=mask_via_smem,
        with_max_logit=return_max_logit,
        schedule=schedule or DEFAULT_SCHEDULE,
        per_sample=io.per_sample,
    )
    stream = torch_stream(device)
    counter = scheduler_counter(device, stream).data_ptr()
    num_ctas = persistent_ctas(device, prep.num_tasks)
    compiled(*io.arguments(prep, tile_counter=counter, num_ctas=num_ctas, stream=stream))
    return io.out, io.lse, io.max_logit


__all__ = [
    "compile_forward",
    "compile_uncached",
    "config_for_view",
    "kernel_key",
    "run_forward",
    "scheduler_counter",
]
