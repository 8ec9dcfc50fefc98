"""Masks from other representations: a dense boolean mask (:func:`from_dense`), a FlexAttention
``mask_mod`` (:func:`from_mask_mod`) or ``BlockMask`` (:func:`from_block_mask`), encoded as the
fewest endpoints each row needs."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..endpoint_samples import record_samples
from ..error_flags import sample_of_row
from ..errors import InputTypeError, InputValueError
from ..validation import require_tensor
from ._args import (
    _as_batch,
    _as_device,
    _as_int,
    _as_length,
    _require_values,
    _varlen_prefixes,
)

# Upper bound on the number of dense mask elements that the encoder (dense -> endpoints) and the
# mask_mod evaluation of from_mask_mod / from_block_mask take at once.
_CHUNK_ELEMENTS = 1 << 24


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
    return join_rows([_encode_rows(mask[:, r0 : r0 + step]) for r0 in range(0, t, step)])


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


def join_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Endpoints ``[H, nfunc_i, n_i]`` of consecutive rows -> ``[H, max nfunc, sum n_i]``, shorter
    ones padded by repeating each row's last endpoint (empty intervals)."""
    nfunc = max(p.shape[1] for p in parts)
    padded = [
        torch.cat([p, p[:, -1:].expand(-1, nfunc - p.shape[1], -1)], dim=1) if p.shape[1] < nfunc else p
        for p in parts
    ]
    return torch.cat(padded, dim=2)


