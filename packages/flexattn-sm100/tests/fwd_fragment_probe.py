"""Script (not a test module): print, as JSON, what the SM100 forward kernel's OWN softmax fragments
hold, per payload subtile ``r`` (one for qstage1-1cta and d256; the two CTA ranks of qstage1-2cta; the
two q stages, i.e. softmax warpgroups, of qstage2-1cta) and softmax thread ``t``: the score coordinates
``(m, n)`` of its registers ``rS[e]`` (the registers the packed-predicate bit-select indexes), the
``(row, column)`` of its packed-P registers and of its O-chunk registers; and where the kernel
reads thread ``t``'s payload words (the plane index of ``Sm100FwdKernel.payload_plane_index`` and,
for the SMEM ring, the offset of word ``w`` of group ``t`` in a stage of
``Sm100FwdKernel.mask_ring_layout``).

It calls :meth:`Sm100FwdKernel.softmax_fragments`, the builder the kernel itself uses, with the
kernel's own MMA slice of each rank inside a ``cute.jit`` trace (compile-time only, no GPU). Run by
``test_fwd_layout_agreement.py`` in a fresh interpreter with ``CUTE_DSL_ARCH=sm_100a``: the DSL fixes
its target architecture once per process.

    python fwd_fragment_probe.py '[[128, 128, "bfloat16", "qstage1-2cta"]]'
"""

from __future__ import annotations

import json
import sys

import cutlass
import cutlass.cute as cute

from flexattn_sm100.fwd_helpers import make_pv_mma, make_qk_mma
from flexattn_sm100.fwd_kernel import Sm100FwdKernel
from flexattn_sm100.heuristics import select_fwd_config

#: partial entries whose plane index is reported
ENTRIES = (0, 1, 7)


def fragments(head_dim_qk: int, head_dim_v: int, dtype: str, variant: str) -> dict[str, list]:
    config = select_fwd_config(head_dim_qk=head_dim_qk, head_dim_v=head_dim_v, dtype=dtype, variant=variant)
    kernel = Sm100FwdKernel(config)
    # payload subtiles: the CTA ranks of a pair, or the q stages of qstage2 (each its own warpgroup)
    ranks = kernel.cta_group_size * kernel.q_stages
    result: dict[str, list] = {"s": [[] for _ in range(ranks)], "p": [[] for _ in range(ranks)],
                               "o": [[] for _ in range(ranks)], "ring": []}  # fmt: skip

    @cute.jit
    def probe():
        qk_mma = make_qk_mma(kernel.dtype, kernel.mma_tile_m, kernel.tile_n, kernel.cta_group_size)
        pv_mma = make_pv_mma(kernel.dtype, kernel.mma_tile_m, kernel.head_dim_v, kernel.cta_group_size)
        tmem = cute.make_ptr(cutlass.Float32, 0, mem_space=cute.AddressSpace.tmem, assumed_align=16)
        for r in cutlass.range_constexpr(ranks):
            rank, q = (0, r) if kernel.q_stages > 1 else (r, 0)
            qk_thr, pv_thr = qk_mma.get_slice(rank), pv_mma.get_slice(rank)
            for t in cutlass.range_constexpr(kernel.cta_tile_m):
                frags = kernel.softmax_fragments(qk_thr, pv_thr, tmem, t, q)
                for key, coords in (("s", frags.tLcS), ("p", frags.tPcP), ("o", frags.tLcO)):
                    result[key][r].append([coords[e] for e in range(cute.size(coords))])
        if cutlass.const_expr(kernel.mask_stages > 0):
            ring = kernel.mask_ring_layout()
            for t in cutlass.range_constexpr(kernel.payload_groups):
                result["ring"].append([cute.crd2idx((w, t, 0), ring) for w in range(kernel.payload_words)])

    probe()
    out = {key: [[[[int(x) for x in c] for c in regs] for regs in per_thread] for per_thread in result[key]]
           for key in ("s", "p", "o")}  # fmt: skip
    out["ring"] = [[int(x) for x in words] for words in result["ring"]]
    out["planes"] = [[kernel.payload_plane_index(e, r) for r in range(ranks)] for e in ENTRIES]
    out["entries"] = list(ENTRIES)
    out["plane_words"] = kernel.payload_plane
    out["mask_stages"] = kernel.mask_stages
    return out


if __name__ == "__main__":
    print(json.dumps([fragments(*case) for case in json.loads(sys.argv[1])]))
