"""Stage 2 (spec 4.3): Q2K classification into visible/full bitsets with counts and endpoint checks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..error_flags import ENDPOINT_ORDER, ENDPOINT_RANGE
from .block_geometry import WORD_BITS, BlockGeometry
from .intervals import CHUNK_ELEMENTS, block_touch_counts, interval_bounds


@dataclass(frozen=True)
class Classification:
    """Planner workspace of one view geometry (not retained by the plan).

    ``visible_bits`` / ``full_bits``: int32 ``[Hmask, n_q_rows, k_words]``, bit ``j % 32`` of word
    ``j // 32`` for sample-local K block ``j``; ``full`` is a subset of ``visible``.
    ``partial_counts`` / ``full_counts``: int32 ``[Hmask, n_q_rows]``.
    """

    visible_bits: torch.Tensor
    full_bits: torch.Tensor
    partial_counts: torch.Tensor
    full_counts: torch.Tensor
    error_flags: int


def pack_bits(flags: torch.Tensor, words: int) -> torch.Tensor:
    """bool ``[..., K]`` -> int32 ``[..., words]`` (bit j%32 of word j//32)."""
    pad = words * WORD_BITS - flags.shape[-1]
    f = torch.nn.functional.pad(flags.to(torch.int64), (0, pad)).reshape(*flags.shape[:-1], words, WORD_BITS)
    w = (f << torch.arange(WORD_BITS, device=flags.device)).sum(-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def unpack_bits(words: torch.Tensor, k: int) -> torch.Tensor:
    """int32 ``[..., words]`` -> bool ``[..., k]``."""
    w = words.to(torch.int64).unsqueeze(-1) >> torch.arange(WORD_BITS, device=words.device)
    return (w & 1).to(torch.bool).flatten(-2)[..., :k]


def endpoint_error_flags(mask_func: torch.Tensor, geom: BlockGeometry) -> int:
    row_k_len = torch.repeat_interleave(geom.k_lens, geom.q_lens, output_size=mask_func.shape[2])
    out_of_range = ((mask_func < 0) | (mask_func.to(torch.int64) > row_k_len)).any()
    unordered = (mask_func[:, 1:] < mask_func[:, :-1]).any()
    bad = torch.stack([out_of_range, unordered]).tolist()
    return (ENDPOINT_RANGE if bad[0] else 0) | (ENDPOINT_ORDER if bad[1] else 0)


def classify(mask_func: torch.Tensor, geom: BlockGeometry) -> Classification:
    """Classify every (Q plan row, sample-local K block) pair as empty, partial or full.

    A block is visible when a valid row of the tile has a visible key in it, and full when it is
    in bounds for every row of the tile and no row's hidden range (gap) reaches into it.
    """
    hmask, total_q = mask_func.shape[0], mask_func.shape[2]
    flags = endpoint_error_flags(mask_func, geom)
    intervals, gaps = interval_bounds(mask_func)
    row_b, row_m = geom.q_row_owner()
    visible = torch.zeros(hmask, geom.n_q_rows, geom.max_k_blocks, dtype=torch.bool, device=mask_func.device)
    full = torch.zeros_like(visible)
    per_row = hmask * (intervals[0].shape[1] * geom.tile_m + geom.max_k_blocks + 1)
    step = max(1, CHUNK_ELEMENTS // per_row)
    j = torch.arange(geom.max_k_blocks, device=mask_func.device)
    for c in range(0, geom.n_q_rows, step):
        b, m = row_b[c : c + step], row_m[c : c + step]
        rows_in_bounds = ((m + 1) * geom.tile_m <= geom.q_lens[b]).unsqueeze(-1)
        tile_in_bounds = rows_in_bounds & ((j + 1) * geom.tile_n <= geom.k_lens[b].unsqueeze(-1))
        visible[:, c : c + step] = block_touch_counts(intervals, geom, b, m, total_q) > 0
        full[:, c : c + step] = (block_touch_counts(gaps, geom, b, m, total_q) == 0) & tile_in_bounds
    return Classification(
        visible_bits=pack_bits(visible, geom.k_words),
        full_bits=pack_bits(full, geom.k_words),
        partial_counts=(visible & ~full).sum(-1, dtype=torch.int32),
        full_counts=full.sum(-1, dtype=torch.int32),
        error_flags=flags,
    )
