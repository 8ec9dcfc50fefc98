"""Scan + allocation header (spec 4.5) in CuTe DSL: exclusive CSR offsets and the nnz header slots.

The oracle is :func:`maskplan_core.reference.csr.exclusive_offsets` (per count array, over the
``(mask head, row)`` flattened order) and :func:`maskplan_core.reference.csr.allocation_header`.

The count arrays are the pre-header workspace ``[Hmask, upper_rows]``: rows past the exact row
count belong to the dummy sample and hold zeros, so the exclusive scan of the padded array equals
the scan of the exact ``[Hmask, rows]`` array at every valid ``(head, row)`` (zeros add nothing).
The materialisers copy the valid part into the plan's exact-size tensors after the header read.

Work decomposition (one CTA per count array, single-pass, correctness first)::

    grid = (num_arrays, 1, 1)        block = (num_threads, 1, 1)
    CTA 0: forward partial counts -> offsets, header[1]      CTA 1: forward full -> header[2]
    CTA 2: K2Q partial -> header[5]                          CTA 3: K2Q full     -> header[6]

    per chunk of num_threads * items_per_thread counts:
        thread t loads items_per_thread consecutive counts (blocked arrangement, coalesced per warp),
        sums them, CTA exclusive scan of the thread sums + running carry, writes the exclusive
        offsets of its items.
    thread 0 stores the array total in its header slot.

A chunk of 4096 counts costs one CTA scan (three barriers), so 1e6 counts are ~250 chunks on one
SM; the planner's sizes (rows * heads up to ~1e5 at S = 128k) stay in the microseconds.

Compile-time (``Constexpr``): ``num_arrays``, ``num_threads``, ``items_per_thread``.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from ._jit_cache import compile_stage
from ._primitives import SCAN_SCRATCH, WARP, block_exclusive_sum
from .geometry import HDR_BWD_FULL, HDR_BWD_PARTIAL, HDR_FWD_FULL, HDR_FWD_PARTIAL

HEADER_SLOTS = (HDR_FWD_PARTIAL, HDR_FWD_FULL, HDR_BWD_PARTIAL, HDR_BWD_FULL)


@dataclass(frozen=True)
class ScanConfig:
    """Static configuration of the scan/header kernel (every field is compile-time)."""

    num_arrays: int  # 2: forward partial/full; 4: + K2Q partial/full
    num_threads: int = 1024
    items_per_thread: int = 4

    def __post_init__(self) -> None:
        if self.num_arrays not in (2, 4):
            raise ValueError(f"num_arrays must be 2 (forward) or 4 (forward + K2Q), got {self.num_arrays}")
        if self.num_threads % WARP or not WARP <= self.num_threads <= 1024:
            raise ValueError(f"num_threads must be a multiple of 32 in [32, 1024], got {self.num_threads}")
        if not 1 <= self.items_per_thread <= 16:
            raise ValueError(f"items_per_thread must be in [1, 16], got {self.items_per_thread}")


class ScanHeader:
    """One CTA per count array; see the module docstring."""

    def __init__(self, config: ScanConfig):
        self.config = config
        self.num_arrays = config.num_arrays
        self.num_threads = config.num_threads
        self.num_warps = config.num_threads // WARP
        self.items = config.items_per_thread
        self.chunk = config.num_threads * config.items_per_thread

    @cute.jit
    def __call__(
        self,
        fwd_partial_counts: cute.Pointer,  # int32 (n_fwd,) = (Hmask, uq_fwd) flattened
        fwd_partial_offsets: cute.Pointer,  # int32 (n_fwd,), written
        fwd_full_counts: cute.Pointer,
        fwd_full_offsets: cute.Pointer,
        k2q_partial_counts: cute.Pointer,  # int32 (n_bwd,) = (Hmask, uk_bwd) flattened (num_arrays 4)
        k2q_partial_offsets: cute.Pointer,
        k2q_full_counts: cute.Pointer,
        k2q_full_offsets: cute.Pointer,
        header: cute.Pointer,  # int32 (8,): slots 1, 2 (, 5, 6) written
        n_fwd: Int32,
        n_bwd: Int32,
        stream: cuda.CUstream,
    ):
        # (n,) each; a zero-size array keeps a 1-element layout and is never read
        lf = cute.make_layout(cutlass.max(n_fwd, 1))
        lb = cute.make_layout(cutlass.max(n_bwd, 1))
        self.kernel(
            cute.make_tensor(fwd_partial_counts, lf),
            cute.make_tensor(fwd_partial_offsets, lf),
            cute.make_tensor(fwd_full_counts, lf),
            cute.make_tensor(fwd_full_offsets, lf),
            cute.make_tensor(k2q_partial_counts, lb),
            cute.make_tensor(k2q_partial_offsets, lb),
            cute.make_tensor(k2q_full_counts, lb),
            cute.make_tensor(k2q_full_offsets, lb),
            cute.make_tensor(header, cute.make_layout(8)),
            n_fwd,
            n_bwd,
        ).launch(grid=[self.num_arrays, 1, 1], block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        mCntFP: cute.Tensor,
        mOffFP: cute.Tensor,
        mCntFF: cute.Tensor,
        mOffFF: cute.Tensor,
        mCntBP: cute.Tensor,
        mOffBP: cute.Tensor,
        mCntBF: cute.Tensor,
        mOffBF: cute.Tensor,
        mHeader: cute.Tensor,
        n_fwd: Int32,
        n_bwd: Int32,
    ):
        bidx, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sScratch = smem.allocate_tensor(Int32, cute.make_layout(SCAN_SCRATCH), byte_alignment=16)
        if bidx == 0:
            self.scan_array(mCntFP, mOffFP, n_fwd, mHeader, HEADER_SLOTS[0], sScratch)
        if bidx == 1:
            self.scan_array(mCntFF, mOffFF, n_fwd, mHeader, HEADER_SLOTS[1], sScratch)
        if const_expr(self.num_arrays == 4):
            if bidx == 2:
                self.scan_array(mCntBP, mOffBP, n_bwd, mHeader, HEADER_SLOTS[2], sScratch)
            if bidx == 3:
                self.scan_array(mCntBF, mOffBF, n_bwd, mHeader, HEADER_SLOTS[3], sScratch)

    @cute.jit
    def scan_array(
        self,
        mCnt: cute.Tensor,
        mOff: cute.Tensor,
        n: Int32,
        mHeader: cute.Tensor,
        slot: cutlass.Constexpr[int],
        sScratch: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        carry = Int32(0)
        for base in cutlass.range(0, n, self.chunk, unroll=1):
            i0 = base + tidx * self.items
            vals = []
            for i in cutlass.range_constexpr(self.items):
                v = Int32(0)
                if i0 + i < n:
                    v = mCnt[i0 + i]
                vals.append(v)
            mine = Int32(0)
            for i in cutlass.range_constexpr(self.items):
                mine = mine + vals[i]
            excl, total = block_exclusive_sum(mine, sScratch, self.num_warps)
            run = carry + excl
            for i in cutlass.range_constexpr(self.items):
                if i0 + i < n:
                    mOff[i0 + i] = run
                run = run + vals[i]
            carry = carry + total
        if tidx == 0:
            mHeader[slot] = carry


def compile_scan_header(config: ScanConfig, *, options: str | None = None):
    """Compile (cached) the scan/header kernel for ``config`` (:func:`._jit_cache.compile_stage`)."""
    return compile_stage("scan_header", ScanHeader, config, pointers=9, ints=2, options=options)
