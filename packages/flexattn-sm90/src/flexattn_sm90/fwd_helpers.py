"""Device helpers of the SM90 forward kernel (CuTe DSL): WGMMA issue, accumulator views, the
online softmax over a WGMMA fragment, and the epilogue's fragment -> SMEM -> GMEM row stores (which
the backward's dK/dV epilogue uses too). The plan walk and the packed-predicate bit-select every
consumer shares live in :mod:`maskplan_kernels.consumer_plan`.

Everything here is generic over the accumulator of a ``wgmma.m64nNk16`` fp32 tile held by one
consumer thread, whose register (fragment) order is the one :mod:`flexattn_sm90.payload_layout`
documents: ``acc[e]`` with ``e = 4j + 2*half + c`` is row ``r0 + 8*half``, column ``8j + 2(l%4) + c``.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.cute.nvgpu.warp import StMatrix8x8x16bOp
from cutlass.tensor_utils import LayoutEnum

from maskplan_kernels.consumer_inputs import check_register_split, max_launch_registers
from maskplan_kernels.consumer_plan import element_ptr
from maskplan_kernels.consumer_softmax import LN_2, row_max_of


# -- warp specialisation ---------------------------------------------------------------------------
def register_split(num_mma_warpgroups: int, producer_regs: int, mma_regs: int) -> tuple[int, int]:
    """``(producer_regs, mma_regs)`` for ``setmaxnreg`` of one producer and ``num_mma_warpgroups``
    MMA warpgroups, checked against the launch allocation
    (:func:`maskplan_kernels.consumer_inputs.check_register_split`)."""
    threads = 128 * (1 + num_mma_warpgroups)
    split = ((producer_regs, 4), (mma_regs, 4 * num_mma_warpgroups))
    check_register_split(threads, split, max_launch_registers(threads))
    return producer_regs, mma_regs


# -- layouts --------------------------------------------------------------------------------------
def smem_layout_row_major(dtype, rows: int, cols: int, stages: int | None = None):
    """Swizzled SMEM layout of a ``rows x cols`` row-major (cols contiguous) tile for WGMMA/TMA.

    ``(rows, cols)`` or ``(rows, cols, stages)``.
    """
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype
    )
    shape = (rows, cols) if stages is None else (rows, cols, stages)
    order = (0, 1) if stages is None else (0, 1, 2)
    return cute.tile_to_shape(atom, shape, order=order)


def transpose_view(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of an SMEM tensor (``(n, d, s)`` -> ``(d, n, s)``)."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def acc_mn_layout(acc_layout: cute.Layout) -> cute.Layout:
    """``((2, 2, N/8), MMA_M, MMA_N)`` -> ``((2, MMA_M), (2, N/8, MMA_N))``: (rows, cols) of a thread."""
    flat = cute.make_layout(acc_layout.shape)
    shape = ((flat.shape[0][1], flat.shape[1]), (flat.shape[0][0], *flat.shape[0][2:], flat.shape[2]))
    stride = ((flat.stride[0][1], flat.stride[1]), (flat.stride[0][0], *flat.stride[0][2:], flat.stride[2]))
    return cute.composition(acc_layout, cute.make_layout(shape, stride=stride))


def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """Row/column view of an accumulator fragment (rows = the thread's 2 rows per m64 atom)."""
    return cute.make_tensor(acc.iterator, acc_mn_layout(acc.layout))


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View a ``((2, 2, N/8), MMA_M, MMA_N)`` fp32 accumulator as the register A operand of the
    next ``m64nKk16`` WGMMA: ``((2, 2, 2), MMA_M, (N/16, MMA_N))`` (two 8-column groups per k16)."""
    layout = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    shape = (
        (layout.shape[0][0], layout.shape[0][1], layout.shape[0][2][0]),
        layout.shape[1],
        (layout.shape[0][2][1], layout.shape[2]),
    )
    stride = (
        (layout.stride[0][0], layout.stride[0][1], layout.stride[0][2][0]),
        layout.stride[1],
        (layout.stride[0][2][1], layout.stride[2]),
    )
    return cute.make_tensor(acc.iterator, cute.make_layout(shape, stride=stride))


# -- WGMMA ----------------------------------------------------------------------------------------
@cute.jit
def wgmma(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tA: cute.Tensor,
    tB: cute.Tensor,
    zero_init: cutlass.Constexpr[bool],
    wait: cutlass.Constexpr[int],
):
    """``acc (+)= A @ B`` over every k-block of the fragments; ``wait >= 0`` waits for all but
    ``wait`` committed groups."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tA.shape[2])):
        cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if const_expr(wait >= 0):
        warpgroup.wait_group(wait)


# -- online softmax -------------------------------------------------------------------------------
@cute.jit
def quad_allreduce_max(x: Float32) -> Float32:
    """Max over the 4 lanes of a quad (the lanes sharing one accumulator row)."""
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))


