"""Host side of the SM90 backward: compile cache and the three launches from a plan's backward view.

::

    dq, dk, dv = run_backward(plan.view("backward"), q, k, v, out, lse, dout, dlse,
                              softmax_scale=s, deterministic=False)

``q/k/v/out/dout`` are THD (``[total, H, D]``; a fixed BSHD tensor is passed as its ``[B*S, H, D]``
view), ``lse`` is the forward's ``[Hq, total_q]`` fp32 LSE, ``dlse`` its gradient or None. Returns
THD ``dq [total_q, Hq, Dqk]``, ``dk [total_k, Hkv, Dqk]``, ``dv [total_k, Hkv, Dv]`` in q's dtype.

Launches, all on the current stream::

    preprocess   (Q blocks, Hq, B)    D = rowsum(dO O) - dlse, LSE in log2 (+inf: no key), dQ
                                      accumulator and turnstiles zeroed       bwd_preprocess.py
    main         (K plan rows, Hkv)   dK, dV stored; dQ bulk-added in fp32    bwd_kernel.py
    postprocess  (Q blocks, Hq, B)    dQ = scale * accumulator, input dtype   bwd_postprocess.py

Like the forward, every kernel takes raw pointers and int32 sizes, so it is compiled once per
:func:`kernel_keys` entry against placeholder pointers (no GPU needed to compile; the project's
compile cache keeps it in process and on disk) and no plan, length or head count triggers a
recompile. Plan-derived tensors (the plan's int32 tensors on the
device, the sample of each K row, the first padded Q block of each sample) are built once per
(view, device). The workspace (fp32 LSE2 / D / dQ accumulator, int32 turnstiles) is per call.
"""

from dataclasses import dataclass

import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float16, Float32, Int32

from maskplan_core.errors import UnsupportedConfigError
from maskplan_core.plan import PlanView
from maskplan_kernels import compile_cache
from maskplan_kernels._cute_args import torch_stream
from maskplan_kernels.consumer_launch import (
    ALIGN,
    aligned,
    cached_per_view,
    check_inputs,
    cute_dtype,
    gmem_ptr,
    int32_tensor,
    output,
    plan_pointers,
)

from . import view_config
from .bwd_kernel import Sm90BwdKernel
from .bwd_postprocess import Sm90BwdPostprocess
from .bwd_preprocess import Sm90BwdPreprocess
from .config import Sm90BwdConfig

GPU_ARCH = "sm_90a"
#: (head_dim_qk, head_dim_v) the backward kernel implements: the 64 x 128 backward tile. (192, 128)
#: and (256, 256) select the 64 x 64 tile (heuristics.bwd_tile), which has no kernel yet.
BWD_HEAD_DIMS: tuple[tuple[int, int], ...] = ((64, 64), (96, 96), (128, 128))
#: packages whose sources the backward kernels are built from (part of their on-disk cache key)
SOURCE_PACKAGES = ("flexattn_sm90", "maskplan_kernels", "maskplan_core")
_MAX_GRID_Y = 65535


# -- configuration --------------------------------------------------------------------------------
def config_for_view(view: PlanView) -> Sm90BwdConfig:
    """The backward config a view was planned for; raises unless it is an SM90 backward view of
    head dims the backward kernel has."""
    g = view.geometry
    if (g.head_dim_qk, g.head_dim_v) not in BWD_HEAD_DIMS:
        raise UnsupportedConfigError(
            f"(head_dim_qk, head_dim_v)=({g.head_dim_qk}, {g.head_dim_v}) has no SM90 backward kernel yet; "
            f"supported (head_dim_qk, head_dim_v) pairs: {', '.join(map(str, BWD_HEAD_DIMS))}"
        )
    return view_config.config_for_view(view, "backward")

