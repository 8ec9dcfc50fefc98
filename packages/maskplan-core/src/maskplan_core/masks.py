"""Builders for interval-endpoint attention masks.

A mask is stored per query row as sorted interval endpoints: a contiguous ``int32`` tensor
``endpoints[Hmask, nfunc, total_q]`` with ``nfunc`` a positive odd integer.  For one query row
with endpoints ``F0 <= F1 <= ... <= F(nfunc-1)`` (each in ``[0, k_len]`` of the row's sample) the
visible keys are::

    [0, F0) U [F1, F2) U [F3, F4) U ...

Equal adjacent endpoints are an empty interval.  Endpoints are sample-local key positions.
``total_q`` is ``B * Sq`` for fixed-length batches (rows in batch-major order: ``row = b * Sq + q``)
or the total query token count for varlen batches (samples delimited by ``cu_seqlens_q``).

Every builder returns a contiguous ``int32`` tensor ``[Hmask, nfunc, total_q]``.

Build a mask for the key length its plan will see: ``seqlen_k`` defaults to ``seqlen_q``, and the
endpoints do not record the length they were made for, so ``causal(Sq)`` planned with ``Sk > Sq``
keys is a valid mask that hides the keys past ``Sq`` (top-left aligned) rather than the
bottom-right causal mask ``causal(Sq, Sk)``.

Examples (``.tolist()`` drops the tensor wrapper):

``causal`` -- bottom-right aligned causal mask, ``nfunc = 1``:

>>> causal(3).tolist()
[[[1, 2, 3]]]
>>> causal(2, 4, batch=2).tolist()
[[[3, 4, 3, 4]]]
>>> causal(cu_seqlens_q=[0, 2, 5], cu_seqlens_k=[0, 3, 6]).tolist()  # varlen: per-sample alignment
[[[2, 3, 1, 2, 3]]]

``sliding_window`` -- keys ``[d - window_left, d + window_right]`` with ``d = i + Sk - Sq``, ``nfunc = 3``:

>>> sliding_window(4, window_left=1).tolist()
[[[0, 0, 0, 0], [0, 0, 1, 2], [1, 2, 3, 4]]]

``document`` -- packed documents (self-attention within each document), ``nfunc = 3``:

>>> document([2, 3]).tolist()
[[[0, 0, 0, 0, 0], [0, 0, 2, 2, 2], [1, 2, 3, 4, 5]]]
>>> document([[2, 1], [1, 2]], causal=False).tolist()
[[[0, 0, 0, 0, 0, 0], [0, 0, 2, 0, 1, 1], [2, 2, 3, 1, 3, 3]]]

``document_ids`` -- the same from per-token document ids (runs of equal ids), on their device:

>>> document_ids(torch.tensor([7, 7, 3, 3, 3])).tolist()
[[[0, 0, 0, 0, 0], [0, 0, 2, 2, 2], [1, 2, 3, 4, 5]]]

``prefix_lm`` -- bidirectional prefix then causal, ``nfunc = 1``:

>>> prefix_lm(4, 2).tolist()
[[[2, 2, 3, 4]]]
>>> prefix_lm(3, [1, 3]).tolist()
[[[1, 2, 3, 3, 3, 3]]]

``chunked`` -- attention restricted to fixed-size chunks (Llama-4 style), ``nfunc = 3``:

>>> chunked(5, 2).tolist()
[[[0, 0, 0, 0, 0], [0, 0, 2, 2, 4], [1, 2, 3, 4, 5]]]

``from_dense`` -- boolean ``[Hmask, total_q, Sk]`` mask to endpoints with the smallest odd ``nfunc``:

>>> m = torch.tensor([[[True, False, True, True], [False, True, False, False]]])
>>> from_dense(m).tolist()
[[[1, 0], [2, 1], [4, 2]]]

``from_mask_mod`` -- a FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx)``:

>>> from_mask_mod(lambda b, h, q, kv: kv <= q, 1, None, 3, 3).tolist()
[[[1, 2, 3]]]
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .errors import InputTypeError, InputValueError
from .validation import MAX_SEQLEN

__all__ = [
    "causal",
    "chunked",
    "document",
    "document_ids",
    "from_block_mask",
    "from_dense",
    "from_mask_mod",
    "prefix_lm",
    "sliding_window",
]

# Upper bound on the number of dense mask elements that the encoder (dense -> endpoints) and the
# mask_mod evaluation of from_mask_mod / from_block_mask take at once.
_CHUNK_ELEMENTS = 1 << 24


# --------------------------------------------------------------------------------------------------
# argument validation helpers
# --------------------------------------------------------------------------------------------------


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


def _as_extent(name: str, value: object, minimum: int = 0) -> int:
    """A window, chunk or prefix size: beyond any sequence length it means "unbounded", so it is
    clipped to ``2**31 - 1`` (the int64 maths on it cannot overflow)."""
    return min(_as_int(name, value, minimum), MAX_SEQLEN)


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
        if value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex:
            raise InputTypeError(f"{name} must hold integers, got a tensor of dtype {value.dtype}")
        if value.dim() != 1:
            raise InputValueError(f"{name} must be 1-D, got a tensor of shape {tuple(value.shape)}")
        return [int(v) for v in value.tolist()]
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InputTypeError(f"{name} must be a sequence of ints, got {type(value).__name__}")
    return [_as_int(f"{name}[{i}]", v) for i, v in enumerate(value)]


def _finish(rows: list[torch.Tensor], batch: int) -> torch.Tensor:
    """Stack per-endpoint rows ``[S]`` into ``[1, nfunc, batch * S]`` contiguous int32."""
    ep = torch.stack(rows).to(torch.int32)
    if batch > 1:
        ep = ep.repeat(1, batch)
    return ep.unsqueeze(0).contiguous()


# --------------------------------------------------------------------------------------------------
# analytic builders
# --------------------------------------------------------------------------------------------------


def _diagonals(seqlen_q, seqlen_k, batch, cu_seqlens_q, cu_seqlens_k, device) -> tuple[torch.Tensor, ...]:
    """``(d, k_len)`` per query row of the batch: ``d`` is the row's bottom-right aligned diagonal
    key (its sample-local position ``+ k_len - q_len``), ``k_len`` its sample's key count. Fixed
    length from ``seqlen_q/k`` and ``batch``, varlen from ``cu_seqlens_q/k``."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        if seqlen_q is None:
            raise InputTypeError("seqlen_q is required (or cu_seqlens_q and cu_seqlens_k for varlen)")
        seqlen_q = _as_length("seqlen_q", seqlen_q)
        seqlen_k = seqlen_q if seqlen_k is None else _as_length("seqlen_k", seqlen_k)
        batch = _as_int("batch", batch, 1)
        i = torch.arange(seqlen_q, device=_as_device(device), dtype=torch.int64)
        d = (i + (seqlen_k - seqlen_q)).repeat(batch)
        return d, torch.full_like(d, seqlen_k)
    if seqlen_q is not None or seqlen_k is not None or batch != 1 or isinstance(batch, bool):
        raise InputValueError(
            "with cu_seqlens_q/k the sample lengths come from them: leave seqlen_q, seqlen_k and batch unset"
        )
    if device is None and isinstance(cu_seqlens_q, torch.Tensor):
        device = cu_seqlens_q.device
    dev = _as_device(device)
    cu_q, cu_k = _varlen_prefixes(cu_seqlens_q, cu_seqlens_k, dev)
    q_lens, k_lens = cu_q.diff(), cu_k.diff()
    per_row = lambda x: torch.repeat_interleave(x, q_lens)  # noqa: E731
    k_len = per_row(k_lens)
    d = torch.arange(int(cu_q[-1]), device=dev) - per_row(cu_q[:-1]) + k_len - per_row(q_lens)
    return d, k_len


