"""Script (not a test module): print, as JSON, for each case in ``argv[2]``, what the probe named by
``argv[1]`` reads off CuTe DSL:

``fragments``: the accumulator coordinates the tcgen05 32x32b TMEM load gives the registers of
sampled softmax threads, per CTA rank.

``v_rows``: the forward's V^T SMEM stage (``make_smem_layout_b`` of the P V MMA): its swizzle and
the offset of every 8-element piece ``(key row, Dv column)``.

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

from flexattn_sm100.fwd_helpers import make_pv_mma


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


def v_rows(head_dim_v: int, tile_n: int) -> dict:
    """One CTA's V^T stage: ``offsets[row][col // 8]`` (elements) and the swizzle's parameters."""
    result = {}

    @cute.jit
    def probe():
        mma = make_pv_mma(cutlass.BFloat16, 128, head_dim_v)
        layout = blackwell.make_smem_layout_b(mma, (128, head_dim_v, tile_n), cutlass.BFloat16, 2)
        swizzle = layout.inner
        result["swizzle"] = (swizzle.num_bits, swizzle.num_base, swizzle.num_shift)
        # the stage's (MMA, MMA_N, MMA_K) coordinates, which the TMA fills with these (Dv, key) elements
        coords = mma.get_slice(0).partition_B(cute.make_identity_tensor((head_dim_v, tile_n)))
        pieces = {}
        for i in cutlass.range_constexpr(0, cute.size(coords), 8):  # Dv runs fastest: 8 a piece
            pieces[coords[i]] = cute.crd2idx(i, layout.outer)
        result["pieces"] = pieces

    probe()
    offsets = [[None] * (head_dim_v // 8) for _ in range(tile_n)]
    for (col, row), offset in result["pieces"].items():
        assert int(col) % 8 == 0, "a sampled element is not the first of its piece"
        offsets[int(row)][int(col) // 8] = int(offset)
    return {"swizzle": list(result["swizzle"]), "offsets": offsets}


PROBES = {"fragments": fragments, "v_rows": v_rows}

if __name__ == "__main__":
    print(json.dumps([PROBES[sys.argv[1]](*case) for case in json.loads(sys.argv[2])]))
