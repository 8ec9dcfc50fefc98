"""Script (not a test module): print, as JSON, what CuTe DSL makes of each case in ``argv[2]``.

``fragments``: the accumulator coordinates it assigns to every register of every thread of the SM90
SS bf16 ``TiledMma`` of a case ``(acc_m, acc_n, atom_layout)``.
``smem_rows``: for a case ``(rows, cols, major)``, the SMEM layout ``bwd_helpers.smem_layout`` builds
for a bf16 tile (the kernels' Q / dO / K / V tiles): the swizzle ``(bits, base, shift)`` and the
unswizzled element offset of each 16-byte piece, ``offsets[r][c // 8]``.

Run by ``test_sm90_cute_crosscheck.py`` in a fresh interpreter with ``CUTE_DSL_ARCH=sm_90a``: the DSL
fixes its target architecture once per process.
"""

from __future__ import annotations

import json
import sys

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as hopper
from cutlass.cute.nvgpu import OperandMajorMode

from flexattn_sm90.bwd_helpers import smem_layout


def fragments(acc_m: int, acc_n: int, atom_layout: tuple[int, int, int]) -> list[list[tuple[int, int]]]:
    result = {}
    tiler = (64, acc_n // atom_layout[1])  # one m64nN atom per warpgroup

    @cute.jit
    def probe():
        tiled_mma = hopper.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.K,
            cutlass.Float32, tuple(atom_layout), tiler,
        )  # fmt: skip
        coords = cute.make_identity_tensor((acc_m, acc_n))  # (acc_m, acc_n) -> (row, col)
        threads = []
        for t in cutlass.range_constexpr(cute.size(tiled_mma)):
            part = tiled_mma.get_slice(t).partition_C(coords)
            regs = []
            for i in cutlass.range_constexpr(cute.size(part)):
                regs.append(part[i])
            threads.append(regs)
        result["threads"] = threads

    probe()
    return [[(int(r), int(c)) for r, c in regs] for regs in result["threads"]]


def smem_rows(rows: int, cols: int, major: int | None) -> dict:
    result = {}

    @cute.jit
    def probe():
        layout = smem_layout(cutlass.BFloat16, rows, cols, major=major)
        swizzle = layout.inner
        result["swizzle"] = (swizzle.num_bits, swizzle.num_base, swizzle.num_shift)
        pieces = range(0, cols, 8)
        result["offsets"] = [[cute.crd2idx((r, c), layout.outer) for c in pieces] for r in range(rows)]

    probe()
    offsets = [[int(o) for o in row] for row in result["offsets"]]
    return {"swizzle": list(result["swizzle"]), "offsets": offsets}


PROBES = {"fragments": fragments, "smem_rows": smem_rows}

if __name__ == "__main__":
    print(json.dumps([PROBES[sys.argv[1]](*case) for case in json.loads(sys.argv[2])]))
