"""Script (not a test module): print, as JSON, the accumulator coordinates the tcgen05 32x32b TMEM load
gives the registers of sampled softmax threads, per CTA rank, for each case in ``argv[1]``.

Run by ``test_sm100_cute_crosscheck.py`` in a fresh interpreter with ``CUTE_DSL_ARCH=sm_100a``: the DSL
fixes its target architecture once per process.
"""

from __future__ import annotations

import json
import sys

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as blackwell
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05


def fragments(tile_m: int, tile_n: int, cta_group_size: int, threads: list[int]) -> list[list[list]]:
    """[rank][sampled thread][register] -> (row, col) of the QK accumulator."""
    result = {}

    @cute.jit
    def probe():
        cta_group = tcgen05.CtaGroup.TWO if cta_group_size == 2 else tcgen05.CtaGroup.ONE
        tiled_mma = blackwell.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32,
            cta_group, (tile_m, tile_n),
        )  # fmt: skip
        atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), cutlass.Float32)
        ranks = []
        for rank in cutlass.range_constexpr(cta_group_size):
            thr_mma = tiled_mma.get_slice(rank)
            acc = thr_mma.make_fragment_C(thr_mma.partition_shape_C((tile_m, tile_n)))
            tmem_ptr = cute.make_ptr(cutlass.Float32, 0, mem_space=cute.AddressSpace.tmem, assumed_align=16)
            tmem_load = tcgen05.make_tmem_copy(atom, cute.make_tensor(tmem_ptr, acc.layout))
            coords = thr_mma.partition_C(cute.make_identity_tensor((tile_m, tile_n)))
            per_thread = []
            for k in cutlass.range_constexpr(len(threads)):
                part = tmem_load.get_slice(threads[k]).partition_D(coords)
                regs = []
                for i in cutlass.range_constexpr(cute.size(part)):
                    regs.append(part[i])
                per_thread.append(regs)
            ranks.append(per_thread)
        result["ranks"] = ranks

    probe()
    return [[[(int(r), int(c)) for r, c in regs] for regs in per_thread] for per_thread in result["ranks"]]


if __name__ == "__main__":
    print(json.dumps([fragments(*case) for case in json.loads(sys.argv[1])]))
