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
    main         (K plan rows, Hkv)   dK, dV stored; dQ bulk-added in fp32    bwd_kernel.py
    postprocess  (Q blocks, Hq, B)    dQ = scale * accumulator                bwd_postprocess.py

Only the ``k2q-1cta`` variant has a kernel (head dims 64, 96, 128). The heuristics' default backward
for (128, 128) and (192, 128) is ``k2q-2cta`` (K-axis CTA pair) and for (256, 256) ``d256``: plans
with those views are refused with :class:`UnsupportedConfigError` naming the variant. A plan built
with the ``k2q-1cta`` backward config (``Sm100BwdConfig(variant=BWD_VARIANTS["k2q-1cta"], ...)``)
runs here for D64/D96/D128.

The preprocess is the SM90 consumer's architecture-neutral SIMT kernel (same workspace contract:
LSE2 / D ``(Hq, n_qblk * tile_m)``, dQ accumulator ``(Hq, n_qblk * tile_m * Dqk)`` zeroed as one
contiguous run per block, turnstiles ``(Hq, n_qblk)``). A consumer may not import another
consumer, so it must live in ``maskplan_kernels`` (:data:`SHARED_PREPROCESS`); until it has moved
there :func:`run_backward` raises :class:`ConsumerNotFoundError` saying so.
"""

import importlib
import weakref
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float16, Float32, Int32

from maskplan_core.errors import (
    ConsumerNotFoundError,
    InputValueError,
    PlanSignatureMismatch,
    UnsupportedConfigError,
)
from maskplan_core.plan import PlanView
from maskplan_kernels import compile_cache

from .bwd_kernel import HEAD_DIMS, IMPLEMENTED_VARIANTS, Sm100BwdKernel
from .bwd_postprocess import Sm100BwdPostprocess
from .config import BWD_VARIANTS, Sm100BwdConfig

GPU_ARCH = "sm_100a"
#: packages whose sources the backward kernels are built from (part of their on-disk cache key)
SOURCE_PACKAGES = ("flexattn_sm100", "maskplan_kernels", "maskplan_core")
#: (module, class) of the architecture-neutral backward preprocess once it is shared
SHARED_PREPROCESS = ("maskplan_kernels.consumer_bwd_preprocess", "BwdPreprocess")
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_ALIGN = 16  # bytes: TMA, bulk copies and 16-byte vector accesses
_MAX_GRID_Y = 65535


# -- configuration --------------------------------------------------------------------------------
def config_for_view(view: PlanView) -> Sm100BwdConfig:
    """The backward config ``view`` was planned for; raises unless it is an SM100 backward view of a
    variant and head dims the backward kernel implements."""
    g, sig = view.geometry, view.signature
    dtype = DTYPE_NAMES.get(g.dtype)
    if dtype is None:
        raise InputValueError(f"the SM100 backward kernel takes float16/bfloat16, the plan is {g.dtype}")
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
        config = Sm100BwdConfig(
            head_dim_qk=g.head_dim_qk, head_dim_v=g.head_dim_v, dtype=dtype, variant=variant,
            qhead_per_kvhead=g.qhead_per_kvhead, varlen=g.varlen,
        )  # fmt: skip
        diffs = config.plan_signature().diff(sig)
    if config is None or diffs:
        listing = (
            "; ".join(str(d) for d in diffs)
            if config
            else f"role {view.role!r}, family {sig.kernel_family!r}"
        )
        raise PlanSignatureMismatch(
            f"this view cannot be run by the SM100 backward kernel ({listing}); rebuild the plan with "
            "create_mask_plan(..., build_backward=True) on an SM100 device",
            diffs if config else [],
        )
    if variant.name not in IMPLEMENTED_VARIANTS:
        raise UnsupportedConfigError(
            f"the plan's SM100 backward variant {variant.name!r} (tile {variant.tile_m}x{variant.tile_n}, "
            f"cta_group_size={variant.cta_group_size}) has no kernel; implemented: "
            f"{', '.join(repr(v) for v in IMPLEMENTED_VARIANTS)} (head dims {', '.join(map(str, HEAD_DIMS))})"
        )
    if (g.head_dim_qk, g.head_dim_v) not in HEAD_DIMS:
        raise UnsupportedConfigError(
            f"(head_dim_qk, head_dim_v)=({g.head_dim_qk}, {g.head_dim_v}) has no SM100 k2q-1cta backward "
            "kernel; "
            f"supported pairs: {', '.join(map(str, HEAD_DIMS))}"
        )
    return config


def kernel_keys(config: Sm100BwdConfig, *, deterministic: bool, with_dlse: bool) -> dict[str, tuple]:
    """Compile keys of the three kernels. GQA ratio, varlen-ness and all sizes are runtime values."""
    dims = (("head_dim_qk", config.head_dim_qk), ("head_dim_v", config.head_dim_v), ("dtype", config.dtype))
    return {
        "pre": ("bwd-pre", dims, config.tile_m, ("dlse", with_dlse)),
        "main": ("sm100-bwd", config.variant.name, dims, ("deterministic", deterministic)),
        "post": ("sm100-bwd-post", dims, config.tile_m),
    }


# -- compile --------------------------------------------------------------------------------------
def _ptr(dtype, address: int = 0, align: int = 4) -> cute.Pointer:
    return cute.runtime.make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)


def _placeholders(kind: str, dtype, *, with_dlse: bool = False) -> list:
    """Compile-time stand-ins for the ``from_pointers`` arguments of kernel ``kind`` (same types)."""
    f32, i32, stream = _ptr(Float32, align=_ALIGN), _ptr(Int32), cute.runtime.make_fake_stream()
    if kind == "pre":
        return [
            _ptr(dtype, align=_ALIGN), _ptr(dtype, align=_ALIGN),  # out, dout
            _ptr(Float32), _ptr(Float32) if with_dlse else None,  # lse, dlse
            f32, f32, f32, i32, i32, i32, *(Int32(1) for _ in range(5)), stream,
        ]  # fmt: skip
    if kind == "main":
        return [
            *(_ptr(dtype, align=_ALIGN) for _ in range(6)),  # q, k, v, dout, dk, dv
            f32, f32, f32, i32,  # lse_log2, dsum, dq_accum, dq_semaphore
            i32, i32, i32, _ptr(Int32, align=_ALIGN),  # mask_block_cnt/offset/idx/masks
            i32, i32, i32, i32, i32,  # full_block_cnt/offset/idx, dq_write_order(_full)
            i32, i32, i32,  # sequence_desc, k_row_batch, q_block_begin
            *(Int32(1) for _ in range(10)), Float32(1.0), stream,
        ]  # fmt: skip
    return [f32, _ptr(dtype, align=_ALIGN), i32, i32, *(Int32(1) for _ in range(5)), Float32(1.0), stream]


def shared_preprocess():
    """The architecture-neutral backward preprocess class, or None while it has not moved to
    ``maskplan_kernels`` (module docstring)."""
    module, name = SHARED_PREPROCESS
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError:
        return None


def _build(kind: str, config: Sm100BwdConfig, *, deterministic: bool, with_dlse: bool):
    if kind == "pre":
        preprocess = shared_preprocess()
        if preprocess is None:
            raise ConsumerNotFoundError(
                "the SM100 backward needs the architecture-neutral backward preprocess in "
                f"{SHARED_PREPROCESS[0]} "
                "(today flexattn_sm90.bwd_preprocess, which flexattn_sm100 may not import); move it there"
            )
        return preprocess(
            config.head_dim_qk, config.head_dim_v, config.dtype, tile_m=config.tile_m, with_dlse=with_dlse
        )
    if kind == "main":
        return Sm100BwdKernel(config, deterministic=deterministic)
    return Sm100BwdPostprocess(config.head_dim_qk, config.dtype, tile_m=config.tile_m)


def _jit_and_placeholders(
    kind: str, config: Sm100BwdConfig, *, deterministic: bool, with_dlse: bool
) -> tuple:
    kernel = _build(kind, config, deterministic=deterministic, with_dlse=with_dlse)
    dtype = {"bfloat16": BFloat16, "float16": Float16}[config.dtype]
    return (kernel.from_pointers, *_placeholders(kind, dtype, with_dlse=with_dlse))


def compile_uncached(
    kind: str,
    config: Sm100BwdConfig,
    *,
    deterministic: bool = False,
    with_dlse: bool = False,
    extra_options: str = "",
):
    """Trace and compile kernel ``kind`` ("pre", "main", "post") for sm_100a (no GPU needed)."""
    options = f"--gpu-arch {GPU_ARCH} {extra_options}".strip()
    return cute.compile(
        *_jit_and_placeholders(kind, config, deterministic=deterministic, with_dlse=with_dlse),
        options=options,
    )


def compile_backward(config: Sm100BwdConfig, *, deterministic: bool, with_dlse: bool) -> dict[str, object]:
    """The three compiled kernels for ``config``, through the project's compile cache."""
    compiled = {}
    for kind, key in kernel_keys(config, deterministic=deterministic, with_dlse=with_dlse).items():

        def build(kind=kind):
            return _jit_and_placeholders(kind, config, deterministic=deterministic, with_dlse=with_dlse)

        compiled[kind] = compile_cache.compile_cached(
            key, build, options=f"--gpu-arch {GPU_ARCH}", packages=SOURCE_PACKAGES
        )
    return compiled


