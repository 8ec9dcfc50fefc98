"""Reading interval endpoints: per-tile counts of rows touching each K block, and per-element tile
predicates.

Both work on ``[0, F0) U [F1, F2) U ...`` by prepending a 0 so intervals are ``[G[2i], G[2i+1])``.
Work is chunked so that no more than ``CHUNK_ELEMENTS`` intermediate elements exist at once:
the planner never materialises a dense ``[total_q, Sk]`` mask.
"""

from __future__ import annotations

import torch

from .block_geometry import BlockGeometry

CHUNK_ELEMENTS = 1 << 24


def interval_bounds(mask_func: torch.Tensor):
    """The visible ranges ``[G[2i], G[2i+1])`` of every row and the hidden ones between and after
    them: ``((starts, ends), (gap_starts, gap_ends))``, each int64 ``[Hmask, nfunc // 2 + 1,
    total_q]``. The last gap is open-ended (its reader clamps it to the row's ``k_len``); for
    well-formed endpoints the gaps are the complement of the intervals within ``[0, k_len)``."""
    h, _, rows = mask_func.shape
    zero = torch.zeros(h, 1, rows, dtype=torch.int64, device=mask_func.device)
    g = torch.cat([zero, mask_func.to(torch.int64)], 1)
    starts, ends = g[:, 0::2], g[:, 1::2]
    return (starts, ends), (ends, torch.cat([starts[:, 1:], zero + torch.iinfo(torch.int64).max], 1))


def row_tokens(geom: BlockGeometry, batch: torch.Tensor, m_block: torch.Tensor, total_q: int):
    """Global query token of each (row, t) of Q blocks ``(batch, m_block)``, clamped, and its validity."""
    t = torch.arange(geom.tile_m, device=batch.device)
    local = m_block.unsqueeze(-1) * geom.tile_m + t
    valid = local < geom.q_lens[batch].unsqueeze(-1)
    tok = (geom.q_offsets[batch].unsqueeze(-1) + local).clamp(0, max(total_q - 1, 0))
    return tok, valid


def block_touch_counts(bounds, geom: BlockGeometry, batch, m_block, total_q) -> torch.Tensor:
    """How many (valid row, range) pairs of each listed Q block touch each K block.

    ``bounds``: (lo, hi), int64 ``[H, I, total_q]``, half-open key ranges per row, clamped here to
    the row's ``[0, k_len]``. A non-empty ``[lo, hi)`` touches blocks ``lo // tn .. ceil(hi / tn)``:
    a +1 and a -1 in a per-(head, Q block) difference row and a running sum give every block's
    count, in ``O(rows * ranges + Q blocks * K blocks)`` rather than per (row, K block). The
    updates are an accumulating ``index_put_`` (deterministic on CUDA). Returns int32 ``[H, R, K]``.
    """
    tok, valid = row_tokens(geom, batch, m_block, total_q)  # [R, tm]
    k_len = geom.k_lens[batch].unsqueeze(-1)
    lo = torch.minimum(bounds[0][:, :, tok].clamp_min(0), k_len)  # [H, I, R, tm]
    hi = torch.minimum(bounds[1][:, :, tok].clamp_min(0), k_len)
    weight = ((hi > lo) & valid).to(torch.int32)
    h, n_rows, k, tn = lo.shape[0], batch.numel(), geom.max_k_blocks, geom.tile_n
    row = torch.arange(h * n_rows, device=batch.device).view(h, 1, n_rows, 1) * (k + 1)
    at = torch.cat([(row + lo // tn).reshape(-1), (row + (hi + tn - 1) // tn).reshape(-1)])
    diff = torch.zeros(h * n_rows * (k + 1), dtype=torch.int32, device=batch.device)
    diff.index_put_((at,), torch.cat([weight.reshape(-1), -weight.reshape(-1)]), accumulate=True)
    return diff.view(h, n_rows, k + 1)[..., :k].cumsum(-1, dtype=torch.int32)


def tile_predicates(row_endpoints, geom: BlockGeometry, head, batch, m_block, n_block) -> torch.Tensor:
    """bool ``[n, tile_m, tile_n]``: which score elements of each listed tile are visible and in bounds.
    ``row_endpoints``: the mask rows-major, ``[Hmask, total_q, nfunc]`` contiguous (a row's
    endpoints one read; gathered strided from ``[Hmask, nfunc, total_q]``, a 50% random mask of
    nfunc 2169 at S = 4096 planned in 3.8 s rather than 2.9).

    With ``G = [0, F0, F1, ...]`` (sorted), key ``x`` is visible iff an odd number of ``G`` values
    are ``<= x``, i.e. an even number of endpoints ``F``. Per row of a tile starting at key ``s``,
    endpoint ``F`` is ``<= s + u`` for the columns ``u >= clamp(F - s, 0, tile_n)``: one mark per
    endpoint at that column and a running count over the row give every element's count (its
    parity survives the uint8 wrap-around), a pass per tile whatever the number of intervals.
    The marks are an accumulating ``index_put_``, which has a deterministic CUDA implementation
    (``torch.use_deterministic_algorithms``), unlike a 3-D ``scatter_add_``.

    Bounds need no pass of their own. The endpoints are validated (within ``[0, k_len]``) before
    any payload is made, so every key past ``k_len`` has all ``nfunc`` (an odd count) at or below
    it: hidden. A row past ``q_len`` gets all its marks at column 0: hidden everywhere.
    """
    n, total_q = head.numel(), row_endpoints.shape[1]
    tm, tn = geom.tile_m, geom.tile_n
    out = torch.empty(n, tm, tn, dtype=torch.bool, device=head.device)
    # per tile: tm * nfunc endpoints and their int64 mark positions, tm * (tn + 1) marks and counts
    step = max(1, CHUNK_ELEMENTS // (tm * (tn + 1 + 2 * row_endpoints.shape[2])))
    one = torch.ones(1, dtype=torch.uint8, device=head.device)
    for c in range(0, n, step):
        sl = slice(c, c + step)
        tok, row_ok = row_tokens(geom, batch[sl], m_block[sl], total_q)
        start = n_block[sl].to(torch.int32) * tn  # [c]
        ends = row_endpoints[head[sl].unsqueeze(-1), tok]  # [c, tm, nfunc]
        column = (ends - start[:, None, None]).clamp_(0, tn).mul_(row_ok.unsqueeze(-1))
        rows = column.shape[0] * tm
        at = torch.arange(rows, device=head.device).view(-1, tm, 1) * (tn + 1) + column  # flat marks
        marks = torch.zeros(rows * (tn + 1), dtype=torch.uint8, device=head.device)
        marks.index_put_((at.reshape(-1),), one.expand(at.numel()), accumulate=True)
        counts = marks.view(-1, tm, tn + 1)[..., :tn].cumsum(-1, dtype=torch.uint8)
        visible = out[sl].view(torch.uint8)  # 1 where the count is even
        torch.bitwise_and(counts, 1, out=visible).bitwise_xor_(1)
    return out