def from_dense(
    mask: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | Sequence[int] | None = None,
    cu_seqlens_k: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """Convert a dense boolean mask ``[Hmask, total_q, Sk]`` (or SDPA's ``[B, Hmask, Sq, Sk]``, fixed
    length) to endpoints ``[Hmask, nfunc, total_q]``.

    SDPA's mask expanded over the heads (``m.expand(B, H, Sq, Sk)``, a head stride of 0) gives one
    head (``Hmask = 1``): the plan serves every head and PackGQA takes it. Heads held apart keep
    ``Hmask = H`` even where they are equal (the heads a mask has do not depend on its values).

    ``nfunc`` is the smallest odd count representing every row: a row with ``r`` runs of True needs
    ``2r - 1`` endpoints if it starts with True at key 0 and ``2r + 1`` otherwise; shorter rows are
    padded by repeating their last endpoint.  All-False rows give all-zero endpoints.

    Fixed length: ``total_q = B * Sq`` and the last axis holds the ``Sk`` keys.  Varlen: pass both
    ``cu_seqlens_q`` and ``cu_seqlens_k`` (int ``[B + 1]``); the last axis is ``max_seqlen_k``
    (sample-local key positions) and entries past each row's sample ``k_len`` must be False.
    The result lives on ``mask.device``.
    """
    require_tensor("mask", mask)
    if mask.layout != torch.strided:
        raise InputTypeError(
            f"mask must be a dense (strided) tensor, got layout {mask.layout} (mask.to_dense())"
        )
    if mask.dtype != torch.bool:
        additive = " (a 0 / 1 mask: mask.bool())" if not mask.is_complex() else ""
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
    if sdpa and mask.shape[0] == 0:
        raise InputValueError(f"mask must have at least one sample (B >= 1), got shape {tuple(mask.shape)}")
    samples = None  # the samples' rows and keys where the mask says them: SDPA's layout, or cu_seqlens
    if sdpa:  # rows are batch-major
        if mask.shape[1] > 1 and mask.stride(1) == 0:  # one mask expanded over the heads: encode it once
            mask = mask[:, :1]
        b, hm, sq, sk = mask.shape
        mask = mask.transpose(0, 1).reshape(hm, b * sq, sk)
        samples = [sq] * b, [sk] * b
        keys_hint = "build it for k's lengths: a dense mask of k's key columns"
    h, t, sk = mask.shape
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        dev = mask.device
        cu_q, cu_k, q_lens, k_lens = _varlen_prefixes(cu_seqlens_q, cu_seqlens_k, dev)
        if sum(q_lens) != t:
            raise InputValueError(
                f"cu_seqlens_q[-1] = {sum(q_lens)} must equal mask.shape[1] (total_q) = {t}"
            )
        too_long = [b for b, (q, k) in enumerate(zip(q_lens, k_lens, strict=True)) if q and k > sk]
        if too_long:
            raise InputValueError(
                f"mask has {sk} key columns but sample {too_long[0]} has k_len {k_lens[too_long[0]]} "
                f"(cu_seqlens_k); the key axis must be at least max_seqlen_k"
            )
        row_klen = torch.repeat_interleave(cu_k.diff(), cu_q.diff(), output_size=t)  # [T]
        keys = torch.arange(sk, device=dev)
        step = _row_chunk(h, sk)
        for r0 in range(0, t, step):
            outside = keys >= row_klen[r0 : r0 + step, None]  # [t, Sk]
            bad = (mask[:, r0 : r0 + step] & outside).any(-1)  # [H, t]
            if bool(bad.any()):
                hh, rr = (int(x) for x in bad.nonzero()[0])
                row = r0 + rr
                b = sample_of_row(cu_q, row)[0]
                raise InputValueError(
                    f"mask row {row} (head {hh}, sample {b}) has True entries at keys >= its sample's "
                    f"k_len {int(row_klen[row])}"
                )
        samples = q_lens, k_lens
        keys_hint = "build it for k's lengths: masks.from_dense(mask, cu_seqlens_q=..., cu_seqlens_k=k's)"
    endpoints = _encode(mask)
    if samples is None:
        return endpoints
    return record_samples(endpoints, "masks.from_dense", *samples, keys_hint=keys_hint)


class _SharedHeadHint(NamedTuple):
    """What a converter with one mask for every head tells a mask_mod that reads its head index:
    how to give every head, and how to give a model of one head, whose mask_mod raised at head 1
    (a per-head table of one entry) or reads its head index without raising there."""

    heads: str
    one_head_raised: str
    one_head_reads: str


#: ``from_mask_mod``'s routes for a model of one head (``H=1`` takes a failure at head 1 as one)
_MASK_MOD_ONE_HEAD = (
    "H=1 for a model of one head",
    "For a model of one head, give it head 0: "
    "lambda b, h, q, kv: mask_mod(b, torch.tensor(0, device=q.device), q, kv)",
)
#: ``from_mask_mod``'s ``H`` values that stand for one mask of every head, as ``create_block_mask``'s
#: do, and how to give the heads instead
_SHARED_HEAD_HINTS = {
    None: _SharedHeadHint("H=None: pass H=Hq", *_MASK_MOD_ONE_HEAD),
    1: _SharedHeadHint("H=1 gives one mask for every head, as in torch: pass H=Hq", *_MASK_MOD_ONE_HEAD),
}
#: ``from_block_mask``'s: one head entry, ``heads`` not given
_BLOCK_MASK_HEAD_HINT = _SharedHeadHint(
    "H=None (or 1): pass heads=Hq", "heads=1 for a model of one head", "For a model of one head, pass heads=1"
)


def from_mask_mod(
    mask_mod: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    B: int,
    H: int | None,
    Sq: int | None = None,
    Sk: int | None = None,
    device: str | torch.device | None = None,
    BLOCK_SIZE: int | tuple[int, int] | None = None,
    _compile: bool = False,
    *,
    Q_LEN: int | None = None,
    KV_LEN: int | None = None,
    separate_full_blocks: bool = True,
    compute_dq_write_order: bool = False,
    dq_kv_order: bool = True,
    batch: int | None = None,
) -> torch.Tensor:
    """Build endpoints from a FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

    The endpoints hold the mask as the mask_mod gives it now: torch calls a mask_mod on every
    attention call, so where it reads a tensor changed in place later (a decode offset), convert
    it again after the change.

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
    of one entry) is taken as one of a model of one head, which torch never calls with head 1, and
    is refused for q of more heads.
    The positional arguments are ``create_block_mask``'s, ``device``, ``BLOCK_SIZE`` and
    ``_compile`` included; ``Sq`` and ``Sk``
    are its ``Q_LEN`` and ``KV_LEN``, and are taken by those names too, so that a call written
    with torch's keywords converts as it is; its ``BLOCK_SIZE``, ``_compile``, ``separate_full_blocks``,
    ``compute_dq_write_order`` and ``dq_kv_order`` are taken too and change nothing (endpoints are
    per element, the mask_mod is evaluated eagerly, and the plan makes its own block lists).
    ``B = None`` takes ``batch=``, the samples (endpoints name every query row of the batch): a
    mask_mod that does not read its sample index ``b`` is evaluated once and its rows given to every
    sample (an image grid's mask costs one sample's evaluation), one that reads it (found as the
    head index is) once per sample, since torch calls it with each sample's index too.
    The result is refused for q or k of other lengths than ``Sq`` and ``Sk``, as torch refuses a
    block mask made for another ``Q_LEN`` or ``KV_LEN`` (:mod:`maskplan_core.endpoint_samples`),
    and for q of other than ``H`` heads where ``H > 1``: ``h`` is a q head's index, as in torch, so
    a mask_mod evaluated for the kv heads never saw the others, even where the result kept one mask.
    """
    _require_mask_mod(mask_mod)
    if B is None and batch is None:
        raise InputTypeError(
            "B=None needs batch=, the samples to give sample 0's mask (endpoints name every query row "
            "of the batch, row = b * Sq + q); or pass B, the batch size, to evaluate mask_mod per sample"
        )
    if B is not None and batch is not None:
        raise InputTypeError("batch= goes with B=None (sample 0's mask for every sample); got B and batch")
    Sq, Sk = _torch_name("Sq", Sq, "Q_LEN", Q_LEN), _torch_name("Sk", Sk, "KV_LEN", KV_LEN)
    copies = 1
    if B is None:  # one evaluation for every sample, unless the mask_mod reads b
        batch = _as_batch(batch, _as_length("Sq", Sq))
        B, copies = (1, batch) if _reads_index(mask_mod, _as_device(device), 0, "b") is False else (batch, 1)
    B = _as_int("B", B, 1)
    H = None if H is None else _as_int("H", H, 1)
    shared_heads = _SHARED_HEAD_HINTS.get(H)
    one_head = H == 1  # only a failure at head 1 tells a model of one head from torch's shared entry
    H = H or 1
    shape = (H, _as_length("Sq", Sq), _as_length("Sk", Sk))
    dev = _as_device(device)
    _require_values("from_mask_mod", dev)
    parts, raised_at_head_1 = [], []
    for b in range(B):
        sample_heads = shared_heads if b == 0 else None  # the head-1 probe needs one sample
        chunks = _mask_mod_rows(
            mask_mod, b, shape, dev, sample_heads, one_head=one_head, samples=B, raised=raised_at_head_1
        )
        parts += [_encode(rows) for rows in chunks]
    keys_hint = "build it for k's lengths: from_mask_mod's Sk (KV_LEN)"
    endpoints = _join_samples(parts)
    if copies > 1:
        endpoints = endpoints.repeat(1, 1, copies)
    samples = B * copies
    return record_samples(
        endpoints, "masks.from_mask_mod", [shape[1]] * samples, [shape[2]] * samples, keys_hint=keys_hint,
        heads=H, every_head=not raised_at_head_1,
    )  # fmt: skip


def _require_mask_mod(mask_mod) -> None:
    """A callable taking ``(b, h, q_idx, kv_idx)``; a score_mod's five arguments are named as such
    (vmap would fail inside it with a missing argument)."""
    if not callable(mask_mod):
        raise InputTypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    try:
        params = inspect.signature(mask_mod).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): its evaluation tells
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(p.default is p.empty for p in positional)
    takes_more = any(p.kind is p.VAR_POSITIONAL for p in params)
    if required > 4 or (len(positional) < 4 and not takes_more):
        score_mod = (
            ": a score_mod(score, b, h, q_idx, kv_idx)? One that only masks is a mask_mod returning "
            "where the score is kept, e.g. lambda b, h, q_idx, kv_idx: kv_idx <= q_idx"
        ) if required == 5 else ""
        raise InputTypeError(
            f"mask_mod must take (b, h, q_idx, kv_idx), as torch's create_block_mask calls it; it takes "
            f"{required} required positional arguments{score_mod}"
        )


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
    keeps ``Hmask = 1`` where the heads agree); ``heads=1`` takes it as a model of one head's,
    refused for q of more heads. Every sample's and head's blocks must hold every
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
      ``b * Sq + q`` of the last dimension; heads: the first dimension, one entry where Hmask = 1),
      then ``.contiguous()``.
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
            "dimension (one entry for every head where Hmask = 1), then .contiguous() (e.g. "
            "endpoints[..., S:2 * S].contiguous() for sample 1 of S rows)"
        )
    blocks = block_mask.to_dense() != 0  # [B, H, Q blocks, KV blocks]
    # one head entry standing for every head (H=None) unless ``heads`` says how many there are
    # (a block mask made with H=1 holds one entry too: torch keeps no difference)
    shared_heads = _BLOCK_MASK_HEAD_HINT if heads is None and blocks.shape[1] == 1 else None
    counts = {}
    for name, given, entries in (("batch", batch, blocks.shape[0]), ("heads", heads, blocks.shape[1])):
        counts[name] = entries if given is None else _as_int(name, given, 1)
        if entries not in (1, counts[name]):
            noun = "batch entries" if name == "batch" else "head entries"
            raise InputValueError(f"block_mask has {entries} {noun} but {name}={counts[name]}")
    # heads=1 (the caller's one head) evaluates head 0 alone: where the mask_mod reads h (or that
    # cannot be told) the endpoints are a model of one head's, not one mask for every head
    one_head = heads == 1 and _reads_head(block_mask.mask_mod, blocks.device, counts["batch"]) is not False
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
    keys_hint = "build it for k's lengths: the block mask's KV_LEN (create_block_mask)"
    lens = [shape[1]] * batch, [shape[2]] * batch
    return record_samples(
        _join_samples(parts), "masks.from_block_mask", *lens, keys_hint=keys_hint, heads=heads,
        every_head=not one_head,
    )  # fmt: skip


