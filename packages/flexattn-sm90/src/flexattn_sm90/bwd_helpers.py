"""Device helpers of the SM90 backward kernels (CuTe DSL): SMEM layouts that serve two WGMMA
operand roles and the dQ accumulator's fragment-ordered chunks. The bulk fp32 reduction, the
per-Q-block turnstile and the K2Q walk are shared with the SM100 backward
(:mod:`maskplan_kernels.consumer_plan`).

Generic WGMMA issue, the accumulator row/column views and the register-A view of an accumulator
are shared with the forward (:mod:`flexattn_sm90.fwd_helpers`).
"""

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from maskplan_kernels.consumer_plan import element_ptr

from .fwd_helpers import stage_fragment, store_rows

#: fp32 values per 16-byte vector of a dQ accumulator chunk
DQ_FRAGMENT_VECTOR = 4


def smem_layout(dtype, rows: int, cols: int, stages: int | None = None, major: int | None = None):
    """Swizzled SMEM layout of a ``rows x cols`` row-major tile (cols contiguous), ``(rows, cols)``
    or ``(rows, cols, stages)``.

    ``major`` (default ``cols``) is the widest contiguous run every reader of the tile needs; a
    tile read both K-major (all ``cols``) and MN-major by warpgroups that each take ``cols / w``
    columns passes ``cols / w``, so the swizzle atom never straddles two warpgroups' slices.
    """
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols if major is None else major), dtype
    )
    shape = (rows, cols) if stages is None else (rows, cols, stages)
    return cute.tile_to_shape(atom, shape, order=tuple(range(len(shape))))


def common_major(*sizes: int) -> int:
    """The largest contiguous run that divides every reader's run."""
    return math.gcd(*sizes)


# -- dQ accumulator chunks --------------------------------------------------------------------------
def dq_warpgroup_tile(tile_m: int, head_dim: int, num_warpgroups: int = 2) -> tuple[int, int]:
    """``(rows, cols)`` of ``dQ = dS K`` (``tile_m x head_dim``) one MMA warpgroup computes: 64 Q rows
    x the whole head dim where the warpgroups fill ``tile_m`` 64 rows each, else all 64 rows x
    ``head_dim / num_warpgroups`` columns. Splitting the rows keeps each WGMMA at N = head_dim: at
    N = 32 (D = 64 split) an SS WGMMA reads more SMEM (A 2 KB + B 1 KB per k-block) than the tensor
    cores consume in its time."""
    if tile_m == 64 * num_warpgroups:
        return 64, head_dim
    assert tile_m == 64, tile_m
    return 64, head_dim // num_warpgroups


def make_dq_tiled_mma(dtype, head_dim: int, tile_m: int, num_warpgroups: int = 2):
    """``dQ = dS K`` (``tile_m x head_dim``, dS K-major from SMEM, K^T MN-major), each warpgroup on
    its :func:`dq_warpgroup_tile`. The main kernel issues it; the postprocess only uses its
    ``partition_C`` to read the fragment-ordered accumulator back, so both agree on the order by
    construction."""
    K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
    rows, cols = dq_warpgroup_tile(tile_m, head_dim, num_warpgroups)
    atoms = (tile_m // rows, head_dim // cols, 1)
    return sm90_utils.make_trivial_tiled_mma(dtype, dtype, K, MN, Float32, atoms, (rows, cols))


def dq_chunk_layout(elements_per_thread: int, threads: int = 128) -> cute.Layout:
    """``(thread, element) -> offset`` in one warpgroup's dQ chunk.

    Element ``e`` of thread ``t``'s accumulator fragment lives at
    ``((e // 4) * threads + t) * 4 + e % 4``: each thread's 4-value runs are 16-byte vectors and
    a warp's 32 vectors are contiguous (no bank conflicts), so the whole chunk is one dense
    ``threads * elements_per_thread`` fp32 run that a single bulk copy moves. The GMEM dQ
    accumulator stores chunks in this order; the postprocess reads them back with the same map.
    """
    v = DQ_FRAGMENT_VECTOR
    return cute.make_layout((threads, (v, elements_per_thread // v)), stride=(v, (1, v * threads)))


# -- per-item pipeline states of the persistent main kernel -----------------------------------------
def item_state(stages: int, item: Int32, user: pipeline.PipelineUserType) -> pipeline.PipelineState:
    """The state of a pipeline used once per item at item ``item``: derived from the item count, so
    the MMA warpgroups carry one register across items rather than a state per pipeline."""
    phase = (item // stages) % 2
    if user == pipeline.PipelineUserType.Producer:
        phase = 1 - phase
    return pipeline.PipelineState(stages, item, item % stages, phase)


__all__ = [
    "common_major",
    "dq_warpgroup_tile",
    "item_state",
    "make_dq_tiled_mma",
    "dq_chunk_layout",
    "smem_layout",
]


# -- results out through SMEM: dK / dV (main kernel), dQ (postprocess) ------------------------------
@cute.jit
def stage_result(
    tiled_mma, acc: cute.Tensor, s_x: cute.Tensor, tidx: Int32, scale: Float32 | None,
    transpose: cutlass.Constexpr[bool] = False,
) -> cute.Tensor:  # fmt: skip
    """An fp32 fragment (times ``scale`` unless None) in ``s_x``'s dtype (returned) -> the SMEM tile
    ``s_x`` of its shape, by stmatrix (``transpose``: ``s_x`` is a transposed view, as
    :func:`fwd_helpers.stage_fragment`)."""
    r_x = cute.make_rmem_tensor_like(acc, s_x.element_type)
    if const_expr(scale is None):
        r_x.store(acc.load().to(s_x.element_type))
    else:
        r_x.store((acc.load() * scale).to(s_x.element_type))
    stage_fragment(tiled_mma, r_x, s_x, tidx, transpose=transpose)
    return r_x


@cute.jit
def store_result_rows(
    s_x: cute.Tensor, m_x: cute.Tensor, first_row: Int32, head: Int32, tidx: Int32,
    threads: cutlass.Constexpr[int], valid_rows: Int32,
):  # fmt: skip
    """The staged ``(rows, D)`` tile ``s_x`` -> rows ``first_row, ...`` of head ``head`` of the THD
    tensor ``m_x`` (a row starts 16-byte aligned), the first ``valid_rows`` (at most the tile) only,
    and the tile's first ``m_x`` head dim columns (all, unless the kernel runs narrower tensors), in
    16-byte row pieces so a warp store writes whole 128-byte lines (as the forward's O)."""
    rows, d = cute.size(s_x, mode=[0]), cute.size(s_x, mode=[1])
    heads, io_d = m_x.shape[1], m_x.shape[2]
    g_x = cute.make_tensor(
        element_ptr(m_x, (first_row * heads + head) * io_d),
        cute.make_layout((rows, d), stride=(heads * io_d, 1)),
    )
    store_rows(s_x, g_x, tidx, threads, Int32(0), 1, valid_rows, valid_cols=io_d)
