"""Device helpers of the SM100 backward kernel (CuTe DSL): the five tcgen05 MMAs, the SMEM tiles that
serve two MMA roles, the TMEM copies of the compute and dQ warps and the dQ accumulator order.
The bulk fp32 reduction, the deterministic turnstile and the K2Q walk are shared with the SM90
backward (:mod:`maskplan_kernels.consumer_plan`); the TMEM accumulator, column shift and tcgen05
fences with the forward (:mod:`flexattn_sm100.fwd_helpers`).

Never run on SM100 hardware: compiled for sm_100a only.

Operand roles (K-major = the reduction axis is contiguous; every tile is one SMEM buffer)::

    S^T  = K  Q^T    A = K   (tile_n x Dqk, K-major)      B = Q   (tile_m x Dqk, K-major)
    dP^T = V  dO^T   A = V   (tile_n x Dv,  K-major)      B = dO  (tile_m x Dv,  K-major)
    dV  += P^T dO    A = P^T (TMEM, 16-bit)               B = dO  (Dv x tile_m,  MN-major view)
    dK  += dS^T Q    A = dS^T (tile_n x tile_m, K-major)  B = Q   (Dqk x tile_m, MN-major view)
    dQ   = dS K      A = dS  (tile_m x tile_n, MN-major)  B = K   (Dqk x tile_n, MN-major view)

So K, Q, dO and dS are each read through two layouts. :func:`smem_views` builds both from the MMA
atoms; ``tests/test_bwd_layout_agreement.py`` checks, coordinate by coordinate, that the two views of
each buffer address the same element (and that the plain 2-D view the compute warps write dS^T
through is the MMA's).

dQ accumulator order (fp32, per (q head, padded Q block), ``tile_m x Dqk`` values): the dQ warp
``w`` (rows ``32 w .. 32 w + 31``) streams column chunk ``c`` (``DQ_CHUNK`` columns) as one
contiguous 4 KB run at ``(c * 4 + w) * 32 * DQ_CHUNK``; inside it lane ``l``'s column ``e`` sits at
``(e // 4) * 128 + 4 l + e % 4`` (16-byte vectors, a warp's 32 vectors contiguous: conflict-free
SMEM stores, one bulk reduction per run). :func:`dq_accum_offset` is that map; the postprocess
reads it back.
"""


import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

#: dQ columns per TMEM load / SMEM staging run / bulk reduction of one dQ warp
DQ_CHUNK = 32
#: rows (TMEM lanes) of one warp's 32x32b access
WARP_ROWS = 32


# -- MMAs ------------------------------------------------------------------------------------------
def make_mmas(dtype, tile_m: int, tile_n: int, head_dim_qk: int, head_dim_v: int) -> dict:
    """The five tiled MMAs (cta_group 1), keyed ``s, dp, dv, dk, dq``; see the module docstring."""
    K, MN = OperandMajorMode.K, OperandMajorMode.MN
    one = tcgen05.CtaGroup.ONE

    def mma(a_major, b_major, mn, a_source=tcgen05.OperandSource.SMEM):
        return sm100_utils.make_trivial_tiled_mma(dtype, dtype, a_major, b_major, Float32, one, mn, a_source)

    return {
        "s": mma(K, K, (tile_n, tile_m)),
        "dp": mma(K, K, (tile_n, tile_m)),
        "dv": mma(K, MN, (tile_n, head_dim_v), tcgen05.OperandSource.TMEM),
        "dk": mma(K, MN, (tile_n, head_dim_qk)),
        "dq": mma(MN, MN, (tile_m, head_dim_qk)),
    }


def mma_tilers(tile_m: int, tile_n: int, head_dim_qk: int, head_dim_v: int) -> dict:
    """(M, N, K) of each MMA."""
    return {
        "s": (tile_n, tile_m, head_dim_qk),
        "dp": (tile_n, tile_m, head_dim_v),
        "dv": (tile_n, head_dim_v, tile_m),
        "dk": (tile_n, head_dim_qk, tile_m),
        "dq": (tile_m, head_dim_qk, tile_n),
    }