def _blocks_differ(b: int, head: int, entries: tuple[int, int], heads: int) -> InputValueError:
    """The refusal of a block mask whose blocks of sample ``b``, head ``head`` contradict its
    mask_mod; ``entries``: its (batch, head) entry counts."""
    at_head = f" at head {head}" if heads > 1 else ""
    # a shared entry (B=None / H=None) holds sample 0's, head 0's blocks: torch applies them
    # to the others, which their own mask_mod contradicts here
    named = (("B", entries[0], b), ("H", entries[1], head))
    shared = [f"{noun}=None (or 1)" for noun, count, i in named if count == 1 and i > 0]
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
    mask_mod, b: int, shape: tuple[int, int, int], dev: torch.device,
    shared_heads: _SharedHeadHint | None = None,
    *, one_head: bool = False, align: int = 1, samples: int = 1, raised: list | None = None,
):  # fmt: skip
    """``mask_mod`` of batch sample ``b`` as dense bool ``[H, rows, Sk]`` chunks of consecutive query
    rows, each a multiple of ``align`` rows (the last may be shorter) and, where ``align`` allows,
    at most about ``_CHUNK_ELEMENTS`` elements: the whole ``[H, Sq, Sk]`` never exists at once.
    ``shared_heads`` (one head standing for every head, ``H = 1``, with what to say instead)
    refuses a mask_mod that reads its head index in any of ``samples`` (:func:`_reads_head`), since
    torch calls it with each head's index. Under ``one_head`` (``H = 1``) such a mask_mod is taken
    as one of a model of one head where it fails at head 1 (a per-head table of one entry), which
    torch never calls with head 1; it is evaluated at head 1 to tell, and ``raised`` (a list) gets
    an entry. Where that cannot be told, head 1 is evaluated instead and compared with head 0
    (heads past 1 unchecked)."""
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
                        f"{err}); {shared_heads.heads}, or {shared_heads.one_head_raised}"
                    ) from err
                probe, reads_head = None, False
                if raised is not None:
                    raised.append(b)
            else:
                reads_head |= bool(traced) or not torch.equal(res[0], other[0])
        yield res.to(dev)
    if reads_head:
        raise _reads_head_error(shared_heads)


