"""Stage 1 (spec 4.2): per-view block grid, compact plan-row prefixes and ``sequence_desc``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..error_flags import prefix_error_flags
from ..geometry import PlanGeometry

WORD_BITS = 32


@dataclass(frozen=True)
class BlockGeometry:
    """The block grid of one view geometry (``tile_m`` x ``tile_n``) over every sample.

    Compact Q plan rows are numbered sample by sample: sample ``b`` owns rows
    ``cu_q_rows[b] .. cu_q_rows[b+1]``; K plan rows (K blocks) likewise with ``cu_k_rows``.
    All tensors are int64 on the plan's device.
    """

    tile_m: int
    tile_n: int
    q_offsets: torch.Tensor  # [B]
    k_offsets: torch.Tensor  # [B]
    q_lens: torch.Tensor  # [B]
    k_lens: torch.Tensor  # [B]
    q_blocks: torch.Tensor  # [B] ceil(q_len / tile_m)
    k_blocks: torch.Tensor  # [B] ceil(k_len / tile_n)
    cu_q_rows: torch.Tensor  # [B+1]
    cu_k_rows: torch.Tensor  # [B+1]
    n_q_rows: int
    n_k_rows: int
    max_k_blocks: int
    max_q_blocks: int

    @property
    def batch(self) -> int:
        return self.q_lens.numel()

    @property
    def k_words(self) -> int:
        """uint32 words per bitset row: one bit per K block of the longest sample, at least one word."""
        return max(1, -(-self.max_k_blocks // WORD_BITS))

    def q_row_owner(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, m_block) of every compact Q plan row."""
        return _owner(self.cu_q_rows, self.n_q_rows)

    def sequence_desc(self, outer: str) -> torch.Tensor:
        """int32 ``[B, 8]``: q_offset, k_offset, q_len, k_len, outer-row begin, outer-row count,
        inner block count, reserved. ``outer="q"`` for Q-major views (inner = K blocks),
        ``"k"`` for K2Q views (inner = Q blocks)."""
        if outer == "q":
            begin, count, inner = self.cu_q_rows[:-1], self.q_blocks, self.k_blocks
        else:
            begin, count, inner = self.cu_k_rows[:-1], self.k_blocks, self.q_blocks
        cols = [
            self.q_offsets,
            self.k_offsets,
            self.q_lens,
            self.k_lens,
            begin,
            count,
            inner,
            torch.zeros_like(inner),
        ]
        return torch.stack(cols, dim=1).to(torch.int32)


def _owner(cu_rows: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    counts = cu_rows[1:] - cu_rows[:-1]
    batch = torch.repeat_interleave(
        torch.arange(counts.numel(), device=cu_rows.device), counts, output_size=n_rows
    )
    return batch, torch.arange(n_rows, device=cu_rows.device) - cu_rows[batch]


def geometry_error_flags(g: PlanGeometry) -> int:
    """Prefix validation (spec 3.2): start at 0, end at total, nondecreasing, within max_seqlen."""
    if not g.varlen:
        return 0
    return prefix_error_flags(g.cu_seqlens_q, g.total_q, g.max_seqlen_q, is_q=True) | prefix_error_flags(
        g.cu_seqlens_k, g.total_k, g.max_seqlen_k, is_q=False
    )


def block_geometry(g: PlanGeometry, tile_m: int, tile_n: int) -> BlockGeometry:
    """Block grid and compact row prefixes of a (validated) geometry at one tile size."""
    cu_q, cu_k = g.cu_seqlens_q.to(torch.int64), g.cu_seqlens_k.to(torch.int64)
    q_lens, k_lens = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    q_blocks = (q_lens + tile_m - 1) // tile_m
    k_blocks = (k_lens + tile_n - 1) // tile_n
    zero = torch.zeros(1, dtype=torch.int64, device=cu_q.device)
    cu_q_rows = torch.cat([zero, torch.cumsum(q_blocks, 0)])
    cu_k_rows = torch.cat([zero, torch.cumsum(k_blocks, 0)])
    host = torch.stack([cu_q_rows[-1], cu_k_rows[-1], k_blocks.max(), q_blocks.max()]).tolist()
    return BlockGeometry(
        tile_m=tile_m,
        tile_n=tile_n,
        q_offsets=cu_q[:-1],
        k_offsets=cu_k[:-1],
        q_lens=q_lens,
        k_lens=k_lens,
        q_blocks=q_blocks,
        k_blocks=k_blocks,
        cu_q_rows=cu_q_rows,
        cu_k_rows=cu_k_rows,
        n_q_rows=host[0],
        n_k_rows=host[1],
        max_k_blocks=host[2],
        max_q_blocks=host[3],
    )
