"""The SM90 packed-predicate payload layout: the ONE place the WGMMA accumulator ownership is written.

Every SM90 payload (forward Q2K and backward K2Q) follows the register fragment a consumer thread
holds after a ``wgmma.mma_async.m64nNk16`` with an fp32 accumulator. The packer (CPU reference and
GPU materialiser), ``PlanView.to_dense()`` and the attention kernel's bit-select all derive from
``WgmmaAccumulatorLayout._fragment`` (through ``element_coords`` and ``register_bit``); nothing
else spells out the lane formula.

Ownership of one warpgroup's m64nN accumulator (PTX ISA, "wgmma .m64nNk16 register fragment" for
matrix D; CUTLASS ``CLayout_64xN = ((4,8,4),(2,2,N/8)):((128,1,16),(64,8,512))``)::

    warp w (0..3) of the warpgroup owns accumulator rows 16w .. 16w+15
    lane l (0..31) holds rows  r0 = 16w + l//4   and   r0 + 8
                   and in every 8-column group j the columns 8j + 2(l%4) and 8j + 2(l%4) + 1

           col: 0   1   2   3   4   5   6   7 | 8   9  ...
    row  0      T0  T0  T1  T1  T2  T2  T3  T3 | T0  T0 ...      warp 0, half 0
    row  1      T4  T4  T5  T5  T6  T6  T7  T7 | T4  T4 ...
    ...
    row  7      T28 T28 T29 T29 T30 T30 T31 T31| T28 T28 ...
    row  8      T0  T0  T1  T1  T2  T2  T3  T3 | T0  T0 ...      warp 0, half 1
    ...
    row 16      T32 T32 T33 T33 ...                              warp 1
    row 63      ... T127                                          warp 3

Fragment element order of one thread (the CUTLASS accumulator register order: values (c0, c1) of
row r0, then (c2, c3) of row r0 + 8, for each 8-column group j)::

    e = 4j + 2*half + c          half: row r0 (+0) / r0 + 8 (+1);   c: column +0 / +1
    row = r0 + 8*half            col = 8j + 2(l%4) + c

A CTA tile uses ``num_warpgroups`` consumer warpgroups tiled over the accumulator like a CUTLASS
``TiledMma`` with atom layout ``(WM, WN, 1)``: ``WM = acc_rows // 64`` warpgroups along M, the
rest along N, warpgroup ``wg = wm + WM * wn`` (column-major, CUTLASS's default). Warpgroup ``wg``
covers rows ``64 wm ..`` and columns ``wn * acc_cols/WN ..``; consumer thread ``t = 128 wg + 32 w + l``.

Payload address of fragment element ``e`` of consumer thread ``t``: the thread loads
``register_words`` uint32 registers, register ``slot`` from ``register_source(t, slot)`` =
``(group, word)`` of the partial entry's plane, and keeps element ``e`` iff bit ``b`` of register
``s`` is set, ``(s, b) = register_bit(e)``. These two maps are the layout; ``element_coords`` (what
the packers write) is derived from them through the fragment ownership above. Here::

    register_source(t, slot) = (t, slot)     register_bit(e) = (e // 32, e % 32)

so a thread loads its own ``words_per_group`` words. Bits past the fragment are padding (0).

=====================  ==========  =======================  ======================================
tile (score m x n)     warpgroups  elements / thread        payload
=====================  ==========  =======================  ======================================
fwd 128x128            2 (M)       64                       256 groups x 2 words  (2 KB)
fwd 128x64 (D256)      2 (M)       32                       256 groups x 1 word   (1 KB)
bwd 128x128, S^T       2 (M)       64                       256 groups x 2 words  (D <= 64)
bwd 64x128, S^T        2 (M)       32                       256 groups x 1 word
bwd 64x64,  S^T        2 (N)       16 (16 padding bits)     256 groups x 1 word   (D256)
bwd 64x96,  S          2 (N)       24 (8 padding bits)      256 groups x 1 word   ((192, 128))
=====================  ==========  =======================  ======================================

PackGQA forward (:class:`WgmmaPackGqaLayout`): the ``G = Hq / Hkv`` q heads of one kv head share
the mask (Hmask = 1) and are packed into the M128 accumulator, row ``R`` = position ``R // G`` of
head ``R % G``; the plan's Q block is ``128 / G`` positions. The ``G`` rows of one position need
the same bits, so the payload has one group per (position, lane quad member)::

    group = m * 4 + q        (q = l % 4: the thread's columns 8j + 2q + c)
    word, bit = divmod(2j + c, 32)           (the thread's k-th column of the row, in register order)

    register_source(t, slot) = (((r0 + 8 * slot) // G) * 4 + l % 4, 0)     (N <= 128: one word a row)
    register_bit(e)          = (half, 2j + c)

=====================  ==========  ===========================================================
tile (positions x n)   G           payload
=====================  ==========  ===========================================================
fwd (128/G) x 128      2..128      (512 / G) groups x 1 word   (2 KB / G)
fwd (128/G) x 64       2..128      (512 / G) groups x 1 word, 16 bits used (D256)
=====================  ==========  ===========================================================

Transposed (backward, K-major): the dK/dV kernel computes ``S^T = K Q^T`` with warpgroups owning
K rows, so score element ``(m, n)`` (m = Q row, n = K column of the score tile) sits at
accumulator ``(row, col) = (n, m)``. :class:`WgmmaAccumulatorLayout` takes ``transposed=True`` for
that; its ``tile_m x tile_n`` is still the score tile (Q x K), as the planner classifies it.

Checked (CPU, no GPU): ``tests/test_sm90_cute_crosscheck.py`` compares every thread's element list
with ``partition_C`` of CuTe DSL's ``make_trivial_tiled_mma`` for the six tiles of the table.
"""