def _reads_head_error(shared_heads: _SharedHeadHint) -> InputValueError:
    return InputValueError(
        "mask_mod reads its head index, and torch's flex_attention calls it with each head's index, "
        f"so one mask for every head could differ from what torch computes; {shared_heads.heads} (the "
        f"endpoints keep one mask where every head's is the same). {shared_heads.one_head_reads}"
    )


class _Follows(TorchDispatchMode):
    """Marks every tensor an operation makes from a marked one, starting with an index tensor (the
    head's, the sample's), and whether a marked one was read as a Python value (``int(b)``, a list
    indexed with it): what a trace would record, without patching anything for the process (fx
    tracing patches ``nn.Module`` and flags "tracing" globally; a dispatch mode's stack is the
    calling thread's). Entered under ``_MODE_LOCK``: a mode's enter and exit save and restore
    torch's process-wide ``is_in_torch_dispatch_mode()`` flag, and two threads inside one at once
    left it set."""

    def __init__(self, start: torch.Tensor):
        super().__init__()
        self.marked = {id(start): start}  # held, so that no id is reused while the evaluation runs
        self.read_as_value = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and id(t) in self.marked for t in tree_leaves((args, kwargs))):
            self.marked.update((id(t), t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            self.read_as_value |= func is torch.ops.aten._local_scalar_dense.default
        return out

    def reached(self, out: torch.Tensor) -> bool:
        """Whether ``out`` came from the start tensor, or depends on it through a value read."""
        return id(out) in self.marked or self.read_as_value


#: one :class:`_Follows` at a time in the process (its docstring says why)
_MODE_LOCK = threading.Lock()


def _reads_head(mask_mod, dev: torch.device, samples: int) -> bool | None:
    """Whether ``mask_mod`` reads its head index ``h`` (its result comes out of an operation on
    ``h``, even one that leaves it unchanged): :func:`_reads_index` at one element of each of
    ``samples`` samples (the sample index is a plain value, which a mask_mod may branch on or index
    a list with). For a sample, the answer holds for every head, row and key, since every operation
    ``h`` flows through is seen. None where an evaluation fails and none read ``h`` (the caller then
    compares head 1 with head 0)."""
    failed = False
    for b in range(samples):
        answer = _reads_index(mask_mod, dev, b, "h")
        if answer:
            return True
        failed |= answer is None
    return None if failed else False


def _reads_index(mask_mod, dev: torch.device, b: int, index: str) -> bool | None:
    """Whether ``mask_mod``'s result at one element of sample ``b`` comes from its ``index``
    (``"h"``, the head's, or ``"b"``, the sample's): an operation on it reaches the result, or it is
    read as a value (a branch, a list indexed with it), under :class:`_Follows`, evaluated as
    :func:`_evaluate` evaluates it. None where that evaluation fails (it names any real error)."""
    args = {"b": torch.tensor(b, device=dev)}
    args.update((name, torch.zeros(1, dtype=torch.int64, device=dev)) for name in ("h", "q", "kv"))
    try:
        with _MODE_LOCK, _Follows(args[index]) as mode:
            out = _vmapped(mask_mod)(*args.values())
    except Exception:  # noqa: BLE001 - the evaluation itself names any real error
        return None
    return mode.reached(out)


def _vmapped(mask_mod):
    """``mask_mod(b, h, q_idx, kv_idx)`` over 1-d ``h``, ``q_idx`` and ``kv_idx`` (``_VMAP_DIMS``)."""
    fn = mask_mod
    for in_dims in _VMAP_DIMS:
        fn = torch.vmap(fn, in_dims=in_dims, out_dims=0)
    return fn


#: torch.vmap's errors where a mask_mod reads a value of an index tensor (Python control flow,
#: .item(), .tolist())
_VMAP_VALUE_ERRORS = (
    "data-dependent control flow", "Boolean value of Tensor", "calling .item()", "Cannot access data pointer"
)


def _evaluate(mask_mod, b: int, heads: torch.Tensor, q_idx: torch.Tensor, Sk: int) -> torch.Tensor:
    """``mask_mod`` at sample ``b``, the head indices ``heads``, the query rows ``q_idx`` and every
    kv_idx: bool ``[len(heads), len(q_idx), Sk]``."""
    dev = heads.device
    fn = _vmapped(mask_mod)
    kv_idx = torch.arange(Sk, device=dev)
    try:
        res = fn(torch.tensor(b, device=dev), heads, q_idx, kv_idx)
    except RuntimeError as err:
        under_vmap = (
            "mask_mod is evaluated as torch FlexAttention's create_block_mask evaluates it (under torch.vmap)"
        )
        if "vmap" in str(err) and "dynamic shape" in str(err):
            raise InputValueError(
                f"{under_vmap}, so ops whose result's shape depends on the values (nonzero, unique, "
                f"indexing with a bool mask) fail: compute one bool per index with comparisons, `&`, `|` "
                f"and torch.where ({err})"
            ) from err
        if not any(sign in str(err) for sign in _VMAP_VALUE_ERRORS):
            raise
        raise InputValueError(
            f"{under_vmap}, so Python `and` / `or` / `if` and `.item()`, `.tolist()` or `.numpy()` on "
            f"its index tensors fail: use `&`, `|` and torch.where, and index tensors with tensors ({err})"
        ) from err
    except ValueError as err:
        if "must only return Tensors" not in str(err):
            raise
        raise InputTypeError(
            "mask_mod must return a bool torch.Tensor computed from its index tensors, not a Python "
            "value: for every key visible write `kv_idx >= 0` (not `True`), for none `kv_idx < 0`"
        ) from err
    if not isinstance(res, torch.Tensor):
        raise InputTypeError(f"mask_mod must return a bool torch.Tensor, got {type(res).__name__}")
    if res.dtype != torch.bool:
        raise InputTypeError(f"mask_mod must return a bool tensor, got dtype {res.dtype}")
    if res.shape != (heads.numel(), q_idx.numel(), Sk):
        raise InputValueError(
            f"mask_mod must return one bool per (b, h, q_idx, kv_idx), got a result of shape "
            f"{tuple(res.shape[3:])} for each"
        )
    return res


def _join_samples(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-sample endpoints ``[H, nfunc_b, Sq]`` -> ``[Hmask, nfunc, B * Sq]`` (:func:`join_rows`),
    one head kept if all heads agree."""
    out = join_rows(parts)
    if out.shape[0] > 1 and bool((out == out[:1]).all()):
        return out[:1].clone()  # a slice would keep every head's memory
    return out.contiguous()
