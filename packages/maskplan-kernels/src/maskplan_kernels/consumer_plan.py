"""Device side of a forward plan view, for attention kernels that consume one (CuTe DSL, inlined).

Architecture-neutral: the SM90 (WGMMA) and SM100 (tcgen05) forward kernels walk a forward view the
same way, and this module is that walk. Per task ``(m_block, head, batch, q_valid_rows)`` of
``fwd_work_desc`` (spec 6.1)::

    row = sequence_desc[batch].row_begin + m_block,   h = head if Hmask > 1 else 0
    partial blocks: mask_block_idx[mask_block_offset[h, row] + [0, mask_block_cnt[h, row])]
    full blocks:    full_block_idx[full_block_offset[h, row] + [0, full_block_cnt[h, row])]

One warp decodes a task (:func:`decode_task`) and hands the fields the other roles need to them
through an SMEM record of :data:`TASK_WORDS` int32 (:func:`publish_task` / :func:`fetch_task`); only
the decoding warp reads the plan's descriptors. A partial block's payload plane reaches SMEM with
:func:`load_payload_plane` (or each thread loads its own words), and the words select scores with
:func:`apply_packed_predicate` (spec 5.1), whatever fragment order the consumer's payload layout
gives them.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr


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
    sequence_desc: cute.Tensor  # (B, 8)
    fwd_work_desc: cute.Tensor  # (tasks, 4)

    def __new_from_mlir_values__(self, values):
        return FwdPlanTensors(*values)


class Task(NamedTuple):
    """One decoded forward task (runtime Int32 values)."""

    m_block: Int32
    head: Int32
    kv_head: Int32
    q_offset: Int32
    k_offset: Int32
    q_valid: Int32
    partial_cnt: Int32
    partial_off: Int32
    full_cnt: Int32
    full_off: Int32


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
    q_offset = plan.sequence_desc[batch, 0]
    k_offset = plan.sequence_desc[batch, 1]
    row = plan.sequence_desc[batch, 4] + m_block
    # Hmask is 1 (shared mask) or Hq
    h_mask = cutlass.min(head, plan.mask_block_cnt.shape[0] - 1)
    kv_head = head // qhead_per_kvhead
    return Task(
        m_block,
        head,
        kv_head,
        q_offset,
        k_offset,
        q_valid,
        plan.mask_block_cnt[h_mask, row],
        plan.mask_block_offset[h_mask, row],
        plan.full_block_cnt[h_mask, row],
        plan.full_block_offset[h_mask, row],
    )


@cute.jit
def publish_task(pipe_sched, state, sTask: cute.Tensor, t: Task | None, valid: Int32, lane: Int32):
    """Hand the decoded task (or, with ``valid = 0``, the end of work) to the other roles through
    stage ``state`` of ``sTask`` ``(TASK_WORDS, stages)``; lane 0 writes and commits."""
    pipe_sched.producer_acquire(state)
    if lane == 0:
        record = sTask[None, state.index]
        record[0] = valid
        if const_expr(t is not None):
            for w, field in enumerate(CONSUMER_FIELDS):
                record[1 + w] = getattr(t, field)
        pipe_sched.producer_commit(state)
    state.advance()
    return state


@cute.jit
def fetch_task(pipe_sched, state, sTask: cute.Tensor):
    """``(valid, task, state)``: the next record :func:`publish_task` wrote (fields outside
    :data:`CONSUMER_FIELDS` are 0)."""
    pipe_sched.consumer_wait(state)
    record = sTask[None, state.index]
    valid = record[0]
    fields = {field: record[1 + w] for w, field in enumerate(CONSUMER_FIELDS)}
    pipe_sched.consumer_release(state)
    state.advance()
    zero = Int32(0)
    return valid, Task(**{f: fields.get(f, zero) for f in Task._fields}), state


@cute.jit
def apply_packed_predicate(scores: cute.Tensor, words: cute.Tensor, num_elements: cutlass.Constexpr[int]):
    """Spec 5.1 on a thread's score registers: element ``e`` keeps its score iff bit ``e % 32`` of
    ``words[e // 32]`` is 1, else becomes -inf. Compile-time unrolled; padding bits are never read."""
    for w in cutlass.range_constexpr((num_elements + 31) // 32):
        word = words[w]
        for b in cutlass.range_constexpr(min(32, num_elements - 32 * w)):
            e = 32 * w + b
            keep = ((word >> b) & 1) != 0
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
    src = cute.make_tensor(int32_gmem_ptr(masks, entry * plane_words, 16), plane)
    dst = cute.make_tensor(sMask[None, None, state.index].iterator, plane)
    pipe_mask.producer_acquire(state)
    with cute.arch.elect_one():
        cute.copy(bulk_atom, src, dst, mbar_ptr=pipe_mask.producer_get_barrier(state))
    state.advance()
    return state


def int32_gmem_ptr(base: cute.Tensor, offset: Int32, align: int):
    """An Int32 GMEM pointer ``offset`` elements past ``base``'s start, with an asserted alignment."""
    return cute.make_ptr(Int32, (base.iterator + offset).toint(), cute.AddressSpace.gmem, assumed_align=align)


def select_modes(t: cute.Tensor, modes: list[int]) -> cute.Tensor:
    """``t`` with its modes reordered (e.g. THD ``(rows, heads, d)`` -> ``(rows, d, heads)`` for TMA)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, modes))


__all__ = [
    "CONSUMER_FIELDS",
    "TASK_WORDS",
    "FwdPlanTensors",
    "Task",
    "apply_packed_predicate",
    "decode_task",
    "fetch_task",
    "int32_gmem_ptr",
    "load_payload_plane",
    "publish_task",
    "select_modes",
]
