"""Device helpers of the SM100 backward kernel (CuTe DSL): the five tcgen05 MMAs, the SMEM tiles that
serve two MMA roles, the TMEM copies of the compute and dQ warps and the dQ accumulator order.
The bulk fp32 reduction, the deterministic turnstile and the K2Q walk are shared with the SM90
backward (:mod:`maskplan_kernels.consumer_plan`); the TMEM accumulator, column shift and tcgen05
fences with the forward (:mod:`flexattn_sm100.fwd_helpers`).

Never run on SM100 hardware: compiled for sm_100a only.

Operand roles (K-major = the reduction axis is contiguous; every tile is one SMEM buffer). A CTA
accumulates dV, dK and dQ over ``1 / splits`` of their head-dim columns (:class:`BwdGeometry`;
``splits = 2`` for D256: half ``h`` takes columns ``[h Dv/2, h Dv/2 + Dv/2)``), S^T and dP^T over the
full reduction::

    S^T  = K  Q^T    A = K   (tile_n x Dqk, K-major)      B = Q   (tile_m x Dqk, K-major)
    dP^T = V  dO^T   A = V   (tile_n x Dv,  K-major)      B = dO  (tile_m x Dv,  K-major)
    dV  += P^T dO    A = P^T (TMEM, 16-bit)               B = dO  (Dv x tile_m,  MN-major view, N-slice h)
    dK  += dS^T Q    A = dS^T (tile_n x tile_m, K-major)  B = Q   (Dqk x tile_m, MN-major view, N-slice h)
    dQ   = dS K      A = dS  (tile_m x tile_n, MN-major)  B = K   (Dqk x tile_n, MN-major view)
    dQ^T = K^T dS^T  A = K   (Dqk x tile_n, MN-major view, M-slice h)   B = dS^T (tile_m x tile_n, MN-major)

The last two are the two forms of dQ: ``dQ`` (M = tile_m = 128 Q rows) or, when the Q block has 64
rows (too few for a 128-lane accumulator), ``dQ^T`` (M = 128 of the head-dim columns, N = 64 Q rows).
The MN-major views cover the FULL head dim, so their MMA_MN mode has ``splits`` entries and the CTA
issues its half's (:func:`mma_operand` with ``mn=``).

So K, Q, dO and dS are each read through two layouts. :func:`smem_views` builds both from the MMA
atoms; ``tests/test_bwd_layout_agreement.py`` checks, coordinate by coordinate, that the two views of
each buffer address the same element (and that the plain 2-D view the compute warps write dS^T
through is the MMA's).

dQ accumulator order (fp32, per (q head, padded Q block), ``tile_m x Dqk`` values): the stored matrix
is the dQ accumulator as the dQ warps read it from TMEM, ``rows x cols`` = ``tile_m x Dqk`` (dQ) or
``Dqk x tile_m`` (dQ^T). Accumulator row ``32 w + l`` (``w < rows / 32``; the dQ warps of split ``h``
own rows ``128 h ..``) streams column chunk ``c`` (``DQ_CHUNK`` columns) as one contiguous 4 KB run
at ``(c * rows / 32 + w) * 32 * DQ_CHUNK``; inside it lane ``l``'s column ``e`` sits at ``(e // 4) *
128 + 4 l + e % 4`` (16-byte vectors, a warp's 32 vectors contiguous: conflict-free SMEM stores, one
bulk reduction per run). :func:`dq_accum_offset` is that map on the host, the layout tests' spec;
the kernels write and read it through :func:`dq_run_layout`.
"""


from dataclasses import dataclass

import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32
from cutlass._mlir import ir
from cutlass._mlir.dialects import nvvm, vector
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
from cutlass.cutlass_dsl import dsl_user_op

from .payload_layout import TMEM_LANES

#: dQ columns per TMEM load / SMEM staging run / bulk reduction of one dQ warp
DQ_CHUNK = 32
#: rows (TMEM lanes) of one warp's 32x32b access
WARP_ROWS = 32
#: bytes of one warp's fp32 staging run (32 rows x DQ_CHUNK columns): one bulk reduction
DQ_RUN_BYTES = WARP_ROWS * DQ_CHUNK * 4


