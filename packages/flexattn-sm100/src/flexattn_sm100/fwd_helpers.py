"""Device helpers of the SM100 forward kernel (CuTe DSL): the tcgen05 MMA builders (1 or 2 CTAs), the
TMEM fragments and copies the softmax warpgroup reads, the payload loads (direct, or from the SMEM
ring) and the per-row online softmax (the plan walk and the packed-predicate bit-select are
:mod:`maskplan_kernels.consumer_plan`).

The score copy (:func:`score_tmem_load`) is the one :mod:`flexattn_sm100.payload_layout` describes:
``tcgen05.ld 32x32b``, thread ``t`` of the softmax warpgroup reads TMEM lane ``t`` (accumulator row
``t``) and its register ``e`` is column ``e``. The kernel tests bit ``e % 32`` of word ``e // 32``
for register ``e``; ``tests/test_fwd_layout_agreement.py`` builds these same objects and checks
every register against ``TmemLoadLayout.element_coords()``.

Since one thread owns one whole score row, the softmax needs no cross-thread reduction: the row
max and the row sum are per-thread scalars.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
from cutlass.cutlass_dsl import dsl_user_op

from maskplan_kernels.consumer_plan import element_ptr
from maskplan_kernels.consumer_softmax import row_max_of

#: registers (32-bit TMEM columns) per tcgen05.ld/st of the O accumulator (rescale and epilogue)
O_CHUNK = 32


# -- warp roles and pipelines (both SM100 kernels) ---------------------------------------------------
def set_max_registers(regs: int, launch_regs: int) -> None:
    """``setmaxnreg`` from the ``launch_regs`` a thread started with to ``regs`` (an increase waits
    for the registers the decreasing warpgroups release; equal: nothing)."""
    if regs > launch_regs:
        cute.arch.setmaxregister_increase(regs)
    elif regs < launch_regs:
        cute.arch.setmaxregister_decrease(regs)


def thread_group(threads: int) -> pipeline.CooperativeGroup:
    """A pipeline participant group of ``threads`` threads."""
    return pipeline.CooperativeGroup(pipeline.Agent.Thread, threads)


def tma_umma_pipeline(barriers, stages: int, nbytes: int, cta_layout_vmnk=None):
    """TMA (one producer thread, ``nbytes`` a stage) -> tcgen05 MMA (released by its commit), over
    the CTAs of ``cta_layout_vmnk`` when given; barriers initialised before the kernel's first sync.

    A stage is released by every MMA issuer reading it: one per ``(M, N, K)`` cluster coordinate
    (the forward's cta_group::2 pair is one issuer; the backward's pair along M is two, each
    committing to both CTAs' empty barriers)."""
    pair, issuers = {}, 1
    if cta_layout_vmnk is not None:
        pair = {"cta_layout_vmnk": cta_layout_vmnk}
        issuers = cute.size(cta_layout_vmnk) // cute.size(cta_layout_vmnk, mode=[0])
    return pipeline.PipelineTmaUmma.create(
        barrier_storage=barriers,
        num_stages=stages,
        producer_group=thread_group(1),
        consumer_group=thread_group(issuers),
        tx_count=nbytes,
        defer_sync=True,
        **pair,
    )


# -- MMA builders ---------------------------------------------------------------------------------
def cta_group_of(cta_group_size: int) -> tcgen05.CtaGroup:
    """``tcgen05.CtaGroup`` of an MMA issued for ``cta_group_size`` (1 or 2) CTAs."""
    return tcgen05.CtaGroup.TWO if cta_group_size == 2 else tcgen05.CtaGroup.ONE


def make_qk_mma(dtype, tile_m: int, tile_n: int, cta_group_size: int = 1) -> cute.TiledMma:
    """S = Q K^T: A = Q (tile_m x Dqk, K-major, SMEM), B = K (tile_n x Dqk, K-major), fp32 in TMEM.
    With ``cta_group_size = 2`` (tile_m = 256) each CTA of the pair holds 128 rows of Q and of S and
    half of K's rows."""
    return sm100_utils.make_trivial_tiled_mma(
        dtype, dtype, OperandMajorMode.K, OperandMajorMode.K, Float32, cta_group_of(cta_group_size),
        (tile_m, tile_n),
    )  # fmt: skip


def make_pv_mma(dtype, tile_m: int, head_dim_v: int, cta_group_size: int = 1) -> cute.TiledMma:
    """O += P V: A = P (tile_m x tile_n, 16-bit, TMEM), B = V^T (Dv x tile_n, MN-major, SMEM).
    With ``cta_group_size = 2`` each CTA holds its 128 rows of P and O and half of V's columns."""
    return sm100_utils.make_trivial_tiled_mma(
        dtype, dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32, cta_group_of(cta_group_size),
        (tile_m, head_dim_v), tcgen05.OperandSource.TMEM,
    )  # fmt: skip


def tmem_acc(thr_mma, shape_mn: tuple[int, int], tmem_ptr: cute.Pointer) -> cute.Tensor:
    """The ``shape_mn`` fp32 accumulator of ``thr_mma`` placed at ``tmem_ptr``: ((128, N), 1, 1)."""
    frag = thr_mma.make_fragment_C(thr_mma.partition_shape_C(shape_mn))
    return cute.make_tensor(tmem_ptr, frag.layout)


def score_tmem_load(tStS: cute.Tensor, tScS: cute.Tensor, thread: Int32):
    """The softmax warpgroup's read of a score tile (spec 5.1): ``tcgen05.ld.32x32b.x32``.

    Returns ``(tiled_copy, tLtS, tLcS)``: the TMEM source partition and, with the same shape, the
    score coordinates ``(m, n)`` of every register of ``thread``. Register ``e`` (flat index) is the
    payload element ``e`` of group ``thread``.
    """
    atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32)
    tiled = tcgen05.make_tmem_copy(atom, tStS)
    thr = tiled.get_slice(thread)
    return tiled, thr.partition_S(tStS), thr.partition_D(tScS)


