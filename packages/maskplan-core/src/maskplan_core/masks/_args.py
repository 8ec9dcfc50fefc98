"""Argument checks and the output assembly the mask builders share."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..endpoint_samples import record_samples
from ..error_flags import sample_lengths
from ..errors import InputTypeError, InputValueError, SeqlenError
from ..validation import MAX_SEQLEN, require_tensor


def _as_int(name: str, value: object, minimum: int | None = None) -> int:
    """Return ``value`` as a Python int, raising TypeError / ValueError naming ``name``."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise InputTypeError(f"{name} must be an int, got {type(value).__name__}")
    try:
        out = operator.index(value)
    except TypeError:
        raise InputTypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if minimum is not None and out < minimum:
        raise InputValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def _as_length(name: str, value: object) -> int:
    """A sequence length: ``0 .. 2**31 - 1`` (int32 endpoints; 0 makes an empty problem, whose
    attention returns zeros and an LSE of -inf, as cuDNN's)."""
    out = _as_int(name, value, 0)
    if out > MAX_SEQLEN:
        raise InputValueError(f"{name} = {out} exceeds the int32 endpoint range (<= {MAX_SEQLEN})")
    return out


def _as_batch(batch: object, seqlen: int, name: str = "batch") -> int:
    """A fixed-length mask's sample count (``name``: what the caller gave it as), refused (before
    its rows are made) where it or ``batch x seqlen`` rows pass the int32 offsets a plan takes."""
    batch = _as_int(name, batch, 1)
    if max(batch, batch * seqlen) > MAX_SEQLEN:
        raise InputValueError(
            f"{name} x seqlen = {batch} x {seqlen} = {batch * seqlen} rows of {batch} samples; a plan's "
            f"int32 offsets reach {MAX_SEQLEN}"
        )
    return batch


def _as_extent(
    name: str, value: object, minimum: int = 0, *, window: bool = False, per_head: str = ""
) -> int:
    """A window, chunk or prefix size: beyond any sequence length it means "unbounded", so it is
    clipped to ``2**31 - 1`` (the int64 maths on it cannot overflow). A negative ``window`` is
    refused with that said: FlashAttention's ``-1`` for an unbounded window is a common port.
    ``per_head``: how to give a size per head, said where a list or tensor of them is given."""
    try:
        n = _as_int(name, value)
    except InputTypeError as err:
        if per_head and isinstance(value, torch.Tensor | Sequence) and not isinstance(value, str):
            raise InputTypeError(f"{err}; {per_head}") from None
        raise
    if n < minimum:
        no_limit = window and n < 0
        unbounded = f"; for no limit pass one at least the sequence's length ({name}=S)" if no_limit else ""
        raise InputValueError(f"{name} must be >= {minimum}, got {n}{unbounded}")
    return min(n, MAX_SEQLEN)