def causal(
    seqlen_q: int | None = None,
    seqlen_k: int | None = None,
    *,
    batch: int = 1,
    cu_seqlens_q: torch.Tensor | Sequence[int] | None = None,
    cu_seqlens_k: torch.Tensor | Sequence[int] | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """Bottom-right aligned causal mask: row ``i`` sees keys ``< i + 1 + seqlen_k - seqlen_q``.

    The bound is clipped to ``[0, seqlen_k]`` (rows before the diagonal starts see nothing).
    Returns ``[1, 1, batch * seqlen_q]`` int32. Varlen: give ``cu_seqlens_q`` and
    ``cu_seqlens_k`` (int ``[B + 1]``) instead of the lengths; each sample is aligned by its own
    lengths and the result is ``[1, 1, total_q]`` (on ``cu_seqlens_q``'s device by default).
    """
    d, k_len = _diagonals(seqlen_q, seqlen_k, batch, cu_seqlens_q, cu_seqlens_k, device)
    return _finish([torch.minimum((d + 1).clamp(min=0), k_len)], 1)


def sliding_window(
    seqlen_q: int | None = None,
    seqlen_k: int | None = None,
    *,
    window_left: int,
    window_right: int = 0,
    batch: int = 1,
    cu_seqlens_q: torch.Tensor | Sequence[int] | None = None,
    cu_seqlens_k: torch.Tensor | Sequence[int] | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """Sliding-window mask: row ``i`` sees keys ``[d - window_left, d + window_right]`` (inclusive).

    ``d = i + seqlen_k - seqlen_q`` (bottom-right aligned diagonal); the window is clipped to
    ``[0, seqlen_k)``.  Rows whose window misses every key get endpoints ``[0, 0, 0]``.
    Returns ``[1, 3, batch * seqlen_q]`` int32 with endpoints ``[0, lo, hi]``. Varlen as
    :func:`causal`.
    """
    window_left = _as_extent("window_left", window_left)
    window_right = _as_extent("window_right", window_right)
    d, k_len = _diagonals(seqlen_q, seqlen_k, batch, cu_seqlens_q, cu_seqlens_k, device)
    lo = torch.minimum((d - window_left).clamp(min=0), k_len)
    hi = torch.minimum((d + window_right + 1).clamp(min=0), k_len)
    empty = lo >= hi
    lo = lo.masked_fill(empty, 0)
    hi = hi.masked_fill(empty, 0)
    return _finish([torch.zeros_like(lo), lo, hi], 1)


def _is_sequence(x: object) -> bool:
    """True for a list/tuple/… or a tensor of rank >= 1 (not for str/bytes or 0-d tensors)."""
    if isinstance(x, torch.Tensor):
        return x.dim() >= 1
    return isinstance(x, Sequence) and not isinstance(x, (str, bytes))


def _parse_doc_lens(doc_lens: object) -> list[list[int]]:
    """Normalise ``doc_lens`` to a list (one entry per batch sample) of document length lists."""
    nested_input = False
    if isinstance(doc_lens, torch.Tensor):
        nested_input = doc_lens.dim() == 2
        if doc_lens.dim() == 1:
            seqs = [_int_list("doc_lens", doc_lens)]
        elif doc_lens.dim() == 2:
            seqs = [_int_list(f"doc_lens[{b}]", row) for b, row in enumerate(doc_lens)]
        else:
            raise InputValueError(
                f"doc_lens must be 1-D or 2-D, got a tensor of shape {tuple(doc_lens.shape)}"
            )
    elif isinstance(doc_lens, (str, bytes)) or not isinstance(doc_lens, Sequence):
        raise InputTypeError(
            f"doc_lens must be a sequence of ints or a sequence of such sequences, "
            f"got {type(doc_lens).__name__}"
        )
    elif len(doc_lens) == 0:
        raise InputValueError("doc_lens must not be empty")
    else:
        nested = [_is_sequence(x) for x in doc_lens]
        if all(nested):
            nested_input = True
            seqs = [_int_list(f"doc_lens[{b}]", row) for b, row in enumerate(doc_lens)]
        elif not any(nested):
            seqs = [_int_list("doc_lens", doc_lens)]
        else:
            raise InputTypeError(
                "doc_lens must be either a sequence of ints or a sequence of sequences, not a mix"
            )
    for b, seq in enumerate(seqs):
        name = f"doc_lens[{b}]" if nested_input else "doc_lens"
        if len(seq) == 0:
            raise InputValueError(f"{name} must contain at least one document length")
        for j, n in enumerate(seq):
            if n < 0:
                raise InputValueError(f"{name}[{j}] must be >= 0, got {n}")
    totals = [sum(seq) for seq in seqs]
    if totals[0] > MAX_SEQLEN:
        raise InputValueError(
            f"doc_lens sum to {totals[0]}, beyond the int32 endpoint range (<= {MAX_SEQLEN})"
        )
    if any(t != totals[0] for t in totals):
        raise InputValueError(
            f"every sample in doc_lens must have the same total length, got totals {totals}"
        )
    return seqs


def document(
    doc_lens: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor,
    *,
    causal: bool = True,
    window_left: int | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """Packed-document (block-diagonal) self-attention mask.

    ``doc_lens`` is either one sequence of document lengths (one packed sequence, batch 1) or a
    sequence of such sequences (one per batch sample; every sample must sum to the same ``S``),
    also accepted as a 1-D / 2-D integer tensor.  Zero-length documents are allowed and ignored;
    a total length of 0 gives endpoints without rows (an empty problem).

    A row at position ``i`` in document ``[s, e)`` sees keys ``[s, e)`` (``causal=False``),
    ``[s, i]`` (``causal=True``).  ``window_left`` additionally limits the left edge to
    ``max(s, i - window_left)`` (for ``causal=False`` the right edge stays ``e``).
    Returns ``[1, 3, B * S]`` int32 with endpoints ``[0, lo, hi]``.
    """
    dev = _as_device(device)
    seqs = _parse_doc_lens(doc_lens)
    # the index of each token's document (an empty document gets no token), one row per sample
    ids = torch.stack([
        torch.repeat_interleave(
            torch.arange(len(seq), device=dev), torch.tensor(seq, device=dev), output_size=sum(seq)
        )  # output_size: the meta device has no values to sum
        for seq in seqs
    ])  # fmt: skip
    return document_ids(ids, causal=causal, window_left=window_left)


def document_ids(
    doc_ids: torch.Tensor, *, causal: bool = True, window_left: int | None = None
) -> torch.Tensor:
    """:func:`document` from per-token document ids, built on ``doc_ids``' device without reading
    it back to the host (a CUDA tensor from the data loader stays on the GPU, with no sync).

    ``doc_ids`` is an integer tensor ``[S]`` (one packed sequence) or ``[B, S]`` (one row per batch
    sample); each maximal run of equal consecutive ids within a row is one document, so ids need
    not be sorted or distinct across documents (``[7, 7, 3, 3, 3]`` is two documents; so is
    ``[0, 0, 1, 1, 1]``). Rows see keys as :func:`document` describes. Returns ``[1, 3, B * S]``
    int32 endpoints ``[0, lo, hi]``. Position ids that restart at 0 in every document give the ids
    as ``(position_ids == 0).cumsum(-1)``.
    """
    if not isinstance(doc_ids, torch.Tensor):
        raise InputTypeError(f"doc_ids must be a torch.Tensor, got {type(doc_ids).__name__}")
    if doc_ids.dtype.is_floating_point or doc_ids.dtype.is_complex or doc_ids.dtype == torch.bool:
        raise InputTypeError(f"doc_ids must be an integer tensor, got {doc_ids.dtype}")
    if doc_ids.dim() not in (1, 2) or (doc_ids.dim() == 2 and doc_ids.shape[0] == 0):
        raise InputValueError(f"doc_ids must be [S] or [B, S] with B >= 1, got shape {tuple(doc_ids.shape)}")
    if not isinstance(causal, bool):
        raise InputTypeError(f"causal must be a bool, got {type(causal).__name__}")
    if window_left is not None:
        window_left = _as_extent("window_left", window_left)
    ids = doc_ids if doc_ids.dim() == 2 else doc_ids.unsqueeze(0)  # [B, S]
    seqlen = ids.shape[1]
    i = torch.arange(seqlen, device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)  # a document starts at row i
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    lo = torch.where(starts, i, 0).cummax(dim=1).values  # the latest start at or before i
    if causal:
        hi = i + 1
    else:  # one past the row's document: the earliest start after i, or S
        next_start = torch.where(starts[:, 1:], i[:, 1:], seqlen)
        # the closing column in i's int64: ids of a narrow dtype (uint8, int16, ...) cannot hold S
        hi = torch.cat([next_start, torch.full_like(i[:, :1], seqlen)], dim=1)
        hi = hi.flip(1).cummin(dim=1).values.flip(1)
    if window_left is not None:
        lo = torch.maximum(lo, i - window_left)
    return _finish([torch.zeros_like(lo).reshape(-1), lo.reshape(-1), hi.reshape(-1)], 1)


def prefix_lm(
    seqlen: int,
    prefix_len: int | Sequence[int] | torch.Tensor,
    *,
    batch: int | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """Prefix-LM mask: row ``i`` sees keys ``[0, max(prefix_len, i + 1))``, clipped to ``seqlen``.

    ``prefix_len`` is an int (same prefix for every sample) or a per-sample sequence / 1-D tensor.
    ``batch`` defaults to 1 for an int ``prefix_len`` and to ``len(prefix_len)`` for a sequence
    (if given, it must match).  Returns ``[1, 1, batch * seqlen]`` int32.
    """
    seqlen = _as_length("seqlen", seqlen)
    dev = _as_device(device)
    if not _is_sequence(prefix_len):
        prefixes = [_as_extent("prefix_len", prefix_len)]
        batch = 1 if batch is None else _as_int("batch", batch, 1)
        prefixes = prefixes * batch
    else:
        prefixes = _int_list("prefix_len", prefix_len)
        if len(prefixes) == 0:
            raise InputValueError("prefix_len must not be an empty sequence")
        for b, p in enumerate(prefixes):
            if p < 0:
                raise InputValueError(f"prefix_len[{b}] must be >= 0, got {p}")
        if batch is not None:
            batch = _as_int("batch", batch, 1)
            if batch != len(prefixes):
                raise InputValueError(f"prefix_len has {len(prefixes)} entries but batch={batch}")
    p = torch.tensor([min(x, MAX_SEQLEN) for x in prefixes], dtype=torch.int64, device=dev)[:, None]
    i = torch.arange(seqlen, device=dev, dtype=torch.int64)[None, :]
    f0 = torch.maximum(p, i + 1).clamp(max=seqlen).reshape(-1)
    return _finish([f0], 1)


def chunked(
    seqlen: int,
    chunk_size: int,
    *,
    causal: bool = True,
    batch: int = 1,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """Chunked attention (Llama-4 style): row ``i`` sees keys of its chunk
    ``[c * chunk_size, (c+1) * chunk_size)``.

    ``c = i // chunk_size``; the chunk is clipped to ``seqlen``; with ``causal=True`` keys are further
    limited to ``<= i``.  Returns ``[1, 3, batch * seqlen]`` int32 with endpoints ``[0, lo, hi]``.
    """
    seqlen = _as_length("seqlen", seqlen)
    chunk_size = _as_extent("chunk_size", chunk_size, 1)
    if not isinstance(causal, bool):
        raise InputTypeError(f"causal must be a bool, got {type(causal).__name__}")
    batch = _as_int("batch", batch, 1)
    dev = _as_device(device)
    i = torch.arange(seqlen, device=dev, dtype=torch.int64)
    lo = torch.div(i, chunk_size, rounding_mode="floor") * chunk_size
    hi = i + 1 if causal else (lo + chunk_size).clamp(max=seqlen)
    return _finish([torch.zeros_like(lo), lo, hi], batch)


# --------------------------------------------------------------------------------------------------
# dense -> endpoints
# --------------------------------------------------------------------------------------------------


def _row_chunk(h: int, sk: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, h * (sk + 1)))


def _transitions(m: torch.Tensor) -> torch.Tensor:
    """``m`` bool ``[H, t, Sk]`` (Sk >= 1) -> bool ``[H, t, Sk]``; entry ``j`` is a run boundary
    at key ``j + 1``.

    A boundary at key ``k`` (1 <= k <= Sk) means ``m[k] != m[k - 1]`` (with ``m[Sk] = False``).
    The boundary at key 0 (a row starting with True) is implicit in the ``[0, F0)`` interval.
    """
    tr = torch.empty_like(m)
    torch.ne(m[..., 1:], m[..., :-1], out=tr[..., :-1])
    tr[..., -1] = m[..., -1]
    return tr


def _encode(mask: torch.Tensor) -> torch.Tensor:
    """bool ``[H, T, Sk]`` -> int32 ``[H, nfunc, T]`` with the smallest odd ``nfunc``."""
    h, t, sk = mask.shape
    if sk == 0 or t == 0:
        return torch.zeros(h, 1, t, dtype=torch.int32, device=mask.device)
    step = _row_chunk(h, sk)
    return _join_rows([_encode_rows(mask[:, r0 : r0 + step]) for r0 in range(0, t, step)])


def _encode_rows(m: torch.Tensor) -> torch.Tensor:
    """One chunk of :func:`_encode`: bool ``[H, n, Sk]`` (Sk >= 1) -> int32 ``[H, nfunc, n]``.

    A row needs one endpoint per boundary after key 0, plus a leading 0 (the empty ``[0, 0)``
    interval) when it does not start with True: an odd count. The boundaries are few, so they are
    listed (``nonzero``, row-major) and each goes to its rank in its row; unused slots repeat the
    row's last endpoint (empty intervals)."""
    h, n, _ = m.shape
    tr = _transitions(m).reshape(h * n, -1)
    per_row = tr.sum(-1)
    lead = (~m[..., 0]).reshape(-1).long()
    counts = per_row + lead
    nfunc = int(counts.max())
    rows, keys = tr.nonzero(as_tuple=True)
    first = torch.cumsum(per_row, 0) - per_row  # index of each row's first boundary in the list
    slot = torch.arange(rows.numel(), device=m.device) - first[rows] + lead[rows]
    buf = torch.zeros(h * n, nfunc, dtype=torch.int32, device=m.device)
    buf[rows, slot] = (keys + 1).to(torch.int32)
    last = buf.gather(1, (counts - 1).unsqueeze(1))
    buf = torch.where(torch.arange(nfunc, device=m.device) >= counts.unsqueeze(1), last, buf)
    return buf.view(h, n, nfunc).transpose(1, 2)


def _join_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Endpoints ``[H, nfunc_i, n_i]`` of consecutive rows -> ``[H, max nfunc, sum n_i]``, shorter
    ones padded by repeating each row's last endpoint (empty intervals)."""
    nfunc = max(p.shape[1] for p in parts)
    padded = [
        torch.cat([p, p[:, -1:].expand(-1, nfunc - p.shape[1], -1)], dim=1) if p.shape[1] < nfunc else p
        for p in parts
    ]
    return torch.cat(padded, dim=2)


def _as_cu_seqlens(name: str, value: object, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex:
            raise InputTypeError(f"{name} must be an integer tensor, got dtype {value.dtype}")
        if value.dim() != 1:
            raise InputValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
        cu = value.to(device=device, dtype=torch.int64)
    else:
        cu = torch.tensor(_int_list(name, value), dtype=torch.int64, device=device)
    if cu.numel() < 2:
        raise InputValueError(f"{name} must have at least 2 entries (B + 1 with B >= 1), got {cu.numel()}")
    if int(cu[0]) != 0:
        raise InputValueError(f"{name} must start at 0, got {int(cu[0])}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise InputValueError(f"{name} must be non-decreasing, got {cu.tolist()}")
    if int(cu[-1]) > MAX_SEQLEN:
        raise InputValueError(
            f"{name}[-1] = {int(cu[-1])} exceeds the int32 endpoint range (<= {MAX_SEQLEN})"
        )
    return cu


def _varlen_prefixes(cu_seqlens_q, cu_seqlens_k, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Both prefix arrays, checked, as int64 on ``device``."""
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise InputValueError("cu_seqlens_q and cu_seqlens_k must be given together (varlen) or both omitted")
    cu_q = _as_cu_seqlens("cu_seqlens_q", cu_seqlens_q, device)
    cu_k = _as_cu_seqlens("cu_seqlens_k", cu_seqlens_k, device)
    if cu_q.numel() != cu_k.numel():
        raise InputValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length (B + 1), "
            f"got {cu_q.numel()} and {cu_k.numel()}"
        )
    return cu_q, cu_k


def from_dense(
    mask: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | Sequence[int] | None = None,
    cu_seqlens_k: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """Convert a dense boolean mask ``[Hmask, total_q, Sk]`` (or SDPA's ``[B, Hmask, Sq, Sk]``, fixed
    length) to endpoints ``[Hmask, nfunc, total_q]``.

    ``nfunc`` is the smallest odd count representing every row: a row with ``r`` runs of True needs
    ``2r - 1`` endpoints if it starts with True at key 0 and ``2r + 1`` otherwise; shorter rows are
    padded by repeating their last endpoint.  All-False rows give all-zero endpoints.

    Fixed length: ``total_q = B * Sq`` and the last axis holds the ``Sk`` keys.  Varlen: pass both
    ``cu_seqlens_q`` and ``cu_seqlens_k`` (int ``[B + 1]``); the last axis is ``max_seqlen_k``
    (sample-local key positions) and entries past each row's sample ``k_len`` must be False.
    The result lives on ``mask.device``.
    """
    if not isinstance(mask, torch.Tensor):
        raise InputTypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        additive = ""
        if mask.is_floating_point():
            additive = (
                " (an additive mask, 0 where visible and -inf or finfo.min where hidden: pass mask == 0; "
                "a 0 / 1 mask: mask.bool())"
            )
        raise InputTypeError(f"mask must be a bool tensor (True: visible), got dtype {mask.dtype}{additive}")
    _require_values("from_dense", mask.device)
    sdpa = mask.dim() == 4 and cu_seqlens_q is None  # SDPA's [B, H, Sq, Sk]
    if mask.dim() != 3 and not sdpa:
        square = ""
        if mask.dim() == 2:
            square = (
                " (one [Sq, Sk] mask for the batch: mask[None, None].expand(B, 1, Sq, Sk); a [B, Sk] "
                "key-padding mask: mask[:, None, None, :].expand(B, 1, Sq, Sk))"
            )
        raise InputValueError(
            f"mask must have rank 3 [Hmask, total_q, Sk] (or, fixed length, rank 4 [B, Hmask, Sq, Sk]), "
            f"got shape {tuple(mask.shape)}{square}"
        )
    if mask.shape[1 if sdpa else 0] == 0:
        raise InputValueError(f"mask must have at least one head (Hmask >= 1), got shape {tuple(mask.shape)}")
    if sdpa:  # rows are batch-major
        b, hm, sq, sk = mask.shape
        mask = mask.transpose(0, 1).reshape(hm, b * sq, sk)
    h, t, sk = mask.shape
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        dev = mask.device
        cu_q, cu_k = _varlen_prefixes(cu_seqlens_q, cu_seqlens_k, dev)
        if int(cu_q[-1]) != t:
            raise InputValueError(
                f"cu_seqlens_q[-1] = {int(cu_q[-1])} must equal mask.shape[1] (total_q) = {t}"
            )
        q_lens = cu_q.diff()
        k_lens = cu_k.diff()
        too_long = (q_lens > 0) & (k_lens > sk)
        if bool(too_long.any()):
            b = int(too_long.nonzero()[0, 0])
            raise InputValueError(
                f"mask has {sk} key columns but sample {b} has k_len {int(k_lens[b])} "
                f"(cu_seqlens_k); the key axis must be at least max_seqlen_k"
            )
        row_klen = torch.repeat_interleave(k_lens, q_lens)  # [T]
        keys = torch.arange(sk, device=dev)
        step = _row_chunk(h, sk)
        for r0 in range(0, t, step):
            outside = keys >= row_klen[r0 : r0 + step, None]  # [t, Sk]
            bad = (mask[:, r0 : r0 + step] & outside).any(-1)  # [H, t]
            if bool(bad.any()):
                hh, rr = (int(x) for x in bad.nonzero()[0])
                row = r0 + rr
                b = int(torch.searchsorted(cu_q, torch.tensor(row, device=dev), right=True)) - 1
                raise InputValueError(
                    f"mask row {row} (head {hh}, sample {b}) has True entries at keys >= its sample's "
                    f"k_len {int(row_klen[row])}"
                )
    return _encode(mask)


#: ``from_mask_mod``'s ``H`` values that stand for one mask of every head, as ``create_block_mask``'s
#: do, and how to give the heads instead
_SHARED_HEAD_HINTS = {
    None: "H=None: pass H=Hq",
    1: "H=1 gives one mask for every head, as in torch: pass H=Hq",
}


def from_mask_mod(
    mask_mod: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    B: int,
    H: int | None,
    Sq: int | None = None,
    Sk: int | None = None,
    device: str | torch.device | None = None,
    *,
    Q_LEN: int | None = None,
    KV_LEN: int | None = None,
) -> torch.Tensor:
    """Build endpoints from a FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

    ``mask_mod`` is evaluated as torch's ``create_block_mask`` evaluates it: under ``torch.vmap``,
    so it sees 0-d int64 index tensors and returns a 0-d bool tensor (``docs[b][q_idx]`` works;
    Python ``and`` / ``if`` on the indices do not). Its dense mask is evaluated and encoded like
    :func:`from_dense` a chunk of query rows at a time (about 16M elements), so the whole
    ``[H, Sq, Sk]`` never exists at once.  Rows are batch-major (``row = b * Sq + q``).  If every head
    gives the same mask the result has ``Hmask = 1``, else ``Hmask = H``.  ``H = None`` or ``1``
    means one mask for every head, as in torch; a mask_mod that reads its head index is refused
    there (torch's flex_attention still calls it with each head's index): pass ``H = Hq``. Reads:
    any operation on ``h`` reaches its result, even one that changes nothing (``h * 0``), as one
    evaluation that follows ``h`` through every operation tells; a mask_mod that cannot be
    evaluated so (Python control flow on ``b``) is evaluated at head 1 and compared with head 0
    instead. With ``H = 1`` a mask_mod that fails at head 1 (a per-head table
    of one entry) is taken as one of a model of one head, which torch never calls with head 1.
    The positional arguments are ``create_block_mask``'s, ``device`` included; ``Sq`` and ``Sk``
    are its ``Q_LEN`` and ``KV_LEN``, and are taken by those names too, so that a call written
    with torch's keywords converts as it is. Its ``BLOCK_SIZE`` has no counterpart (endpoints are
    per element), and ``B`` cannot be None.
    The endpoints do not record ``Sk``: used with more keys than ``Sk``, they hide the keys past it
    (torch refuses a block mask made for another ``KV_LEN``).
    """
    if not callable(mask_mod):
        raise InputTypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    if B is None:
        raise InputTypeError(
            "B must be the batch size, not None: endpoints name every query row of the batch "
            "(row = b * Sq + q), so mask_mod is evaluated once per sample"
        )
    Sq, Sk = _torch_name("Sq", Sq, "Q_LEN", Q_LEN), _torch_name("Sk", Sk, "KV_LEN", KV_LEN)
    B = _as_int("B", B, 1)
    H = None if H is None else _as_int("H", H, 1)
    shared_heads = _SHARED_HEAD_HINTS.get(H)
    one_head = H == 1  # only a failure at head 1 tells a model of one head from torch's shared entry
    H = H or 1
    shape = (H, _as_length("Sq", Sq), _as_length("Sk", Sk))
    dev = _as_device(device)
    _require_values("from_mask_mod", dev)
    parts = []
    for b in range(B):
        sample_heads = shared_heads if b == 0 else None  # the head-1 probe needs one sample
        chunks = _mask_mod_rows(mask_mod, b, shape, dev, sample_heads, one_head=one_head, samples=B)
        parts += [_encode(rows) for rows in chunks]
    return _join_samples(parts, H)


def _torch_name(name: str, value, torch_name: str, torch_value):
    """A length given as ``name`` or as torch's ``torch_name``: exactly one of them."""
    if (value is None) == (torch_value is None):
        given = "both" if value is not None else "neither"
        raise InputTypeError(
            f"from_mask_mod takes {name} or {torch_name} (create_block_mask's name), got {given}"
        )
    return torch_value if value is None else value


def from_block_mask(block_mask, *, batch: int | None = None, heads: int | None = None) -> torch.Tensor:
    """Endpoints of a torch FlexAttention ``BlockMask`` (what ``create_block_mask`` returns): its
    ``mask_mod`` over its batch, heads and ``seq_lengths``, on its device, as :func:`from_mask_mod`.

    A block mask made with ``B=None`` holds one batch entry; ``batch`` then says how many samples
    the endpoints cover (the mask_mod is evaluated for each). Likewise one made with ``H=None``
    holds one head entry, and its mask_mod gives one mask for every head (``Hmask = 1``), refused
    where it reads its head index (as :func:`from_mask_mod` tells: torch calls the mask_mod with
    each head's index), unless ``heads``
    says how many q heads to evaluate it for: pass ``heads=Hq`` for such a mask_mod (the result
    keeps ``Hmask = 1`` where the heads agree). Every sample's and head's blocks must hold every
    element its mask_mod makes visible (blocks listed besides are harmless: torch finds nothing
    visible in them either), and the blocks listed full (where torch skips the mask_mod) must be
    wholly visible (both true of ``create_block_mask``), else the block mask is refused rather than
    converted to another mask than torch computes with it:

    - one batch / head entry (``B=None`` / ``H=None``) holds sample 0's / head 0's blocks, which
      torch applies to every sample / head, so ``batch=`` / ``heads=`` are refused where another
      sample's or head's visible or full blocks differ (documents that move, a window that grows
      with the head): make the block mask with ``B`` / ``H`` given, or take the endpoints of the
      mask_mod alone, ``from_mask_mod(block_mask.mask_mod, B, H, Sq, Sk)``;
    - block lists that leave out elements the mask_mod shows (``BlockMask.from_kv_blocks``
      without one, whose mask_mod shows every element): build the mask torch computes (the
      mask_mod inside the listed blocks) as a dense bool tensor and use :func:`from_dense`;
    - a sliced block mask (``block_mask[...]``) has no mask_mod (torch replaces it with one that
      raises): convert the unsliced one and index the endpoints as the slice does (samples: rows
      ``b * Sq + q`` of the last dimension; heads: the first dimension, one entry where Hmask = 1).
    """
    for attr in ("mask_mod", "seq_lengths", "kv_num_blocks", "BLOCK_SIZE", "to_dense"):
        if not hasattr(block_mask, attr):
            raise InputTypeError(
                f"block_mask must be a torch FlexAttention BlockMask, got {type(block_mask).__name__}"
            )
    if getattr(block_mask.mask_mod, "__name__", None) == "_sliced_mask_mod_error":
        raise InputValueError(
            "block_mask is a sliced BlockMask (block_mask[...]), whose mask_mod torch replaces with one "
            "that raises: convert the unsliced block mask and index its endpoints [Hmask, nfunc, B * Sq] "
            "as the slice does: samples are the rows b * Sq + q of the last dimension, heads the first "
            "dimension (one entry for every head where Hmask = 1)"
        )
    blocks = block_mask.to_dense() != 0  # [B, H, Q blocks, KV blocks]
    # one head entry standing for every head (H=None) unless ``heads`` says how many there are
    shared_heads = "H=None: pass heads=Hq" if heads is None and blocks.shape[1] == 1 else None
    counts = {}
    for name, given, entries in (("batch", batch, blocks.shape[0]), ("heads", heads, blocks.shape[1])):
        counts[name] = entries if given is None else _as_int(name, given, 1)
        if entries not in (1, counts[name]):
            noun = "batch entries" if name == "batch" else "head entries"
            raise InputValueError(f"block_mask has {entries} {noun} but {name}={counts[name]}")
    batch, heads = counts["batch"], counts["heads"]
    shape = (heads, *(int(n) for n in block_mask.seq_lengths))
    bq, bk = (int(n) for n in block_mask.BLOCK_SIZE)
    full = _full_blocks(block_mask, blocks.shape[-1])
    parts = []
    for b in range(batch):
        sample_heads = shared_heads if b == 0 else None
        entry = b if blocks.shape[0] > 1 else 0
        first = 0  # the chunk's first Q block
        differs = torch.zeros(heads, dtype=torch.bool, device=blocks.device)  # per head, over the chunks
        chunks = _mask_mod_rows(
            block_mask.mask_mod, b, shape, blocks.device, sample_heads, align=bq, samples=batch
        )
        for dense in chunks:
            # torch computes mask_mod inside the listed blocks and nothing outside them: a listed block
            # where the mask_mod shows nothing is harmless, an unlisted one where it shows something is not
            seen = _per_block(dense, (bq, bk), torch.any)
            rows = slice(first, first + seen.shape[1])
            wrong = seen & ~blocks[entry, :, rows].expand_as(seen)
            if full is not None:  # torch skips mask_mod in a full block: every element there must be visible
                wrong |= full[entry, :, rows].expand_as(seen) & ~_per_block(dense, (bq, bk), torch.all)
            differs |= wrong.flatten(1).any(1)
            parts.append(_encode(dense))
            first += seen.shape[1]
        if bool(differs.any()):
            raise _blocks_differ(b, int(differs.nonzero()[0, 0]), blocks.shape[:2], heads)
    return _join_samples(parts, heads)


def _blocks_differ(b: int, head: int, entries: tuple[int, int], heads: int) -> InputValueError:
    """The refusal of a block mask whose blocks of sample ``b``, head ``head`` contradict its
    mask_mod; ``entries``: its (batch, head) entry counts."""
    at_head = f" at head {head}" if heads > 1 else ""
    # a shared entry (B=None / H=None) holds sample 0's, head 0's blocks: torch applies them
    # to the others, which their own mask_mod contradicts here
    named = (("B", entries[0], b), ("H", entries[1], head))
    shared = [f"{noun}=None" for noun, count, i in named if count == 1 and i > 0]
    if shared:
        hint = (
            f"the block mask was made with {' and '.join(shared)}, so it lists sample 0's / head 0's "
            f"blocks for every one; make it with them given, or convert the mask_mod alone: "
            f"masks.from_mask_mod(block_mask.mask_mod, B, H, Sq, Sk)"
        )
    else:
        hint = (
            "torch computes the mask_mod inside the listed blocks, every element of a full one and "
            "nothing elsewhere: build that dense [B, H, Sq, Sk] bool mask and use from_dense"
        )
    return InputValueError(
        f"block_mask's blocks of sample {b} leave out elements its mask_mod makes visible (or "
        f"list full a block it does not make wholly visible){at_head}; {hint}"
    )


def _per_block(dense: torch.Tensor, block: tuple[int, int], reduce) -> torch.Tensor:
    """``reduce`` (torch.any / torch.all) of ``[H, Sq, Sk]`` over each ``block``, edge blocks over
    their elements only: ``[H, Q blocks, KV blocks]``."""
    (bq, bk), (_, sq, sk) = block, dense.shape
    padded = torch.nn.functional.pad(dense, (0, -sk % bk, 0, -sq % bq), value=reduce is torch.all)
    return reduce(reduce(padded.unflatten(2, (-1, bk)).unflatten(1, (-1, bq)), 4), 2)


def _full_blocks(block_mask, kv_blocks: int) -> torch.Tensor | None:
    """bool ``[B, H, Q blocks, kv_blocks]``: the blocks ``block_mask`` lists as full (torch applies no
    mask_mod there); None where it lists none."""
    num, idx = block_mask.full_kv_num_blocks, block_mask.full_kv_indices
    if num is None or idx is None:
        return None
    listed = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)
    spare = max(kv_blocks, idx.shape[-1])  # a column for the unlisted slots
    dense = torch.zeros(*idx.shape[:-1], spare + 1, dtype=torch.bool, device=idx.device)
    dense.scatter_(-1, torch.where(listed, idx, spare).long(), listed)
    return dense[..., :kv_blocks]


#: torch.vmap's in_dims over (b, h, q_idx, kv_idx), innermost first: kv_idx, q_idx, then h (b is one
#: sample's 0-d index), so mask_mod sees 0-d indices, as under torch's create_block_mask
_VMAP_DIMS = ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None))


def _mask_mod_rows(
    mask_mod, b: int, shape: tuple[int, int, int], dev: torch.device, shared_heads: str | None = None,
    *, one_head: bool = False, align: int = 1, samples: int = 1,
):  # fmt: skip
    """``mask_mod`` of batch sample ``b`` as dense bool ``[H, rows, Sk]`` chunks of consecutive query
    rows, each a multiple of ``align`` rows (the last may be shorter) and, where ``align`` allows,
    at most about ``_CHUNK_ELEMENTS`` elements: the whole ``[H, Sq, Sk]`` never exists at once.
    ``shared_heads`` (one head standing for every head, ``H = 1``, the string saying how to give the
    heads) refuses a mask_mod that reads its head index in any of ``samples`` (:func:`_reads_head`), since
    torch calls it with each head's index. Under ``one_head`` (``H = 1``) such a mask_mod is taken
    as one of a model of one head where it fails at head 1 (a per-head table of one entry), which
    torch never calls with head 1; it is evaluated at head 1 to tell. Where that cannot be told,
    head 1 is evaluated instead and compared with head 0 (heads past 1 unchecked)."""
    H, Sq, Sk = shape
    if Sq == 0 or Sk == 0:  # no element to evaluate (an empty problem)
        yield torch.zeros(shape, dtype=torch.bool, device=dev)
        return
    traced = _reads_head(mask_mod, dev, samples) if shared_heads else False
    if traced and not one_head:
        raise _reads_head_error(shared_heads)
    step = max(1, _row_chunk(H, Sk) // align) * align
    # head 1 evaluated: where the trace shows the head index read (one_head: does it fail there?),
    # or could not tell; a failure at head 1 in any chunk answers first
    probe, reads_head = (shared_heads if traced is not False else None), False
    for r0 in range(0, Sq, step):
        q_idx = torch.arange(r0, min(r0 + step, Sq), device=dev)
        res = _evaluate(mask_mod, b, torch.arange(H, device=dev), q_idx, Sk)
        if probe:
            try:
                other = _evaluate(mask_mod, b, torch.ones(1, dtype=torch.int64, device=dev), q_idx, Sk)
            except Exception as err:  # noqa: BLE001 - the probe's failure is the user's answer, named
                if not one_head:
                    raise InputValueError(
                        f"one mask stands for every head, so mask_mod is also evaluated at head 1 to check "
                        f"that it does not read its head index, and it raised there ({type(err).__name__}: "
                        f"{err}); {shared_heads}, or 1 for a model of one head"
                    ) from err
                probe, reads_head = None, False
            else:
                reads_head |= bool(traced) or not torch.equal(res[0], other[0])
        yield res.to(dev)
    if reads_head:
        raise _reads_head_error(shared_heads)


def _reads_head_error(shared_heads: str) -> InputValueError:
    return InputValueError(
        "mask_mod reads its head index, and torch's flex_attention calls it with each head's index, "
        f"so one mask for every head could differ from what torch computes; {shared_heads} (the "
        "endpoints keep one mask where every head's is the same). For a model of one head, give it "
        "head 0: lambda b, h, q, kv: mask_mod(b, torch.tensor(0, device=q.device), q, kv)"
    )


class _FromHead(TorchDispatchMode):
    """Marks every tensor an operation makes from a marked one, starting with the head index: what
    a trace would record, without patching anything for the process (fx tracing patches
    ``nn.Module`` and flags "tracing" globally; a dispatch mode's stack is the calling thread's).
    Entered under ``_MODE_LOCK``: a mode's enter and exit save and restore torch's process-wide
    ``is_in_torch_dispatch_mode()`` flag, and two threads inside one at once left it set."""

    def __init__(self, head: torch.Tensor):
        super().__init__()
        self.marked = {id(head): head}  # held, so that no id is reused while the evaluation runs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and id(t) in self.marked for t in tree_leaves((args, kwargs))):
            self.marked.update((id(t), t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


#: one :class:`_FromHead` at a time in the process (its docstring says why)
_MODE_LOCK = threading.Lock()


def _reads_head(mask_mod, dev: torch.device, samples: int) -> bool | None:
    """Whether ``mask_mod`` reads its head index ``h`` (its result comes out of an operation on
    ``h``, even one that leaves it unchanged): evaluated as :func:`_evaluate` evaluates it, at one
    element of each of ``samples`` samples (the sample index is a plain value, which a mask_mod may
    branch on or index a list with), under :class:`_FromHead`. For a sample, the answer holds for
    every head, row and key, since every operation ``h`` flows through is seen. None where an
    evaluation fails and none read ``h`` (the caller then compares head 1 with head 0)."""
    h, q_idx, kv_idx = (torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(3))
    fn, failed = _vmapped(mask_mod), False
    for b in range(samples):
        try:
            with _MODE_LOCK, _FromHead(h) as mode:
                out = fn(torch.tensor(b, device=dev), h, q_idx, kv_idx)
        except Exception:  # noqa: BLE001 - the evaluation itself names any real error
            failed = True
            continue
        if id(out) in mode.marked:
            return True
    return None if failed else False


def _vmapped(mask_mod):
    """``mask_mod(b, h, q_idx, kv_idx)`` over 1-d ``h``, ``q_idx`` and ``kv_idx`` (``_VMAP_DIMS``)."""
    fn = mask_mod
    for in_dims in _VMAP_DIMS:
        fn = torch.vmap(fn, in_dims=in_dims, out_dims=0)
    return fn


def _evaluate(mask_mod, b: int, heads: torch.Tensor, q_idx: torch.Tensor, Sk: int) -> torch.Tensor:
    """``mask_mod`` at sample ``b``, the head indices ``heads``, the query rows ``q_idx`` and every
    kv_idx: bool ``[len(heads), len(q_idx), Sk]``."""
    dev = heads.device
    fn = _vmapped(mask_mod)
    kv_idx = torch.arange(Sk, device=dev)
    try:
        res = fn(torch.tensor(b, device=dev), heads, q_idx, kv_idx)
    except RuntimeError as err:
        if "data-dependent control flow" not in str(err) and "Boolean value of Tensor" not in str(err):
            raise
        raise InputValueError(
            "mask_mod is evaluated as torch FlexAttention's create_block_mask evaluates it (under "
            "torch.vmap), so Python `and` / `or` / `if` on its index tensors fail: use `&`, `|` and "
            f"torch.where ({err})"
        ) from err
    except ValueError as err:
        if "must only return Tensors" not in str(err):
            raise
        raise InputTypeError(f"mask_mod must return a bool torch.Tensor ({err})") from err
    if res.dtype != torch.bool:
        raise InputTypeError(f"mask_mod must return a bool tensor, got dtype {res.dtype}")
    if res.shape != (heads.numel(), q_idx.numel(), Sk):
        raise InputValueError(
            f"mask_mod must return one bool per (b, h, q_idx, kv_idx), got a result of shape "
            f"{tuple(res.shape[3:])} for each"
        )
    return res


def _join_samples(parts: list[torch.Tensor], H: int) -> torch.Tensor:
    """Per-sample endpoints ``[H, nfunc_b, Sq]`` -> ``[Hmask, nfunc, B * Sq]`` (:func:`_join_rows`),
    one head kept if all heads agree."""
    out = _join_rows(parts)
    if H > 1 and bool((out == out[:1]).all()):
        out = out[:1]
    return out.contiguous()
