"""Host side of the SM100 forward kernel: compile cache and launch from a MaskPlan's forward view.

Compile-verified for sm_100a; NEVER run on SM100 hardware (there is none where it was written).

::

    out, lse, max_logit = run_forward(plan.view("forward"), q, k, v, softmax_scale=s)

Same contract as ``flexattn_sm90.fwd_launch.run_forward``: ``q/k/v`` are THD (``[total, H, D]``; a
fixed BSHD tensor is passed as its ``[B*S, H, D]`` view); ``out`` is ``[total_q, Hq, Dv]`` in q's
dtype, ``lse`` ``[Hq, total_q]`` fp32 (natural log; -inf and O = 0 on rows with no visible key),
``max_logit`` ``[Hq]`` fp32 (or None). The grid is one CTA per task of ``fwd_work_desc``; the
hardware CLC queue turns the running CTAs into persistent ones, so there is no counter to zero.

The kernel is launched through :meth:`Sm100FwdKernel.from_pointers` (raw global pointers plus int32
sizes), so it is compiled once per :func:`kernel_key` against placeholder pointers: no GPU and no
memory is needed to compile, and a plan, a sequence length, a head count or a batch size never
triggers a recompile.
"""

import weakref
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float16, Float32, Int32

from maskplan_core.errors import ConsumerNotFoundError, InputValueError
from maskplan_core.plan import PlanView
from maskplan_kernels import compile_cache

from . import view_config
from .config import Sm100FwdConfig
from .fwd_kernel import IMPLEMENTED_VARIANTS, Sm100FwdKernel

GPU_ARCH = "sm_100a"
#: packages whose sources the forward kernel is built from (part of its on-disk cache key)
SOURCE_PACKAGES = ("flexattn_sm100", "maskplan_kernels", "maskplan_core")
_DTYPE_NAMES = view_config.DTYPE_NAMES
#: alignment (bytes) the kernel assumes for Q/K/V/O and the payload tensor (TMA, vector loads)
_ALIGN = 16
#: stands in for softmax_scale = 0 (every visible score then weighs the same)
_TINY_SCALE = 1e-30


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
    """Whether a kernel for ``config`` exists (compiles; none has run on hardware)."""
    return (
        config.variant.name in IMPLEMENTED_VARIANTS
        and not config.pack_gqa
        and config.head_dim_v <= 128
        and config.head_dim_v % 32 == 0
    )


# -- compile --------------------------------------------------------------------------------------
def _ptr(dtype, address: int = 0, align: int = 4) -> cute.Pointer:
    return cute.runtime.make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)


def placeholder_arguments(kernel: Sm100FwdKernel, *, with_max_logit: bool) -> list:
    """Compile-time stand-ins for :meth:`Sm100FwdKernel.from_pointers`' arguments (same types)."""
    dt = kernel.dtype
    return [
        *(_ptr(dt, align=_ALIGN) for _ in range(4)),  # q, k, v, o
        _ptr(Float32),  # lse
        _ptr(Float32) if with_max_logit else None,
        _ptr(Int32), _ptr(Int32), _ptr(Int32), _ptr(Int32, align=_ALIGN),  # mask_block_cnt/offset/idx/masks
        _ptr(Int32), _ptr(Int32), _ptr(Int32),  # full_block_cnt/offset/idx
        _ptr(Int32), _ptr(Int32),  # sequence_desc, fwd_work_desc
        *(Int32(1) for _ in range(10)),  # sizes
        Float32(1.0), cute.runtime.make_fake_stream(),
    ]  # fmt: skip


def compile_forward(config: Sm100FwdConfig, *, with_max_logit: bool = False):
    """The compiled kernel for ``config``: compiled on first use, then served by the project's
    compile cache (:mod:`maskplan_kernels.compile_cache`: in process, and on disk across
    processes). Thread-safe, one compile per key."""
    key = kernel_key(config, with_max_logit=with_max_logit)

    def build():
        kernel = Sm100FwdKernel(config)
        return (kernel.from_pointers, *placeholder_arguments(kernel, with_max_logit=with_max_logit))

    options = f"--gpu-arch {GPU_ARCH}"
    return compile_cache.compile_cached(key, build, options=options, packages=SOURCE_PACKAGES)


def compile_uncached(config: Sm100FwdConfig, *, with_max_logit: bool = False, extra_options: str = ""):
    """Trace and compile one kernel for sm_100a (no GPU needed); ``extra_options`` e.g. ``--keep-ptx``."""
    kernel = Sm100FwdKernel(config)
    args = placeholder_arguments(kernel, with_max_logit=with_max_logit)
    options = f"--gpu-arch {GPU_ARCH} {extra_options}".strip()
    return cute.compile(kernel.from_pointers, *args, options=options)


# -- launch ---------------------------------------------------------------------------------------
_DUMMY: dict[tuple, torch.Tensor] = {}


def config_dtype(dtype: torch.dtype):
    return {torch.bfloat16: BFloat16, torch.float16: Float16}[dtype]