def smem_views(mmas: dict, tilers: dict, dtype, q_stages: int, do_stages: int) -> dict:
    """UMMA-canonical SMEM layouts ((MMA), MMA_MN, MMA_K[, stages]) of every operand role.

    ``k / q / do / ds`` allocate a buffer; ``kt / qt / dot / dsq`` are the second role of the same
    buffer (same swizzle, checked in the layout-agreement test). ``tp`` is the P^T operand in TMEM.
    """
    a, b = sm100_utils.make_smem_layout_a, sm100_utils.make_smem_layout_b
    return {
        "k": a(mmas["s"], tilers["s"], dtype, 1),
        "kt": b(mmas["dq"], tilers["dq"], dtype, 1),
        "v": a(mmas["dp"], tilers["dp"], dtype, 1),
        "q": b(mmas["s"], tilers["s"], dtype, q_stages),
        "qt": b(mmas["dk"], tilers["dk"], dtype, q_stages),
        "do": b(mmas["dp"], tilers["dp"], dtype, do_stages),
        "dot": b(mmas["dv"], tilers["dv"], dtype, do_stages),
        "ds": a(mmas["dk"], tilers["dk"], dtype, 1),
        "dsq": a(mmas["dq"], tilers["dq"], dtype, 1),
        "tp": a(mmas["dv"], tilers["dv"], dtype, 1),
    }


def operand_2d(layout: cute.Layout) -> cute.Layout:
    """``((atom_MN, atom_K), MMA_MN, MMA_K, ...)`` (stage 0) -> the plain ``(MN, K)`` layout."""
    s, d = layout.shape, layout.stride
    return cute.make_layout(((s[0][0], s[1]), (s[0][1], s[2])), stride=((d[0][0], d[1]), (d[0][1], d[2])))


# -- TMEM ------------------------------------------------------------------------------------------
def column_chunk(t: cute.Tensor, columns: int) -> cute.Tensor:
    """The first ``columns`` columns of a ``((128, N), 1, 1)`` accumulator (or coordinate) tensor."""
    return cute.make_tensor(t.iterator, cute.composition(t.layout, cute.make_layout((128, columns))))


def chunk_copy(acc: cute.Tensor, coords: cute.Tensor, thread: Int32, columns: int, store: bool = False):
    """A ``tcgen05.{ld,st} 32x32b.x<columns>`` of ``columns`` accumulator columns: thread ``t`` (of
    a warpgroup) owns TMEM lane ``t`` and its register ``e`` is column ``e`` of the chunk.

    Returns ``(copy, tTMEM, tCoords)``: the copy, this thread's TMEM partition of the first chunk
    (chunk ``i`` is the same partition shifted ``i * columns`` columns) and the coordinates its
    registers hold (for the layout tests).
    """
    op = tcgen05.copy.St32x32bOp if store else tcgen05.copy.Ld32x32bOp
    chunk = column_chunk(acc, columns)
    tiled = tcgen05.make_tmem_copy(cute.make_copy_atom(op(tcgen05.copy.Repetition(columns)), Float32), chunk)
    thr = tiled.get_slice(thread)
    if store:
        return tiled, thr.partition_D(chunk), thr.partition_S(column_chunk(coords, columns))
    return tiled, thr.partition_S(chunk), thr.partition_D(column_chunk(coords, columns))


# -- dQ accumulator --------------------------------------------------------------------------------
def dq_run_layout() -> cute.Layout:
    """``(lane, element) -> offset`` inside one warp's ``32 x DQ_CHUNK`` run (module docstring)."""
    v = 4
    return cute.make_layout((WARP_ROWS, (v, DQ_CHUNK // v)), stride=(v, (1, v * WARP_ROWS)))


def dq_accum_offset(row: int, col: int) -> int:
    """Offset of dQ element ``(row, col)`` inside its Q block's accumulator (host-side spec)."""
    w, lane = divmod(row, WARP_ROWS)
    c, e = divmod(col, DQ_CHUNK)
    return (c * 4 + w) * WARP_ROWS * DQ_CHUNK + (e // 4) * 4 * WARP_ROWS + 4 * lane + e % 4


__all__ = [
    "DQ_CHUNK",
    "WARP_ROWS",
    "chunk_copy",
    "column_chunk",
    "dq_accum_offset",
    "dq_run_layout",
    "make_mmas",
    "mma_tilers",
    "operand_2d",
    "smem_views",
]