@dataclass(frozen=True)
class BwdGeometry:
    """Compile-time shape of one backward CTA's five GEMMs (module docstring).

    ``splits`` CTAs share one K block; each accumulates ``1 / splits`` of the columns of dV, dK and dQ
    (and recomputes S^T and dP^T in full).
    """

    tile_m: int  # Q rows of a block (the N of S^T / dP^T, the reduction of dV / dK)
    tile_n: int  # K rows of a block (TMEM lanes of S^T, dP^T, dV, dK)
    head_dim_qk: int
    head_dim_v: int
    splits: int = 1

    def __post_init__(self) -> None:
        if self.tile_n != TMEM_LANES or self.tile_m not in (64, TMEM_LANES):
            raise ValueError(
                f"tile {self.tile_m}x{self.tile_n}: the backward takes 128 K rows, 64 or 128 Q rows"
            )
        if self.dq_transposed and self.dk_cols != TMEM_LANES:
            raise ValueError(f"dQ^T takes 128 head-dim columns per CTA, not {self.dk_cols}")
        if not self.dq_transposed and self.splits != 1:
            raise ValueError("a split head dim needs the dQ^T form (64-row Q blocks)")

    @property
    def dq_transposed(self) -> bool:
        """dQ^T = K^T dS^T (M = head-dim columns) instead of dQ = dS K (M = Q rows)."""
        return self.tile_m < TMEM_LANES

    @property
    def dv_cols(self) -> int:
        """dV columns one CTA accumulates."""
        return self.head_dim_v // self.splits

    @property
    def dk_cols(self) -> int:
        """dK (and dQ) columns one CTA accumulates."""
        return self.head_dim_qk // self.splits

    @property
    def dq_acc(self) -> tuple[int, int]:
        """(rows = TMEM lanes, columns) of the CTA's dQ accumulator."""
        return (self.dk_cols, self.tile_m) if self.dq_transposed else (self.tile_m, self.head_dim_qk)

    @property
    def dq_block_rows(self) -> int:
        """Rows of a Q block's stored accumulator matrix (module docstring): Dqk for dQ^T."""
        return self.head_dim_qk if self.dq_transposed else self.tile_m


# -- MMAs ------------------------------------------------------------------------------------------
def make_mmas(dtype, geo: BwdGeometry) -> dict:
    """The five tiled MMAs (cta_group 1), keyed ``s, dp, dv, dk, dq``; see the module docstring."""
    K, MN = OperandMajorMode.K, OperandMajorMode.MN
    one = tcgen05.CtaGroup.ONE

    def mma(a_major, b_major, mn, a_source=tcgen05.OperandSource.SMEM):
        return sm100_utils.make_trivial_tiled_mma(dtype, dtype, a_major, b_major, Float32, one, mn, a_source)

    tm, tn = geo.tile_m, geo.tile_n
    return {
        "s": mma(K, K, (tn, tm)),
        "dp": mma(K, K, (tn, tm)),
        "dv": mma(K, MN, (tn, geo.dv_cols), tcgen05.OperandSource.TMEM),
        "dk": mma(K, MN, (tn, geo.dk_cols)),
        "dq": mma(MN, MN, geo.dq_acc),
    }


def mma_tilers(geo: BwdGeometry) -> dict:
    """(M, N, K) of the SMEM operands of each MMA: the full head dim, so that a split MMA's MN-major
    view has ``splits`` MMA_MN entries."""
    tm, tn, dqk, dv = geo.tile_m, geo.tile_n, geo.head_dim_qk, geo.head_dim_v
    return {
        "s": (tn, tm, dqk),
        "dp": (tn, tm, dv),
        "dv": (tn, dv, tm),
        "dk": (tn, dqk, tm),
        "dq": (dqk, tm, tn) if geo.dq_transposed else (tm, dqk, tn),
    }


