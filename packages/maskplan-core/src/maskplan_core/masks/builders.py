"""The analytic mask builders: causal, sliding window, documents, prefix-LM, chunked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from ..errors import InputTypeError, InputValueError
from ..validation import MAX_SEQLEN, require_tensor
from ._args import (
    _as_batch,
    _as_device,
    _as_extent,
    _as_int,
    _as_length,
    _finish,
    _int_list,
    _varlen_prefixes,
)

#: where a causal or windowed mask's diagonal starts where a sample's query and key counts differ:
#: at its last query and key (FlashAttention's), or at its first (torch's kv_idx <= q_idx, SDPA's
#: is_causal); cuDNN's diagonal_alignment names both
_ALIGNMENTS = ("bottom_right", "top_left")


def _diagonals(
    seqlen_q, seqlen_k, batch, cu_seqlens_q, cu_seqlens_k, device, seqused_k=None, align="bottom_right"
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """``(d, k_len, q_lens, k_lens)``: per query row of the batch ``d``, the row's diagonal key
    (aligned bottom-right: its sample-local position ``+ k_len - q_len``; top-left: the position),
    and ``k_len``, the keys its sample uses (all of them, or ``seqused_k``'s); and the samples'
    query rows and keys. Fixed length from ``seqlen_q/k`` and ``batch``, varlen from
    ``cu_seqlens_q/k``."""
    if align not in _ALIGNMENTS:
        raise InputValueError(f"align must be one of {_ALIGNMENTS}, got {align!r}")
    if cu_seqlens_q is None and cu_seqlens_k is None:
        if seqlen_q is None:
            raise InputTypeError("seqlen_q is required (or cu_seqlens_q and cu_seqlens_k for varlen)")
        seqlen_q = _as_length("seqlen_q", seqlen_q)
        seqlen_k = seqlen_q if seqlen_k is None else _as_length("seqlen_k", seqlen_k)
        batch = _as_batch(batch, seqlen_q)
        dev = _as_device(device)
        q_lens, k_lens = [seqlen_q] * batch, [seqlen_k] * batch
        i = torch.arange(seqlen_q, device=dev, dtype=torch.int64).repeat(batch)
    else:
        if seqlen_q is not None or seqlen_k is not None or batch != 1 or isinstance(batch, bool):
            raise InputValueError(
                "with cu_seqlens_q/k the sample lengths come from them: leave seqlen_q, seqlen_k and batch "
                "unset"
            )
        if device is None and isinstance(cu_seqlens_q, torch.Tensor):
            device = cu_seqlens_q.device
        dev = _as_device(device)
        cu_q, _, q_lens, k_lens = _varlen_prefixes(cu_seqlens_q, cu_seqlens_k, dev)
        total = sum(q_lens)  # known on the host: the row index needs no device read
        starts = torch.repeat_interleave(cu_q[:-1], cu_q.diff(), output_size=total)
        i = torch.arange(total, device=dev) - starts
    used = k_lens if seqused_k is None else _seqused(seqused_k, k_lens)
    rows = torch.tensor(q_lens, device=dev, dtype=torch.int64)
    # output_size: known here, and the meta device cannot count it
    per_row = lambda x: torch.repeat_interleave(x, rows, output_size=i.numel())  # noqa: E731
    k_len = per_row(torch.tensor(used, device=dev, dtype=torch.int64))
    d = i + k_len - per_row(rows) if align == "bottom_right" else i
    return d, k_len, q_lens, k_lens


def _seqused(seqused_k: object, k_lens: list[int]) -> list[int]:
    """``seqused_k`` as a list of ints, one per sample, each within the sample's keys."""
    used = _int_list("seqused_k", seqused_k)
    if len(used) != len(k_lens):
        raise InputValueError(
            f"seqused_k has {len(used)} entries for {len(k_lens)} samples: one per sample (batch=, or "
            "cu_seqlens_q/k)"
        )
    for b, (u, k) in enumerate(zip(used, k_lens, strict=True)):
        if not 0 <= u <= k:
            raise InputValueError(f"seqused_k[{b}] = {u}: must be within the sample's {k} keys (0..{k})")
    return used


def _keys_hint(builder: str, aligned: bool = True) -> str:
    """How ``builder`` takes other key lengths; ``aligned``: where its rows are aligned to the last
    key (bottom-right), which makes a mask of fewer rows that of the sequence's last positions (a
    top-left one's are its first)."""
    if not aligned:
        return f"build it for k's lengths: masks.{builder}(seqlen_q, seqlen_k, ...), or with cu_seqlens_k"
    return (
        f"build it for k's lengths: masks.{builder}(seqlen_q, seqlen_k, ...) (q's rows as the last "
        "seqlen_q of the keys' positions), or with cu_seqlens_k; for q at other positions of the keys' "
        "sequence (a context-parallel shard, a prefill chunk), masks.select_rows of its whole mask"
    )


#: document_ids' refusal of other samples: one row of ids per sample
_DOCUMENT_IDS_ROWS_HINT = " (doc_ids [B, S], one row per sample; the same for each: doc_ids.expand(B, -1))"
#: document's refusal of other samples: a flat list of document lengths for a batch, and what to give
_DOCUMENT_ROWS_HINT = (
    " (one list of document lengths per sample; varlen samples of other lengths: "
    "torch.cat([masks.document(lens_b) for each sample b], dim=2), or masks.causal("
    "cu_seqlens_q=..., cu_seqlens_k=...) where each sample is one document)"
)


def causal(
    seqlen_q: int | None = None,
    seqlen_k: int | None = None,
    *,
    batch: int = 1,
    cu_seqlens_q: torch.Tensor | Sequence[int] | None = None,
    cu_seqlens_k: torch.Tensor | Sequence[int] | None = None,
    seqused_k: torch.Tensor | Sequence[int] | None = None,
    device: str | torch.device | None = None,
    align: Literal["bottom_right", "top_left"] = "bottom_right",
) -> torch.Tensor:
    """Bottom-right aligned causal mask: row ``i`` sees keys ``< i + 1 + seqlen_k - seqlen_q``
    (``align="top_left"``: keys ``<= i``, torch's ``kv_idx <= q_idx`` and SDPA's ``is_causal``).

    The bound is clipped to ``[0, seqlen_k]`` (rows before the diagonal starts see nothing).
    Bottom-right, fewer rows than keys are the sequence's last ``seqlen_q`` positions (a decode
    step, a prefill's last chunk); rows of other positions (a context-parallel shard) are the whole
    sequence's mask's: :func:`~maskplan_core.masks.select_rows`.
    Returns ``[1, 1, batch * seqlen_q]`` int32. Varlen: give ``cu_seqlens_q`` and
    ``cu_seqlens_k`` (int ``[B + 1]``) instead of the lengths; each sample is aligned by its own
    lengths and the result is ``[1, 1, total_q]`` (on ``cu_seqlens_q``'s device by default).
    ``seqused_k`` (one int per sample; FlashAttention's name): sample ``b`` uses only its first
    ``seqused_k[b]`` keys (a static KV cache's written slots), and its diagonal aligns to the
    last of them (bottom-right; a top-left one stays at key 0); the keys past them are hidden.
    ``device``: where the endpoints are made (None: the CPU, or ``cu_seqlens_q``'s device where it
    is a tensor).
    """
    d, k_len, *lens = _diagonals(
        seqlen_q, seqlen_k, batch, cu_seqlens_q, cu_seqlens_k, device, seqused_k, align
    )
    hint = _keys_hint("causal", aligned=align == "bottom_right")
    return _finish([torch.minimum((d + 1).clamp(min=0), k_len)], 1, "masks.causal", *lens, keys_hint=hint)


def full(
    seqlen_q: int | None = None,
    seqlen_k: int | None = None,
    *,
    batch: int = 1,
    cu_seqlens_q: torch.Tensor | Sequence[int] | None = None,
    cu_seqlens_k: torch.Tensor | Sequence[int] | None = None,
    seqused_k: torch.Tensor | Sequence[int] | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """No mask: row ``i`` sees every key of its sample (torch's ``block_mask=None``; with varlen
    samples, attention within each sample). Returns ``[1, 1, batch * seqlen_q]`` int32 (varlen:
    ``[1, 1, total_q]``), taking the lengths, ``seqused_k`` and ``device`` as :func:`causal` does."""
    _, k_len, *lens = _diagonals(seqlen_q, seqlen_k, batch, cu_seqlens_q, cu_seqlens_k, device, seqused_k)
    return _finish([k_len], 1, "masks.full", *lens, keys_hint=_keys_hint("full", aligned=False))


#: a causal window of a size per head, which no builder takes (for Sq == Sk; sliding_window aligns
#: the diagonal to the last key)
_PER_HEAD_WINDOW = (
    "a window per head is a mask_mod's: masks.from_mask_mod(lambda b, h, q, kv: (kv <= q) & "
    "(q - kv <= window[h]), B, Hq, S, S) with window a tensor of Hq sizes (where Sq == Sk)"
)


def sliding_window(
    seqlen_q: int | None = None,
    seqlen_k: int | None = None,
    *,
    window_left: int,
    window_right: int = 0,
    batch: int = 1,
    cu_seqlens_q: torch.Tensor | Sequence[int] | None = None,
    cu_seqlens_k: torch.Tensor | Sequence[int] | None = None,
    seqused_k: torch.Tensor | Sequence[int] | None = None,
    device: str | torch.device | None = None,
    align: Literal["bottom_right", "top_left"] = "bottom_right",
) -> torch.Tensor:
    """Sliding-window mask: row ``i`` sees keys ``[d - window_left, d + window_right]`` (inclusive).

    ``d = i + seqlen_k - seqlen_q`` (bottom-right aligned diagonal; ``align="top_left"``:
    ``d = i``, as :func:`causal`); the window is clipped to
    ``[0, seqlen_k)``.  Rows whose window misses every key get endpoints ``[0, 0, 0]``. Rows of
    positions other than the last ``seqlen_q`` (a context-parallel shard): as :func:`causal` says.
    Returns ``[1, 3, batch * seqlen_q]`` int32 with endpoints ``[0, lo, hi]``. Varlen, ``device``
    and ``seqused_k`` (``seqlen_k`` then the sample's used keys) as :func:`causal`.
    """
    window_left = _as_extent("window_left", window_left, window=True, per_head=_PER_HEAD_WINDOW)
    window_right = _as_extent("window_right", window_right, window=True)
    d, k_len, *lens = _diagonals(
        seqlen_q, seqlen_k, batch, cu_seqlens_q, cu_seqlens_k, device, seqused_k, align
    )
    lo = torch.minimum((d - window_left).clamp(min=0), k_len)
    hi = torch.minimum((d + window_right + 1).clamp(min=0), k_len)
    empty = lo >= hi
    lo = lo.masked_fill(empty, 0)
    hi = hi.masked_fill(empty, 0)
    hint = _keys_hint("sliding_window", aligned=align == "bottom_right")
    return _finish([torch.zeros_like(lo), lo, hi], 1, "masks.sliding_window", *lens, keys_hint=hint)


def _is_sequence(x: object) -> bool:
    """True for a list/tuple/… or a tensor of rank >= 1 (not for str/bytes or 0-d tensors)."""
    if isinstance(x, torch.Tensor):
        return x.dim() >= 1
    return isinstance(x, Sequence) and not isinstance(x, (str, bytes))


def _int_rows(name: str, value: object) -> tuple[list[list[int]], bool]:
    """``(rows, nested)``: ``value``, a sequence of ints or of such sequences (lists, tuples, 1-D /
    2-D integer tensors or numpy arrays), as one list of ints per batch sample, and whether it was
    given per sample."""
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):  # as the lists it holds
        value = value.tolist()
    if isinstance(value, torch.Tensor):
        if value.dim() == 1:
            return [_int_list(name, value)], False
        if value.dim() == 2:
            return [_int_list(f"{name}[{b}]", row) for b, row in enumerate(value)], True
        raise InputValueError(f"{name} must be 1-D or 2-D, got a tensor of shape {tuple(value.shape)}")
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InputTypeError(
            f"{name} must be a sequence of ints or a sequence of such sequences, got {type(value).__name__}"
        )
    if len(value) == 0:
        raise InputValueError(f"{name} must not be empty")
    nested = [_is_sequence(x) for x in value]
    if all(nested):
        return [_int_list(f"{name}[{b}]", row) for b, row in enumerate(value)], True
    if not any(nested):
        return [_int_list(name, value)], False
    raise InputTypeError(f"{name} must be either a sequence of ints or a sequence of sequences, not a mix")


def _parse_doc_lens(doc_lens: object) -> list[list[int]]:
    """Normalise ``doc_lens`` to a list (one entry per batch sample) of document length lists."""
    seqs, nested_input = _int_rows("doc_lens", doc_lens)
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
    chunk_size: int | None = None,
    prefix_lens: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """Packed-document (block-diagonal) self-attention mask.

    ``doc_lens`` is either one sequence of document lengths (one packed sequence, batch 1) or a
    sequence of such sequences (one per batch sample; every sample must sum to the same ``S``),
    also accepted as a 1-D / 2-D integer tensor.  Zero-length documents are allowed and ignored;
    a total length of 0 gives endpoints without rows (an empty problem).

    A row at position ``i`` in document ``[s, e)`` sees keys ``[s, e)`` (``causal=False``),
    ``[s, i]`` (``causal=True``).  ``window_left`` additionally limits the left edge to
    ``max(s, i - window_left)`` (for ``causal=False`` the right edge stays ``e``). ``chunk_size``
    (chunked attention, as :func:`chunked`, inside each document) cuts every document into chunks
    of that many tokens from its start: a row sees only keys of its own chunk. ``prefix_lens``
    (prefix-LM inside each document, ``causal=True``), shaped as ``doc_lens``: the first
    ``prefix_lens[b][j]`` tokens of document ``j`` see one another both ways (a prompt), the rest
    causally, as :func:`prefix_lm` per document; a window or chunks still apply on top.
    Returns ``[1, 3, B * S]`` int32 with endpoints ``[0, lo, hi]`` on ``device`` (None: the CPU).
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
    prefix = None if prefix_lens is None else _prefix_tokens(prefix_lens, seqs, dev)
    return _documents(
        ids, causal, window_left, chunk_size, "masks.document", rows_hint=_DOCUMENT_ROWS_HINT, prefix=prefix
    )


def _prefix_tokens(prefix_lens: object, seqs: list[list[int]], dev: torch.device) -> torch.Tensor:
    """bool ``[B, S]``: the tokens of each document's prefix, from ``prefix_lens`` shaped as the
    parsed ``doc_lens`` (``seqs``)."""
    rows, nested = _int_rows("prefix_lens", prefix_lens)
    if [len(row) for row in rows] != [len(seq) for seq in seqs]:
        raise InputValueError(
            f"prefix_lens must give one prefix per document of doc_lens ({[len(q) for q in seqs]} "
            f"documents per sample), got {[len(row) for row in rows]}"
        )
    for b, (row, seq) in enumerate(zip(rows, seqs, strict=True)):
        for j, (p, n) in enumerate(zip(row, seq, strict=True)):
            if not 0 <= p <= n:
                name = f"prefix_lens[{b}][{j}]" if nested else f"prefix_lens[{j}]"
                raise InputValueError(f"{name} must be in [0, {n}] (its document's length), got {p}")
    tokens = []
    for row, seq in zip(rows, seqs, strict=True):  # per document, p prefix tokens then n - p others
        runs = [x for p, n in zip(row, seq, strict=True) for x in (p, n - p)]
        marks = torch.tensor([True, False] * len(seq), device=dev)
        tokens.append(torch.repeat_interleave(marks, torch.tensor(runs, device=dev), output_size=sum(seq)))
    return torch.stack(tokens)


def document_ids(
    doc_ids: torch.Tensor,
    *,
    causal: bool = True,
    window_left: int | None = None,
    chunk_size: int | None = None,
    pad_id: int | None = None,
    prefix: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`document` from per-token document ids, built on ``doc_ids``' device without reading
    it back to the host (a CUDA tensor from the data loader stays on the GPU, with no sync).

    ``doc_ids`` is an integer tensor ``[S]`` (one packed sequence) or ``[B, S]`` (one row per batch
    sample); each maximal run of equal consecutive ids within a row is one document, so ids need
    not be sorted or distinct across documents (``[7, 7, 3, 3, 3]`` is two documents; so is
    ``[0, 0, 1, 1, 1]``). Rows see keys as :func:`document` describes, with its ``causal``,
    ``window_left`` and ``chunk_size``. Returns ``[1, 3, B * S]``
    int32 endpoints ``[0, lo, hi]``. Position ids that restart at 0 in every document give the ids
    as ``(position_ids == 0).cumsum(-1)``.

    Padding: a run of padding tokens is a document of its own where its ids differ from its
    neighbours' (give them their own id), so no other row sees it, but its rows attend to one
    another. With ``pad_id`` the rows of that id see nothing instead (their output is 0, their LSE
    -inf, their gradients 0, and their tiles cost no attention work). Every token of that id is
    padding, a document's too: use an id no document has, such as -1. From a data loader's
    ``position_ids``, ``attention_mask`` (0 on padding) and ``labels`` (-100 on the prompt)::

        ids = (position_ids == 0).cumsum(-1).masked_fill(attention_mask == 0, -1)
        endpoints = document_ids(ids, prefix=labels == -100, pad_id=-1)  # prefix: SFT prompts

    ``prefix`` (prefix-LM inside each document, ``causal=True``): a bool tensor shaped as
    ``doc_ids``, True on prefix tokens (a prompt). A run of them (split where a document starts)
    sees itself both ways; every row also sees its document's keys up to itself, as
    :func:`document`'s ``prefix_lens``; a window or chunks still apply on top.
    """
    require_tensor("doc_ids", doc_ids)
    if doc_ids.dtype.is_floating_point or doc_ids.dtype.is_complex or doc_ids.dtype == torch.bool:
        raise InputTypeError(f"doc_ids must be an integer tensor, got {doc_ids.dtype}")
    if doc_ids.dim() not in (1, 2) or (doc_ids.dim() == 2 and doc_ids.shape[0] == 0):
        raise InputValueError(f"doc_ids must be [S] or [B, S] with B >= 1, got shape {tuple(doc_ids.shape)}")
    ids = doc_ids if doc_ids.dim() == 2 else doc_ids.unsqueeze(0)  # [B, S]
    pad = None if pad_id is None else ids == _pad_id(pad_id, ids.dtype)
    if prefix is not None:
        if not isinstance(prefix, torch.Tensor) or prefix.dtype != torch.bool:
            got = prefix.dtype if isinstance(prefix, torch.Tensor) else type(prefix).__name__
            raise InputTypeError(f"prefix must be a bool tensor shaped as doc_ids, got {got}")
        if prefix.shape != doc_ids.shape or prefix.device != doc_ids.device:
            raise InputValueError(
                f"prefix must be shaped as doc_ids {tuple(doc_ids.shape)} on its device {doc_ids.device}, "
                f"got {tuple(prefix.shape)} on {prefix.device}"
            )
        prefix = prefix.reshape(ids.shape)
    return _documents(
        ids, causal, window_left, chunk_size, "masks.document_ids", rows_hint=_DOCUMENT_IDS_ROWS_HINT,
        pad=pad, prefix=prefix,
    )  # fmt: skip


def _pad_id(pad_id: object, dtype: torch.dtype) -> int:
    """``pad_id`` where ``dtype`` holds it: torch compares ids with a scalar cast to their dtype, so
    a ``-1`` with uint8 ids would mark id 255's tokens as padding."""
    pad_id = _as_int("pad_id", pad_id)
    info = torch.iinfo(dtype)
    if not info.min <= pad_id <= info.max:
        raise InputValueError(
            f"pad_id = {pad_id} is not a value of doc_ids' dtype {dtype} ({info.min} .. {info.max}): "
            "no token can be padding, and torch would compare the ids with it wrapped around (another "
            "id's tokens taken for padding); give padding an id in that range"
        )
    return pad_id


def _documents(
    ids: torch.Tensor, causal: bool, window_left: int | None, chunk_size: int | None, builder: str,
    rows_hint: str = "", pad: torch.Tensor | None = None, prefix: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """:func:`document_ids` of checked ``ids`` ``[B, S]``, as ``builder`` returns it (``rows_hint``:
    its refusal of other samples' addition, :mod:`maskplan_core.endpoint_samples`; ``pad``: bool
    ``[B, S]``, rows that see nothing; ``prefix``: bool ``[B, S]``, prefix tokens)."""
    if not isinstance(causal, bool):
        raise InputTypeError(f"causal must be a bool, got {type(causal).__name__}")
    if prefix is not None and not causal:
        raise InputValueError(
            "a prefix changes only causal documents (causal=False already shows every row its whole document)"
        )
    window_left = None if window_left is None else _as_extent("window_left", window_left, window=True)
    chunk_size = None if chunk_size is None else _as_extent("chunk_size", chunk_size, 1)
    seqlen = ids.shape[1]
    i = torch.arange(seqlen, device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)  # a document starts at row i
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    lo = torch.where(starts, i, 0).cummax(dim=1).values  # the latest start at or before i
    if not causal:  # one past the row's document
        hi = _next_after(starts, i, seqlen)
    elif prefix is None:
        hi = i + 1
    else:  # a prefix row sees on to the end of its run of prefix tokens in its document
        hi = torch.where(prefix, _next_after(starts | ~prefix, i, seqlen), i + 1)
    if chunk_size is not None:  # the row's chunk, counted from its document's start
        lo = lo + torch.div(i - lo, chunk_size, rounding_mode="floor") * chunk_size
        hi = torch.minimum(hi, lo + chunk_size)
    if window_left is not None:
        lo = torch.maximum(lo, i - window_left)
    if pad is not None:  # [0, 0) U [0, 0): no key
        lo, hi = lo.masked_fill(pad, 0), hi.masked_fill(pad, 0)
    rows = [torch.zeros_like(lo).reshape(-1), lo.reshape(-1), hi.reshape(-1)]
    return _finish(rows, 1, builder, [seqlen] * ids.shape[0], rows_hint=rows_hint)


def _next_after(flags: torch.Tensor, i: torch.Tensor, seqlen: int) -> torch.Tensor:
    """Per position ``i`` of ``[B, S]``, the earliest later position where ``flags`` holds, else S."""
    later = torch.where(flags[:, 1:], i[:, 1:], seqlen)
    # the closing column in i's int64 (flags come from ids of any integer dtype, which may not hold S)
    later = torch.cat([later, torch.full_like(i[:, :1], seqlen)], dim=1)
    return later.flip(1).cummin(dim=1).values.flip(1)


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
    (if given, it must match).  Returns ``[1, 1, batch * seqlen]`` int32 on ``device`` (None: the
    CPU).
    """
    seqlen = _as_length("seqlen", seqlen)
    dev = _as_device(device)
    if not _is_sequence(prefix_len):
        prefixes = [_as_extent("prefix_len", prefix_len)]
        batch = 1 if batch is None else _as_batch(batch, seqlen)
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
        _as_batch(len(prefixes), seqlen, "len(prefix_len)")
    p = torch.tensor([min(x, MAX_SEQLEN) for x in prefixes], dtype=torch.int64, device=dev)[:, None]
    i = torch.arange(seqlen, device=dev, dtype=torch.int64)[None, :]
    f0 = torch.maximum(p, i + 1).clamp(max=seqlen).reshape(-1)
    return _finish([f0], 1, "masks.prefix_lm", [seqlen] * len(prefixes))


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
    limited to ``<= i``.  Returns ``[1, 3, batch * seqlen]`` int32 with endpoints ``[0, lo, hi]``
    on ``device`` (None: the CPU).
    """
    seqlen = _as_length("seqlen", seqlen)
    chunk_size = _as_extent("chunk_size", chunk_size, 1)
    if not isinstance(causal, bool):
        raise InputTypeError(f"causal must be a bool, got {type(causal).__name__}")
    batch = _as_batch(batch, seqlen)
    dev = _as_device(device)
    i = torch.arange(seqlen, device=dev, dtype=torch.int64)
    lo = torch.div(i, chunk_size, rounding_mode="floor") * chunk_size
    hi = i + 1 if causal else (lo + chunk_size).clamp(max=seqlen)
    return _finish([torch.zeros_like(lo), lo, hi], batch, "masks.chunked", [seqlen] * batch)
