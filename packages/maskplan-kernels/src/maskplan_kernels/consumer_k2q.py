"""Device side of a backward (K2Q) plan view, for the K-major main kernels (CuTe DSL, inlined).

A CTA (or a persistent kernel's item, from :func:`take_ticket`) owns one K block and kv head
(:func:`decode_work`), in the launch order of :func:`grouped_launch_slot`, taking a number of kv
heads at a time that the K2Q row fill decides (:func:`k2q_row_fill`, :func:`atomic_head_group`; SM90
also :func:`staggered_row_ends`). For each of the ``G = Hq / Hkv`` q heads sharing the kv head
(:func:`head_range`; a kernel that splits each kv head's q heads over ``s`` items,
``consumer_launch.launch_backward``, passes the items' ``Hkv * s`` kv heads and ``G / s``)::

    h = q_head if Hmask > 1 else 0
    partial Q blocks: mask_block_idx[mask_block_offset[h, row] + [0, mask_block_cnt[h, row])]
    full Q blocks:    full_block_idx[full_block_offset[h, row] + [0, full_block_cnt[h, row])]

walked merged by Q block (:func:`walk_row`), descending, or ascending in a kernel that launches
its K rows descending (the *mirrored* order, whose ranks are
``consumer_launch.mirrored_view_args``'). Each step's dQ goes to the (q head, Q block)
accumulator through :mod:`maskplan_kernels.consumer_dq`.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .consumer_plan import (
    BwdPlanTensors,
    desc_field,
    element_ptr,
)
from .geometry import (
    DESC_K_LEN,
    DESC_K_OFFSET,
    DESC_Q_OFFSET,
    DESC_ROW_BEGIN,
)


class Work(NamedTuple):
    """The CTA's K block (runtime Int32 values)."""

    row: Int32  # K plan row
    n_block: Int32  # sample-local K block
    kv_head: Int32
    q_offset: Int32
    k_offset: Int32
    k_valid: Int32  # keys of this block inside the sample
    qblk_base: Int32  # global Q block of the sample's block 0
    q_per_kv: Int32  # G = Hq / Hkv (of the items' kv heads)
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


def grouped_launch_slot(
    launch: Int32, kv_heads: Int32, k_rows: Int32, group: Int32, rows_descending: bool = False
) -> tuple[Int32, Int32]:
    """``(K row, kv head)`` of the ``launch``-th CTA (in launch order; a persistent kernel's
    ``launch``-th ticket, :func:`take_ticket`) when the launch order takes
    ``group`` kv heads at a time, K rows ascending within a group (descending with
    ``rows_descending``: row ``R - 1 - r`` for ``r``), heads ascending within a row::

        kv_heads = 5, group = 2:   launch  0 1 2 3 ..      2R 2R+1 ..      4R   4R+1 ..
                                   (row, head) (0,0) (0,1) (1,0) (1,1) .. (0,2) (0,3) .. (0,4) (1,4) ..

    ``group >= kv_heads`` is heads-major order, ``group == 1`` rows-major. Every CTA of a head
    launches (or is taken) after the CTAs of the same head with lower K rows (higher ones with
    ``rows_descending``), which the turnstiles need to never wait on a CTA not yet resident: a
    writer waits only on the ranks below its own (deterministic mode on all of them, a kernel that
    stores the first contribution on rank 0's store), and the ranks ascend with the K block in
    ``dq_write_order`` and descend in ``consumer_launch.mirrored_view_args``, whose order launches
    rows descending.
    A plain function of integers, so that it also runs on the CPU (its test)."""
    span = group * k_rows
    first = launch // span * group
    heads = cutlass.min(group, kv_heads - first)
    within = launch - first * k_rows
    row = within // heads
    if rows_descending:
        row = k_rows - 1 - row
    return row, first + within % heads


