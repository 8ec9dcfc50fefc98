"""Device helpers of the SM90 backward kernels (CuTe DSL): SMEM layouts that serve two WGMMA
operand roles, the dQ accumulator's fragment-ordered chunks, the bulk fp32 reduction and the
per-Q-block turnstile of deterministic mode.

Generic WGMMA issue, the accumulator row/column views and the register-A view of an accumulator
are shared with the forward (:mod:`flexattn_sm90.fwd_helpers`).
"""

import math

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.tensor_utils import LayoutEnum

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
def make_dq_tiled_mma(dtype, head_dim: int, tile_m: int, num_warpgroups: int = 2):
    """``dQ = dS K`` (``tile_m x head_dim``, dS K-major from SMEM, K^T MN-major): the warpgroups
    split the head dim. The main kernel issues it; the postprocess only uses its ``partition_C``
    to read the fragment-ordered accumulator back, so both agree on the order by construction."""
    K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, K, MN, Float32, (1, num_warpgroups, 1), (tile_m, head_dim // num_warpgroups)
    )


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


# -- PTX the DSL has no op for ----------------------------------------------------------------------
@dsl_user_op
def bulk_reduce_add_f32(smem_src: cute.Pointer, gmem_dst: cute.Pointer, num_bytes: int, *, loc=None, ip=None):
    """``gmem[i] += smem[i]`` for ``num_bytes / 4`` fp32 values, by the bulk copy engine
    (``cp.reduce.async.bulk``, completion through the issuing thread's bulk async-group)."""
    llvm.inline_asm(
        None,
        [
            gmem_dst.toint(loc=loc, ip=ip).ir_value(),
            smem_src.toint(loc=loc, ip=ip).ir_value(),
            Int32(num_bytes).ir_value(loc=loc, ip=ip),
        ],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


# -- deterministic dQ turnstile -----------------------------------------------------------------------
@cute.jit
def turnstile_wait(counter: cute.Pointer, ticket: Int32, lane: Int32):
    """Spin (lane 0) until ``*counter == ticket`` with acquire semantics, then order the bulk
    reduction that follows (async proxy) after the acquire."""
    if lane == 0:
        seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
        while seen != ticket:
            seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
    cute.arch.sync_warp()
    cute.arch.fence_proxy("async.global")


@cute.jit
def turnstile_advance(counter: cute.Pointer, lane: Int32):
    """After this thread's bulk reductions completed (``cp.async.bulk.wait_group 0``): make them
    visible, then pass the turn on (release)."""
    cute.arch.fence_proxy("async.global")
    if lane == 0:
        cute.arch.red(counter, Int32(1), op="add", dtype="s32", sem="release", scope="gpu")
    cute.arch.sync_warp()


# -- small register helpers --------------------------------------------------------------------------
@cute.jit
def quad_sum(x: Float32) -> Float32:
    x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
    return x + cute.arch.shuffle_sync_bfly(x, offset=2)


def aligned_ptr(base: cute.Tensor, offset, align: int = 16) -> cute.Pointer:
    """A GMEM pointer of ``base``'s element type ``offset`` elements past its start, asserting an
    alignment the caller guarantees (so 16-byte vector accesses are emitted)."""
    return cute.make_ptr(
        base.element_type, (base.iterator + offset).toint(), cute.AddressSpace.gmem, assumed_align=align
    )


def int32_ptr(base: cute.Tensor, offset) -> cute.Pointer:
    return cute.make_ptr(Int32, (base.iterator + offset).toint(), cute.AddressSpace.gmem, assumed_align=4)


__all__ = [
    "bulk_reduce_add_f32",
    "common_major",
    "make_dq_tiled_mma",
    "dq_chunk_layout",
    "aligned_ptr",
    "int32_ptr",
    "quad_sum",
    "smem_layout",
    "turnstile_advance",
    "turnstile_wait",
]
