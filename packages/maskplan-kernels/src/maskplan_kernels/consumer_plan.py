"""Device side of a forward plan view, for attention kernels that consume one (CuTe DSL, inlined).

Architecture-neutral: the SM90 (WGMMA) and SM100 (tcgen05) forward kernels walk a forward view the
same way, and this module is that walk. Per task ``(m_block, head, batch, q_valid_rows)`` of
``fwd_work_desc`` (spec 6.1)::

    row = sequence_desc[batch].row_begin + m_block,   h = head if Hmask > 1 else 0
    partial blocks: mask_block_idx[mask_block_offset[h, row] + [0, mask_block_cnt[h, row])]
    full blocks:    full_block_idx[full_block_offset[h, row] + [0, full_block_cnt[h, row])]

``sequence_desc[b]`` is the view's per-sample descriptor (``maskplan_core.plan``): a varlen view
retains it, a fixed-length view does not, and every kernel reads its columns through
:func:`desc_field` (on a :class:`SequenceDesc` from :func:`make_sequence_desc`), which reads the
table or derives the column.

One warp decodes a task (:func:`decode_task`) and hands the fields the other roles need to them
through an SMEM record of :data:`TASK_WORDS` int32 (:func:`publish_task` / :func:`fetch_task`); only
the decoding warp reads the plan's descriptors. A partial block's payload plane reaches SMEM with
:func:`load_payload_plane` (or each thread loads its own words), and the words select scores with
:func:`apply_packed_predicate` (spec 5.1), whatever fragment order the consumer's payload layout
gives them.

A backward (K2Q) view is walked per CTA of one K block and kv head (:func:`decode_work`): for each
of the ``G = Hq / Hkv`` q heads sharing the kv head (:func:`head_range`)::

    h = q_head if Hmask > 1 else 0
    partial Q blocks: mask_block_idx[mask_block_offset[h, row] + [0, mask_block_cnt[h, row])]
    full Q blocks:    full_block_idx[full_block_offset[h, row] + [0, full_block_cnt[h, row])]

and each step bulk-adds its fp32 dQ into the (q head, Q block) accumulator
(:func:`bulk_reduce_add_f32`), in deterministic mode in ``dq_write_order`` behind a turnstile
(:func:`turnstile_wait` / :func:`turnstile_advance`; SM90's atomic mode on sparse K2Q rows waits
there only for the block's first contribution, which it stores: :func:`bulk_store`). Both
consumers share their kernels' host entries, :class:`FwdHostEntry` and :class:`BwdHostEntry` (raw
pointers -> the row-major views :func:`thd_tensor`, :func:`row_major`, :func:`vector` and the
plan's tensors); a persistent forward (SM90: a stream-local atomic tile counter) takes one
argument more than a grid of one CTA per task.
"""

from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

# columns of sequence_desc[b] (maskplan_core.plan), one definition with the planner's geometry stage
from ._cute_args import row_major
from .geometry import (
    DESC_COLS,
    DESC_INNER_BLOCKS,
    DESC_K_LEN,
    DESC_K_OFFSET,
    DESC_Q_LEN,
    DESC_Q_OFFSET,
    DESC_ROW_BEGIN,
    DESC_ROW_COUNT,
)
from .stage_fill import fill_stage


# -- the per-sample descriptor ----------------------------------------------------------------------
class SequenceDesc(NamedTuple):
    """A view's per-sample descriptor as a kernel reads it (:func:`desc_field`): a varlen view's
    retained table, or the columns of a fixed-length view (which retains none) derived from the
    per-sample sizes below, the formula of ``maskplan_core.plan.fixed_sequence_desc``. Varlen-ness
    is a runtime flag, so one compiled kernel serves both. Built by :func:`make_sequence_desc`."""

    table: cute.Tensor  # (B, 8) int32; fixed length: a valid dummy the kernel never reads
    varlen: Int32  # 1: columns come from ``table``; 0: derived from the sizes below
    q_len: Int32  # fixed length: Sq
    k_len: Int32 | None  # Sk; None where the kernel is not given total_k
    outer_blocks: Int32 | None  # plan rows (outer blocks) per sample
    inner_blocks: Int32 | None  # inner blocks per sample


def make_sequence_desc(
    table: cute.Pointer,
    varlen: Int32,
    *,
    batch: Int32,
    total_q: Int32,
    total_k: Int32 | None,
    block_m: int,
    block_n: int | None,
    k_major: bool,
) -> SequenceDesc:
    """The :class:`SequenceDesc` of a view with ``batch`` samples and blocks of ``block_m`` Q
    positions x ``block_n`` keys, outer axis K (a K2Q view) if ``k_major`` else Q. For a fixed-length
    view ``Sq = total_q / B``, ``Sk = total_k / B``, ``q_blocks = ceil(Sq / block_m)``,
    ``k_blocks = ceil(Sk / block_n)``. A kernel not given ``total_k`` (and ``block_n``) passes None:
    it cannot read the K columns (nor the block count on the K axis)."""
    samples = cutlass.max(batch, 1)  # a varlen launch may have B = 0; it never reads these sizes
    q_len = total_q // samples
    q_blocks = (q_len + block_m - 1) // block_m
    k_len = k_blocks = None
    if total_k is not None:
        k_len = total_k // samples
        k_blocks = (k_len + block_n - 1) // block_n
    outer, inner = (k_blocks, q_blocks) if k_major else (q_blocks, k_blocks)
    return SequenceDesc(row_major(table, batch, DESC_COLS), varlen, q_len, k_len, outer, inner)


@cute.jit
def desc_field(desc: SequenceDesc, b: Int32, column: cutlass.Constexpr[int]) -> Int32:
    """``sequence_desc[b, column]`` (``column`` one of ``geometry.DESC_*``): read from the table of a
    varlen view, derived for a fixed-length one (Q_OFFSET = b * Sq, K_OFFSET = b * Sk,
    ROW_BEGIN = b * outer_blocks; the other columns are the same for every sample)."""
    if const_expr(column in (DESC_Q_OFFSET, DESC_Q_LEN)):
        size = desc.q_len
    elif const_expr(column in (DESC_K_OFFSET, DESC_K_LEN)):
        size = desc.k_len
    elif const_expr(column in (DESC_ROW_BEGIN, DESC_ROW_COUNT)):
        size = desc.outer_blocks
    else:
        size = desc.inner_blocks
    if const_expr(size is None):
        raise ValueError(f"sequence_desc column {column} needs total_k, which this kernel is not given")
    value = b * size if const_expr(column in (DESC_Q_OFFSET, DESC_K_OFFSET, DESC_ROW_BEGIN)) else size
    if desc.varlen != 0:
        value = desc.table[b, column]
    return value


class SampleQ(NamedTuple):
    """A sample's Q extent in a backward (K2Q) view: its Q blocks, first row and length."""

    blocks: Int32
    offset: Int32
    length: Int32


@cute.jit
def sample_q(desc: SequenceDesc, b: Int32) -> SampleQ:
    """:class:`SampleQ` of sample ``b`` of a backward view (what the kernels that walk its Q blocks,
    the pre- and postprocess, need)."""
    blocks = desc_field(desc, b, DESC_INNER_BLOCKS)
    return SampleQ(blocks, desc_field(desc, b, DESC_Q_OFFSET), desc_field(desc, b, DESC_Q_LEN))