# -- plan-derived tensors -------------------------------------------------------------------------
_DUMMY: dict[tuple, torch.Tensor] = {}


def _int32(t: torch.Tensor, device: torch.device, shape_if_empty: tuple[int, ...]) -> torch.Tensor:
    """A contiguous, 16-byte aligned int32 tensor; empty ones become a small dummy (never read)."""
    if t.numel() == 0:
        key = (device, shape_if_empty)
        if key not in _DUMMY:
            _DUMMY[key] = torch.zeros(shape_if_empty, dtype=torch.int32, device=device)
        return _DUMMY[key]
    t = t.to(device=device, dtype=torch.int32).contiguous()
    return t if t.data_ptr() % _ALIGN == 0 else t.clone()


@dataclass(frozen=True)
class _PreparedView:
    """What the launches need from a view, derived once per (view, device): the plan is immutable."""

    tensors: tuple  # int32 device tensors, kept alive for the pointers below
    pointers: tuple  # cute pointers of the 12 plan tensors, in Sm100BwdKernel.from_pointers order
    mask_heads: int
    k_rows: int
    partial_nnz: int
    full_nnz: int
    batch: int
    n_qblk: int  # padded Q blocks of all samples (workspace rows / tile_m)
    max_q_blocks: int  # Q blocks of the longest sample (grid of pre/postprocess)


_CONFIGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _prepared_config(view: PlanView) -> Sm100BwdConfig:
    config = _CONFIGS.get(view)
    if config is None:
        config = _CONFIGS[view] = config_for_view(view)
    return config


def _prepared(view: PlanView, device: torch.device) -> _PreparedView:
    per_device = _PREPARED.setdefault(view, {})
    prep = per_device.get(device)
    if prep is not None:
        return prep
    t = view.tensors
    desc = t["sequence_desc"].to(device=device, dtype=torch.int64)
    batch = desc.shape[0]
    # the sample of every K plan row; the first global (padded) Q block of every sample
    k_row_batch = torch.repeat_interleave(torch.arange(batch, device=device), desc[:, 5])
    q_blocks = desc[:, 6]
    q_block_begin = torch.cumsum(q_blocks, 0) - q_blocks
    n_qblk, max_q_blocks = (int(x) for x in torch.stack([q_blocks.sum(), q_blocks.max()]).tolist())
    cnt = t["mask_block_cnt"]
    tensors = (
        _int32(cnt, device, (1, 1)),
        _int32(t["mask_block_offset"], device, (1, 1)),
        _int32(t["mask_block_idx"], device, (4,)),
        _int32(t["mask_block_masks"].reshape(-1), device, (4,)),
        _int32(t["full_block_cnt"], device, (1, 1)),
        _int32(t["full_block_offset"], device, (1, 1)),
        _int32(t["full_block_idx"], device, (4,)),
        _int32(t["dq_write_order"], device, (4,)),
        _int32(t["dq_write_order_full"], device, (4,)),
        _int32(t["sequence_desc"], device, (1, 8)),
        _int32(k_row_batch, device, (4,)),
        _int32(q_block_begin, device, (4,)),
    )
    pointers = tuple(_ptr(Int32, x.data_ptr(), _ALIGN if i == 3 else 4) for i, x in enumerate(tensors))
    prep = _PreparedView(
        tensors=tensors,
        pointers=pointers,
        mask_heads=cnt.shape[0],
        k_rows=cnt.shape[1],
        partial_nnz=t["mask_block_idx"].numel(),
        full_nnz=t["full_block_idx"].numel(),
        batch=batch,
        n_qblk=n_qblk,
        max_q_blocks=max_q_blocks,
    )
    per_device[device] = prep
    return prep


# -- launch ---------------------------------------------------------------------------------------
def _aligned(t: torch.Tensor) -> torch.Tensor:
    if t.is_contiguous() and t.data_ptr() % _ALIGN == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _output(t, name, shape, dtype, device) -> torch.Tensor:
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise InputValueError(
            f"{name} must be a contiguous {dtype} tensor {shape} on {device}, got {tuple(t.shape)} {t.dtype}"
        )
    if t.data_ptr() % _ALIGN:
        raise InputValueError(f"{name} must be {_ALIGN}-byte aligned")
    return t


def _check_inputs(view: PlanView, **given) -> None:
    g = view.geometry
    expect = {
        "q": ((g.total_q, g.num_heads_q, g.head_dim_qk), g.dtype),
        "k": ((g.total_k, g.num_heads_kv, g.head_dim_qk), g.dtype),
        "v": ((g.total_k, g.num_heads_kv, g.head_dim_v), g.dtype),
        "out": ((g.total_q, g.num_heads_q, g.head_dim_v), g.dtype),
        "dout": ((g.total_q, g.num_heads_q, g.head_dim_v), g.dtype),
        "lse": ((g.num_heads_q, g.total_q), torch.float32),
        "dlse": ((g.num_heads_q, g.total_q), None),
    }
    for name, x in given.items():
        if x is None:
            continue
        shape, dtype = expect[name]
        if tuple(x.shape) != shape or (dtype is not None and x.dtype != dtype) or x.device.type != "cuda":
            raise InputValueError(
                f"{name} is {tuple(x.shape)} {x.dtype} on {x.device}; the plan expects {shape} "
                f"{dtype or 'floating point'} on CUDA (THD layout)"
            )


