"""Host side of a consumer kernel's call: the caller's tensors, checked against the plan view and
made kernel-ready the same way for every consumer (SM90, SM100; forward and backward).

* :func:`check_inputs` (THD shapes against the plan geometry), :func:`require_int32_offsets`
  (32-bit element offsets), :func:`check_register_split` (a warp-specialised kernel's
  ``setmaxnreg`` split);
* :func:`aligned`, :func:`qkv_operands` (q, k, v may be strided views, or ``[B, S, H, D]`` read per
  sample: :func:`qkv_strides`), :func:`output`, :func:`positive_softmax_scale`.

Addresses a launch passes are 16-byte aligned (:data:`ALIGN`), what the kernels' compile-time
placeholders assume (:mod:`maskplan_kernels.consumer_launch`).
"""

from __future__ import annotations

import torch

from maskplan_core.consumer import has_thd_view, thd, thd_shapes
from maskplan_core.errors import InputValueError, UnsupportedConfigError
from maskplan_core.plan import PlanView
from maskplan_core.validation import representable_scale

#: alignment (bytes) of Q/K/V/O and the payload tensor (TMA, bulk copies, 16-byte vector loads)
ALIGN = 16
#: stands in for softmax_scale = 0 (every visible score then weighs the same)
TINY_SCALE = 1e-30

#: the inputs a fixed-length call may also give as ``[B, S, H, D]`` (:func:`qkv_operands`)
QKV = ("q", "k", "v")