# -- forward (Q2K) view -----------------------------------------------------------------------------
class FwdPlanTensors(NamedTuple):
    """The forward view's tensors as a kernel reads them (all int32, see ``maskplan_core.plan``).

    ``mask_block_masks`` is flattened to ``[partial_nnz * plane]``, ``plane`` being the int32 words of
    one partial entry in the consumer's payload layout (``PayloadLayout.words_per_tile``).
    """

    mask_block_cnt: cute.Tensor  # (Hmask, rows)
    mask_block_offset: cute.Tensor  # (Hmask, rows)
    mask_block_idx: cute.Tensor  # (partial_nnz,)
    mask_block_masks: cute.Tensor  # (partial_nnz * plane,)
    full_block_cnt: cute.Tensor  # (Hmask, rows)
    full_block_offset: cute.Tensor  # (Hmask, rows)
    full_block_idx: cute.Tensor  # (full_nnz,)
    sequence_desc: SequenceDesc
    fwd_work_desc: cute.Tensor  # (tasks, 4)


class Task(NamedTuple):
    """One decoded forward task (runtime Int32 values)."""

    m_block: Int32
    head: Int32
    kv_head: Int32
    q_offset: Int32
    k_offset: Int32
    k_len: Int32  # the sample's keys: a K block past them is a tail block
    q_valid: Int32
    partial_cnt: Int32
    partial_off: Int32
    full_cnt: Int32
    full_off: Int32
    batch: Int32  # the sample


#: the CuTe element type of each kernel input dtype, by the name the kernel configs use
#: (``maskplan_core.consumer.KERNEL_DTYPE_NAMES``)
CUTE_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
#: the task fields the roles other than the decoding warp need, in SMEM record order after the
#: valid flag (the others read as 0 after :func:`fetch_task`)
CONSUMER_FIELDS = ("m_block", "head", "q_offset", "q_valid", "partial_cnt", "partial_off", "full_cnt")
#: int32 words of one SMEM task record: the valid flag, then :data:`CONSUMER_FIELDS`
TASK_WORDS = 1 + len(CONSUMER_FIELDS)


@cute.jit
def decode_task(plan: FwdPlanTensors, task: Int32, qhead_per_kvhead: Int32) -> Task:
    """Task ``task`` of ``fwd_work_desc`` with its sample offsets and CSR ranges."""
    m_block = plan.fwd_work_desc[task, 0]
    head = plan.fwd_work_desc[task, 1]
    batch = plan.fwd_work_desc[task, 2]
    q_valid = plan.fwd_work_desc[task, 3]
    q_offset = desc_field(plan.sequence_desc, batch, DESC_Q_OFFSET)
    k_offset = desc_field(plan.sequence_desc, batch, DESC_K_OFFSET)
    k_len = desc_field(plan.sequence_desc, batch, DESC_K_LEN)
    row = desc_field(plan.sequence_desc, batch, DESC_ROW_BEGIN) + m_block
    # Hmask is 1 (shared mask) or Hq
    h_mask = cutlass.min(head, plan.mask_block_cnt.shape[0] - 1)
    kv_head = head // qhead_per_kvhead
    return Task(
        m_block,
        head,
        kv_head,
        q_offset,
        k_offset,
        k_len,
        q_valid,
        plan.mask_block_cnt[h_mask, row],
        plan.mask_block_offset[h_mask, row],
        plan.full_block_cnt[h_mask, row],
        plan.full_block_offset[h_mask, row],
        batch,
    )


def record_pipeline(barriers: cute.Pointer, stages: int, readers: int):
    """The pipeline of :func:`publish_record` / :func:`fetch_record`: one thread publishes, ``readers``
    threads each fetch and release every record."""
    return pipeline.PipelineAsync.create(
        barrier_storage=barriers,
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, readers),
        defer_sync=True,
    )


@cute.jit
def publish_record(pipe_sched, state, sRecord: cute.Tensor, fields: tuple, valid: Int32, lane: Int32):
    """Hand a scheduler record to the other roles through stage ``state`` of ``sRecord``
    ``(words, stages)``: word 0 the valid flag (0: the end of work), then ``fields``; lane 0 writes
    and commits. Returns the advanced state."""
    pipe_sched.producer_acquire(state)
    if lane == 0:
        record = sRecord[None, state.index]
        record[0] = valid
        for w, value in enumerate(fields):
            record[1 + w] = value
        pipe_sched.producer_commit(state)
    state.advance()
    return state


@cute.jit
def fetch_record(pipe_sched, state, sRecord: cute.Tensor, num_fields: cutlass.Constexpr[int]):
    """``(valid, fields, state)``: the next record :func:`publish_record` wrote, its first
    ``num_fields`` fields as a list."""
    pipe_sched.consumer_wait(state)
    record = sRecord[None, state.index]
    valid = record[0]
    fields = [record[1 + w] for w in range(num_fields)]
    pipe_sched.consumer_release(state)
    state.advance()
    return valid, fields, state


@cute.jit
def publish_task(pipe_sched, state, sTask: cute.Tensor, t: Task | None, valid: Int32, lane: Int32):
    """Hand the decoded task (or, with ``valid = 0``, the end of work) to the other roles through
    stage ``state`` of ``sTask`` ``(TASK_WORDS, stages)`` (:func:`publish_record`)."""
    fields = () if const_expr(t is None) else tuple(getattr(t, field) for field in CONSUMER_FIELDS)
    return publish_record(pipe_sched, state, sTask, fields, valid, lane)


@cute.jit
def fetch_task(pipe_sched, state, sTask: cute.Tensor):
    """``(valid, task, state)``: the next record :func:`publish_task` wrote (fields outside
    :data:`CONSUMER_FIELDS` are 0)."""
    valid, values, state = fetch_record(pipe_sched, state, sTask, len(CONSUMER_FIELDS))
    fields = dict(zip(CONSUMER_FIELDS, values, strict=True))
    zero = Int32(0)
    return valid, Task(**{f: fields.get(f, zero) for f in Task._fields}), state


