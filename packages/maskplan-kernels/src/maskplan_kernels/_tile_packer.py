"""Device half of the packed predicate payload (spec 5), shared by the Q2K and K2Q materialisers.

One tile = ``tile_m`` query rows x ``tile_n`` keys of one (mask head, sample, Q block, K block).
Three CTA-wide steps, all threads participating::

    load_rows     sEnd[f, t] = endpoint f of tile row t           (0 for rows past q_len: no interval)
    build_bitmap  sBitmap[m * row_stride + c] = visibility of keys j*tn + 32c .. +31 of row m
                  = OR over intervals [G(2i), G(2i+1)) of G = [0, F0, F1, ...] of the clipped bit range
                  (clipped to the tile's columns and to k_len: exactly the reference tile predicate
                  "odd number of G values <= key", row < q_len, key < k_len, for sorted endpoints)
    pack          warp w owns payload words 32g .. 32g+31 for g = w, w + W, ...; for word 32g + i
                  lane b reads its table entry (held in registers for the whole kernel), tests
                  that bitmap bit, and the ballot is the word; lane i keeps word i and the warp
                  stores its 32 words with one coalesced 128-byte store.

The table is the consumer layout's bit map as data (:mod:`maskplan_kernels.payload_table`); the
kernel is the same for every layout of the same (tile, words_per_tile).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from ._primitives import WARP, WarpsPerCta, range_bits
from .payload_table import bitmap_row_stride, bitmap_words, row_words, zero_address


@dataclass(frozen=True)
class MaterializeConfig(WarpsPerCta):
    """Static configuration of a materialiser (every field is compile-time).

    ``words_per_tile`` is ``layout.words_per_tile`` of the consumer's layout; the layout's bit map
    itself is runtime data, so layouts of one shape share a compiled kernel.
    """

    tile_m: int
    tile_n: int
    nfunc: int
    words_per_tile: int
    num_warps: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tile_m < 1 or self.tile_n < 1:
            raise ValueError(f"tile sizes must be positive, got {self.tile_m}x{self.tile_n}")
        if self.nfunc < 1 or self.nfunc % 2 == 0:
            raise ValueError(f"nfunc must be a positive odd integer, got {self.nfunc}")
        if self.words_per_tile < 1:
            raise ValueError(f"words_per_tile must be positive, got {self.words_per_tile}")
        if self.table_groups > 4:
            raise ValueError(
                f"{self.words_per_tile} payload words over {self.num_warps} warps need "
                f"{self.table_groups * WARP} table registers per thread (max 128): raise num_warps"
            )

    @property
    def table_groups(self) -> int:
        """32-word groups of the payload each warp packs (table registers / 32)."""
        return -(-self.words_per_tile // (WARP * self.num_warps))


class MaterializeViews(NamedTuple):
    """The tensors both materialisers' host entries build alike from their raw pointers."""

    mask: cute.Tensor  # (Hmask, nfunc, total_q) endpoints
    visible: cute.Tensor  # (Hmask, uq, k_words) Q2K bitsets of the view's geometry
    full: cute.Tensor  # (Hmask, uq, k_words)
    counts_ws: cute.Tensor  # (4, Hmask, ws_rows): partial cnt, full cnt, partial off, full off
    counts_out: cute.Tensor  # (4, Hmask, max(out_rows, 1)): the compact copy
    masks: cute.Tensor  # (max(nnz_p, 1), words_per_tile) payloads, written
    table: cute.Tensor  # (words_per_tile * 32,) payload source table


def index_vector(ptr: cute.Pointer, n) -> cute.Tensor:
    """A ``(max(n, 1),)`` int32 list (an empty one is never indexed)."""
    return cute.make_tensor(ptr, cute.make_layout(cutlass.max(n, 1)))