def run_backward(
    view: PlanView,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    *,
    softmax_scale: float,
    deterministic: bool = False,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward of ``view`` (an SM100 ``k2q-1cta`` backward view); see the module
    docstring. Needs a compute-capability 10.x GPU; never run on one so far.

    ``deterministic=True`` applies each Q block's dQ contributions in the plan's ``dq_write_order``
    (bit-identical results run to run); dK/dV are always deterministic (one CTA owns each K block
    and kv head). ``dq/dk/dv`` may be given (contiguous, of the output shapes and q's dtype) to be
    written in place; every element of them is written.
    """
    config = _prepared_config(view)
    _check_inputs(view, q=q, k=k, v=v, out=out, lse=lse, dout=dout, dlse=dlse)
    g = view.geometry
    device = q.device
    dq = _output(dq, "dq", (g.total_q, g.num_heads_q, g.head_dim_qk), q.dtype, device)
    dk = _output(dk, "dk", (g.total_k, g.num_heads_kv, g.head_dim_qk), q.dtype, device)
    dv = _output(dv, "dv", (g.total_k, g.num_heads_kv, g.head_dim_v), q.dtype, device)
    prep = _prepared(view, device)
    if g.total_q == 0 or g.total_k == 0 or prep.partial_nnz + prep.full_nnz == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()  # no visible key anywhere: every gradient is 0
    q, k, v, out, dout = (_aligned(x) for x in (q, k, v, out, dout))
    lse = lse.to(torch.float32).contiguous()
    dlse = None if dlse is None else dlse.to(torch.float32).contiguous()
    if deterministic and prep.k_rows > _MAX_GRID_Y:
        raise UnsupportedConfigError(
            f"deterministic=True puts the {prep.k_rows} K blocks of this plan on grid y (at most "
            f"{_MAX_GRID_Y}); split the batch or use deterministic=False"
        )
    compiled = compile_backward(config, deterministic=deterministic, with_dlse=dlse is not None)

    hq, rows = g.num_heads_q, prep.n_qblk * config.tile_m
    lse_log2 = torch.empty(hq, rows, dtype=torch.float32, device=device)
    dsum = torch.empty(hq, rows, dtype=torch.float32, device=device)
    dq_accum = torch.empty(hq, rows * config.head_dim_qk, dtype=torch.float32, device=device)
    dq_semaphore = torch.empty(hq, prep.n_qblk, dtype=torch.int32, device=device)
    dt = {torch.bfloat16: BFloat16, torch.float16: Float16}[q.dtype]

    def ptr(x, dtype=dt, align=_ALIGN):
        return _ptr(dtype, x.data_ptr(), align)

    stream = cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)
    seq_ptr, qbb_ptr = prep.pointers[9], prep.pointers[11]
    sizes = (Int32(g.total_q), Int32(hq), Int32(prep.batch), Int32(prep.n_qblk), Int32(prep.max_q_blocks))
    compiled["pre"](
        ptr(out), ptr(dout), ptr(lse, Float32, 4), ptr(dlse, Float32, 4) if dlse is not None else None,
        ptr(lse_log2, Float32), ptr(dsum, Float32), ptr(dq_accum, Float32), ptr(dq_semaphore, Int32, 4),
        seq_ptr, qbb_ptr, *sizes, stream,
    )  # fmt: skip
    compiled["main"](
        *(ptr(x) for x in (q, k, v, dout, dk, dv)),
        ptr(lse_log2, Float32), ptr(dsum, Float32), ptr(dq_accum, Float32), ptr(dq_semaphore, Int32, 4),
        *prep.pointers,
        *(Int32(n) for n in (g.total_q, g.total_k, hq, g.num_heads_kv, prep.mask_heads, prep.k_rows)),
        *(Int32(n) for n in (prep.partial_nnz, prep.full_nnz, prep.batch, prep.n_qblk)),
        Float32(softmax_scale), stream,
    )  # fmt: skip
    compiled["post"](
        ptr(dq_accum, Float32), ptr(dq), seq_ptr, qbb_ptr, *sizes, Float32(softmax_scale), stream
    )
    return dq, dk, dv


__all__ = [
    "GPU_ARCH",
    "SHARED_PREPROCESS",
    "compile_backward",
    "compile_uncached",
    "config_for_view",
    "kernel_keys",
    "run_backward",
    "shared_preprocess",
]