@cute.jit
def decode_work(
    plan: BwdPlanTensors,
    q_per_kv: Int32,
    tile_n: cutlass.Constexpr[int],
    kv_heads: Int32,
    head_group: Int32,
    splits: cutlass.Constexpr[int] = 1,
    ticket: Int32 | None = None,
    rows_descending: cutlass.Constexpr[bool] = False,
) -> Work:
    """The CTA's K block from its block index ``x`` in a 1-D grid of ``splits * kv_heads * K rows`` CTAs
    (:func:`launch_grid`), or from ``ticket`` (:func:`take_ticket`) in a persistent kernel: launch
    slot ``x // splits`` is ``(K row, kv head)`` in the order of :func:`grouped_launch_slot`, taking
    ``head_group`` kv heads at a time (ascending K rows per head, descending with
    ``rows_descending``, so the writers of a Q block run in the order of their ranks, which the
    turnstiles need). The ``splits`` CTAs of one K block (a kernel splitting
    its outputs' head dim, or a cluster along K) are adjacent in x, so they launch together. Grid x
    holds 2^31 - 1 CTAs (grid y only 65535)."""
    x = Int32(0)
    if const_expr(ticket is None):
        x, _, _ = cute.arch.block_idx()
    else:
        x = ticket
    row, kv_head = grouped_launch_slot(
        x // splits, kv_heads, cute.size(plan.k_row_batch), head_group, rows_descending
    )
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
    ``dq_semaphore`` (:class:`maskplan_kernels.consumer_entry.BwdHostEntry`; the preprocess zeroes
    it), as a one-element tensor."""
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
    return row_range(plan, h, work.row, q_head)


@cute.jit
def row_range(plan: BwdPlanTensors, h: Int32, row: Int32, q_head: Int32) -> HeadRange:
    """The partial and full K2Q ranges of K row ``row`` of mask head ``h``, for q head ``q_head``."""
    return HeadRange(
        q_head,
        plan.mask_block_cnt[h, row],
        plan.mask_block_offset[h, row],
        plan.full_block_cnt[h, row],
        plan.full_block_offset[h, row],
    )


class WalkStep(NamedTuple):
    """One entry of :func:`walk_row` (runtime Int32 values)."""

    partial: Int32  # 1: a partial entry (payload, dq_write_order); 0: a full one
    entry: Int32  # index into the partial or the full arrays
    q_block: Int32  # sample-local Q block
    partial_left: Int32  # entries of each list still to walk after this one
    full_left: Int32


@cute.jit
def walk_row(
    plan: BwdPlanTensors, hr: HeadRange, partial_left: Int32, full_left: Int32,
    descending: cutlass.Constexpr[bool] = True,
) -> WalkStep:  # fmt: skip
    """The next entry of the merged walk over a K row's partial and full lists by DESCENDING Q block
    (ascending where ``descending`` is False; start with ``partial_left, full_left =
    hr.partial_cnt, hr.full_cnt``; each list is ascending, so the next entry is the larger of the
    two lists' last unwalked ones, or the smaller of their first; a Q block is in one list).

    Why descending, with K rows launched ascending: every K block of a causal, sliding-window or
    document mask sees its sample's Q blocks up to the same or a later last one than the K block
    below it, so walking down from the last, a CTA reaches each Q block no earlier than the lower
    K block's CTA (started before it) does, and ``dq_write_order`` adds a Q block's contributions
    by ascending K block: the turnstiles rarely wait. Partial-then-full visits a sliding window's
    trailing-edge blocks first and waits for a whole chain of CTAs. Except where the rows end
    together and are short (documents): the CTAs of one document, started together, reach its last
    Q block at the same step and queue there. The mirrored order (K rows launched descending, walks
    ascending, ranks by descending K block: ``consumer_launch.mirrored_view_args``) reaches Q
    block ``i`` from K block ``j`` at step ``i - j`` of a document's (or causal's, or a window's)
    walks: the writers of a Q block arrive one step apart, the highest first."""
    # each list's candidate: its last unwalked entry (descending) or its first (ascending)
    if const_expr(descending):
        p, f, none = partial_left - 1, full_left - 1, Int32(-1)  # none: before every Q block
    else:
        p, f, none = hr.partial_cnt - partial_left, hr.full_cnt - full_left, Int32(2**31 - 1)
    m_p = none
    m_f = none
    if partial_left > 0:
        m_p = plan.mask_block_idx[hr.partial_off + p]
    if full_left > 0:
        m_f = plan.full_block_idx[hr.full_off + f]
    take_p = Int32(m_p > m_f) if const_expr(descending) else Int32(m_p < m_f)
    return WalkStep(
        take_p,
        take_p * (hr.partial_off + p) + (1 - take_p) * (hr.full_off + f),
        cutlass.max(m_p, m_f) if const_expr(descending) else cutlass.min(m_p, m_f),
        partial_left - take_p,
        full_left - (1 - take_p),
    )


@cute.jit
def k_row_last_q_block(plan: BwdPlanTensors, row: Int32) -> Int32:
    """The last Q block K row ``row`` of mask head 0 visits (-1 where it visits none)."""
    hr = row_range(plan, Int32(0), row, Int32(0))
    return walk_row(plan, hr, hr.partial_cnt, hr.full_cnt).q_block


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
    document's last Q block, causal's at the sample's. Up to 14 loads a pair (224 in all), once
    per CTA; their cost is not measured."""
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


__all__ = [
    "ATOMIC_HEAD_GROUP",
    "SPARSE_ROW_FILL",
    "STAGGER_PAIRS",
    "STAGGER_RUN",
    "HeadRange",
    "WalkStep",
    "Work",
    "atomic_head_group",
    "decode_work",
    "grouped_launch_slot",
    "head_range",
    "k_row_last_q_block",
    "k2q_row_fill",
    "launch_grid",
    "row_range",
    "stagger_pair_row",
    "staggered_row_ends",
    "take_ticket",
    "ticket_counter",
    "total_steps",
    "view_row_fill",
    "walk_row",
]
