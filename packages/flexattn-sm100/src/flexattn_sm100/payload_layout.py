"""The SM100/SM103 packed-predicate payload layout: the ONE place the TMEM load ownership is written.

Status: compile-verified only, and only in part; never run on SM100 hardware.
``tests/test_sm100_cute_crosscheck.py`` checks the forward QK ownership (1CTA M128, and 2CTA M256
per CTA rank) against CuTe DSL's ``tcgen05.make_tmem_copy(Ld32x32bOp)`` partition at compile time
(``CUTE_DSL_ARCH=sm_100a``);
``tests/test_fwd_layout_agreement.py`` checks that the forward kernel's own softmax fragments (every
variant: qstage1 and qstage2 + 1CTA, qstage1 + 2CTA, D256) test, in every subtile, thread and
register, the bit this layout assigns, and read the words of the CTA's own plane (compiled for
sm_100a, never run);
``tests/test_bwd_layout_agreement.py`` checks the same for the backward kernel's two-warpgroup
column split (compiled for sm_100a, never run).

The score accumulator lives in tensor memory (TMEM): accumulator row ``r`` of a 128-row MMA tile is
TMEM lane ``r``, column ``c`` is TMEM column ``c``. With the 32x32b load shape each thread of a warp
reads one lane, one 32-bit column per register, and warp ``w`` of a warpgroup may only access
lanes ``32 (w % 4) .. 32 (w % 4) + 31``. So the softmax warpgroup's thread ``t`` (0..127) owns
accumulator row ``t`` and, with ``Repetition(n)``, its registers hold the columns in order::

             col: 0    1    2   ...  tile_n-1
    lane/row   0: T0   T0   T0  ...  T0        warp 0
    lane/row   1: T1   T1   T1  ...  T1
    ...
    lane/row 127: T127 T127 T127 ... T127      warp 3

    fragment element e of thread t  ->  accumulator (row, col) = (t, e)
    payload address                 ->  group = t, word = e // 32, bit = e % 32

With ``num_warpgroups = W > 1`` (the backward's 8 compute warps), the warpgroups split the columns:
thread ``t = 128 wg + r`` owns row ``r``, columns ``wg * acc_cols/W + e``.

Subtiles. A plan block can span more accumulator rows than one TMEM tile of 128 lanes:

* ``q_stage = 2`` (1CTA): two Q tiles of 128 rows in flight, one softmax warpgroup each;
* ``cta_group_size = 2`` (2CTA, M256 MMA): each CTA of the pair holds 128 rows in its own TMEM.

Each 128-row slab is one physical subtile (``subtile = row // 128``; the q stage or the CTA rank)
with its own 128-group payload plane, so a CTA loads only its CTA-native plane (spec 6.2:
2CTA N128 -> 128 groups x 4 words = 2 KB per stage)::

    subtile = acc_row // 128    group = 128 wg + acc_row % 128    word = e // 32    bit = e % 32

Transposed (backward, K-major): the dK/dV kernel holds ``S^T`` (TMEM lanes = K rows, columns = Q),
so score element ``(m, n)`` (m = Q row, n = K column) sits at accumulator ``(row, col) = (n, m)``;
with the 2CTA K-axis cluster the plan block's ``tile_n`` is the union of both CTAs' K rows.
"""

from __future__ import annotations

from functools import cache, cached_property

import torch

from maskplan_core.payload import WORD_BITS, PayloadLayout, fragment_inverse

TMEM_LANES = 128
WARPGROUP_THREADS = 128
LAYOUT_VERSION = "v1"