def row_chunk_copies(tAtA: cute.Tensor, thread: Int32, columns: int):
    """32x32b load/store of ``columns`` TMEM columns of a 128-lane fp32 tile (one row per thread).

    Returns ``(load, store, tLtA, tStA)``: the copies and this thread's TMEM partitions of the
    first ``columns`` columns; chunk ``i`` is the same partition shifted by ``i * columns`` columns.
    """
    chunk = cute.make_tensor(tAtA.iterator, cute.composition(tAtA.layout, cute.make_layout((128, columns))))
    ld = tcgen05.make_tmem_copy(
        cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(columns)), Float32), chunk
    )
    st = tcgen05.make_tmem_copy(
        cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(columns)), Float32), chunk
    )
    return ld, st, ld.get_slice(thread).partition_S(chunk), st.get_slice(thread).partition_D(chunk)


def shift_columns(t: cute.Tensor, columns) -> cute.Tensor:
    """The TMEM partition ``t`` moved ``columns`` 32-bit columns to the right."""
    return cute.make_tensor(t.iterator + columns, t.layout)


# -- per-row online softmax -------------------------------------------------------------------------
@cute.jit
def exp2_row_and_sum(row: cute.Tensor, scale_log2: Float32, max_scaled: Float32) -> Float32:
    """``row[c] = 2^(row[c] * scale_log2 - max_scaled)`` in place; returns the sum (4 partial sums)."""
    part = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
    for c in cutlass.range_constexpr(cute.size(row)):
        p = cute.math.exp2(row[c] * scale_log2 - max_scaled, fastmath=True)
        row[c] = p
        part[c % 4] = part[c % 4] + p
    return (part[0] + part[1]) + (part[2] + part[3])


@cute.jit
def softmax_update(
    row: cute.Tensor, m_prev: Float32, sum_prev: Float32, scale_log2: Float32
) -> tuple[Float32, Float32, Float32]:
    """One K block of one row: ``row`` (raw scores, -inf where masked) becomes P in place.

    Returns ``(m_new, sum_new, correction)``; ``m`` is the raw (unscaled) running max, and O must
    be multiplied by ``correction`` before P V is added. A row with nothing visible yet keeps
    ``m = -inf`` and contributes exactly 0 (never NaN).
    """
    m_new = row_max_of(row, m_prev)
    m_safe = Float32(0.0) if m_new == -Float32.inf else m_new
    correction = cute.math.exp2((m_prev - m_safe) * scale_log2, fastmath=True)
    block_sum = exp2_row_and_sum(row, scale_log2, m_safe * scale_log2)
    return m_new, sum_prev * correction + block_sum, correction


@cute.jit
def load_words(masks: cute.Tensor, offset: Int32, words: cute.Tensor):
    """This thread's payload words (spec 6.2 direct delivery: GMEM -> registers, one vector load)."""
    n = cute.size(words)
    src = element_ptr(masks, offset, 4 * n)
    cute.autovec_copy(cute.make_tensor(src, cute.make_layout(n)), words)


@cute.jit
def read_staged_words(pipe_mask, state, sMask: cute.Tensor, group: Int32, words: cute.Tensor):
    """Spec 6.2 SMEM delivery, consumer side: wait for stage ``state`` of the payload ring ``sMask``
    ``(words, groups, stages)``, copy payload group ``group``'s words to registers, order the generic
    reads before the next bulk copy into the stage (``fence.proxy.async``), release the stage.
    Returns the advanced state (it advances once per partial block, never on full blocks)."""
    pipe_mask.consumer_wait(state)
    cute.autovec_copy(sMask[None, group, state.index], words)
    cute.arch.fence_proxy("async.shared", space="cta")
    pipe_mask.consumer_release(state)
    state.advance()
    return state


@dsl_user_op
def tcgen05_fence_before(*, loc=None, ip=None) -> None:
    """``tcgen05.fence::before_thread_sync``: order this thread's prior tcgen05 ops (ld/st) before
    the mbarrier arrive that follows."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC, loc=loc, ip=ip)


@dsl_user_op
def tcgen05_fence_after(*, loc=None, ip=None) -> None:
    """``tcgen05.fence::after_thread_sync``: order the tcgen05 ops that follow after the mbarrier
    wait that precedes."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC, loc=loc, ip=ip)


__all__ = [
    "O_CHUNK",
    "cta_group_of",
    "load_words",
    "make_pv_mma",
    "make_qk_mma",
    "read_staged_words",
    "row_chunk_copies",
    "score_tmem_load",
    "shift_columns",
    "softmax_update",
    "tcgen05_fence_after",
    "tcgen05_fence_before",
    "tmem_acc",
]