def _as_device(device: object) -> torch.device:
    if device is None:
        return torch.device("cpu")
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as exc:
            raise InputValueError(f"device is not a valid device string: {device!r} ({exc})") from None
    if not isinstance(device, torch.device):
        raise InputTypeError(f"device must be a str, torch.device or None, got {type(device).__name__}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputValueError(f"device={str(device)!r}, but this torch has no CUDA device (use 'cpu')")
    return device


def _require_values(builder: str, device: torch.device) -> None:
    """Builders that read values (a dense mask's runs, a mask_mod's results) need a device that
    holds them: a meta tensor has shapes only."""
    if device.type == "meta":
        raise InputValueError(
            f"{builder} reads the endpoints from values, which the meta device does not hold: "
            "build them on 'cpu' or 'cuda'"
        )


def _int_list(name: str, value: object) -> list[int]:
    """Validate a 1-D sequence (list/tuple/1-D integer tensor) of ints."""
    if isinstance(value, torch.Tensor):
        require_tensor(name, value)
        if value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex:
            raise InputTypeError(f"{name} must hold integers, got a tensor of dtype {value.dtype}")
        if value.dim() != 1:
            raise InputValueError(f"{name} must be 1-D, got a tensor of shape {tuple(value.shape)}")
        if value.is_meta:
            raise InputValueError(f"{name} must hold values, got a meta tensor (pass device='meta' instead)")
        return [int(v) for v in value.tolist()]
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InputTypeError(f"{name} must be a sequence of ints, got {type(value).__name__}")
    return [_as_int(f"{name}[{i}]", v) for i, v in enumerate(value)]


def _endpoint_operand(label: str, m: object, hint: str = "") -> torch.Tensor:
    """``m`` checked as a mask a builder takes (int32 endpoints ``[Hmask, nfunc, total_q]`` of at
    least one head, an odd ``nfunc``, values rather than a meta tensor); ``label`` names it in the
    refusals (``"masks.union: mask 1"``), ``hint`` follows the refusal of another type."""
    if not isinstance(m, torch.Tensor) or m.dtype != torch.int32 or m.dim() != 3:
        got = f"{m.dtype} of shape {tuple(m.shape)}" if isinstance(m, torch.Tensor) else type(m).__name__
        raise InputTypeError(f"{label} must be int32 endpoints [Hmask, nfunc, total_q], got {got}{hint}")
    if m.shape[0] == 0:
        raise InputValueError(f"{label} has no heads (Hmask = 0); it must be 1 or Hq")
    if m.shape[1] % 2 == 0:
        raise InputValueError(f"{label} has an even nfunc ({m.shape[1]}); it must be odd")
    if m.is_meta:
        raise InputValueError(f"{label} is a meta tensor, which holds no endpoints")
    return m


def _finish(
    rows: list[torch.Tensor],
    batch: int,
    builder: str,
    q_lens: Sequence[int],
    k_lens: Sequence[int] | None = None,
    **hints: str,
) -> torch.Tensor:
    """Stack per-endpoint rows ``[S]`` into ``[1, nfunc, batch * S]`` contiguous int32, recorded as
    ``builder``'s for samples of ``q_lens`` rows and ``k_lens`` keys, or as a self-attention mask's
    (as many keys as rows) without ``k_lens`` (:mod:`maskplan_core.endpoint_samples`; ``hints``:
    its ``rows_hint`` and ``keys_hint``)."""
    ep = torch.stack(rows).to(torch.int32)
    if batch > 1:
        ep = ep.repeat(1, batch)
    if k_lens is None:
        k_lens = q_lens
        hints.setdefault(
            "keys_hint",
            f"{builder} builds self-attention masks, whose keys are q's rows; for other key lengths "
            "use masks.from_mask_mod or masks.from_dense",
        )
    return record_samples(ep.unsqueeze(0).contiguous(), builder, q_lens, k_lens, **hints)


def _as_cu_seqlens(name: str, value: object, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """``value`` as int64 prefixes on ``device`` and as a list, checked on the host: a tensor's
    values are read back once."""
    if device.type == "meta" or (isinstance(value, torch.Tensor) and value.is_meta):
        raise InputValueError(
            f"{name}: a varlen mask is built from its samples' lengths, which the meta device does "
            "not hold: build it on 'cpu' or 'cuda'"
        )
    if isinstance(value, torch.Tensor):
        require_tensor(name, value)
        if value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex:
            raise InputTypeError(f"{name} must be an integer tensor, got dtype {value.dtype}")
        if value.dim() != 1:
            raise InputValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
        values = [int(v) for v in value.tolist()]
    else:
        values = _int_list(name, value)
    if len(values) < 2:
        raise SeqlenError(f"{name} must have at least 2 entries (B + 1 with B >= 1), got {len(values)}")
    if values[0] != 0:
        raise SeqlenError(f"{name} must start at 0, got {values[0]}")
    if any(b < a for a, b in zip(values[:-1], values[1:], strict=True)):
        raise SeqlenError(f"{name} must be non-decreasing, got {values}")
    if values[-1] > MAX_SEQLEN:
        raise SeqlenError(f"{name}[-1] = {values[-1]} exceeds the int32 endpoint range (<= {MAX_SEQLEN})")
    # made from the values: a copy from another device would be a second read
    return torch.tensor(values, dtype=torch.int64, device=device), values


class VarlenPrefixes(NamedTuple):
    """A varlen builder's prefixes (int64 on its device) and its samples' query rows and keys."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    q_lens: list[int]
    k_lens: list[int]


def _varlen_prefixes(cu_seqlens_q, cu_seqlens_k, device: torch.device) -> VarlenPrefixes:
    """Both prefix arrays, checked (each tensor read back once)."""
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise InputValueError("cu_seqlens_q and cu_seqlens_k must be given together (varlen) or both omitted")
    cu_q, values_q = _as_cu_seqlens("cu_seqlens_q", cu_seqlens_q, device)
    cu_k, values_k = _as_cu_seqlens("cu_seqlens_k", cu_seqlens_k, device)
    if len(values_q) != len(values_k):
        raise InputValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length (B + 1), "
            f"got {len(values_q)} and {len(values_k)}"
        )
    return VarlenPrefixes(cu_q, cu_k, sample_lengths(values_q), sample_lengths(values_k))
