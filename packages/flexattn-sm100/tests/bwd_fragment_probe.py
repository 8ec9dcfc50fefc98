"""Script (not a test module): print, as JSON, what the SM100 backward kernel's OWN fragments and SMEM
views hold, for ``test_bwd_layout_agreement.py`` (compile-time only, no GPU; run in a fresh
interpreter with ``CUTE_DSL_ARCH=sm_100a`` because the DSL fixes its target once per process).

Per case ``(variant, head_dim_qk, head_dim_v, dtype)``:

* ``s``: for compute thread ``t = 128 wg + r`` (``W`` warpgroups), the score ``(m, n)`` of each of its
  64 registers in the order the kernel tests payload bits: chunk ``c`` register ``e`` is the chunk-0
  copy (:meth:`Sm100BwdKernel.compute_fragments`) shifted ``64 wg + 32 c`` TMEM columns (a TMEM
  address plus ``k`` is column plus ``k``), and accumulator ``(row, col)`` of S^T is score ``(col,
  row)``;
* ``p``: the ``(row, packed column)`` of the P^T store registers (chunk 0);
* ``dq``: the dQ accumulator ``(row, column)`` of each dQ thread's chunk-0 registers (d256: of dQ^T);
* ``ranks``: per CTA rank ``c`` of the K block (k2q-2cta: 2, else 1), the plan-block K row of the
  CTA's TMEM lane 0 (:meth:`Sm100BwdKernel.cta_k_rows`) and the int32 offset in ``mask_block_masks``
  at which each compute thread reads its words of partial entry 1 (:meth:`Sm100BwdKernel.payload_offset`);
* ``smem``: for every buffer read through two MMA layouts (K, Q, dO, dS), the number of
  coordinates (every column of :data:`SAMPLE_ROWS`) where the second view does not address the
  element the first one does, the swizzles of both, and the stage strides;
* ``rows``: for K, V, Q and dO (their rows are sequence positions; the tail zeroing of the load
  warp takes them through ``stage_fill.row_view``), the offset of every 8-element piece ``(row,
  col)`` through ``operand_2d`` of stage 0, the swizzle, and on sampled elements the number where
  ``operand_2d`` disagrees with the MMA's own partition of the tile.

    python bwd_fragment_probe.py '[["k2q-2cta", 128, 128, "bfloat16"]]'
"""

from __future__ import annotations

import json
import sys

import cutlass
import cutlass.cute as cute

from flexattn_sm100.bwd_helpers import make_mmas, operand_2d, smem_views
from flexattn_sm100.bwd_kernel import Sm100BwdKernel
from flexattn_sm100.config import BWD_VARIANTS, Sm100BwdConfig

#: rows whose every column is compared (two swizzle periods at the start, middle and end: the
#: swizzle repeats every 8 rows, the atoms every 64)
SAMPLE_ROWS = (*range(16), *range(56, 72), *range(112, 128))
#: (buffer, its second role): the second is the transpose of the first
PAIRS = (("k", "kt"), ("q", "qt"), ("do", "dot"), ("ds", "dsq"))
#: (buffer, the MMA of its first role, its operand there): rows are sequence positions
ROW_BUFFERS = (("k", "s", "A"), ("v", "dp", "A"), ("q", "s", "B"), ("do", "dp", "B"))


def probe(variant: str, head_dim_qk: int, head_dim_v: int, dtype: str) -> dict:
    config = Sm100BwdConfig(
        head_dim_qk=head_dim_qk, head_dim_v=head_dim_v, dtype=dtype, variant=BWD_VARIANTS[variant]
    )
    kernel = Sm100BwdKernel(config)
    result: dict = {"s_chunk0": [], "p": [], "dq": [], "smem": {}, "rows": {}}

    @cute.jit
    def run():
        mmas = make_mmas(kernel.dtype, kernel.geometry)
        views = smem_views(mmas, kernel.geometry, kernel.dtype, kernel.q_stages, kernel.do_stages)
        thr = {key: m.get_slice(0) for key, m in mmas.items()}
        tmem = cute.make_ptr(cutlass.Float32, 0, mem_space=cute.AddressSpace.tmem, assumed_align=16)
        for r in cutlass.range_constexpr(128):
            f = kernel.compute_fragments(thr, tmem, r)
            result["s_chunk0"].append([tuple(f["tLcS"][e]) for e in range(cute.size(f["tLcS"]))])
            result["p"].append([tuple(f["tScP"][e]) for e in range(cute.size(f["tScP"]))])
            g = kernel.dq_fragments(thr, tmem, r)
            result["dq"].append([tuple(g["tLc"][e]) for e in range(cute.size(g["tLc"]))])
        for first, second in PAIRS:
            a, b = views[first], views[second]
            a2, b2 = operand_2d(a.outer), operand_2d(b.outer)
            rows, cols = cute.size(a2, mode=[0]), cute.size(a2, mode=[1])
            bad = sum(
                cute.crd2idx((i, j), a2) != cute.crd2idx((j, i), b2)
                for i in SAMPLE_ROWS
                if i < rows
                for j in range(cols)
            )
            stage = [
                cute.rank(a.outer) > 3 and a.outer.stride[3],
                cute.rank(b.outer) > 3 and b.outer.stride[3],
            ]
            result["smem"][first] = {
                "shape": [rows, cols],
                "mismatches": int(bad),
                "swizzles": [str(a.inner), str(b.inner)],
                "stage_strides": [int(x) for x in stage],
            }

        for name, mma, operand in ROW_BUFFERS:
            layout = views[name]
            flat = operand_2d(layout.outer)
            rows, cols = cute.size(flat, mode=[0]), cute.size(flat, mode=[1])
            ident = cute.make_identity_tensor((rows, cols))
            part = thr[mma].partition_A(ident) if operand == "A" else thr[mma].partition_B(ident)
            bad = sum(
                cute.crd2idx(i, layout.outer) != cute.crd2idx(part[i], flat)
                for i in range(0, cute.size(part), 61)
            )
            swizzle = layout.inner
            result["rows"][name] = {
                "offsets": [[cute.crd2idx((r, c), flat) for c in range(0, cols, 8)] for r in range(rows)],
                "swizzle": [swizzle.num_bits, swizzle.num_base, swizzle.num_shift],
                "partition_mismatches": bad,
            }

    run()
    for check in result["rows"].values():
        check["offsets"] = [[int(o) for o in row] for row in check["offsets"]]
        check["partition_mismatches"] = int(check["partition_mismatches"])
    chunk0 = result.pop("s_chunk0")
    chunk = len(chunk0[0])
    # score (m, n) = accumulator (col, row) of S^T, chunk c of warpgroup wg shifted 64 wg + chunk c columns
    result["s"] = [
        [
            [int(col) + kernel.payload_elements * wg + chunk * c, int(row)]
            for c in range(kernel.payload_elements // chunk)
            for row, col in chunk0[r]
        ]
        for wg in range(kernel.num_compute_threads // 128)
        for r in range(128)
    ]
    result["dq"] = [[[int(x) for x in c] for c in regs] for regs in result["dq"]]
    result["p"] = [[[int(x) for x in c] for c in regs] for regs in result["p"]]
    result["ranks"] = [
        {
            "k_row0": int(kernel.cta_k_rows(c)),
            "offsets": [int(kernel.payload_offset(1, c, t)) for t in range(kernel.num_compute_threads)],
        }
        for c in range(kernel.pair)
    ]
    return result


if __name__ == "__main__":
    print(json.dumps([probe(*case) for case in json.loads(sys.argv[1])]))
