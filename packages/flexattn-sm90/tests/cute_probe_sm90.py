"""Script (not a test module): print, as JSON, the accumulator coordinates CuTe DSL assigns to every
register of every thread of the SM90 SS bf16 ``TiledMma`` for each case in ``argv[1]``.

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


if __name__ == "__main__":
    print(json.dumps([fragments(*case) for case in json.loads(sys.argv[1])]))
