"""Warp- and CTA-level building blocks shared by the planner kernels (CuTe DSL, inlined at trace time).

Every function here is a ``@cute.jit`` helper called from inside a ``@cute.kernel``; none launches
anything. Conventions:

* scans are over ``Int32`` values, one value per lane (warp) or per thread (CTA);
* a CTA helper that uses shared memory takes its scratch tensor as an argument and ends with a
  ``sync_threads`` so the caller may reuse the scratch (and anything it read) immediately;
* every thread of the warp / CTA must call a collective helper (no divergent calls).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

WARP = 32
FULL_MASK = 0xFFFFFFFF
#: Int32 slots a CTA scan needs in shared memory: one per warp (at most 32) plus the total.
SCAN_SCRATCH = WARP + 1


class WarpsPerCta:
    """Mixin of the planner kernels' frozen config dataclasses that have a ``num_warps`` field: its
    check (run by the dataclass ``__init__``; a config with more checks calls it first) and the CTA
    size it gives."""

    num_warps: int

    def __post_init__(self) -> None:
        if not 1 <= self.num_warps <= 32:
            raise ValueError(f"num_warps must be in [1, 32], got {self.num_warps}")

    @property
    def num_threads(self) -> int:
        return WARP * self.num_warps


@cute.jit
def warp_inclusive_sum(value: Int32, lane: Int32) -> Int32:
    """Inclusive prefix sum over the lanes of a warp (Kogge-Stone with ``shfl.up``)."""
    for k in cutlass.range_constexpr(5):
        other = cute.arch.shuffle_sync_up(value, 1 << k)
        value = value + cutlass.select_(lane >= (1 << k), other, Int32(0))
    return value


@cute.jit
def warp_broadcast(value: Int32, src_lane: int) -> Int32:
    return cute.arch.shuffle_sync(value, src_lane)


@cute.jit
def warp_sum(value: Int32) -> Int32:
    """Sum over the warp, returned to every lane (``redux.sync.add``)."""
    return cute.arch.warp_redux_sync(value, "add")


@cute.jit
def block_exclusive_sum(value: Int32, sScratch: cute.Tensor, num_warps: cutlass.Constexpr[int]):
    """CTA-wide exclusive prefix sum in thread order. Returns ``(exclusive, total)``.

    ``sScratch``: Int32 shared tensor of at least :data:`SCAN_SCRATCH` elements. Ends with a
    ``sync_threads`` (the scratch is free again when it returns).
    """
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    incl = warp_inclusive_sum(value, lane)
    if lane == WARP - 1:
        sScratch[warp] = incl
    cute.arch.sync_threads()
    if warp == 0:
        w_total = Int32(0)
        if lane < num_warps:
            w_total = sScratch[lane]
        w_incl = warp_inclusive_sum(w_total, lane)
        if lane < num_warps:
            sScratch[lane] = w_incl - w_total
        if lane == WARP - 1:
            sScratch[WARP] = w_incl
    cute.arch.sync_threads()
    excl = sScratch[warp] + incl - value
    total = sScratch[WARP]
    cute.arch.sync_threads()
    return excl, total


@cute.jit
def block_reduce(
    value: Int32, sScratch: cute.Tensor, num_warps: cutlass.Constexpr[int], op: cutlass.Constexpr[str]
) -> Int32:
    """CTA-wide reduction by ``op`` (``"add"`` or ``"or"``: ``redux.sync``'s, 0 their identity),
    returned to every thread. Same scratch/sync contract as :func:`block_exclusive_sum`."""
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    w = cute.arch.warp_redux_sync(value, op)
    if lane == 0:
        sScratch[warp] = w
    cute.arch.sync_threads()
    if warp == 0:
        part = Int32(0)
        if lane < num_warps:
            part = sScratch[lane]
        part = cute.arch.warp_redux_sync(part, op)
        if lane == 0:
            sScratch[WARP] = part
    cute.arch.sync_threads()
    total = sScratch[WARP]
    cute.arch.sync_threads()
    return total


@cute.jit
def range_bits(lo: Int32, hi: Int32) -> Int32:
    """Bits ``lo .. hi-1`` set (``0 <= lo, hi <= 32``; empty when ``hi <= lo``), via 64-bit shifts
    so that ``hi == 32`` is well defined."""
    hi = cutlass.max(hi, lo)
    return Int32((Int64(1) << Int64(hi)) - (Int64(1) << Int64(lo)))


@cute.jit
def lowest_bit_index(x: Int32) -> Int32:
    """Index of the lowest set bit of a non-zero word."""
    low = x & (Int32(0) - x)
    return Int32(31) - Int32(cute.arch.clz(low))