@cute.jit
def apply_packed_predicate(
    scores: cute.Tensor, words: cute.Tensor, num_elements: cutlass.Constexpr[int], register_bit=None
):
    """Spec 5.1 on a thread's score registers: element ``e`` keeps its score iff bit ``b`` of
    ``words[s]`` is 1, else becomes -inf, with ``(s, b) = register_bit(e)`` (the consumer payload
    layout's map; default ``divmod(e, 32)``). Compile-time unrolled; padding bits are never read."""
    for chunk in cutlass.range_constexpr((num_elements + 31) // 32):  # unrolled in loops of <= 32
        for i in cutlass.range_constexpr(min(32, num_elements - 32 * chunk)):
            e = 32 * chunk + i
            s, b = divmod(e, 32) if const_expr(register_bit is None) else register_bit(e)
            keep = ((words[s] >> b) & 1) != 0
            scores[e] = scores[e] if keep else -Float32.inf


@cute.jit
def load_payload_plane(
    pipe_mask, state, bulk_atom, masks: cute.Tensor, sMask: cute.Tensor, entry: Int32,
    plane_words: cutlass.Constexpr[int],
):  # fmt: skip
    """Spec 6.2 SMEM delivery: bulk-copy the ``plane_words`` payload words of partial entry ``entry``
    (16-byte aligned in ``masks``) into stage ``state`` of ``sMask`` ``(words, groups, stages)``;
    one elected lane issues the copy on the stage's barrier. Returns the advanced state."""
    plane = cute.make_layout(plane_words)
    src = cute.make_tensor(element_ptr(masks, entry * plane_words, 16), plane)
    dst = cute.make_tensor(sMask[None, None, state.index].iterator, plane)
    fill_stage(pipe_mask, state, (), ((bulk_atom, src, dst),))
    state.advance()
    return state


def element_ptr(base: cute.Tensor, offset, align: int = 16, dtype=None) -> cute.Pointer:
    """A GMEM pointer ``offset`` elements past ``base``'s start (of ``base``'s element type unless
    ``dtype`` is given), asserting an alignment the caller guarantees (so vector accesses and bulk
    copies are emitted)."""
    return cute.make_ptr(
        base.element_type if dtype is None else dtype,
        (base.iterator + offset).toint(),
        cute.AddressSpace.gmem,
        assumed_align=align,
    )


def select_modes(t: cute.Tensor, modes: list[int]) -> cute.Tensor:
    """``t`` with its modes reordered (e.g. THD ``(rows, heads, d)`` -> ``(rows, d, heads)`` for TMA)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, modes))


def heads_rows(t: cute.Tensor) -> cute.Tensor:
    """THD ``(total, heads, d)`` -> ``((heads, total), d)``: one row mode over (head, position) pairs,
    head fastest. A PackGQA tile of ``G`` heads x ``P`` positions is one ``((G, P), d)`` box of it."""
    shape = ((t.shape[1], t.shape[0]), t.shape[2])
    stride = ((t.stride[1], t.stride[0]), t.stride[2])
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


def group_heads(t: cute.Tensor, group: int) -> cute.Tensor:
    """``((heads, total), d)`` -> ``((group, total), d, heads / group)``: the packed rows of each kv
    head (its ``group`` consecutive q heads at every position) as mode 0, the kv head as mode 2.
    Works on memory tensors and on TMA coordinate tensors alike."""
    (h_stride, t_stride), d_stride = t.stride
    shape = ((group, t.shape[0][1]), t.shape[1], t.shape[0][0] // group)
    stride = ((h_stride, t_stride), d_stride, h_stride * group)
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


# -- backward (K2Q) view ----------------------------------------------------------------------------
class BwdPlanTensors(NamedTuple):
    """The backward view's tensors as a kernel reads them (int32; see ``maskplan_core.plan``), plus
    two plan-derived ones the launcher computes once per view
    (:func:`maskplan_kernels.consumer_launch.bwd_view_args`)."""

    mask_block_cnt: cute.Tensor  # (Hmask, k_rows)
    mask_block_offset: cute.Tensor  # (Hmask, k_rows)
    mask_block_idx: cute.Tensor  # (partial_nnz,)  sample-local Q block
    mask_block_masks: cute.Tensor  # (partial_nnz * plane,)
    full_block_cnt: cute.Tensor  # (Hmask, k_rows)
    full_block_offset: cute.Tensor  # (Hmask, k_rows)
    full_block_idx: cute.Tensor  # (full_nnz,)
    dq_write_order: cute.Tensor  # (partial_nnz,)  rank of the entry among its Q block's writers
    dq_write_order_full: cute.Tensor  # (full_nnz,)
    sequence_desc: SequenceDesc
    k_row_batch: cute.Tensor  # (k_rows,)  sample of each K plan row
    q_block_begin: cute.Tensor  # (B,)  first global (padded) Q block of each sample


# -- tensor views a host entry builds from raw pointers and int32 sizes -----------------------------
# Plain helpers, traced inline by the ``@cute.jit`` host entry that calls them.
def thd_tensor(
    ptr: cute.Pointer, total, heads, d: int, strides: tuple | None = None, samples: tuple | None = None
) -> cute.Tensor:
    """THD ``(total, heads, d)``: contiguous, or with ``strides = (row, head)`` (Int32 elements, each a
    multiple of 16 bytes, as a TMA operand's are) where the caller's tensor is a strided view, e.g.
    q, k and v as slices of one packed QKV tensor.

    ``samples = (B, batch_stride, granule)``: the rows are ``B`` samples of ``S = total / B`` rows,
    ``batch_stride`` elements apart rather than ``S`` rows (a ``[B, S, H, D]`` view of a
    ``[B, H, S, D]`` tensor), and the row mode is ``(granule, S / granule, B)``. A flat row index
    still addresses it (``b * S + s``), and a tile of rows that divides ``granule`` (with
    ``S % granule == 0``, which the launcher checks) stays inside one sample; TMA takes the modes
    as separate box dims::

        row t = b * S + s  ->  (s % granule, s / granule, b) : (row, row * granule, batch_stride)
    """
    per_16_bytes = 128 // ptr.dtype.width
    if const_expr(strides is None):
        stride = (heads * d, d, 1)
    else:
        stride = (*(cute.assume(s, divby=per_16_bytes) for s in strides), 1)
    shape = (total, heads, d)
    if const_expr(samples is not None):
        batch, batch_stride, granule = samples
        row = stride[0]
        shape = ((granule, total // batch // granule, batch), heads, d)
        stride = ((row, row * granule, cute.assume(batch_stride, divby=per_16_bytes)), *stride[1:])
    return cute.make_tensor(ptr, cute.make_layout(shape, stride=stride))


def rows_from(t: cute.Tensor, first_row, packed: bool = False) -> cute.Tensor:
    """``t``, a ``(rows, d)`` view of a THD tensor (PackGQA: ``((G, rows), d)``, ``packed``), from
    flat row ``first_row`` on."""
    return cute.domain_offset(((0, first_row) if const_expr(packed) else first_row, 0), t)


def csr_tensors(
    cnt: cute.Pointer,
    offset: cute.Pointer,
    idx: cute.Pointer,
    masks: cute.Pointer,
    full_cnt: cute.Pointer,
    full_offset: cute.Pointer,
    full_idx: cute.Pointer,
    *,
    mask_heads: Int32,
    rows: Int32,
    partial_nnz: Int32,
    full_nnz: Int32,
    plane: int,
) -> tuple:
    """The 7 CSR tensors every view has, in plan order: partial ``cnt/offset (Hmask, rows)``,
    ``idx (nnz,)``, ``masks (nnz * plane,)``, then full ``cnt/offset/idx``. ``rows`` are the view's
    outer blocks (Q for the forward, K for the backward); ``plane`` the int32 words of one entry."""
    return (
        row_major(cnt, mask_heads, rows),
        row_major(offset, mask_heads, rows),
        row_major(idx, partial_nnz),
        row_major(masks, partial_nnz * plane),
        row_major(full_cnt, mask_heads, rows),
        row_major(full_offset, mask_heads, rows),
        row_major(full_idx, full_nnz),
    )


class ThdHostEntry:
    """What the kernels' host entries share: the THD tensors' head dims, and how their q, k, v rows
    are laid out (:meth:`samples`)."""

    #: nonzero: q, k, v rows are ``thd_tensor(samples=...)`` with this granule (a multiple of every
    #: tile of rows the kernel takes from them), for fixed-length batches whose samples are not
    #: ``S`` rows apart; 0: one flat row mode
    row_granule = 0

    def qkv_tensors(self, q, k, v, *, total_q, total_k, num_heads_q, num_heads_kv, batch, strides) -> tuple:
        """THD ``q``, ``k``, ``v`` (:meth:`io_head_dims`) from ``strides``, the host entries' nine
        stride arguments: row and head strides of q, k, v, then their batch strides."""
        dqk, dv = self.io_head_dims()
        shapes = ((total_q, num_heads_q, dqk), (total_k, num_heads_kv, dqk), (total_k, num_heads_kv, dv))
        return tuple(
            thd_tensor(ptr, *shape, strides[2 * i : 2 * i + 2], self.samples(batch, strides[6 + i]))
            for i, (ptr, shape) in enumerate(zip((q, k, v), shapes, strict=True))
        )

    def samples(self, batch: Int32, batch_stride: Int32):
        """``thd_tensor``'s ``samples`` for a q, k or v of ``batch_stride`` (None: flat rows)."""
        return (batch, batch_stride, self.row_granule) if const_expr(self.row_granule) else None

    def sample_rows(self, t: cute.Tensor, batch: Int32, first_row: Int32, packed: bool = False):
        """Sample ``batch``'s rows of ``t``, a ``(rows, d)`` view of q, k or v (memory or TMA
        coordinates; ``packed``: PackGQA's ``((G, rows), d)``), whose first flat row is ``first_row``.
        Read per sample, that is the sample's own ``(granule, S / granule)`` rows: a tile index into
        it divides by the static granule only, where the flat offset into ``(granule, S / granule,
        B)`` would divide by the runtime ``S / granule`` in every load's coordinates."""
        if const_expr(self.row_granule):
            rows = (None, None, batch)
            flat = t[(None, rows) if const_expr(packed) else rows, None]  # the slice drops the nesting
            return cute.group_modes(flat, 0, cute.rank(flat) - 1)
        return rows_from(t, first_row, packed)

    def io_head_dims(self) -> tuple[int, int]:
        """``(Dqk, Dv)`` of the THD tensors: the kernel's, unless a class that reads narrower ones
        into its tiles (TMA fills the columns past them with zeros) overrides this."""
        return self.head_dim_qk, self.head_dim_v


class FwdHostEntry(ThdHostEntry):
    """The host entry of a forward kernel, the same for every consumer: raw global pointers plus
    int32 sizes (the project's launch convention, no size triggers a recompile; the arguments
    :func:`maskplan_kernels.consumer_launch.fwd_entry_placeholders` and ``fwd_entry_arguments``
    pass), turned into row-major tensors for the kernel class's ``@cute.jit __call__(mQ, mK, mV,
    mO, mLSE, mMaxLogit, plan, [tile_counter,] softmax_scale, num_ctas, stream)``.

    The kernel class provides ``config`` (its ``topology()`` gives the view's block, its
    ``payload_layout`` the words of one partial entry), ``head_dim_qk`` and ``head_dim_v``; the
    THD tensors' head dims are :meth:`io_head_dims`. A ``persistent`` kernel (one whose CTAs take
    tasks from a stream-local atomic counter) also takes ``tile_counter``; the others are given
    None for it. ``num_ctas`` is the grid the launcher chose (persistent: at most one CTA per SM;
    otherwise one CTA, or cluster, per task).
    """

    #: the kernel class takes ``tile_counter`` (see above)
    persistent = False

    @cute.jit
    def from_pointers(
        self,
        q: cute.Pointer,  # THD (total_q, Hq, Dqk), 16-byte aligned, strided (see q_row_stride)
        k: cute.Pointer,  # (total_k, Hkv, Dqk)
        v: cute.Pointer,  # (total_k, Hkv, Dv)
        o: cute.Pointer,  # (total_q, Hq, Dv)  contiguous
        lse: cute.Pointer,  # fp32 (Hq, total_q)
        max_logit: cute.Pointer | None,  # fp32 (Hq,); None: not computed
        mask_block_cnt: cute.Pointer,  # int32 (Hmask, rows)
        mask_block_offset: cute.Pointer,  # (Hmask, rows)
        mask_block_idx: cute.Pointer,  # (partial_nnz,)
        mask_block_masks: cute.Pointer,  # (partial_nnz * words_per_tile,), 16-byte aligned
        full_block_cnt: cute.Pointer,  # (Hmask, rows)
        full_block_offset: cute.Pointer,  # (Hmask, rows)
        full_block_idx: cute.Pointer,  # (full_nnz,)
        sequence_desc: cute.Pointer,  # (B, 8) of a varlen view; fixed length: a dummy never read
        fwd_work_desc: cute.Pointer,  # (tasks, 4)
        tile_counter: cute.Pointer | None,  # (1,) int32 of a persistent kernel; None otherwise
        total_q: Int32,
        total_k: Int32,
        num_heads_q: Int32,
        num_heads_kv: Int32,
        mask_heads: Int32,
        q_rows: Int32,
        partial_nnz: Int32,
        full_nnz: Int32,
        batch: Int32,
        num_tasks: Int32,
        varlen: Int32,  # runtime, so fixed and varlen views share one compiled kernel
        q_row_stride: Int32,  # q, k, v: strides in elements, multiples of 16 bytes (qkv_strides)
        q_head_stride: Int32,
        k_row_stride: Int32,
        k_head_stride: Int32,
        v_row_stride: Int32,
        v_head_stride: Int32,
        q_batch_stride: Int32,  # read where row_granule is set (ThdHostEntry.samples)
        k_batch_stride: Int32,
        v_batch_stride: Int32,
        softmax_scale: Float32,
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        """Builds the tensors and calls ``self.__call__``."""
        dqk, dv = self.io_head_dims()
        block = self.config.topology()
        csr = csr_tensors(
            mask_block_cnt, mask_block_offset, mask_block_idx, mask_block_masks,
            full_block_cnt, full_block_offset, full_block_idx,
            mask_heads=mask_heads, rows=q_rows, partial_nnz=partial_nnz, full_nnz=full_nnz,
            plane=self.config.payload_layout.words_per_tile,
        )  # fmt: skip
        desc = make_sequence_desc(
            sequence_desc, varlen, batch=batch, total_q=total_q, total_k=total_k,
            block_m=block.tile_m, block_n=block.tile_n, k_major=False,
        )  # fmt: skip
        tensors = (
            *self.qkv_tensors(
                q, k, v, total_q=total_q, total_k=total_k, num_heads_q=num_heads_q, num_heads_kv=num_heads_kv,
                batch=batch, strides=(q_row_stride, q_head_stride, k_row_stride, k_head_stride, v_row_stride,
                                      v_head_stride, q_batch_stride, k_batch_stride, v_batch_stride),
            ),  # fmt: skip
            thd_tensor(o, total_q, num_heads_q, dv),
            row_major(lse, num_heads_q, total_q),
            row_major(max_logit, num_heads_q) if const_expr(max_logit is not None) else None,
            FwdPlanTensors(*csr, desc, row_major(fwd_work_desc, num_tasks, 4)),
        )
        if const_expr(self.persistent):
            self.__call__(*tensors, row_major(tile_counter, 1), softmax_scale, num_ctas, stream)
        else:
            self.__call__(*tensors, softmax_scale, num_ctas, stream)


def bwd_plan_tensors(
    mask_block_cnt: cute.Pointer,
    mask_block_offset: cute.Pointer,
    mask_block_idx: cute.Pointer,
    mask_block_masks: cute.Pointer,
    full_block_cnt: cute.Pointer,
    full_block_offset: cute.Pointer,
    full_block_idx: cute.Pointer,
    dq_write_order: cute.Pointer,
    dq_write_order_full: cute.Pointer,
    sequence_desc: cute.Pointer,
    k_row_batch: cute.Pointer,
    q_block_begin: cute.Pointer,
    *,
    mask_heads: Int32,
    k_rows: Int32,
    partial_nnz: Int32,
    full_nnz: Int32,
    batch: Int32,
    varlen: Int32,
    total_q: Int32,
    total_k: Int32,
    block: tuple[int, int],
    plane: int,
) -> BwdPlanTensors:
    """:class:`BwdPlanTensors` from the 12 plan pointers (in field order) and the view's int32 sizes;
    ``block`` is the view's block (Q rows, keys), ``plane`` the int32 words of one partial entry
    (``PayloadLayout.words_per_tile``)."""
    csr = csr_tensors(
        mask_block_cnt, mask_block_offset, mask_block_idx, mask_block_masks,
        full_block_cnt, full_block_offset, full_block_idx,
        mask_heads=mask_heads, rows=k_rows, partial_nnz=partial_nnz, full_nnz=full_nnz, plane=plane,
    )  # fmt: skip
    desc = make_sequence_desc(
        sequence_desc, varlen, batch=batch, total_q=total_q, total_k=total_k,
        block_m=block[0], block_n=block[1], k_major=True,
    )  # fmt: skip
    return BwdPlanTensors(
        *csr,
        row_major(dq_write_order, partial_nnz),
        row_major(dq_write_order_full, full_nnz),
        desc,
        row_major(k_row_batch, k_rows),
        row_major(q_block_begin, batch),
    )


class DqPostprocessHostEntry:
    """The host entry of a backward postprocess (fp32 dQ accumulator -> dQ), the same for every
    consumer: raw pointers plus int32 sizes, turned into ``(mdQaccum, mdQsem, mdQ, sequence_desc,
    q_block_begin)`` (the fp32 accumulator ``(Hq, n_qblk * tile_m * head_dim)`` in the consumer's
    own order inside a Q block; the turnstile counts ``(Hq, n_qblk)``, or None; THD ``dq``; the
    backward view's :class:`SequenceDesc` with Q columns only; the ``(B,)`` first padded Q block of
    each sample) for the class's ``@cute.kernel kernel(*those, *self.kernel_operands(),
    softmax_scale)``, one CTA of ``num_threads`` per (Q block, q head, sample).

    The kernel class provides ``tile_m``, ``head_dim``, ``num_threads``, ``zero_unvisited`` and
    ``kernel_operands()`` (its compile-time operands, e.g. a ``TiledMma``); ``dq``'s head dim is
    :meth:`io_head_dim` (``head_dim`` unless a class overrides it). With ``zero_unvisited``
    the accumulator was not zeroed (the main kernel stored each Q block's first contribution:
    ``BackwardCompiler.first_dq_stored``), and a block whose turnstile count is 0
    had none: its dQ is 0. Otherwise ``mdQsem`` is None.
    """

    def io_head_dim(self) -> int:
        """Head dim of the THD ``dq`` (the accumulator's is ``head_dim``)."""
        return self.head_dim

    @cute.jit
    def from_pointers(
        self,
        dq_accum: cute.Pointer,  # fp32 (Hq, n_qblk * tile_m * D)  16-byte aligned
        dq_semaphore: cute.Pointer,  # int32 (Hq, n_qblk), the turnstile counts
        dq: cute.Pointer,  # (total_q, Hq, D)  output
        sequence_desc: cute.Pointer,  # (B, 8) of a varlen view; fixed length: a dummy never read
        q_block_begin: cute.Pointer,  # (B,)
        total_q: Int32,
        num_heads_q: Int32,
        batch: Int32,
        n_qblk: Int32,
        max_q_blocks: Int32,
        varlen: Int32,
        softmax_scale: Float32,
        stream: cuda.CUstream,
    ):
        tm, d = self.tile_m, self.head_dim
        self.kernel(
            row_major(dq_accum, num_heads_q, n_qblk * tm * d),
            row_major(dq_semaphore, num_heads_q, n_qblk) if const_expr(self.zero_unvisited) else None,
            thd_tensor(dq, total_q, num_heads_q, self.io_head_dim()),
            backward_q_desc(sequence_desc, varlen, batch=batch, total_q=total_q, tile_m=tm),
            row_major(q_block_begin, batch),
            *self.kernel_operands(),
            softmax_scale,
        ).launch(grid=[max_q_blocks, num_heads_q, batch], block=[self.num_threads, 1, 1], stream=stream)


def backward_q_desc(sequence_desc: cute.Pointer, varlen: Int32, *, batch: Int32, total_q: Int32, tile_m: int):
    """The backward (K2Q) view's :class:`SequenceDesc` for the kernels around the main one (pre- and
    postprocess), which walk Q blocks and are not given the K sizes: Q columns and INNER_BLOCKS."""
    return make_sequence_desc(
        sequence_desc, varlen, batch=batch, total_q=total_q, total_k=None,
        block_m=tile_m, block_n=None, k_major=True,
    )  # fmt: skip


class BwdHostEntry(ThdHostEntry):
    """The host entry of a backward (K2Q) main kernel, the same for every consumer: raw global pointers
    plus int32 sizes (the project's launch convention, no size triggers a recompile; the arguments
    :func:`maskplan_kernels.consumer_launch.bwd_placeholders` and ``launch_backward`` pass), turned
    into row-major tensors for the kernel class's ``@cute.jit __call__(mQ, mK, mV, mdO, mdK, mdV,
    mLSE, mDsum, mdQaccum, mdQsem, plan, softmax_scale, stream)``.

    The kernel class provides ``head_dim_qk``, ``head_dim_v``, ``tile_m``, ``tile_n`` and
    ``payload_plane`` (int32 words of one partial entry); the THD tensors' head dims are
    :meth:`io_head_dims`. A ``persistent`` kernel (one whose CTAs take
    (K row, kv head) items from :func:`take_ticket`) also takes ``max_ctas`` (its grid is at most
    that) after ``plan``, and its ticket counter is the int32 after the turnstiles (the
    preprocess zeroes both).
    """

    #: the kernel class takes ``max_ctas`` (see above)
    persistent = False

    @cute.jit
    def from_pointers(
        self,
        q: cute.Pointer,  # (total_q, Hq, Dqk)   THD, 16-byte aligned, strided (see q_row_stride)
        k: cute.Pointer,  # (total_k, Hkv, Dqk)
        v: cute.Pointer,  # (total_k, Hkv, Dv)
        dout: cute.Pointer,  # (total_q, Hq, Dv)  contiguous
        dk: cute.Pointer,  # (total_k, Hkv, Dqk)  output, input dtype
        dv: cute.Pointer,  # (total_k, Hkv, Dv)  output
        lse_log2: cute.Pointer,  # fp32 (Hq, n_qblk * tile_m)  from the preprocess
        dsum: cute.Pointer,  # fp32 (Hq, n_qblk * tile_m)
        dq_accum: cute.Pointer,  # fp32 (Hq, n_qblk * tile_m * Dqk), zeroed by the preprocess
        dq_semaphore: cute.Pointer,  # int32 (Hq, n_qblk) + the ticket counter, zeroed by the preprocess
        mask_block_cnt: cute.Pointer,
        mask_block_offset: cute.Pointer,
        mask_block_idx: cute.Pointer,
        mask_block_masks: cute.Pointer,  # 16-byte aligned
        full_block_cnt: cute.Pointer,
        full_block_offset: cute.Pointer,
        full_block_idx: cute.Pointer,
        dq_write_order: cute.Pointer,
        dq_write_order_full: cute.Pointer,
        sequence_desc: cute.Pointer,  # (B, 8) of a varlen view; fixed length: a dummy never read
        k_row_batch: cute.Pointer,
        q_block_begin: cute.Pointer,
        total_q: Int32,
        total_k: Int32,
        num_heads_q: Int32,
        num_heads_kv: Int32,
        mask_heads: Int32,
        k_rows: Int32,
        partial_nnz: Int32,
        full_nnz: Int32,
        batch: Int32,
        n_qblk: Int32,
        varlen: Int32,
        max_ctas: Int32,  # persistent kernels: at most this many CTAs (one per SM)
        q_row_stride: Int32,  # q, k, v: strides in elements, multiples of 16 bytes (qkv_strides)
        q_head_stride: Int32,
        k_row_stride: Int32,
        k_head_stride: Int32,
        v_row_stride: Int32,
        v_head_stride: Int32,
        q_batch_stride: Int32,  # read where row_granule is set (ThdHostEntry.samples)
        k_batch_stride: Int32,
        v_batch_stride: Int32,
        softmax_scale: Float32,
        stream: cuda.CUstream,
    ):
        """Builds the tensors and calls ``self.__call__``."""
        dqk, dv_ = self.io_head_dims()
        plan = bwd_plan_tensors(
            mask_block_cnt,
            mask_block_offset,
            mask_block_idx,
            mask_block_masks,
            full_block_cnt,
            full_block_offset,
            full_block_idx,
            dq_write_order,
            dq_write_order_full,
            sequence_desc,
            k_row_batch,
            q_block_begin,
            mask_heads=mask_heads,
            k_rows=k_rows,
            partial_nnz=partial_nnz,
            full_nnz=full_nnz,
            batch=batch,
            varlen=varlen,
            total_q=total_q,
            total_k=total_k,
            block=(self.tile_m, self.tile_n),
            plane=self.payload_plane,
        )
        tensors = (
            *self.qkv_tensors(
                q, k, v, total_q=total_q, total_k=total_k, num_heads_q=num_heads_q, num_heads_kv=num_heads_kv,
                batch=batch, strides=(q_row_stride, q_head_stride, k_row_stride, k_head_stride, v_row_stride,
                                      v_head_stride, q_batch_stride, k_batch_stride, v_batch_stride),
            ),  # fmt: skip
            thd_tensor(dout, total_q, num_heads_q, dv_),
            thd_tensor(dk, total_k, num_heads_kv, dqk),
            thd_tensor(dv, total_k, num_heads_kv, dv_),
            row_major(lse_log2, num_heads_q, n_qblk * self.tile_m),
            row_major(dsum, num_heads_q, n_qblk * self.tile_m),
            row_major(dq_accum, num_heads_q, n_qblk * (self.tile_m * self.head_dim_qk)),  # the tiles' D
            row_major(dq_semaphore, num_heads_q, n_qblk),
            plan,
        )
        if const_expr(self.persistent):
            self.__call__(*tensors, max_ctas, softmax_scale, stream)
        else:
            self.__call__(*tensors, softmax_scale, stream)


class Work(NamedTuple):
    """The CTA's K block (runtime Int32 values)."""

    row: Int32  # K plan row
    n_block: Int32  # sample-local K block
    kv_head: Int32
    q_offset: Int32
    k_offset: Int32
    k_valid: Int32  # keys of this block inside the sample
    qblk_base: Int32  # global Q block of the sample's block 0
    q_per_kv: Int32  # G = Hq / Hkv
    mask_heads: Int32
    split: Int32  # which of the ``splits`` CTAs of the K block (0 without a split)
    batch: Int32  # the sample


class HeadRange(NamedTuple):
    """The K2Q ranges of one Q head for the CTA's K block."""

    q_head: Int32
    partial_cnt: Int32
    partial_off: Int32
    full_cnt: Int32
    full_off: Int32


#: kv heads the atomic (non-deterministic) backward launch takes at a time: K rows first (one head
#: at a time) left the longest causal K rows of the last head in the last waves, all heads at a time
#: spread a wave's Q / dO reads over every head in L2 (measured on SM90: flexattn_sm90.bwd_kernel)
ATOMIC_HEAD_GROUP = 2
#: below this K2Q row fill (:func:`k2q_row_fill`) the atomic launch takes all kv heads at a time:
#: a K block then walks few Q blocks (documents, sliding windows), so a wave over every head stays
#: small in L2, and the short rows of all heads even out the waves. SM90 fwd+bwd, device time:
#: document +3% (D=128) and +4-5% (D=64 GQA 32/8), sliding-1024 within 1% (RESULTS.md, session 19)
SPARSE_ROW_FILL = 0.25


def k2q_row_fill(entries, k_rows, q_blocks_per_sample):
    """The fraction of its sample's Q blocks a backward view's K2Q row visits on average: its
    ``entries`` (partial + full) over ``k_rows`` (K plan rows x mask heads) x Q blocks per sample.
    Plain arithmetic, so kernels and host tests ask the same question."""
    return entries / (k_rows * q_blocks_per_sample)


@cute.jit
def view_row_fill(plan: BwdPlanTensors, n_qblk: Int32) -> Float32:
    """:func:`k2q_row_fill` of the launched view; ``n_qblk`` is the padded Q blocks of all samples
    (varlen: from the host bound ``geometry.ViewBounds.q_rows``, within one block per sample)."""
    entries = Float32(cute.size(plan.mask_block_idx) + cute.size(plan.full_block_idx))
    k_rows = Float32(cute.size(plan.mask_block_cnt))
    return k2q_row_fill(entries, k_rows, Float32(n_qblk) / Float32(cute.size(plan.q_block_begin)))


@cute.jit
def atomic_head_group(
    plan: BwdPlanTensors, n_qblk: Int32, kv_heads: Int32, sparse_heads: cutlass.Constexpr[int] = 0
) -> Int32:
    """Kv heads the atomic backward launch (:func:`decode_work`) takes at a time:
    ``ATOMIC_HEAD_GROUP``, or on sparse K2Q rows (``SPARSE_ROW_FILL``) all of them, at most
    ``sparse_heads`` where that is given (> 0): a kernel whose Q blocks are large in L2 caps it."""
    group = Int32(ATOMIC_HEAD_GROUP)
    if view_row_fill(plan, n_qblk) < SPARSE_ROW_FILL:
        group = kv_heads
        if const_expr(sparse_heads > 0):
            group = cutlass.min(kv_heads, Int32(sparse_heads))
    return group


def grouped_launch_slot(launch: Int32, kv_heads: Int32, k_rows: Int32, group: Int32) -> tuple[Int32, Int32]:
    """``(K row, kv head)`` of the ``launch``-th CTA (in launch order; a persistent kernel's
    ``launch``-th ticket, :func:`take_ticket`) when the launch order takes
    ``group`` kv heads at a time, K rows ascending within a group, heads ascending within a row::

        kv_heads = 5, group = 2:   launch  0 1 2 3 ..      2R 2R+1 ..      4R   4R+1 ..
                                   (row, head) (0,0) (0,1) (1,0) (1,1) .. (0,2) (0,3) .. (0,4) (1,4) ..

    ``group >= kv_heads`` is heads-major order, ``group == 1`` rows-major. Every CTA of a head
    launches (or is taken) after the CTAs of the same head with lower K rows, which the
    turnstiles (``dq_write_order`` ranks ascend with the K block; deterministic mode waits for the
    ranks below, SM90's atomic mode on sparse rows for rank 0) need to never wait on a CTA not yet
    resident.
    A plain function of integers, so that it also runs on the CPU (its test)."""
    span = group * k_rows
    first = launch // span * group
    heads = cutlass.min(group, kv_heads - first)
    within = launch - first * k_rows
    return within // heads, first + within % heads


@cute.jit
def decode_work(
    plan: BwdPlanTensors,
    q_per_kv: Int32,
    tile_n: cutlass.Constexpr[int],
    kv_heads: Int32,
    head_group: Int32,
    splits: cutlass.Constexpr[int] = 1,
    ticket: Int32 | None = None,
) -> Work:
    """The CTA's K block from its block index ``x`` in a 1-D grid of ``splits * Hkv * K rows`` CTAs
    (:func:`launch_grid`), or from ``ticket`` (:func:`take_ticket`) in a persistent kernel: launch
    slot ``x // splits`` is ``(K row, kv head)`` in the order of :func:`grouped_launch_slot`, taking
    ``head_group`` kv heads at a time (ascending K rows per head, so the writers of a Q block run
    in ``dq_write_order``, which the turnstiles need). The ``splits`` CTAs of one K block (a kernel splitting
    its outputs' head dim, or a cluster along K) are adjacent in x, so they launch together. Grid x
    holds 2^31 - 1 CTAs (grid y only 65535)."""
    x = Int32(0)
    if const_expr(ticket is None):
        x, _, _ = cute.arch.block_idx()
    else:
        x = ticket
    row, kv_head = grouped_launch_slot(x // splits, kv_heads, cute.size(plan.k_row_batch), head_group)
    b = plan.k_row_batch[row]
    n_block = row - desc_field(plan.sequence_desc, b, DESC_ROW_BEGIN)
    k_len = desc_field(plan.sequence_desc, b, DESC_K_LEN)
    return Work(
        row,
        n_block,
        kv_head,
        desc_field(plan.sequence_desc, b, DESC_Q_OFFSET),
        desc_field(plan.sequence_desc, b, DESC_K_OFFSET),
        cutlass.min(k_len - n_block * tile_n, tile_n),
        plan.q_block_begin[b],
        q_per_kv,
        plan.mask_block_cnt.shape[0],
        x % splits,
        b,
    )


def launch_grid(k_rows, kv_heads, splits: int = 1) -> list:
    """The 1-D grid :func:`decode_work` decodes: ``splits`` CTAs per (K row, kv head)."""
    return [k_rows * kv_heads * splits, 1, 1]


def ticket_counter(dq_semaphore: cute.Tensor) -> cute.Tensor:
    """A persistent backward's ticket counter: the int32 after the ``(Hq, n_qblk)`` turnstiles of
    ``dq_semaphore`` (:class:`BwdHostEntry`; the preprocess zeroes it), as a one-element tensor."""
    return cute.make_tensor(element_ptr(dq_semaphore, cute.size(dq_semaphore), 4), cute.make_layout(1))


@cute.jit
def take_ticket(counter: cute.Tensor, lane: Int32) -> Int32:
    """The next ticket of a persistent kernel's counter: lane 0 takes ``atomicAdd(counter, 1)``,
    broadcast to the warp. A backward whose every item, the first included, comes from the
    counter (0 at launch) takes its items in ticket order by CTAs that are running: a deterministic
    turnstile waiting on a lower ticket waits on a CTA that holds it, whatever the residency."""
    ticket = Int32(0)
    if lane == 0:
        ticket = cute.arch.atomic_add(counter.iterator, Int32(1))
    return cute.arch.shuffle_sync(ticket, 0)


@cute.jit
def head_range(plan: BwdPlanTensors, work: Work, g: Int32) -> HeadRange:
    """The partial and full K2Q ranges of q head ``g`` (of ``G``) of the CTA's kv head."""
    q_head = work.kv_head * work.q_per_kv + g
    h = cutlass.min(q_head, work.mask_heads - 1)  # Hmask is 1 (shared mask) or Hq
    return HeadRange(
        q_head,
        plan.mask_block_cnt[h, work.row],
        plan.mask_block_offset[h, work.row],
        plan.full_block_cnt[h, work.row],
        plan.full_block_offset[h, work.row],
    )


class WalkStep(NamedTuple):
    """One entry of :func:`walk_descending` (runtime Int32 values)."""

    partial: Int32  # 1: a partial entry (payload, dq_write_order); 0: a full one
    entry: Int32  # index into the partial or the full arrays
    q_block: Int32  # sample-local Q block
    partial_left: Int32  # entries of each list still to walk after this one
    full_left: Int32


@cute.jit
def walk_descending(plan: BwdPlanTensors, hr: HeadRange, partial_left: Int32, full_left: Int32) -> WalkStep:
    """The next entry of the merged walk over a K row's partial and full lists by DESCENDING Q block
    (start with ``partial_left, full_left = hr.partial_cnt, hr.full_cnt``; each list is ascending, so
    the next entry is the larger of the two lists' last unwalked ones; a Q block is in one list).

    Why descending: every K block of a causal, sliding-window or document mask sees its sample's
    Q blocks up to the same or a later last one than the K block below it, so walking down from the
    last, a CTA reaches each Q block no earlier than the lower K block's CTA (started before it)
    does. Deterministic mode adds a Q block's dQ contributions by ascending K block
    (``dq_write_order``), so its turnstiles then rarely wait; partial-then-full visits a sliding
    window's trailing-edge blocks first and waits for a whole chain of CTAs."""
    m_p = Int32(-1)
    m_f = Int32(-1)
    if partial_left > 0:
        m_p = plan.mask_block_idx[hr.partial_off + partial_left - 1]
    if full_left > 0:
        m_f = plan.full_block_idx[hr.full_off + full_left - 1]
    take_p = Int32(m_p > m_f)
    return WalkStep(
        take_p,
        take_p * (hr.partial_off + partial_left - 1) + (1 - take_p) * (hr.full_off + full_left - 1),
        cutlass.max(m_p, m_f),
        partial_left - take_p,
        full_left - (1 - take_p),
    )


@cute.jit
def k_row_last_q_block(plan: BwdPlanTensors, row: Int32) -> Int32:
    """The last Q block K row ``row`` of mask head 0 visits (-1 where it visits none)."""
    hr = HeadRange(
        Int32(0),
        plan.mask_block_cnt[0, row],
        plan.mask_block_offset[0, row],
        plan.full_block_cnt[0, row],
        plan.full_block_offset[0, row],
    )
    return walk_descending(plan, hr, hr.partial_cnt, hr.full_cnt).q_block


#: pairs of adjacent K rows :func:`staggered_row_ends` samples, in runs of STAGGER_RUN pairs
STAGGER_PAIRS = 16
STAGGER_RUN = 4


def stagger_pair_row(pair: int, k_rows):
    """The lower K row of sampled pair ``pair`` (of ``STAGGER_PAIRS``; the pair is that row and the
    next). Runs of ``STAGGER_RUN`` pairs start evenly over the rows::

        k rows  0 ..................................................... k_rows - 1
                [0 1 2 3 4]        [run]        [run]        [run]

    A plain function of integers, so that the kernel and its CPU test sample the same rows (a
    row of ``k_rows - 1`` or more leaves no pair: only where ``k_rows`` is below
    ``STAGGER_RUN + 1``)."""
    span = cutlass.max(k_rows - STAGGER_RUN - 1, 0)
    return span * (pair // STAGGER_RUN) // (STAGGER_PAIRS // STAGGER_RUN) + pair % STAGGER_RUN


@cute.jit
def staggered_row_ends(plan: BwdPlanTensors) -> cutlass.Boolean:
    """Whether more than half of the sampled pairs of adjacent K rows (:func:`stagger_pair_row`;
    mask head 0; pairs within one sample whose rows both visit a Q block) end their K2Q walks at
    different Q blocks, as a sliding window's rows do; a document's rows end together at the
    document's last Q block, causal's at the sample's. A few dozen loads, once per CTA."""
    k_rows = cute.size(plan.mask_block_cnt, mode=[1])
    pairs = Int32(0)
    staggered = Int32(0)
    for p in cutlass.range_constexpr(STAGGER_PAIRS):
        row = stagger_pair_row(p, k_rows)
        if row + 1 < k_rows:
            if plan.k_row_batch[row] == plan.k_row_batch[row + 1]:
                lower, upper = k_row_last_q_block(plan, row), k_row_last_q_block(plan, row + 1)
                if cutlass.min(lower, upper) >= 0:  # both rows visit a Q block
                    pairs += 1
                    staggered += Int32(lower != upper)
    return staggered * 2 > pairs


@cute.jit
def total_steps(plan: BwdPlanTensors, work: Work) -> Int32:
    """Q blocks (partial + full, all q heads of the kv head) the CTA's K block visits."""
    n = Int32(0)
    for g in cutlass.range(work.q_per_kv, unroll=1):
        hr = head_range(plan, work, g)
        n += hr.partial_cnt + hr.full_cnt
    return n


# -- programmatic dependent launch ----------------------------------------------------------------------
#: launch option of a kernel that may launch while the kernel before it on the stream finishes; it
#: runs :func:`after_predecessor` first. The SM90 forward launches so (+0.3-1% on the H200); the
#: backward's three kernels measured no gain from it (benchmarks/RESULTS.md, session 28)
PDL = {"use_pdl": True}


@cute.jit
def after_predecessor():
    """Wait until the kernel before this one on the stream has completed and its writes are
    visible, then let the next kernel launch. Every thread calls it before its first global
    access, read or write (the predecessor may still read a buffer this kernel writes), so a kernel
    launched with :data:`PDL` overlaps only its launch and prologue (SMEM carve-up, barrier init,
    TMA descriptor prefetch) with the predecessor's last wave. Because each kernel lets its
    successor launch only after its own wait, everything older than the predecessor has completed
    by then too. After a kernel launched without PDL (a torch op) the wait returns at once."""
    cute.arch.griddepcontrol_wait()
    cute.arch.griddepcontrol_launch_dependents()


# -- dQ accumulation: PTX the DSL has no op for, and the per-Q-block turnstile ---------------------
def _bulk_to_global(instruction: str, smem_src: cute.Pointer, gmem_dst: cute.Pointer, num_bytes: int, loc, ip):  # noqa: E501
    llvm.inline_asm(
        None,
        [
            gmem_dst.toint(loc=loc, ip=ip).ir_value(),
            smem_src.toint(loc=loc, ip=ip).ir_value(),
            Int32(num_bytes).ir_value(loc=loc, ip=ip),
        ],
        f"{instruction} [$0], [$1], $2;",
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def bulk_reduce_add_f32(smem_src: cute.Pointer, gmem_dst: cute.Pointer, num_bytes: int, *, loc=None, ip=None):
    """``gmem[i] += smem[i]`` for ``num_bytes / 4`` fp32 values, by the bulk copy engine
    (``cp.reduce.async.bulk``, completion through the issuing thread's bulk async-group)."""
    _bulk_to_global(
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32", smem_src, gmem_dst, num_bytes, loc, ip
    )


@dsl_user_op
def bulk_store(smem_src: cute.Pointer, gmem_dst: cute.Pointer, num_bytes: int, *, loc=None, ip=None):
    """``gmem[i] = smem[i]`` for ``num_bytes`` bytes, by the bulk copy engine (``cp.async.bulk``;
    completion as for :func:`bulk_reduce_add_f32`)."""
    _bulk_to_global("cp.async.bulk.global.shared::cta.bulk_group", smem_src, gmem_dst, num_bytes, loc, ip)


@cute.jit
def turnstile_wait(counter: cute.Pointer, ticket: Int32, leader: Int32):
    """Spin (the thread whose ``leader`` index is 0) until ``*counter == ticket`` with acquire
    semantics, then order the bulk reductions that follow (async proxy) after the acquire.
    Called by whole warps (``leader`` is the lane, or the thread index in a group of warps that
    then meets at a barrier)."""
    if leader == 0:
        seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
        while seen != ticket:
            seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
    cute.arch.sync_warp()
    cute.arch.fence_proxy("async.global")


@cute.jit
def turnstile_advance(counter: cute.Pointer, leader: Int32):
    """After the calling threads' bulk reductions completed (``cp.async.bulk.wait_group 0``): make
    them visible, then (the thread whose ``leader`` index is 0) pass the turn on (release).
    Called by whole warps, like :func:`turnstile_wait`."""
    cute.arch.fence_proxy("async.global")
    if leader == 0:
        cute.arch.red(counter, Int32(1), op="add", dtype="s32", sem="release", scope="gpu")
    cute.arch.sync_warp()


__all__ = [
    "ATOMIC_HEAD_GROUP",
    "CONSUMER_FIELDS",
    "CUTE_DTYPES",
    "PDL",
    "SPARSE_ROW_FILL",
    "STAGGER_PAIRS",
    "STAGGER_RUN",
    "TASK_WORDS",
    "BwdHostEntry",
    "BwdPlanTensors",
    "DqPostprocessHostEntry",
    "FwdHostEntry",
    "FwdPlanTensors",
    "HeadRange",
    "SampleQ",
    "SequenceDesc",
    "Task",
    "WalkStep",
    "Work",
    "after_predecessor",
    "apply_packed_predicate",
    "atomic_head_group",
    "backward_q_desc",
    "bulk_reduce_add_f32",
    "bulk_store",
    "bwd_plan_tensors",
    "decode_task",
    "decode_work",
    "desc_field",
    "element_ptr",
    "fetch_record",
    "fetch_task",
    "grouped_launch_slot",
    "head_range",
    "k_row_last_q_block",
    "k2q_row_fill",
    "launch_grid",
    "load_payload_plane",
    "make_sequence_desc",
    "publish_record",
    "publish_task",
    "record_pipeline",
    "sample_q",
    "select_modes",
    "stagger_pair_row",
    "staggered_row_ends",
    "take_ticket",
    "ticket_counter",
    "thd_tensor",
    "total_steps",
    "turnstile_advance",
    "turnstile_wait",
    "view_row_fill",
    "walk_descending",
]
