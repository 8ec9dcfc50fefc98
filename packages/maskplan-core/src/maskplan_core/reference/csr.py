"""Stages 4-5 (spec 4.5, 4.6, 4.7): scan + allocation header, and exact-size CSR materialisation.

CSR convention of every view (Q-major and K2Q alike), for outer plan rows ``r`` of mask head ``h``::

    cnt[h, r]                     entries of row r                     int32 [Hmask, rows]
    offset[h, r]                  exclusive scan of cnt in (h, r) order int32 [Hmask, rows]
    idx[offset[h, r] + i]         sample-local inner block index, ascending in i
    masks[offset[h, r] + i]       packed payload (partial CSR only)

Partial and full lists are independent CSRs; empty blocks have no storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..payload import PayloadLayout
from .block_geometry import BlockGeometry
from .classify import Classification, unpack_bits
from .intervals import CHUNK_ELEMENTS, tile_predicates


def exclusive_offsets(counts: torch.Tensor) -> torch.Tensor:
    flat = counts.reshape(-1).to(torch.int64)
    return (torch.cumsum(flat, 0) - flat).to(torch.int32).reshape(counts.shape)


def allocation_header(fwd: Classification, fwd_geom: BlockGeometry, k2q=None, bwd_geom=None, error_flags=0):
    """The 8-value int32 allocation header (one device-to-host read per plan build)."""
    zero = torch.zeros((), dtype=torch.int64, device=fwd.partial_counts.device)
    values = [
        zero + fwd_geom.n_q_rows,
        fwd.partial_counts.sum(dtype=torch.int64),
        fwd.full_counts.sum(dtype=torch.int64),
        zero + (bwd_geom.n_q_rows if bwd_geom else 0),
        zero + (bwd_geom.n_k_rows if bwd_geom else 0),
        k2q[0].sum(dtype=torch.int64) if k2q else zero,
        k2q[1].sum(dtype=torch.int64) if k2q else zero,
        zero + error_flags,
    ]
    return torch.stack(values).to(torch.int32)


@dataclass(frozen=True)
class Csr:
    cnt: torch.Tensor
    offset: torch.Tensor
    idx: torch.Tensor


@dataclass(frozen=True)
class BlockLists:
    """One view's partial and full CSRs with the partial payloads."""

    partial: Csr
    full: Csr
    masks: torch.Tensor


def block_flags(cls: Classification, geom: BlockGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) bool ``[Hmask, n_q_rows, max_k_blocks]`` decoded from the bitsets."""
    visible = unpack_bits(cls.visible_bits, geom.max_k_blocks)
    full = unpack_bits(cls.full_bits, geom.max_k_blocks)
    return visible & ~full, full


def pack_payloads(
    mask_func, geom: BlockGeometry, layout: PayloadLayout, head, q_row, n_block
) -> torch.Tensor:
    """Packed payloads of the tiles (mask head, compact Q plan row, K block), ``CHUNK_ELEMENTS``
    predicate elements at a time: where most tiles are partial, all their predicates at once are the
    dense mask, and packing makes several copies of it (20x the plan's bytes at its peak)."""
    if (layout.tile_m, layout.tile_n) != (geom.tile_m, geom.tile_n):
        raise ValueError(f"{layout!r} does not match the view tile {geom.tile_m}x{geom.tile_n}")
    row_b, row_m = geom.q_row_owner()
    batch, m_block = row_b[q_row], row_m[q_row]
    step = max(1, CHUNK_ELEMENTS // (geom.tile_m * geom.tile_n))
    rows = mask_func.transpose(1, 2).contiguous()  # one copy of the mask per view: tile_predicates
    return torch.cat([
        layout.pack(tile_predicates(rows, geom, head[sl], batch[sl], m_block[sl], n_block[sl]))
        for sl in (slice(c, c + step) for c in range(0, max(head.numel(), 1), step))
    ])  # fmt: skip


def materialize_q2k(mask_func, cls: Classification, geom: BlockGeometry, layout: PayloadLayout) -> BlockLists:
    partial, full = block_flags(cls, geom)
    ph, pr, pj = partial.nonzero(as_tuple=True)  # row-major (h, r, j): the CSR order
    _, _, fj = full.nonzero(as_tuple=True)
    return BlockLists(
        partial=Csr(cls.partial_counts, exclusive_offsets(cls.partial_counts), pj.to(torch.int32)),
        full=Csr(cls.full_counts, exclusive_offsets(cls.full_counts), fj.to(torch.int32)),
        masks=pack_payloads(mask_func, geom, layout, ph, pr, pj),
    )