@cute.jit
def quad_allreduce_sum(x: Float32) -> Float32:
    x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
    return x + cute.arch.shuffle_sync_bfly(x, offset=1)


@cute.jit
def online_softmax_scores(
    acc_s: cute.Tensor,
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    correction: cute.Tensor,
    scale_log2: Float32,
):
    """The score half of one K block of the online softmax (fp32, exp2 with
    ``softmax_scale * log2(e)`` folded in); it does not touch O, so it may run while a GEMM still
    accumulates into O.

    ``row_max`` holds the raw (unscaled) running max of each of the thread's rows, ``row_sum`` the
    thread-partial running sum (quad-reduced only at the end). Overwrites ``acc_s`` with
    P = exp2(s * scale_log2 - max * scale_log2) and writes into ``correction[r]`` the factor O's row
    ``r`` must be scaled by (:func:`rescale_rows`). Fully masked rows keep max = -inf and
    contribute exactly 0 (never NaN).
    """
    s_mn = acc_mn_view(acc_s)
    for r in cutlass.range_constexpr(cute.size(row_max)):
        m_prev = row_max[r]
        m_new = quad_allreduce_max(row_max_of(s_mn[r, None], m_prev))
        row_max[r] = m_new
        m_safe = Float32(0.0) if m_new == -Float32.inf else m_new
        m_scaled = m_safe * scale_log2
        correction[r] = cute.math.exp2((m_prev - m_safe) * scale_log2, fastmath=True)
        part = [Float32(0.0), Float32(0.0)]
        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            p = cute.math.exp2(s_mn[r, c] * scale_log2 - m_scaled, fastmath=True)
            s_mn[r, c] = p
            part[c % 2] = part[c % 2] + p
        row_sum[r] = row_sum[r] * correction[r] + (part[0] + part[1])


@cute.jit
def rescale_rows(acc_o: cute.Tensor, correction: cute.Tensor):
    """``O[r, :] *= correction[r]`` for each of the thread's rows."""
    o_mn = acc_mn_view(acc_o)
    for r in cutlass.range_constexpr(cute.size(correction)):
        for c in cutlass.range(cute.size(o_mn, mode=[1]), unroll_full=True):
            o_mn[r, c] = o_mn[r, c] * correction[r]


