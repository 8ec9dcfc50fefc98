"""Device half of the packed predicate payload (spec 5), shared by the Q2K and K2Q materialisers.

One tile = ``tile_m`` query rows x ``tile_n`` keys of one (mask head, sample, Q block, K block).
A CTA packs up to ``slots`` tiles of one (mask head, Q row) or (mask head, K row) per pass, so the
global round trip of the endpoints and the CTA barriers are paid once per pass, not per tile.
The materialiser lists the pass's blocks in shared memory: K blocks for a Q2K row (the tiles share
their rows: one ``sEnd`` slot), Q blocks for a K2Q row (one ``sEnd`` slot per tile)::

    load_rows     sEnd[f, slot rows + t] = endpoint f of tile row t   (0 for rows past q_len: no interval)
                  (K2Q: fetch_rows to registers while the previous pass packs, then store_rows)
    build_bitmap  sBitmap[slot words + row_base(m) + c] = visibility of keys j*tn + 32c .. +31 of row m
                  = OR over intervals [G(2i), G(2i+1)) of G = [0, F0, F1, ...] of the clipped bit range
                  (clipped to the tile's columns and to k_len: exactly the reference tile predicate
                  "odd number of G values <= key", row < q_len, key < k_len, for sorted endpoints)
    pack          the tile's payload words form B = ceil(words / 32) blocks of 32; with W warps,
                  warp w packs block w % min(B, W) (+ g W for g < ceil(B / W)) of the slots
                  s = w // min(B, W) (+ W // min(B, W) each step), so no warp idles when B < W;
                  for word 32 b + i lane l reads its table entry (held in registers for the whole
                  kernel) and tests that bitmap bit of the slot (the 32 loads first, then the 32
                  ballots); ballot i IS word i, warp-uniform, so the warp stages the 32 words in
                  shared memory (16-byte stores), lane i reads word i back and the warp stores
                  them with one coalesced 128-byte store.

    sBitmap:  | slot 0: rows, zero word | slot 1: rows, zero word | ...   (bitmap_words each)

The table is the consumer layout's bit map as data (:mod:`maskplan_kernels.payload_table`); the
kernel is the same for every layout of the same (tile, words_per_tile).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from ._cute_args import row_major
from ._primitives import WARP, WarpsPerCta, range_bits
from .payload_table import bitmap_row_base, bitmap_words, row_words, zero_address


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


#: CTAs per materialiser work row: each packs every ROW_PARTS-th pass of the row (part 0 also writes
#: the row's indices and counts), so a row with many partial tiles (a K block that straddles two
#: documents has one with every Q block of both) is not left to one SM
ROW_PARTS = 2

#: shared memory the packer's slots may take (endpoints + bitmaps); the rest stays free for
#: the materialisers' lists and scan scratch
SLOT_SMEM_BYTES = 40 * 1024


def packer_slots(config: MaterializeConfig, listed: str) -> int:
    """Tiles a pass of :class:`TilePacker` packs: at most one row per thread (one load round trip;
    one tile at least), with every tile's endpoints and bitmap within ``SLOT_SMEM_BYTES``; 0 where
    one tile's do not fit (``nfunc`` past about ``SLOT_SMEM_BYTES / (4 tile_m)``): the planner
    kernels do not build such a plan (:func:`maskplan_kernels.builder.unserved`)."""
    row_bytes = 4 * config.nfunc * config.tile_m
    per_slot = 4 * bitmap_words(config.tile_m, config.tile_n) + (row_bytes if listed == "q" else 0)
    fixed = row_bytes if listed == "k" else 0  # a Q2K pass's tiles share their rows' endpoints
    by_threads = max(1, config.num_threads // config.tile_m)  # more rows than threads: several loads
    return max(0, min(by_threads, (SLOT_SMEM_BYTES - fixed) // per_slot))


class TilePacker:
    """Constexpr tile geometry + the three device steps of the module docstring.

    ``listed`` is what the materialiser's per-pass list holds: ``"k"`` (Q2K: K blocks of one Q row,
    the tiles share their rows) or ``"q"`` (K2Q: Q blocks of one K row, rows per tile).
    """

    def __init__(self, config: MaterializeConfig, listed: str):
        if listed not in ("q", "k"):
            raise ValueError(f"listed must be 'q' or 'k', got {listed!r}")
        if listed == "q" and config.tile_m > config.num_threads:
            raise ValueError(
                f"tile_m={config.tile_m} > {config.num_threads} threads: a K2Q pass fetches one row a thread"
            )
        self.listed = listed
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.nfunc = config.nfunc
        self.num_intervals = (config.nfunc + 1) // 2
        self.words_per_tile = config.words_per_tile
        self.num_warps = config.num_warps
        self.num_threads = config.num_threads
        self.groups = config.table_groups
        self.row_words = row_words(config.tile_n)
        self.bitmap_words = bitmap_words(config.tile_m, config.tile_n)
        self.zero_word = bitmap_row_base(config.tile_m, config.tile_n)
        self.zero_address = zero_address(config.tile_m, config.tile_n)
        # pack: 32-word blocks of a tile, warps per slot, slots packed side by side
        blocks = -(-self.words_per_tile // WARP)
        self.block_warps = min(blocks, self.num_warps)
        self.slot_phases = self.num_warps // self.block_warps
        self.slots = packer_slots(config, listed)
        if self.slots == 0:
            raise ValueError(
                f"nfunc={config.nfunc} endpoints of a {config.tile_m}-row tile do not fit the packer's "
                f"{SLOT_SMEM_BYTES} bytes of shared memory"
            )
        self.end_slots = self.slots if listed == "q" else 1

    def host_views(
        self, mask_func, visible_bits, full_bits, counts_ws, counts_out, masks, table, *,
        hmask, total_q, uq, k_words, ws_rows, out_rows, nnz_p,
    ) -> MaterializeViews:  # fmt: skip
        """Row-major views of the pointers both host entries share (traced inline); 64-bit strides
        where a product of sizes may pass 2^31."""
        words = self.words_per_tile
        return MaterializeViews(
            mask=row_major(mask_func, hmask, self.nfunc, total_q, wide=True),
            visible=row_major(visible_bits, hmask, uq, k_words, wide=True),
            full=row_major(full_bits, hmask, uq, k_words, wide=True),
            counts_ws=row_major(counts_ws, 4, hmask, ws_rows, wide=True),
            counts_out=row_major(counts_out, 4, hmask, cutlass.max(out_rows, 1), wide=True),
            masks=row_major(masks, cutlass.max(nnz_p, 1), words, wide=True),
            table=row_major(table, words * WARP),
        )

    def allocate(self, smem):
        """(sEnd (nfunc, end_slots * tile_m), sBitmap (slots * bitmap_words,), sStage (warps, 32)) in
        shared memory."""
        rows = self.end_slots * self.tile_m
        ends = cute.make_layout((self.nfunc, rows), stride=(rows, 1))
        sEnd = smem.allocate_tensor(Int32, ends, byte_alignment=16)
        bitmaps = cute.make_layout(self.slots * self.bitmap_words)
        sBitmap = smem.allocate_tensor(Int32, bitmaps, byte_alignment=16)
        stage = cute.make_layout((self.num_warps, WARP), stride=(WARP, 1))
        sStage = smem.allocate_tensor(Int32, stage, byte_alignment=16)
        return sEnd, sBitmap, sStage

    @cute.jit
    def row_item(self, item: Int32, n_rows: Int32):
        """``(head, row, part)`` of persistent work item ``item`` (``ROW_PARTS`` items a row, rows
        head-major, as the materialisers' CSR order)."""
        return item // (n_rows * ROW_PARTS), item // ROW_PARTS % n_rows, item % ROW_PARTS

    @cute.jit
    def row_counts(
        self, mCountsWs: cute.Tensor, mCountsOut: cute.Tensor, head: Int32, row: Int32, part: Int32,
        write_compact: Int32, tidx: Int32,
    ):  # fmt: skip
        """``(partial cnt, full cnt, partial off, full off)`` of the item's row in the counts
        workspace; with ``write_compact``, part 0's thread 0 copies them to the compact counts."""
        counts = [mCountsWs[i, head, row] for i in range(4)]
        if write_compact != 0:
            if (tidx == 0) & (part == 0):
                for i in cutlass.range_constexpr(4):
                    mCountsOut[i, head, row] = counts[i]
        return counts

    def block_base(self, g: int, warp):
        """The first payload word of ``warp``'s 32-word block in table group ``g``: ``32 block(g)``,
        ``block(g) = g W + warp % min(B, W)`` (module docstring); ``warp`` an int or the kernel's
        Int32, so the CPU tests count the words the kernel packs with this very formula."""
        return (g * self.num_warps + warp % self.block_warps) * WARP

    def slot_phase(self, warp):
        """The first of the pass's slots ``warp`` packs (then every ``slot_phases``-th); none where it
        is ``slot_phases`` or more."""
        return warp // self.block_warps

    @cute.jit
    def init(self, sBitmap: cute.Tensor, tidx: Int32):
        """Zero each slot's padding target word (never written again). Visible after the caller's
        next barrier."""
        if tidx < self.slots:
            sBitmap[tidx * self.bitmap_words + self.zero_word] = Int32(0)

    @cute.jit
    def load_table(self, mTable: cute.Tensor, warp: Int32, lane: Int32):
        """This lane's table entries: ``regs[g][i]`` feeds bit ``lane`` of word ``32 block(g) + i``
        (``block(g) = g W + warp % min(B, W)``, module docstring)."""
        regs = []
        for g in cutlass.range_constexpr(self.groups):
            base = self.block_base(g, warp)
            row = []
            for i in cutlass.range_constexpr(WARP):
                a = Int32(self.zero_address)
                if base + i < self.words_per_tile:
                    a = mTable[(base + i) * WARP + lane]
                row.append(a)
            regs.append(row)
        return regs

    @cute.jit
    def endpoints(self, mMask: cute.Tensor, head: Int32, q_offset: Int32, q_len: Int32, local: Int32, f: int):
        """Endpoint ``f`` of the sample-local Q row ``local``; 0 (no visible key) outside the sample."""
        token = q_offset + local
        v = Int32(0)
        if (local < q_len) & (token >= 0) & (token < mMask.shape[2]):
            v = mMask[head, f, token]
        return v

    @cute.jit
    def load_rows(
        self, mMask: cute.Tensor, sEnd: cute.Tensor, head: Int32, q_offset: Int32, q_len: Int32,
        first_local: Int32, tidx: Int32,
    ):  # fmt: skip
        """``listed == "k"``: the endpoints of the tile rows from sample-local row ``first_local`` into
        ``sEnd`` (coalesced over rows). Visible after the caller's next barrier."""
        for t in cutlass.range(tidx, self.tile_m, self.num_threads, unroll=1):
            for f in cutlass.range_constexpr(self.nfunc):
                sEnd[f, t] = self.endpoints(mMask, head, q_offset, q_len, first_local + t, f)

    @cute.jit
    def fetch_rows(
        self, mMask: cute.Tensor, rEnd: cute.Tensor, head: Int32, q_offset: Int32, q_len: Int32,
        sList: cute.Tensor, e0: Int32, n_list: Int32, tidx: Int32,
    ):  # fmt: skip
        """``listed == "q"``: this thread's row of the pass from list entry ``e0`` (one row a thread:
        slot ``tidx // tile_m``, row ``tidx % tile_m`` of Q block ``sList[e0 + slot]``) into the
        registers ``rEnd``; issued before the current pass is packed, so the load overlaps it."""
        slot = tidx // self.tile_m
        valid = (tidx < self.slots * self.tile_m) & (e0 + slot < n_list)
        local = Int32(0)
        if valid:
            local = sList[e0 + slot] * self.tile_m + tidx - slot * self.tile_m
        for f in cutlass.range_constexpr(self.nfunc):
            v = Int32(0)
            if valid:
                v = self.endpoints(mMask, head, q_offset, q_len, local, f)
            rEnd[f] = v

    @cute.jit
    def store_rows(self, sEnd: cute.Tensor, rEnd: cute.Tensor, tidx: Int32):
        """The fetched rows into ``sEnd``. Visible after the caller's next barrier."""
        if tidx < self.slots * self.tile_m:
            for f in cutlass.range_constexpr(self.nfunc):
                sEnd[f, tidx] = rEnd[f]

    @cute.jit
    def build_bitmap(
        self,
        sEnd: cute.Tensor,
        sBitmap: cute.Tensor,
        sList: cute.Tensor,
        e0: Int32,
        n: Int32,
        n_block: Int32,
        k_len: Int32,
        tidx: Int32,
    ):
        """Row-major predicate bitmaps of the pass's ``n`` tiles: slot ``s`` covers K block
        ``sList[e0 + s]`` (``listed == "k"``) or ``n_block`` with its own rows (``"q"``). Visible
        after the caller's next barrier."""
        tn = self.tile_n
        slot_items = self.tile_m * self.row_words
        for idx in cutlass.range(tidx, n * slot_items, self.num_threads, unroll=1):
            slot = idx // slot_items
            rest = idx - slot * slot_items
            m = rest // self.row_words
            c = rest - m * self.row_words
            block = n_block
            row = m
            if const_expr(self.listed == "k"):
                block = sList[e0 + slot]
            else:
                row = slot * self.tile_m + m
            x0 = block * tn + c * WARP  # key of bit 0 of this word
            lim = cutlass.min(cutlass.min(tn - c * WARP, WARP), k_len - x0)
            lim = cutlass.max(lim, 0)  # bits [0, lim) are inside the tile and the sample
            word = Int32(0)
            for i in cutlass.range_constexpr(self.num_intervals):
                start = Int32(0)
                if const_expr(i > 0):
                    start = sEnd[2 * i - 1, row]
                end = sEnd[2 * i, row]
                lo = cutlass.min(cutlass.max(start - x0, 0), lim)
                hi = cutlass.min(cutlass.max(end - x0, 0), lim)
                word = word | range_bits(lo, hi)
            sBitmap[slot * self.bitmap_words + bitmap_row_base(m, tn) + c] = word

    @cute.jit
    def pack(
        self, sBitmap: cute.Tensor, sStage: cute.Tensor, regs, mMasks: cute.Tensor, entry0: Int32,
        n: Int32, warp: Int32, lane: Int32,
    ):  # fmt: skip
        """Payload words of the pass's ``n`` tiles -> ``mMasks[entry0 + s, :]`` (reads ``sBitmap``;
        ``sStage`` is the warps' private staging rows).

        The slot loop stays a runtime loop: unrolling it made ptxas spill and ran 3.5x slower on
        the H200."""
        phase = self.slot_phase(warp)
        if phase < self.slot_phases:
            for s in cutlass.range(phase, n, self.slot_phases, unroll=1):
                sSlot = cute.make_tensor(sBitmap.iterator + s * self.bitmap_words, sBitmap.layout)
                for g in cutlass.range_constexpr(self.groups):
                    base = self.block_base(g, warp)
                    # all 32 loads first: ptxas does not move a shared load above a vote, so loads
                    # interleaved with the ballots would each wait out their latency
                    bits = []
                    for i in cutlass.range_constexpr(WARP):
                        a = regs[g][i]  # the word index and the mask are loop-invariant (hoisted)
                        bits.append(sSlot[a >> 5] & (Int32(1) << (a & 31)))
                    # the ballots are warp-uniform: every lane stores them (4 words a 16-byte store)
                    # to the warp's staging row, and lane i reads word i back
                    row = sStage[warp, None]
                    for q in cutlass.range_constexpr(WARP // 4):
                        quad = cute.make_rmem_tensor((4,), Int32)
                        for j in cutlass.range_constexpr(4):
                            quad[j] = cute.arch.vote_ballot_sync(bits[4 * q + j] != 0)
                        cute.autovec_copy(quad, cute.local_tile(row, (4,), (q,)))
                    cute.arch.sync_warp()
                    mine = row[lane]
                    cute.arch.sync_warp()  # every lane has its word before the row is rewritten
                    if base + lane < self.words_per_tile:
                        mMasks[entry0 + s, base + lane] = mine