def kernel_keys(config: Sm90BwdConfig, *, deterministic: bool, with_dlse: bool) -> dict[str, tuple]:
    """Compile keys of the three kernels. GQA ratio, varlen-ness and all sizes are runtime values."""
    dims = (("head_dim_qk", config.head_dim_qk), ("head_dim_v", config.head_dim_v), ("dtype", config.dtype))
    tile = (
        ("tile_m", config.tile_m),
        ("tile_n", config.tile_n),
        ("warpgroups", config.num_consumer_warpgroups),
    )
    stages = (("q_stages", config.q_stages), ("mask_pipeline_stages", config.mask_pipeline_stages))
    return {
        "pre": ("sm90-bwd-pre", dims, config.tile_m, ("dlse", with_dlse)),
        "main": ("sm90-bwd", dims, tile, stages, ("deterministic", deterministic)),
        "post": ("sm90-bwd-post", dims, config.tile_m, config.num_consumer_warpgroups),
    }


# -- compile --------------------------------------------------------------------------------------
def _placeholders(kind: str, dtype, *, with_dlse: bool = False) -> list:
    """Compile-time stand-ins for the ``from_pointers`` arguments of kernel ``kind`` (same types)."""
    f32, i32, stream = gmem_ptr(Float32, align=ALIGN), gmem_ptr(Int32), cute.runtime.make_fake_stream()
    if kind == "pre":
        return [
            gmem_ptr(dtype, align=ALIGN), gmem_ptr(dtype, align=ALIGN),  # out, dout
            gmem_ptr(Float32), gmem_ptr(Float32) if with_dlse else None,  # lse, dlse
            f32, f32, f32, i32, i32, i32, *(Int32(1) for _ in range(5)), stream,
        ]  # fmt: skip
    if kind == "main":
        return [
            *(gmem_ptr(dtype, align=ALIGN) for _ in range(6)),  # q, k, v, dout, dk, dv
            f32, f32, f32, i32,  # lse_log2, dsum, dq_accum, dq_semaphore
            i32, i32, i32, gmem_ptr(Int32, align=ALIGN),  # mask_block_cnt/offset/idx/masks
            i32, i32, i32, i32, i32,  # full_block_cnt/offset/idx, dq_write_order(_full)
            i32, i32, i32,  # sequence_desc, k_row_batch, q_block_begin
            *(Int32(1) for _ in range(10)), Float32(1.0), stream,
        ]  # fmt: skip
    return [f32, gmem_ptr(dtype, align=ALIGN), i32, i32, *(Int32(1) for _ in range(5)), Float32(1.0), stream]


def _build(kind: str, config: Sm90BwdConfig, *, deterministic: bool, with_dlse: bool):
    if kind == "pre":
        return Sm90BwdPreprocess(
            config.head_dim_qk, config.head_dim_v, config.dtype, tile_m=config.tile_m, with_dlse=with_dlse
        )
    if kind == "main":
        return Sm90BwdKernel(config, deterministic=deterministic)
    return Sm90BwdPostprocess(
        config.head_dim_qk, config.dtype, tile_m=config.tile_m, num_warpgroups=config.num_consumer_warpgroups
    )


def _jit_and_placeholders(kind: str, config: Sm90BwdConfig, *, deterministic: bool, with_dlse: bool) -> tuple:
    kernel = _build(kind, config, deterministic=deterministic, with_dlse=with_dlse)
    dtype = {"bfloat16": BFloat16, "float16": Float16}[config.dtype]
    return (kernel.from_pointers, *_placeholders(kind, dtype, with_dlse=with_dlse))


def compile_uncached(
    kind: str,
    config: Sm90BwdConfig,
    *,
    deterministic: bool = False,
    with_dlse: bool = False,
    extra_options: str = "",
):
    """Trace and compile kernel ``kind`` ("pre", "main", "post") for sm_90a (no GPU needed)."""
    options = f"--gpu-arch {GPU_ARCH} {extra_options}".strip()
    return cute.compile(
        *_jit_and_placeholders(kind, config, deterministic=deterministic, with_dlse=with_dlse),
        options=options,
    )


def compile_backward(config: Sm90BwdConfig, *, deterministic: bool, with_dlse: bool) -> dict[str, object]:
    """The three compiled kernels for ``config``: compiled on first use, then served by the
    project's compile cache (:mod:`maskplan_kernels.compile_cache`, in process and on disk).
    Thread-safe, one compile per key."""
    compiled = {}
    for kind, key in kernel_keys(config, deterministic=deterministic, with_dlse=with_dlse).items():

        def build(kind=kind):
            return _jit_and_placeholders(kind, config, deterministic=deterministic, with_dlse=with_dlse)

        compiled[kind] = compile_cache.compile_cached(
            key, build, options=f"--gpu-arch {GPU_ARCH}", packages=SOURCE_PACKAGES
        )
    return compiled