def check_inputs(view: PlanView, **tensors: torch.Tensor | None) -> None:
    """Raise :class:`InputValueError` unless every given tensor (``q, k, v, out, dout, lse, dlse``;
    None is skipped) is a tensor of the THD shape and dtype the view's geometry expects, on ``q``'s
    CUDA device; a fixed-length view's ``q``, ``k``, ``v`` may also be ``[B, S, H, D]``."""
    g = view.geometry
    shapes = thd_shapes(g)
    dtypes = {"lse": torch.float32, "dlse": None}  # dlse: any floating point dtype; the rest g.dtype
    for name, x in tensors.items():
        if x is None:
            continue
        shape, dtype = shapes[name], dtypes.get(name, g.dtype)
        if name in QKV and x.dim() == 4 and not g.varlen:  # [B, S, H, D]
            shape = (g.batch, shape[0] // g.batch, *shape[1:])
        dtype_ok = x.dtype == dtype if dtype is not None else x.dtype.is_floating_point
        if tuple(x.shape) != shape or not dtype_ok or x.device.type != "cuda":
            raise InputValueError(
                f"{name} is {tuple(x.shape)} {x.dtype} on {x.device}; the plan expects {shape} "
                f"{dtype or 'floating point'} on CUDA (THD layout)"
            )
        if x.device != tensors["q"].device:
            raise InputValueError(f"{name} is on {x.device} but q is on {tensors['q'].device}")


INT32_LIMIT = 2**31
REGISTERS_PER_SM = 65536


def max_launch_registers(num_threads: int) -> int:
    """Registers per thread a CTA of ``num_threads`` can launch with at one CTA per SM (ptxas
    allocates in multiples of 8, at most 255): 168 for 384 threads."""
    return min(REGISTERS_PER_SM // num_threads, 255) // 8 * 8


def check_register_split(num_threads: int, split: tuple[tuple[int, int], ...], launch_regs: int) -> None:
    """Raise ValueError unless the ``(registers, warps)`` pairs a warp-specialised kernel sets with
    ``setmaxnreg`` fit the ``launch_regs`` per thread its CTA launched with (counts multiples of 8
    in [24, 256]). ``setmaxnreg.inc`` only draws on registers that ``setmaxnreg.dec`` released
    inside the same CTA, so a split that fits the SM's 65536 but not the launch allocation never
    returns (the first SM90 backward hung this way: 24 + 2 x 240 fits 3 x 168, 32 + 2 x 240 does not).
    """
    total = sum(32 * regs * warps for regs, warps in split)
    if sum(warps for _, warps in split) * 32 != num_threads or total > num_threads * launch_regs:
        raise ValueError(
            f"setmaxnreg split {split} takes {total} registers; it does not fit "
            f"{num_threads / 128:g} x {launch_regs} registers per thread at launch"
        )
    if any(regs % 8 or not 24 <= regs <= 256 for regs, _ in split):
        raise ValueError(f"setmaxnreg counts must be multiples of 8 in [24, 256]: {split}")


def require_int32_offsets(g, *, payload_words: int = 0, dq_accum: tuple[int, int] | None = None) -> None:
    """Raise :class:`UnsupportedConfigError` when a tensor the kernels index is too large for their
    32-bit element offsets: THD ``q/k/v/out`` (``total * heads * head_dim``), the view's packed
    predicate payload (``payload_words``: a partial entry's plane starts at ``entry * plane_words``)
    and, for the backward, the fp32 dQ accumulator (``Hq * rows * head_dim``, ``dq_accum = (rows,
    head_dim)``: the kernel's head dim, which may exceed the view's). Better a clear refusal than a
    wrapped offset reading or writing elsewhere."""
    extents = {
        "q/out": g.total_q * g.num_heads_q * max(g.head_dim_qk, g.head_dim_v),
        "k/v": g.total_k * g.num_heads_kv * max(g.head_dim_qk, g.head_dim_v),
        "the mask payload": payload_words,
    }
    if dq_accum is not None:
        extents["the dQ accumulator"] = g.num_heads_q * dq_accum[0] * dq_accum[1]
    for name, n in extents.items():
        if n >= INT32_LIMIT:
            raise UnsupportedConfigError(
                f"{name} holds {n} elements; the kernels index with 32-bit offsets (at most "
                f"{INT32_LIMIT - 1}): split the batch into smaller calls"
            )


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous (row-major THD, what the kernels' ``from_pointers`` assume) with a 16-byte
    aligned base; copies only when it is not."""
    if t.is_contiguous() and t.data_ptr() % ALIGN == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def qkv_operands(view: PlanView, q, k, v, *, row_granule: int | None) -> tuple:
    """``q``, ``k``, ``v`` (THD, or ``[B, S, H, D]`` for a fixed-length view) as the kernels read
    them. Each is kept where its head dim is contiguous, its base and strides are 16-byte multiples
    and every element it spans lies within 32-bit offsets: as a THD view where its rows merge (a
    slice of a packed QKV tensor, a ``[B, S, H, D]`` view of ``[B, H, S, D]`` at B = 1), else (a
    view of ``[B, H, S, D]`` at B > 1) as it is, if the consumer reads rows per sample
    (``row_granule``: None where it does not) and both sequence lengths are multiples of
    ``row_granule``. Any other is copied to a contiguous THD tensor.

    Returns ``(q, k, v, per_sample)``: ``per_sample`` when one of them was kept as
    ``[B, S, H, D]``; the kernels then take the rows of all three per sample
    (``ThdHostEntry.row_granule``)."""
    g = view.geometry
    per_sample = (
        bool(row_granule) and not g.varlen
        and g.max_seqlen_q % row_granule == 0 and g.max_seqlen_k % row_granule == 0
    )  # fmt: skip
    kept = tuple(_kernel_operand(t, per_sample=per_sample) for t in (q, k, v))
    return (*kept, any(t.dim() == 4 for t in kept))


def qkv_strides(q, k, v, batch: int, per_sample: bool) -> tuple[int, ...]:
    """The nine stride arguments (elements) of the kernels' host entries for :func:`qkv_operands`'
    ``q``, ``k``, ``v``: their row and head strides, then their batch strides, read only
    ``per_sample`` (a THD tensor's: ``S = total / batch`` rows), else 0 (an int32 argument: a THD
    tensor's gapped rows may span past it)."""
    rows_heads = [_row_head_strides(t) for t in (q, k, v)]
    batches = (
        (t.stride(0) if t.dim() == 4 else t.shape[0] // batch * row) if per_sample else 0
        for t, (row, _) in zip((q, k, v), rows_heads, strict=True)
    )
    return (*(x for pair in rows_heads for x in pair), *batches)


def _kernel_operand(t: torch.Tensor, *, per_sample: bool) -> torch.Tensor:
    """One of :func:`qkv_operands`' tensors: its THD view if it has one, else itself if the
    kernels read rows ``per_sample``; kept where TMA can read it, else a contiguous THD copy."""
    if t.dim() == 4 and has_thd_view(t):
        t = thd(t)
    if (t.dim() == 3 or per_sample) and _tma_readable(t):
        return t
    return t.clone(memory_format=torch.contiguous_format).view(-1, *t.shape[-2:])


def _tma_readable(t: torch.Tensor) -> bool:
    """Head dim contiguous, base and the other strides 16-byte multiples, span below 2^31 elements."""
    if t.stride(-1) != 1 or t.data_ptr() % ALIGN or t.numel() == 0:
        return False
    strides = (*_row_head_strides(t), *((t.stride(0),) if t.dim() == 4 else ()))
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return all(st > 0 and st * t.element_size() % ALIGN == 0 for st in strides) and span < INT32_LIMIT


def _row_head_strides(t: torch.Tensor) -> tuple[int, int]:
    """A THD or ``[B, S, H, D]`` ``t``'s row and head strides, a size-1 mode's taken as the
    contiguous one (torch gives those any stride)."""
    rows, heads, d = t.shape[-3:]
    return (t.stride(-3) if rows > 1 else heads * d), (t.stride(-2) if heads > 1 else d)


def output(t: torch.Tensor | None, name: str, shape: tuple[int, ...], dtype, device) -> torch.Tensor:
    """A new output tensor, or ``t`` checked to be one the kernel can write in place."""
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise InputValueError(
            f"{name} must be a contiguous {dtype} tensor {shape} on {device}, got {tuple(t.shape)} {t.dtype}"
        )
    if t.data_ptr() % ALIGN:
        raise InputValueError(f"{name} must be {ALIGN}-byte aligned")
    return t


#: the largest finite fp32: the kernels scale scores in fp32
FP32_MAX = 3.4028234663852886e38


def fp32_softmax_scale(softmax_scale: float) -> float:
    """``softmax_scale`` as a float the kernels' fp32 holds, else :class:`InputValueError`."""
    return representable_scale(softmax_scale, torch.float32, "the GPU kernels compute")


def positive_softmax_scale(q: torch.Tensor, softmax_scale: float) -> tuple[torch.Tensor, float]:
    """``(q, scale)`` with ``scale > 0``: the kernels track the running max of raw scores, which
    needs a positive scale. ``s * c = (-q . k) * |c|`` for ``c < 0``, and ``c = 0`` is the limit of
    a tiny positive scale."""
    softmax_scale = fp32_softmax_scale(softmax_scale)
    if softmax_scale < 0:
        q, softmax_scale = -q, -softmax_scale
    return q, max(softmax_scale, TINY_SCALE)


__all__ = [
    "ALIGN",
    "FP32_MAX",
    "TINY_SCALE",
    "aligned",
    "check_inputs",
    "fp32_softmax_scale",
    "output",
    "positive_softmax_scale",
    "qkv_operands",
    "qkv_strides",
]