class TmemLoadLayout(PayloadLayout):
    """Payload layout of a score tile read from TMEM with ``tcgen05.ld 32x32b``.

    Args:
        tile_m: Q rows of the plan block (the union over q stages / CTAs of the pair).
        tile_n: K columns of the plan block.
        num_warpgroups: warpgroups sharing one 128-lane subtile, splitting its columns.
        transposed: the accumulator holds ``S^T`` (lanes = K rows, columns = Q).
    """

    hardware_verified = False

    def __init__(
        self, tile_m: int, tile_n: int, num_warpgroups: int = 1, *, transposed: bool = False
    ) -> None:
        self.tile_m, self.tile_n, self.transposed = tile_m, tile_n, transposed
        self.acc_rows, self.acc_cols = (tile_n, tile_m) if transposed else (tile_m, tile_n)
        if self.acc_rows % TMEM_LANES:
            raise ValueError(
                f"accumulator rows {self.acc_rows} (tile {tile_m}x{tile_n}, transposed={transposed}) "
                f"must be a multiple of the {TMEM_LANES} TMEM lanes"
            )
        if num_warpgroups <= 0 or self.acc_cols % num_warpgroups:
            raise ValueError(
                f"num_warpgroups={num_warpgroups} must divide the {self.acc_cols} accumulator columns"
            )
        self.num_warpgroups = num_warpgroups
        self.elements_per_thread = self.acc_cols // num_warpgroups
        self.subtiles = self.acc_rows // TMEM_LANES
        self.groups = WARPGROUP_THREADS * num_warpgroups
        self.words_per_group = -(-self.elements_per_thread // WORD_BITS)
        self.layout_id = (
            f"sm100-tmem-ld32x32b-{LAYOUT_VERSION}-{tile_m}x{tile_n}"
            + (f"-wg{num_warpgroups}" if num_warpgroups != 1 else "")
            + ("-kq" if transposed else "")
        )

    # -- the one source of truth ------------------------------------------------------------
    @cached_property
    def _fragment(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Score coordinates ``(m, n)``, int64 ``[subtiles, groups, elements_per_thread]``: element
        ``e`` (register order) of thread ``t`` of the warpgroup(s) serving subtile ``s``."""
        s = torch.arange(self.subtiles, device="cpu").view(-1, 1, 1)
        t = torch.arange(self.groups, device="cpu").view(1, -1, 1)
        e = torch.arange(self.elements_per_thread, device="cpu").view(1, 1, -1)
        row = TMEM_LANES * s + t % WARPGROUP_THREADS + 0 * e  # (S, T, E)
        col = (t // WARPGROUP_THREADS) * self.elements_per_thread + e + 0 * s
        m, n = (col, row) if self.transposed else (row, col)
        return m.contiguous(), n.contiguous()

    # -- derived views ----------------------------------------------------------------------
    def element_coords(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(subtile, group, word, bit)``, int64 ``[tile_m, tile_n]``: the inverse of the fragment map."""
        return tuple(x.clone() for x in self._inverse)

    @cached_property
    def _inverse(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        m, n = self._fragment
        shape = m.shape
        s = torch.arange(shape[0], device="cpu").view(-1, 1, 1).expand(shape)
        t = torch.arange(shape[1], device="cpu").view(1, -1, 1).expand(shape)
        e = torch.arange(shape[2], device="cpu").view(1, 1, -1).expand(shape)
        return fragment_inverse(self, m, n, (s, t, e // WORD_BITS, e % WORD_BITS))

    def thread_elements(self, thread: int, subtile: int = 0) -> list[tuple[int, int]]:
        """Score elements ``(m, n)`` of thread ``thread`` serving ``subtile``, in register order."""
        if not 0 <= thread < self.groups or not 0 <= subtile < self.subtiles:
            raise IndexError(
                f"(subtile={subtile}, thread={thread}) is outside {self.subtiles} subtile(s) x "
                f"{self.groups} threads of {self.layout_id}"
            )
        m, n = self._fragment
        return list(zip(m[subtile, thread].tolist(), n[subtile, thread].tolist(), strict=True))

    def _key(self) -> tuple:
        return (self.tile_m, self.tile_n, self.num_warpgroups, self.transposed)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TmemLoadLayout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(("TmemLoadLayout", *self._key()))


@cache
def tmem_layout(
    tile_m: int, tile_n: int, num_warpgroups: int = 1, transposed: bool = False
) -> TmemLoadLayout:
    """Shared (cached) layout instance, so the bit index is computed once per process."""
    return TmemLoadLayout(tile_m, tile_n, num_warpgroups, transposed=transposed)