# -- plan-derived tensors -------------------------------------------------------------------------
@dataclass(frozen=True)
class _PreparedView:
    """What the launches need from a view, derived once per (view, device): the plan is immutable."""

    tensors: tuple  # int32 device tensors, kept alive for the pointers below
    pointers: tuple  # cute pointers of the 12 plan tensors, in Sm90BwdKernel.from_pointers order
    mask_heads: int
    k_rows: int
    partial_nnz: int
    full_nnz: int
    batch: int
    n_qblk: int  # padded Q blocks of all samples (workspace rows / tile_m)
    max_q_blocks: int  # Q blocks of the longest sample (grid of pre/postprocess)


@cached_per_view
def _prepared_config(view: PlanView) -> Sm90BwdConfig:
    return config_for_view(view)


@cached_per_view
def _prepared(view: PlanView, device: torch.device) -> _PreparedView:
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
        int32_tensor(cnt, device, (1, 1)),
        int32_tensor(t["mask_block_offset"], device, (1, 1)),
        int32_tensor(t["mask_block_idx"], device, (4,)),
        int32_tensor(t["mask_block_masks"].reshape(-1), device, (4,)),
        int32_tensor(t["full_block_cnt"], device, (1, 1)),
        int32_tensor(t["full_block_offset"], device, (1, 1)),
        int32_tensor(t["full_block_idx"], device, (4,)),
        int32_tensor(t["dq_write_order"], device, (4,)),
        int32_tensor(t["dq_write_order_full"], device, (4,)),
        int32_tensor(t["sequence_desc"], device, (1, 8)),
        int32_tensor(k_row_batch, device, (4,)),
        int32_tensor(q_block_begin, device, (4,)),
    )
    return _PreparedView(
        tensors=tensors,
        pointers=plan_pointers(tensors),
        mask_heads=cnt.shape[0],
        k_rows=cnt.shape[1],
        partial_nnz=t["mask_block_idx"].numel(),
        full_nnz=t["full_block_idx"].numel(),
        batch=batch,
        n_qblk=n_qblk,
        max_q_blocks=max_q_blocks,
    )


# -- launch ---------------------------------------------------------------------------------------
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
    """Attention backward of ``view`` (an SM90 backward plan view); see the module docstring.

    ``deterministic=True`` applies each Q block's dQ contributions in the plan's
    ``dq_write_order`` (bit-identical results run to run); dK/dV are always deterministic
    (one CTA owns each K block and kv head). ``dq/dk/dv`` may be given (contiguous, of the
    output shapes and q's dtype) to be written in place; every element of them is written.
    """
    config = _prepared_config(view)
    check_inputs(view, q=q, k=k, v=v, out=out, lse=lse, dout=dout, dlse=dlse)
    g = view.geometry
    device = q.device
    dq = output(dq, "dq", (g.total_q, g.num_heads_q, g.head_dim_qk), q.dtype, device)
    dk = output(dk, "dk", (g.total_k, g.num_heads_kv, g.head_dim_qk), q.dtype, device)
    dv = output(dv, "dv", (g.total_k, g.num_heads_kv, g.head_dim_v), q.dtype, device)
    prep = _prepared(view, device)
    if g.total_q == 0 or g.total_k == 0 or prep.partial_nnz + prep.full_nnz == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()  # no visible key anywhere: every gradient is 0
    q, k, v, out, dout = (aligned(x) for x in (q, k, v, out, dout))
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
    dt = cute_dtype(q.dtype)

    def ptr(x, dtype=dt, align=ALIGN):
        return gmem_ptr(dtype, x.data_ptr(), align)

    stream = torch_stream(device)
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
    "BWD_HEAD_DIMS",
    "compile_backward",
    "compile_uncached",
    "config_for_view",
    "kernel_keys",
    "run_backward",
]