class TilePacker:
    """Constexpr tile geometry + the three device steps of the module docstring."""

    def __init__(self, config: MaterializeConfig):
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.nfunc = config.nfunc
        self.num_intervals = (config.nfunc + 1) // 2
        self.words_per_tile = config.words_per_tile
        self.num_warps = config.num_warps
        self.num_threads = config.num_threads
        self.groups = config.table_groups
        self.row_words = row_words(config.tile_n)
        self.row_stride = bitmap_row_stride(config.tile_n)
        self.bitmap_words = bitmap_words(config.tile_m, config.tile_n)
        self.zero_word = config.tile_m * self.row_stride
        self.zero_address = zero_address(config.tile_m, config.tile_n)

    def host_views(
        self, mask_func, visible_bits, full_bits, counts_ws, counts_out, masks, table, *,
        hmask, total_q, uq, k_words, ws_rows, out_rows, nnz_p,
    ) -> MaterializeViews:  # fmt: skip
        """Row-major views of the pointers both host entries share (traced inline); 64-bit strides
        where a product of sizes may pass 2^31."""
        nfunc, words = self.nfunc, self.words_per_tile
        bits = cute.make_layout((hmask, uq, k_words), stride=(Int64(uq) * k_words, Int64(k_words), 1))
        rows_out = cutlass.max(out_rows, 1)
        return MaterializeViews(
            mask=cute.make_tensor(
                mask_func,
                cute.make_layout((hmask, nfunc, total_q), stride=(Int64(total_q) * nfunc, Int64(total_q), 1)),
            ),
            visible=cute.make_tensor(visible_bits, bits),
            full=cute.make_tensor(full_bits, bits),
            counts_ws=cute.make_tensor(
                counts_ws,
                cute.make_layout((4, hmask, ws_rows), stride=(Int64(hmask) * ws_rows, Int64(ws_rows), 1)),
            ),
            counts_out=cute.make_tensor(
                counts_out,
                cute.make_layout((4, hmask, rows_out), stride=(Int64(hmask) * rows_out, Int64(rows_out), 1)),
            ),
            masks=cute.make_tensor(
                masks, cute.make_layout((cutlass.max(nnz_p, 1), words), stride=(Int64(words), 1))
            ),
            table=cute.make_tensor(table, cute.make_layout(words * WARP)),
        )

    def allocate(self, smem):
        """(sEnd (nfunc, tile_m), sBitmap (bitmap_words,)) in shared memory."""
        sEnd = smem.allocate_tensor(
            Int32, cute.make_layout((self.nfunc, self.tile_m), stride=(self.tile_m, 1)), byte_alignment=16
        )
        sBitmap = smem.allocate_tensor(Int32, cute.make_layout(self.bitmap_words), byte_alignment=16)
        return sEnd, sBitmap

    @cute.jit
    def init(self, sBitmap: cute.Tensor, tidx: Int32):
        """Zero the padding target word (never written again). Visible after the caller's next barrier."""
        if tidx == 0:
            sBitmap[self.zero_word] = Int32(0)

    @cute.jit
    def load_table(self, mTable: cute.Tensor, warp: Int32, lane: Int32):
        """This lane's table entries: ``regs[g][i]`` feeds bit ``lane`` of word ``32 (g W + warp) + i``."""
        regs = []
        for g in cutlass.range_constexpr(self.groups):
            base = (g * self.num_warps + warp) * WARP
            row = []
            for i in cutlass.range_constexpr(WARP):
                a = Int32(self.zero_address)
                if base + i < self.words_per_tile:
                    a = mTable[(base + i) * WARP + lane]
                row.append(a)
            regs.append(row)
        return regs

    @cute.jit
    def load_rows(
        self,
        mMask: cute.Tensor,
        sEnd: cute.Tensor,
        head: Int32,
        q_offset: Int32,
        first_local: Int32,
        q_len: Int32,
        tidx: Int32,
    ):
        """Endpoints of the tile's rows into ``sEnd`` (coalesced over rows); rows outside the sample get
        all-zero endpoints, i.e. no visible key. Visible after the caller's next barrier."""
        total_q = mMask.shape[2]
        for t in cutlass.range(tidx, self.tile_m, self.num_threads, unroll=1):
            local = first_local + t
            token = q_offset + local
            ok = (local < q_len) & (token >= 0) & (token < total_q)
            for f in cutlass.range_constexpr(self.nfunc):
                v = Int32(0)
                if ok:
                    v = mMask[head, f, token]
                sEnd[f, t] = v

    @cute.jit
    def build_bitmap(
        self, sEnd: cute.Tensor, sBitmap: cute.Tensor, n_block: Int32, k_len: Int32, tidx: Int32
    ):
        """Row-major predicate bitmap of K block ``n_block``. Visible after the caller's next barrier."""
        tn = self.tile_n
        for idx in cutlass.range(tidx, self.tile_m * self.row_words, self.num_threads, unroll=1):
            m = idx // self.row_words
            c = idx - m * self.row_words
            x0 = n_block * tn + c * WARP  # key of bit 0 of this word
            lim = cutlass.min(cutlass.min(tn - c * WARP, WARP), k_len - x0)
            lim = cutlass.max(lim, 0)  # bits [0, lim) are inside the tile and the sample
            word = Int32(0)
            for i in cutlass.range_constexpr(self.num_intervals):
                start = Int32(0)
                if const_expr(i > 0):
                    start = sEnd[2 * i - 1, m]
                end = sEnd[2 * i, m]
                lo = cutlass.min(cutlass.max(start - x0, 0), lim)
                hi = cutlass.min(cutlass.max(end - x0, 0), lim)
                word = word | range_bits(lo, hi)
            sBitmap[m * self.row_stride + c] = word

    @cute.jit
    def pack(self, sBitmap: cute.Tensor, regs, mMasks: cute.Tensor, entry: Int32, warp: Int32, lane: Int32):
        """Payload words of one tile -> ``mMasks[entry, :]`` (reads only ``sBitmap``)."""
        for g in cutlass.range_constexpr(self.groups):
            base = (g * self.num_warps + warp) * WARP
            mine = Int32(0)
            for i in cutlass.range_constexpr(WARP):
                a = regs[g][i]
                bit = (sBitmap[a >> 5] >> (a & 31)) & 1
                word = cute.arch.vote_ballot_sync(bit != 0)
                mine = cutlass.select_(lane == i, Int32(word), mine)
            if base + lane < self.words_per_tile:
                mMasks[entry, base + lane] = mine
