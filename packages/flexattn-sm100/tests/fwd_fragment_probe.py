"""Script (not a test module): print, as JSON, what the SM100 forward kernel's OWN softmax fragments
hold, per softmax thread ``t``: the score coordinates ``(m, n)`` of its registers ``rS[e]`` (the
registers the packed-predicate bit-select indexes), the ``(row, column)`` of its packed-P registers
and of its O-chunk registers.

It calls :meth:`Sm100FwdKernel.softmax_fragments`, the builder the kernel itself uses, inside a
``cute.jit`` trace (compile-time only, no GPU). Run by ``test_fwd_layout_agreement.py`` in a fresh
interpreter with ``CUTE_DSL_ARCH=sm_100a``: the DSL fixes its target architecture once per process.

    python fwd_fragment_probe.py '[[128, 128, "bfloat16"]]'     # (head_dim_qk, head_dim_v, dtype)
"""

from __future__ import annotations

import json
import sys

import cutlass
import cutlass.cute as cute

from flexattn_sm100.fwd_helpers import make_pv_mma, make_qk_mma
from flexattn_sm100.fwd_kernel import Sm100FwdKernel
from flexattn_sm100.heuristics import select_fwd_config


def fragments(head_dim_qk: int, head_dim_v: int, dtype: str) -> dict[str, list]:
    config = select_fwd_config(
        head_dim_qk=head_dim_qk, head_dim_v=head_dim_v, dtype=dtype, variant="qstage1-1cta"
    )
    kernel = Sm100FwdKernel(config)
    result: dict[str, list] = {"s": [], "p": [], "o": []}

    @cute.jit
    def probe():
        qk_thr = make_qk_mma(kernel.dtype, kernel.tile_m, kernel.tile_n).get_slice(0)
        pv_thr = make_pv_mma(kernel.dtype, kernel.tile_m, kernel.head_dim_v).get_slice(0)
        tmem = cute.make_ptr(cutlass.Float32, 0, mem_space=cute.AddressSpace.tmem, assumed_align=16)
        for t in cutlass.range_constexpr(kernel.num_softmax_threads):
            frags = kernel.softmax_fragments(qk_thr, pv_thr, tmem, t)
            for key, coords in (("s", frags.tLcS), ("p", frags.tPcP), ("o", frags.tLcO)):
                result[key].append([coords[e] for e in range(cute.size(coords))])

    probe()
    return {
        key: [[[int(x) for x in c] for c in regs] for regs in per_thread]
        for key, per_thread in result.items()
    }


if __name__ == "__main__":
    print(json.dumps([fragments(*case) for case in json.loads(sys.argv[1])]))