def _aligned(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` contiguous (row-major THD) with a 16-byte aligned base (TMA); copies only when not."""
    if t.dtype not in _DTYPE_NAMES:
        raise InputValueError(f"{name} must be float16 or bfloat16, got {t.dtype}")
    if t.is_contiguous() and t.data_ptr() % _ALIGN == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _int32(t: torch.Tensor, device: torch.device, shape_if_empty: tuple[int, ...]) -> torch.Tensor:
    """A contiguous, 16-byte aligned int32 tensor; empty ones become a small dummy (never read)."""
    if t.numel() == 0:
        key = (device, shape_if_empty)
        if key not in _DUMMY:
            _DUMMY[key] = torch.zeros(shape_if_empty, dtype=torch.int32, device=device)
        return _DUMMY[key]
    t = t.to(device=device, dtype=torch.int32).contiguous()
    return t if t.data_ptr() % _ALIGN == 0 else t.clone()


def _output(t, name, shape, dtype, device) -> torch.Tensor:
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise InputValueError(
            f"{name} must be a contiguous {dtype} tensor {shape} on {device}, got {tuple(t.shape)}"
        )
    if t.data_ptr() % _ALIGN:
        raise InputValueError(f"{name} must be {_ALIGN}-byte aligned")
    return t


@dataclass(frozen=True)
class _PreparedView:
    """What a launch needs from a view, derived once per (view, device): the plan is immutable."""

    tensors: tuple  # int32, contiguous, 16-byte aligned (kept alive for the pointers below)
    pointers: tuple  # cute pointers of the 9 plan tensors, in from_pointers order
    sizes: tuple  # Int32: total_q, total_k, Hq, Hkv, Hmask, rows, partial_nnz, full_nnz, B, tasks
    num_tasks: int


_CONFIGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _prepared_config(view: PlanView) -> Sm100FwdConfig:
    config = _CONFIGS.get(view)
    if config is None:
        config = config_for_view(view)
        if not supports(config):
            raise ConsumerNotFoundError(
                f"flexattn-sm100 has no forward kernel for the plan's variant {config.variant.name!r} "
                f"(head dims ({config.head_dim_qk}, {config.head_dim_v})); implemented: "
                f"{', '.join(IMPLEMENTED_VARIANTS)} with Dv <= 128"
            )
        _CONFIGS[view] = config
    return config


def _prepared(view: PlanView, device: torch.device) -> _PreparedView:
    per_device = _PREPARED.setdefault(view, {})
    prep = per_device.get(device)
    if prep is not None:
        return prep
    t, g = view.tensors, view.geometry
    tensors = (
        _int32(t["mask_block_cnt"], device, (1, 1)),
        _int32(t["mask_block_offset"], device, (1, 1)),
        _int32(t["mask_block_idx"], device, (4,)),
        _int32(t["mask_block_masks"].reshape(-1), device, (4,)),
        _int32(t["full_block_cnt"], device, (1, 1)),
        _int32(t["full_block_offset"], device, (1, 1)),
        _int32(t["full_block_idx"], device, (4,)),
        _int32(t["sequence_desc"], device, (1, 8)),
        _int32(t["fwd_work_desc"], device, (1, 4)),
    )
    pointers = tuple(_ptr(Int32, x.data_ptr(), _ALIGN if i == 3 else 4) for i, x in enumerate(tensors))
    cnt, num_tasks = t["mask_block_cnt"], t["fwd_work_desc"].shape[0]
    sizes = (
        g.total_q, g.total_k, g.num_heads_q, g.num_heads_kv, cnt.shape[0], cnt.shape[1],
        t["mask_block_idx"].numel(), t["full_block_idx"].numel(), t["sequence_desc"].shape[0], num_tasks,
    )  # fmt: skip
    prep = _PreparedView(tensors, pointers, tuple(Int32(n) for n in sizes), num_tasks)
    per_device[device] = prep
    return prep


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
    g = view.geometry
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise InputValueError("run_forward takes THD q/k/v ([total, heads, head_dim])")
    expect = {
        "q": (g.total_q, g.num_heads_q, g.head_dim_qk),
        "k": (g.total_k, g.num_heads_kv, g.head_dim_qk),
        "v": (g.total_k, g.num_heads_kv, g.head_dim_v),
    }
    for name, x in (("q", q), ("k", k), ("v", v)):
        if tuple(x.shape) != expect[name] or x.dtype != g.dtype or x.device.type != "cuda":
            raise InputValueError(
                f"{name} is {tuple(x.shape)} {x.dtype} on {x.device}; the plan expects THD {expect[name]} "
                f"{g.dtype} on CUDA"
            )
    device = q.device
    q, k, v = _aligned(q, "q"), _aligned(k, "k"), _aligned(v, "v")
    # the kernel tracks the running max of raw scores, which needs softmax_scale > 0:
    # s * c = (-q . k) * |c| for c < 0, and c = 0 is the limit of a tiny positive scale
    softmax_scale = float(softmax_scale)
    if softmax_scale < 0:
        q, softmax_scale = -q, -softmax_scale
    softmax_scale = max(softmax_scale, _TINY_SCALE)
    total_q, num_heads_q = q.shape[0], q.shape[1]
    out = _output(out, "out", (total_q, num_heads_q, g.head_dim_v), q.dtype, device)
    lse = _output(lse, "lse", (num_heads_q, total_q), torch.float32, device)
    max_logit = torch.full((num_heads_q,), float("-inf"), device=device) if return_max_logit else None
    if view.fwd_work_desc.shape[0] == 0:
        return out, lse, max_logit
    prep = _prepared(view, device)
    compiled = compile_forward(config, with_max_logit=return_max_logit)
    dt = config_dtype(q.dtype)
    compiled(
        *(_ptr(dt, x.data_ptr(), _ALIGN) for x in (q, k, v, out)),
        _ptr(Float32, lse.data_ptr()),
        _ptr(Float32, max_logit.data_ptr()) if return_max_logit else None,
        *prep.pointers,
        *prep.sizes,
        Float32(softmax_scale),
        cuda.CUstream(torch.cuda.current_stream(device).cuda_stream),
    )
    return out, lse, max_logit


__all__ = [
    "compile_forward",
    "compile_uncached",
    "config_for_view",
    "kernel_key",
    "placeholder_arguments",
    "run_forward",
    "supports",
]