from __future__ import annotations

from functools import cache, cached_property

import torch

from maskplan_core.payload import WORD_BITS, PayloadLayout, fragment_inverse

WARPGROUP_THREADS = 128
WARPGROUP_ROWS = 64  # the M of one wgmma atom
LAYOUT_VERSION = "v1"


class WgmmaAccumulatorLayout(PayloadLayout):
    """Payload layout of a score tile held in WGMMA m64nNk16 fp32 accumulators.

    Args:
        tile_m: Q rows of the score tile (the plan block's M).
        tile_n: K columns of the score tile (the plan block's N).
        num_warpgroups: consumer warpgroups sharing the accumulator; default one per 64
            accumulator rows. More than that tiles the remaining warpgroups along N.
        transposed: the accumulator holds ``S^T`` (rows = K, columns = Q), as the K-major
            backward kernel's tiles do except at (192, 128), which computes ``S``.
    """

    def __init__(
        self, tile_m: int, tile_n: int, num_warpgroups: int | None = None, *, transposed: bool = False
    ) -> None:
        self.tile_m, self.tile_n, self.transposed = tile_m, tile_n, transposed
        # (acc_rows, acc_cols): the accumulator the warpgroups compute (S, or S^T when transposed)
        self.acc_rows, self.acc_cols = (tile_n, tile_m) if transposed else (tile_m, tile_n)
        if self.acc_rows % WARPGROUP_ROWS or self.acc_cols % 8:
            raise ValueError(
                f"accumulator {self.acc_rows}x{self.acc_cols} (tile {tile_m}x{tile_n}, "
                f"transposed={transposed}) must have rows a multiple of 64 and columns a multiple of 8"
            )
        self.wg_m = self.acc_rows // WARPGROUP_ROWS
        self.num_warpgroups = self.wg_m if num_warpgroups is None else num_warpgroups
        if self.num_warpgroups <= 0 or self.num_warpgroups % self.wg_m:
            raise ValueError(
                f"num_warpgroups={num_warpgroups} must be a positive multiple of accumulator rows / 64 "
                f"= {self.wg_m} (each warpgroup computes one m64 slab)"
            )
        self.wg_n = self.num_warpgroups // self.wg_m
        if self.acc_cols % (8 * self.wg_n):
            raise ValueError(
                f"accumulator columns {self.acc_cols} do not split into {self.wg_n} warpgroup column "
                f"blocks of a multiple of 8"
            )
        self.wg_cols = self.acc_cols // self.wg_n  # the N of each warpgroup's m64nNk16 atom
        self.elements_per_thread = WARPGROUP_ROWS * self.wg_cols // WARPGROUP_THREADS
        self.threads = WARPGROUP_THREADS * self.num_warpgroups
        self.subtiles = 1
        self.groups = self.threads
        self.words_per_group = -(-self.elements_per_thread // WORD_BITS)
        self.register_words = self.words_per_group
        self.layout_id = _layout_id(tile_m, tile_n, self.num_warpgroups, self.wg_m, transposed)

    # -- the one source of truth: what a thread loads and which bit guards each register ---------
    # Plain integer arithmetic: evaluated on torch tensors (CPU proofs), Python ints and the
    # kernels' Int32 values alike.
    def register_source(self, t, slot: int):
        """``(group, word)`` of the plane that consumer thread ``t``'s payload register ``slot`` holds."""
        return t, slot

    def register_bit(self, e):
        """``(slot, bit)``: the register and bit guarding the thread's fragment element ``e``."""
        return e // WORD_BITS, e % WORD_BITS

    @cached_property
    def _accumulator(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Accumulator ``(row, col)``, int64 ``[threads, elements_per_thread]`` (the ownership picture)."""
        t = torch.arange(self.threads, device="cpu").unsqueeze(1)  # (T, 1)
        e = torch.arange(self.elements_per_thread, device="cpu").unsqueeze(0)  # (1, E)
        wg, warp, lane = t // WARPGROUP_THREADS, (t // 32) % 4, t % 32
        wm, wn = wg % self.wg_m, wg // self.wg_m
        j, half, c = e // 4, (e // 2) % 2, e % 2
        row = WARPGROUP_ROWS * wm + 16 * warp + lane // 4 + 8 * half  # (T, E)
        col = self.wg_cols * wn + 8 * j + 2 * (lane % 4) + c
        return row.contiguous(), col.contiguous()

    @cached_property
    def _fragment(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Score coordinates ``(m, n)``, int64 ``[threads, elements_per_thread]``, of every thread's
        fragment element ``e`` in register order. Row ``t`` is consumer thread ``t``."""
        row, col = self._accumulator
        return (col, row) if self.transposed else (row, col)

    # -- derived views ----------------------------------------------------------------------
    def element_coords(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(subtile, group, word, bit)``, int64 ``[tile_m, tile_n]``: where the registers of every
        thread holding element ``(m, n)`` take its bit from (all holders agree, checked)."""
        return tuple(x.clone() for x in self._inverse)

    @cached_property
    def _inverse(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        m, n = self._fragment
        t = torch.arange(self.threads, device="cpu").unsqueeze(1).expand_as(m)
        e = torch.arange(self.elements_per_thread, device="cpu").unsqueeze(0).expand_as(m)
        slot, bit = self.register_bit(e)
        group, word = self.register_source(t, slot)
        holders = self.threads * self.elements_per_thread // (self.tile_m * self.tile_n)
        coords = (torch.zeros_like(m), group.expand_as(m), word.expand_as(m), bit)
        return fragment_inverse(self, m, n, coords, holders)

    def thread_elements(self, thread: int) -> list[tuple[int, int]]:
        """Score elements ``(m, n)`` of consumer thread ``thread``, in fragment (register) order:
        element ``e`` of the list is guarded by ``register_bit(e)`` of the registers
        ``register_source(thread, slot)`` loads."""
        if not 0 <= thread < self.threads:
            raise IndexError(
                f"thread={thread} is outside the {self.threads} consumer threads of {self.layout_id}"
            )
        m, n = self._fragment
        return list(zip(m[thread].tolist(), n[thread].tolist(), strict=True))

    def _key(self) -> tuple:
        return (self.tile_m, self.tile_n, self.num_warpgroups, self.transposed)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WgmmaAccumulatorLayout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(("WgmmaAccumulatorLayout", *self._key()))


class WgmmaPackGqaLayout(WgmmaAccumulatorLayout):
    """Forward PackGQA tile: ``G`` q heads x ``acc_rows / G`` positions in the M of the accumulator
    (row ``R`` = position ``R // G``, head ``R % G``), one payload row per position (module docstring).

    ``tile_m`` is the plan's Q block in positions, ``acc_rows / G``.
    """

    def __init__(self, acc_rows: int, tile_n: int, qhead_per_kvhead: int) -> None:
        super().__init__(acc_rows, tile_n)
        g = qhead_per_kvhead
        if g < 1 or acc_rows % g:
            raise ValueError(
                f"qhead_per_kvhead={g} must divide the {acc_rows} accumulator rows for PackGQA"
            )
        self.qhead_per_kvhead = g
        self.tile_m = acc_rows // g
        self.row_bits = self.wg_cols // 4  # columns one thread holds of one row
        self.groups = self.tile_m * 4
        self.words_per_group = -(-self.row_bits // WORD_BITS)
        self.register_words = 2 * self.words_per_group  # the thread's two rows r0, r0 + 8
        self.layout_id = f"sm90-wgmma-packgqa-{LAYOUT_VERSION}-{acc_rows}x{tile_n}-g{g}"

    def register_source(self, t, slot: int):
        half, word = slot // self.words_per_group, slot % self.words_per_group
        wm, warp, lane = (t // WARPGROUP_THREADS) % self.wg_m, (t // 32) % 4, t % 32
        row = WARPGROUP_ROWS * wm + 16 * warp + lane // 4 + 8 * half
        return (row // self.qhead_per_kvhead) * 4 + lane % 4, word

    def register_bit(self, e):
        j, half, c = e // 4, (e // 2) % 2, e % 2
        k = 2 * j + c  # the element's index among the thread's columns of its row
        return half * self.words_per_group + k // WORD_BITS, k % WORD_BITS

    @cached_property
    def _fragment(self) -> tuple[torch.Tensor, torch.Tensor]:
        row, col = self._accumulator
        return row // self.qhead_per_kvhead, col

    def _key(self) -> tuple:
        return (*super()._key(), self.qhead_per_kvhead)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WgmmaPackGqaLayout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(("WgmmaPackGqaLayout", *self._key()))


class WgmmaForward128x128Layout(WgmmaAccumulatorLayout):
    """Forward M128xN128 tile, two consumer warpgroups: 256 groups x 2 words."""

    def __init__(self) -> None:
        super().__init__(128, 128)


class WgmmaForward128x64Layout(WgmmaAccumulatorLayout):
    """Forward D256 M128xN64 tile, two consumer warpgroups: 256 groups x 1 word."""

    def __init__(self) -> None:
        super().__init__(128, 64)


@cache
def wgmma_layout(
    tile_m: int, tile_n: int, num_warpgroups: int | None = None, transposed: bool = False
) -> WgmmaAccumulatorLayout:
    """Shared (cached) layout instance, so the bit index is computed once per process."""
    return WgmmaAccumulatorLayout(tile_m, tile_n, num_warpgroups, transposed=transposed)


@cache
def wgmma_pack_gqa_layout(acc_rows: int, tile_n: int, qhead_per_kvhead: int) -> WgmmaPackGqaLayout:
    return WgmmaPackGqaLayout(acc_rows, tile_n, qhead_per_kvhead)


def _layout_id(tile_m: int, tile_n: int, num_warpgroups: int, wg_m: int, transposed: bool) -> str:
    layout_id = f"sm90-wgmma-acc-{LAYOUT_VERSION}-{tile_m}x{tile_n}"
    if num_warpgroups != wg_m:
        layout_id += f"-wg{wg_m}x{num_warpgroups // wg_m}"
    return layout_id + ("-kq" if transposed else "")