def smem_views(mmas: dict, geo: BwdGeometry, dtype, q_stages: int, do_stages: int) -> dict:
    """UMMA-canonical SMEM layouts ((MMA), MMA_MN, MMA_K[, stages]) of every operand role.

    ``k / q / do / ds`` allocate a buffer; ``kt / qt / dot / dsq`` are the second role of the same
    buffer (same swizzle, checked in the layout-agreement test). ``tp`` is the P^T operand in TMEM.
    K^T is dQ's A and dS its B in the dQ^T form, the other way round in the dQ form.
    """
    a, b = sm100_utils.make_smem_layout_a, sm100_utils.make_smem_layout_b
    tilers = mma_tilers(geo)
    kt, dsq = (a, b) if geo.dq_transposed else (b, a)
    return {
        "k": a(mmas["s"], tilers["s"], dtype, 1),
        "kt": kt(mmas["dq"], tilers["dq"], dtype, 1),
        "v": a(mmas["dp"], tilers["dp"], dtype, 1),
        "q": b(mmas["s"], tilers["s"], dtype, q_stages),
        "qt": b(mmas["dk"], tilers["dk"], dtype, q_stages),
        "do": b(mmas["dp"], tilers["dp"], dtype, do_stages),
        "dot": b(mmas["dv"], tilers["dv"], dtype, do_stages),
        "ds": a(mmas["dk"], tilers["dk"], dtype, 1),
        "dsq": dsq(mmas["dq"], tilers["dq"], dtype, 1),
        "tp": a(mmas["dv"], tilers["dv"], dtype, 1),
    }


def mma_operand(frag: cute.Tensor, mn=0, stage=None) -> cute.Tensor:
    """Entry ``mn`` (a runtime split index, or 0) of a ``((MMA), MMA_MN, MMA_K[, stages])`` fragment's
    MMA_MN mode: ``((MMA), MMA_K[, stages])``, of one stage when ``stage`` is given."""
    if cute.rank(frag) == 3:
        return frag[None, mn, None]
    return frag[None, mn, None, stage]


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


def dq_accum_offset(row: int, col: int, rows: int = TMEM_LANES) -> int:
    """Offset of accumulator element ``(row, col)`` inside its Q block's stored ``rows``-row matrix
    (:attr:`BwdGeometry.dq_block_rows`; host-side spec)."""
    w, lane = divmod(row, WARP_ROWS)
    c, e = divmod(col, DQ_CHUNK)
    return (c * (rows // WARP_ROWS) + w) * WARP_ROWS * DQ_CHUNK + (e // 4) * 4 * WARP_ROWS + 4 * lane + e % 4


@dsl_user_op
def store_async_remote(dst: cute.Pointer, values: tuple, full: cute.Pointer, *, loc=None, ip=None) -> None:
    """``st.async.shared::cluster.v4.b32``: 4 int32 values to ``dst`` in the peer's SMEM, completing
    16 bytes on its mbarrier ``full`` (both DSMEM pointers of :func:`cute.arch.map_dsmem_ptr`, mapped
    once by the caller rather than per store as ``cute.arch.store_async_dsmem`` does: the dQ warps
    have 80 registers)."""
    words = [Int32(x).ir_value(loc=loc, ip=ip) for x in values]
    vec = vector.from_elements(ir.VectorType.get([4], Int32.mlir_type), words, loc=loc, ip=ip)
    nvvm.store_async(dst.to_llvm_ptr(loc=loc, ip=ip), vec, full.to_llvm_ptr(loc=loc, ip=ip), loc=loc, ip=ip)


__all__ = [
    "DQ_CHUNK",
    "DQ_RUN_BYTES",
    "BwdGeometry",
    "WARP_ROWS",
    "chunk_copy",
    "column_chunk",
    "dq_accum_offset",
    "dq_run_layout",
    "make_mmas",
    "mma_operand",
    "mma_tilers",
    "operand_2d",
    "smem_views",
    "store_async_remote",
]
