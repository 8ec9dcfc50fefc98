"""The SM90 packed-predicate payload layout: the ONE place the WGMMA accumulator ownership is written.

Every SM90 payload (forward Q2K and backward K2Q) follows the register fragment a consumer thread
holds after a ``wgmma.mma_async.m64nNk16`` with an fp32 accumulator. The packer (CPU reference and
GPU materialiser), ``PlanView.to_dense()`` and the attention kernel's bit-select all derive from
:meth:`WgmmaAccumulatorLayout.fragment_coords`; nothing else spells out the lane formula.

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

Payload address of fragment element ``e`` of consumer thread ``t``::

    subtile = 0        group = t        word = e // 32        bit = e % 32

so a thread loads its own ``words_per_group`` words and selects bit ``e % 32`` of word ``e // 32``
for its ``e``-th accumulator register. Bits past the fragment are padding (0).

=====================  ==========  =======================  ======================================
tile (score m x n)     warpgroups  elements / thread        payload
=====================  ==========  =======================  ======================================
fwd 128x128            2 (M)       64                       256 groups x 2 words  (2 KB)
fwd 128x64 (D256)      2 (M)       32                       256 groups x 1 word   (1 KB)
bwd 64x128, S^T        2 (M)       32                       256 groups x 1 word
bwd 64x64,  S^T        2 (N)       16 (16 padding bits)     256 groups x 1 word
=====================  ==========  =======================  ======================================

Transposed (backward, K-major): the dK/dV kernel computes ``S^T = K Q^T`` with warpgroups owning
K rows, so score element ``(m, n)`` (m = Q row, n = K column of the score tile) sits at
accumulator ``(row, col) = (n, m)``. :class:`WgmmaAccumulatorLayout` takes ``transposed=True`` for
that; its ``tile_m x tile_n`` is still the score tile (Q x K), as the planner classifies it.

Checked (CPU, no GPU): ``tests/test_sm90_cute_crosscheck.py`` compares every thread's element list
with ``partition_C`` of CuTe DSL's ``make_trivial_tiled_mma`` for the four tiles of the table.
"""

from __future__ import annotations

from functools import cache, cached_property

import torch

from maskplan_core.payload import WORD_BITS, PayloadLayout

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
        transposed: the accumulator holds ``S^T`` (rows = K, columns = Q), as in the K-major
            backward kernel.
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
        self.subtiles = 1
        self.groups = WARPGROUP_THREADS * self.num_warpgroups
        self.words_per_group = -(-self.elements_per_thread // WORD_BITS)
        self.layout_id = _layout_id(tile_m, tile_n, self.num_warpgroups, self.wg_m, transposed)

    # -- the one source of truth ------------------------------------------------------------
    def fragment_coords(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Score coordinates ``(m, n)``, int64 ``[groups, elements_per_thread]``, of every thread's
        fragment element ``e`` in register order. Row ``t`` is consumer thread ``t``."""
        return self._fragment[0].clone(), self._fragment[1].clone()

    @cached_property
    def _fragment(self) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(self.groups).unsqueeze(1)  # (T, 1)
        e = torch.arange(self.elements_per_thread).unsqueeze(0)  # (1, E)
        wg, warp, lane = t // WARPGROUP_THREADS, (t // 32) % 4, t % 32
        wm, wn = wg % self.wg_m, wg // self.wg_m
        j, half, c = e // 4, (e // 2) % 2, e % 2
        row = WARPGROUP_ROWS * wm + 16 * warp + lane // 4 + 8 * half  # (T, E)
        col = self.wg_cols * wn + 8 * j + 2 * (lane % 4) + c
        m, n = (col, row) if self.transposed else (row, col)
        return m.contiguous(), n.contiguous()

    # -- derived views ----------------------------------------------------------------------
    def element_coords(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(subtile, group, word, bit)``, int64 ``[tile_m, tile_n]``: the inverse of the fragment map."""
        return tuple(x.clone() for x in self._inverse)

    @cached_property
    def _inverse(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        m, n = self._fragment
        t = torch.arange(self.groups).unsqueeze(1).expand_as(m)
        e = torch.arange(self.elements_per_thread).unsqueeze(0).expand_as(m)
        return _invert(self.tile_m, self.tile_n, m, n, torch.zeros_like(m), t, e, self.layout_id)

    def thread_elements(self, thread: int) -> list[tuple[int, int]]:
        """Score elements ``(m, n)`` of consumer thread ``thread``, in fragment (register) order:
        element ``e`` of the list is guarded by bit ``e % 32`` of word ``e // 32`` of group ``thread``."""
        if not 0 <= thread < self.groups:
            raise IndexError(
                f"thread={thread} is outside the {self.groups} consumer threads of {self.layout_id}"
            )
        m, n = self._fragment
        return list(zip(m[thread].tolist(), n[thread].tolist(), strict=True))

    def _key(self) -> tuple:
        return (self.tile_m, self.tile_n, self.num_warpgroups, self.transposed)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WgmmaAccumulatorLayout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(("WgmmaAccumulatorLayout", *self._key()))


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


def _layout_id(tile_m: int, tile_n: int, num_warpgroups: int, wg_m: int, transposed: bool) -> str:
    layout_id = f"sm90-wgmma-acc-{LAYOUT_VERSION}-{tile_m}x{tile_n}"
    if num_warpgroups != wg_m:
        layout_id += f"-wg{wg_m}x{num_warpgroups // wg_m}"
    return layout_id + ("-kq" if transposed else "")


def _invert(tile_m, tile_n, m, n, s, g, e, layout_id):
    """Scatter the (subtile, group, element) -> (m, n) map into [tile_m, tile_n] coordinate tensors,
    checking that it is a bijection onto the tile."""
    flat = (m * tile_n + n).reshape(-1)
    hits = torch.bincount(flat, minlength=tile_m * tile_n)
    if hits.numel() != tile_m * tile_n or not bool((hits == 1).all()):
        raise AssertionError(f"{layout_id}: fragment map is not a bijection onto the {tile_m}x{tile_n} tile")
    out = []
    for value in (s, g, e // WORD_BITS, e % WORD_BITS):
        dense = torch.empty(tile_m * tile_n, dtype=torch.int64)
        dense[flat] = value.reshape(-1)
        out.append(dense.reshape(tile_m, tile_n))
    return tuple(out)
