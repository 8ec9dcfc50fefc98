"""Reference attention forward and backward that consume a ``PlanView`` the way a kernel does.

For every mask head, the view's partial entries (predicate decoded from the packed payload
through the consumer's layout: bit 0 -> -inf) and then its full entries (no predicate) are
visited tile by tile. Accumulation is in fp32 (fp64 for fp64 inputs), in two passes over the
tiles: row maxima, then exp-sums and P @ V (the backward recomputes P from the LSE).
Rows with no visible key give O = 0 and LSE = -inf, and zero gradients.

Samples stay independent, as in dense attention: a tile's rows and columns past its sample's end
index a neighbouring sample's tokens, which are zeroed before use and whose results are dropped,
so a non-finite value in one sample never reaches another through a zero probability
(0 * inf = nan). An enclosing ``torch.autocast`` does not change the accumulation dtype.

Q/K/V are THD (``[total, H, D]``); O is ``[total_q, Hq, Dv]``, LSE ``[Hq, total_q]`` and the max
logit ``[Hq]`` in the accumulation dtype (fp32; fp64 for fp64 inputs).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..consumer import check_thd_inputs
from ..plan import BlockEntries, PlanView
from ..validation import representable_scale
from . import unary_dispatch

#: tiles a chunk holds at most, and scores (tiles x their q heads x tm x tn) about at most: the
#: second keeps memory flat in the head count (64 tiles of each of 32 heads took 2 GB); the first
#: keeps short samples' chunks short (a long sample's tile in a chunk stops _kept_extents from
#: trimming the others)
_CHUNK_TILES = 64
_CHUNK_SCORES = 1 << 22


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class _Tiles:
    """One chunk of tiles of one mask head: token indices, keep mask and the Q heads it serves.
    A chunk of full tiles, which lie wholly inside their sample, keeps everything: its ``q_ok``,
    ``k_ok`` and ``keep`` are None, and no mask work is done for it (most tiles of most masks).
    A chunk of partial tiles holds each tile's first ``m <= tm`` rows and ``k <= tn`` columns, up
    to the last ones that any of its tiles keeps."""

    q_tok: torch.Tensor  # [n, m]
    k_tok: torch.Tensor  # [n, k]
    q_ok: torch.Tensor | None  # [n, m]: the row lies in the tile's sample
    k_ok: torch.Tensor | None  # [n, k]: the column lies in the tile's sample
    keep: torch.Tensor | None  # [n, m, k]
    q_heads: torch.Tensor  # [hq']
    kv_heads: torch.Tensor  # [hq']


def _tiles(view: PlanView) -> Iterator[_Tiles]:
    g = view.geometry
    tm, tn = view.block_size
    desc = view.sequence_desc().to(torch.int64)
    dev = desc.device
    t, u = torch.arange(tm, device=dev), torch.arange(tn, device=dev)
    step = min(_CHUNK_TILES, max(1, _CHUNK_SCORES // (heads_per_tile(g) * tm * tn)))
    for kind in ("partial", "full"):
        e: BlockEntries = view.entries(kind)
        for c in range(0, e.head.numel(), step):
            sl = slice(c, c + step)
            b = e.batch[sl]
            q_local, k_local = e.q_block[sl, None] * tm + t, e.k_block[sl, None] * tn + u
            row_ok = col_ok = keep = None
            if e.payload is not None:
                row_ok, col_ok = q_local < desc[b, 2, None], k_local < desc[b, 3, None]
                keep = row_ok[:, :, None] & col_ok[:, None, :] & view.layout.unpack(e.payload[sl])
                # rows and columns past the last one any tile of the chunk keeps contribute nothing:
                # drop them (a tile of a sample shorter than the tile is mostly such rows)
                rows, cols = _kept_extents(keep)
                q_local, row_ok, keep = q_local[:, :rows], row_ok[:, :rows], keep[:, :rows, :cols]
                k_local, col_ok = k_local[:, :cols], col_ok[:, :cols]
            q_tok = (desc[b, 0, None] + q_local).clamp(max=max(g.total_q - 1, 0))
            k_tok = (desc[b, 1, None] + k_local).clamp(max=max(g.total_k - 1, 0))
            for h in e.head[sl].unique().tolist():
                mine = e.head[sl] == h
                q_heads = (
                    torch.arange(g.num_heads_q, device=dev)
                    if g.mask_heads == 1
                    else torch.tensor([h], device=dev)
                )
                masks = (None if x is None else x[mine] for x in (row_ok, col_ok, keep))
                yield _Tiles(q_tok[mine], k_tok[mine], *masks, q_heads, q_heads // g.qhead_per_kvhead)


def heads_per_tile(g) -> int:
    """Q heads a tile of a mask head serves (its chunk's scores are ``[heads, tiles, tm, tn]``)."""
    return g.num_heads_q // g.mask_heads


def _kept_extents(keep: torch.Tensor) -> tuple[int, int]:
    """One past the last row and the last column that any tile of ``keep`` (``[n, m, k]``) keeps,
    at least 1 so that shapes stay non-empty; one device read."""
    ends = [
        (kept.any(0) * torch.arange(1, kept.shape[1] + 1, device=keep.device)).max()
        for kept in (keep.any(2), keep.any(1))
    ]
    rows, cols = torch.stack(ends).tolist()
    return max(rows, 1), max(cols, 1)


def _heads_major(x: torch.Tensor) -> torch.Tensor:
    """THD ``[total, H, D]`` as ``[H, total, D]``, contiguous: a chunk's rows gathered from it are
    ``[h, n, t, d]``, the batch-major layout the chunk's matrix products take without a copy."""
    return x.transpose(0, 1).contiguous()


def _rows(xt: torch.Tensor, tok: torch.Tensor, ok: torch.Tensor | None, heads: torch.Tensor) -> torch.Tensor:
    """Rows ``tok`` of heads ``heads`` of a heads-major ``xt`` (``[h, n, t, d]``), zero where ``ok``
    is False (another sample's token)."""
    return _masked(xt[heads[:, None, None], tok], ok, 0.0, _OVER_ROWS)  # one gather


# how a chunk's masks broadcast: keep [n, m, k] over scores [h, n, m, k]; a row mask [n, t] over
# rows [h, n, t, d] (gathered, or of an output)
_OVER_SCORES = (None,)
_OVER_ROWS = (None, Ellipsis, None)


def _masked(x: torch.Tensor, keep: torch.Tensor | None, value: float, at: tuple) -> torch.Tensor:
    """``x`` with ``value`` where ``keep[at]`` (broadcast) is False; ``x`` itself where ``keep`` is
    None (a chunk of full tiles keeps everything)."""
    return x if keep is None else x.masked_fill(~keep[at], value)


def _exact(fn):
    """Run ``fn(view, q, ...)`` with autocast off: it computes in its own accumulation dtype, and an
    enclosing ``torch.autocast`` would recast its einsums to half precision."""

    @functools.wraps(fn)
    def run(view, q, *args, **kwargs):
        with torch.autocast(q.device.type, enabled=False):
            return fn(view, q, *args, **kwargs)

    return run


def _settle_exp_log(q: torch.Tensor) -> None:
    """The exponentials and logarithms below run on several CPU threads: their kernel must be
    settled first (``unary_dispatch``), or a process's first call may be 1e-4 off."""
    if q.device.type == "cpu":
        unary_dispatch.settle(torch.exp, torch.log)


def _scores(tl: _Tiles, qt, kt, scale) -> torch.Tensor:
    """Scaled scores ``[hq', n, m, k]`` with masked elements at -inf (``qt``, ``kt`` heads-major)."""
    qs = _rows(qt, tl.q_tok, tl.q_ok, tl.q_heads)  # [h, n, m, d]
    ks = _rows(kt, tl.k_tok, tl.k_ok, tl.kv_heads)  # [h, n, k, d]
    s = torch.einsum("hnmd,hnkd->hnmk", qs, ks) * scale
    return _masked(s, tl.keep, float("-inf"), _OVER_SCORES)


def _row_index(total: int, heads: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """Flat index ``head * total + token`` (``[h, n, t]``) of rows ``tok`` of heads ``heads``."""
    return heads[:, None, None] * total + tok[None]


def _probabilities(tl: _Tiles, s: torch.Tensor, row_offset: torch.Tensor) -> torch.Tensor:
    """``exp(s - row_offset)``, exactly 0 off the mask (a padding row's offset is another sample's)."""
    return _masked(torch.exp(s - row_offset.unsqueeze(-1)), tl.keep, 0.0, _OVER_SCORES)


@_exact
def attention_forward(view: PlanView, q, k, v, *, softmax_scale: float, return_max_logit: bool = False):
    check_thd_inputs(view, q=q, k=k, v=v)
    _settle_exp_log(q)
    g = view.geometry
    cd = compute_dtype(q.dtype)
    softmax_scale = representable_scale(softmax_scale, cd, "the reference computes")
    qt, kt, vt = (_heads_major(x.to(cd)) for x in (q, k, v))
    rows = g.num_heads_q * g.total_q
    row_max = torch.full((rows,), float("-inf"), dtype=cd, device=q.device)
    for tl in _tiles(view):
        s = _scores(tl, qt, kt, softmax_scale)
        idx = _row_index(g.total_q, tl.q_heads, tl.q_tok)
        row_max.scatter_reduce_(0, idx.reshape(-1), s.amax(-1).reshape(-1), "amax")
    safe_max = torch.where(torch.isinf(row_max), 0.0, row_max)
    row_sum = torch.zeros(rows, dtype=cd, device=q.device)
    acc = torch.zeros(g.num_heads_q, g.total_q, g.head_dim_v, dtype=cd, device=q.device)
    for tl in _tiles(view):
        idx = _row_index(g.total_q, tl.q_heads, tl.q_tok)
        p = _probabilities(tl, _scores(tl, qt, kt, softmax_scale), safe_max[idx])
        row_sum.index_add_(0, idx.reshape(-1), p.sum(-1).reshape(-1))
        pv = torch.einsum("hnmk,hnkd->hnmd", p, _rows(vt, tl.k_tok, tl.k_ok, tl.kv_heads))
        pv = _masked(pv, tl.q_ok, 0.0, _OVER_ROWS)
        acc.view(rows, -1).index_add_(0, idx.reshape(-1), pv.reshape(-1, g.head_dim_v))
    empty = row_sum == 0
    out = acc / torch.where(empty, 1.0, row_sum).view(g.num_heads_q, g.total_q, 1)
    lse = torch.where(empty, float("-inf"), safe_max + torch.log(row_sum)).view(g.num_heads_q, g.total_q)
    max_logit = None
    if return_max_logit:  # amax over an empty row axis is an error; no query token means -inf
        per_row = row_max.view(g.num_heads_q, g.total_q)
        max_logit = per_row.amax(1) if g.total_q else per_row.new_full((g.num_heads_q,), float("-inf"))
    return out.transpose(0, 1).contiguous(), lse, max_logit


@_exact
def attention_backward(view: PlanView, q, k, v, out, lse, dout, dlse, *, softmax_scale: float):
    """Gradients (dq, dk, dv) in the inputs' dtype; ``dlse`` ``[Hq, total_q]`` or None."""
    check_thd_inputs(view, q=q, k=k, v=v, out=out, lse=lse, dout=dout, dlse=dlse)
    _settle_exp_log(q)
    g = view.geometry
    cd = compute_dtype(q.dtype)
    softmax_scale = representable_scale(softmax_scale, cd, "the reference computes")
    qt, kt, vt, dot = (_heads_major(x.to(cd)) for x in (q, k, v, dout))
    lse_flat = lse.to(cd).reshape(-1)
    safe_lse = torch.where(torch.isinf(lse_flat), 0.0, lse_flat)
    delta = (dot * _heads_major(out.to(cd))).sum(-1).reshape(-1)  # [Hq * total_q]
    if dlse is not None:
        delta = delta - dlse.to(cd).reshape(-1)
    # heads-major accumulators, [H, total, D]
    dq, dk, dv = (torch.zeros_like(x) for x in (qt, kt, vt))
    for tl in _tiles(view):
        idx = _row_index(g.total_q, tl.q_heads, tl.q_tok)
        p = _probabilities(tl, _scores(tl, qt, kt, softmax_scale), safe_lse[idx])  # [h, n, m, k]
        do_s, q_s = (_rows(x, tl.q_tok, tl.q_ok, tl.q_heads) for x in (dot, qt))  # [h, n, m, d]
        v_s, k_s = (_rows(x, tl.k_tok, tl.k_ok, tl.kv_heads) for x in (vt, kt))  # [h, n, k, d]
        dp = torch.einsum("hnmd,hnkd->hnmk", do_s, v_s)
        ds = _masked(p * (dp - delta[idx].unsqueeze(-1)) * softmax_scale, tl.keep, 0.0, _OVER_SCORES)
        _add_rows(dq, tl.q_tok, tl.q_ok, tl.q_heads, torch.einsum("hnmk,hnkd->hnmd", ds, k_s))
        _add_rows(dk, tl.k_tok, tl.k_ok, tl.kv_heads, torch.einsum("hnmk,hnmd->hnkd", ds, q_s))
        _add_rows(dv, tl.k_tok, tl.k_ok, tl.kv_heads, torch.einsum("hnmk,hnmd->hnkd", p, do_s))
    return tuple(x.transpose(0, 1).to(t.dtype).contiguous() for x, t in ((dq, q), (dk, k), (dv, v)))


def _add_rows(
    dst: torch.Tensor, tok: torch.Tensor, ok: torch.Tensor | None, heads: torch.Tensor, val: torch.Tensor
) -> None:
    """Heads-major ``dst[heads, tok] += val`` for tiles ``[h, n, t, d]`` (GQA heads sharing a kv
    head accumulate); rows where ``ok`` is False (another sample's token) add nothing."""
    val = _masked(val, ok, 0.0, _OVER_ROWS)
    flat = _row_index(dst.shape[1], heads, tok).reshape(-1)
    dst.view(-1, dst.shape[-1]).index_add_(0, flat, val.reshape(-1, dst.shape[-1]))