@cute.jit
def finalize_softmax(
    acc_o: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, lse: cute.Tensor, scale_log2: Float32
):
    """Normalise O by the row sum and write the natural-log LSE of each row into ``lse``.

    A row with no visible key (sum 0) gets O = 0 and LSE = -inf.
    """
    o_mn = acc_mn_view(acc_o)
    for r in cutlass.range_constexpr(cute.size(row_max)):
        total = quad_allreduce_sum(row_sum[r])
        empty = total == Float32(0.0)
        inv = Float32(0.0) if empty else cute.arch.rcp_approx(total)
        lse[r] = (
            -Float32.inf
            if empty
            else (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * Float32(LN_2)
        )
        for c in cutlass.range(cute.size(o_mn, mode=[1]), unroll_full=True):
            o_mn[r, c] = o_mn[r, c] * inv


# -- epilogue: accumulator -> SMEM -> whole rows of GMEM ------------------------------------------
#: elements of a 16-bit dtype in one 16-byte piece
PIECE = 8


@cute.jit
def stage_fragment(
    tiled_mma: cute.TiledMma, frag: cute.Tensor, s_tile: cute.Tensor, tidx: Int32,
    transpose: cutlass.Constexpr[bool] = False,
):  # fmt: skip
    """This thread's C fragment ``frag`` (16-bit, in ``tiled_mma``'s C ownership of ``s_tile``'s
    shape) -> the SMEM tile ``s_tile``, by stmatrix (8x8 matrices).
    ``transpose``: ``s_tile`` is a transposed view (its columns are contiguous), written by
    ``stmatrix.trans``. An atom N that is an odd multiple of 8 (dQ's 40-column halves at D = 80)
    takes two matrices per instruction: four cover 16 columns."""
    matrices = 4 if const_expr(tiled_mma.op.shape_mnk[1] % 16 == 0) else 2
    atom = cute.make_copy_atom(StMatrix8x8x16bOp(transpose, matrices), s_tile.element_type)
    r2s = cute.make_tiled_copy_C(atom, tiled_mma)
    thr = r2s.get_slice(tidx)
    cute.copy(r2s, thr.retile(frag), thr.partition_D(s_tile))


@cute.jit
def store_rows(
    s_tile: cute.Tensor, g_tile: cute.Tensor, tidx: Int32, threads: cutlass.Constexpr[int], row0: Int32,
    rows_per_position: cutlass.Constexpr[int], valid_positions: Int32,
    valid_cols: cutlass.Constexpr[int | None] = None,
):  # fmt: skip
    """Copy the SMEM tile ``s_tile`` (rows, cols) to ``g_tile`` in 16-byte row pieces, ``threads``
    consecutive threads along the rows (so each warp store writes whole 128-byte lines), skipping
    row ``r`` unless ``(row0 + r) // rows_per_position < valid_positions``, and the columns from
    ``valid_cols`` on (a multiple of 8; None: every column) where the tensor's head dim ends inside
    the tile. ``g_tile``'s rows start
    16-byte aligned (the tensor base is, and rows are whole multiples of 8 elements apart). Where
    ``threads`` do not cover whole rows per pass (the backward's 96- and 192-column tiles) the
    last pass runs past the tile, so there the caller must pass ``valid_positions`` of at most the
    tile (the backward's do): the rows past it are then skipped. The threads past the last whole
    row fall on the next pass's first row pieces and store the same bytes as their owners."""
    rows, cols = cute.size(s_tile, mode=[0]), cute.size(s_tile, mode=[1])
    per_row = cols // PIECE
    s2g = cute.make_tiled_copy_tv(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), s_tile.element_type, num_bits_per_copy=128),
        cute.make_ordered_layout((threads // per_row, per_row), order=(1, 0)),
        cute.make_layout((1, PIECE)),
    )
    thr = s2g.get_slice(tidx)
    t_s = thr.partition_S(s_tile)
    t_g = thr.partition_D(g_tile)
    t_c = thr.partition_S(cute.make_identity_tensor((rows, cols)))
    # a piece is stored where its row is valid and, with valid_cols inside the tile, its column
    col_limit = cols if const_expr(valid_cols is None) else min(valid_cols, cols)
    for m in cutlass.range_constexpr(cute.size(t_s, mode=[1])):
        row, col = t_c[0, m, 0]
        keep = (row0 + row) // rows_per_position < valid_positions
        if const_expr(col_limit < cols):
            keep = keep & (col < col_limit)
        if keep:
            dst = t_g[None, m, None]  # its alignment is lost to the dynamic row stride: restate it
            cute.copy(s2g, t_s[None, m, None], cute.make_tensor(element_ptr(dst, 0, 16), dst.layout))
