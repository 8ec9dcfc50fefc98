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

A backward (K2Q) view's tensors reach a kernel as :class:`BwdPlanTensors`; its walk (items, launch
order, the merged partial / full walk by Q block) is :mod:`maskplan_kernels.consumer_k2q`, its dQ
accumulation :mod:`maskplan_kernels.consumer_dq`. Both consumers share their kernels' host entries
(:mod:`maskplan_kernels.consumer_entry`: raw pointers and int32 sizes -> these tensors).
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr

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


__all__ = [
    "CONSUMER_FIELDS",
    "CUTE_DTYPES",
    "PDL",
    "TASK_WORDS",
    "BwdPlanTensors",
    "FwdPlanTensors",
    "SampleQ",
    "SequenceDesc",
    "Task",
    "after_predecessor",
    "apply_packed_predicate",
    "decode_task",
    "desc_field",
    "element_ptr",
    "fetch_record",
    "fetch_task",
    "load_payload_plane",
    "make_sequence_desc",
    "publish_record",
    "publish_task",
    "record_pipeline",
    "sample_q",
    "select_modes",
]
