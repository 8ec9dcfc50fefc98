"""The SM90 backward's launch order: which kv heads its item order takes at a time.

Item order (tickets ``0 .. Hkv x s x K rows - 1`` for ``s`` items per K row and kv head,
``maskplan_kernels.kv_head_split``; ``consumer_k2q.grouped_launch_slot``; "heads" below are the
items' kv heads)::

    ATOMIC_HEAD_GROUP = 2:  (row 0, h0) (row 0, h1) (row 1, h0) (row 1, h1) ... (row 0, h2) ...

Atomic mode takes ``consumer_k2q.ATOMIC_HEAD_GROUP`` kv heads at a time. One head at a time
(K rows first) left a tail: on causal masks a sample's longest K rows come first, so the last
head's second sample started its longest CTAs in the last waves (a list-scheduling model of 132
SMs: 5.6% past the ideal finish for MHA, 11% for GQA 32/8, whose CTAs walk 4 heads). Two heads at
a time fill the waves with half-length rows in between (model: 0.1-0.6%) while each wave's CTAs
still share few heads' Q and dO in L2; all heads at a time spread them over every head and lost
more in L2 than it gained (benchmarks/RESULTS.md, session 18). Except on sparse K2Q rows
(documents, sliding windows: ``consumer_k2q.atomic_head_group``), where a wave over all heads
still fits L2 and all heads at a time measured 3-5% faster on documents (session 19); from (192,
128) on it does not, and those rows take ``SPARSE_HEAD_CAP`` heads (``launch_head_group``).

Deterministic mode: :meth:`LaunchOrder.launch_head_group`.

How many items a K block makes per kv head: ``maskplan_kernels.kv_head_split`` (shared with SM100).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from maskplan_kernels.consumer_k2q import (
    SPARSE_ROW_FILL,
    atomic_head_group,
    staggered_row_ends,
    view_row_fill,
)
from maskplan_kernels.consumer_plan import BwdPlanTensors


class LaunchOrder:
    """Mixin of :class:`flexattn_sm90.bwd_kernel.Sm90BwdKernel`: the kv heads its item order takes at
    a time, from the kernel's mode (``self.deterministic``) and the L2 footprint of its Q blocks."""

    #: kv heads the deterministic item order takes at a time on dense K2Q rows (launch_head_group)
    DENSE_HEAD_GROUP = 2
    #: K2Q row fill (consumer_k2q.k2q_row_fill) from which the rows count as dense
    DENSE_ROW_FILL = 0.75
    #: atomic mode on sparse K2Q rows: all kv heads at a time while a Q block's Q, dO and fp32 dQ
    #: take at most SPARSE_ALL_HEADS_BYTES, else SPARSE_HEAD_CAP heads (launch_head_group)
    SPARSE_ALL_HEADS_BYTES = 64 * 1024
    SPARSE_HEAD_CAP = 4
    #: deterministic mode: HALF_FULL_HEAD_CAP heads at a time on half-full K2Q rows (causal's) where
    #: a Q block takes DET_CAP_BYTES or more, SPARSE_HEAD_CAP on sparse or half-full ones with
    #: staggered ends (sliding windows') where it takes STAGGER_CAP_BYTES or more (launch_head_group)
    DET_CAP_BYTES = 128 * 1024
    HALF_FULL_HEAD_CAP = 8
    STAGGER_CAP_BYTES = 88 * 1024

    @staticmethod
    def q_block_bytes(config) -> int:
        """What every step streams through L2 per Q block: its Q, dO and fp32 dQ."""
        return config.tile_m * (6 * config.head_dim_qk + 2 * config.head_dim_v)

    @classmethod
    def mirrors_sparse_rows(cls, config) -> bool:
        """Whether deterministic mode takes the mirrored order on sparse K2Q rows
        (``consumer_k2q.walk_row``; ``launch_head_group`` then takes atomic mode's heads): where a Q
        block takes STAGGER_CAP_BYTES or more, (192, 128) and (256, 256). There, on an H100 (fwd+bwd,
        B=2, S=8192, 16 heads, device TFLOP/s, plan order -> mirrored): documents 319 -> 350 and
        291 -> 321-323, sliding-1024 401 -> 413 and 347 -> 369-371; at D = 128 it lost 2-4%
        (documents 381 -> 372, sliding-1024 448 -> 431), as did atomic mode (documents -3% at
        (256, 256), -5% at D = 128; RESULTS.md, session 70)."""
        return cls.q_block_bytes(config) >= cls.STAGGER_CAP_BYTES

    def init_launch_order(self, q_block_bytes: int) -> None:
        """Set the caps from what every step streams through L2 per Q block (its Q, dO and fp32 dQ)."""
        self.sparse_heads = self.SPARSE_HEAD_CAP if q_block_bytes > self.SPARSE_ALL_HEADS_BYTES else 0
        self.det_capped_heads = self.HALF_FULL_HEAD_CAP if q_block_bytes >= self.DET_CAP_BYTES else 0
        self.det_stagger_heads = self.SPARSE_HEAD_CAP if q_block_bytes >= self.STAGGER_CAP_BYTES else 0

    @cute.jit
    def launch_head_group(self, plan: BwdPlanTensors, n_qblk: Int32, kv_heads: Int32) -> Int32:
        """Kv heads the item order (tickets, ``decode_work``) takes at a time. Atomic mode:
        ``consumer_k2q.atomic_head_group``, all heads on sparse K2Q rows only while a Q block
        (its Q, dO and fp32 dQ) takes at most ``SPARSE_ALL_HEADS_BYTES``, so up to D = 128. With
        larger blocks a wave over all heads no longer fits L2: (256, 256) fwd+bwd on sliding-1024
        (16 heads, S = 8192) had its main kernel at 39% DRAM throughput and a 76% L2 hit rate
        (cuDNN's: 18%, 88%); ``SPARSE_HEAD_CAP`` heads at a time measured +7-9% there, +2% on
        documents, and at (192, 128) +3-4% / -1-0% (D = 128: -3% on documents; RESULTS.md,
        session 31). Deterministic mode: ``DENSE_HEAD_GROUP`` on dense K2Q rows (``k2q_row_fill``
        of ``DENSE_ROW_FILL`` or more), ``det_capped_heads`` where set on half-full rows and
        ``det_stagger_heads`` where set on sparse or half-full rows with staggered ends (below),
        else all of them.
        With all heads, a wave of resident CTAs holds ~8 K blocks per head, each streaming its
        head's Q, dO and dQ blocks: on dense rows that is every head's whole Q range per wave,
        which spilled from L2 ((192, 128) random-5: DRAM 56% busy, the dQ writers' adds slowed,
        0.66 of atomic). On an H100, random-5 fwd+bwd in deterministic mode at (256, 256) ran at
        162 TFLOP/s over 4 heads at a time, 217 over 1 and 232 over 2 (atomic: 239); at D = 128
        297 / 287 / 297 (atomic 307), at (192, 128) 262 over 4 and 260 over 2 (session 53,
        RESULTS.md). Fewer heads at a time share those blocks among more CTAs but make longer
        turnstile chains, which costs where a K block's walk is short (document masks: 269 -> 218
        TFLOP/s at 4 heads; at (256, 256) 318 -> 215, so deterministic mode does not take the
        atomic cap on sparse rows whose ends are aligned). Measured: benchmarks/RESULTS.md,
        sessions 14 and 31. A document's K rows end together at its last Q block, so walking down
        they reach each Q block at the same step and queue on its turnstile, which their short
        walks do not amortise; a sliding window's rows end staggered
        (``consumer_k2q.staggered_row_ends``) and reach each Q block in ``dq_write_order``. At
        (256, 256) the queue is the whole loss: deterministic mode's order with atomic adds ran
        documents at atomic speed (358 against 362 TFLOP/s; turnstiles 315), and atomic mode with
        this order lost nothing (358; H200, session 67). From (192, 128) on, sparse rows take the
        mirrored order instead (:meth:`mirrors_sparse_rows`), which reaches a document's Q blocks
        one writer per step, with atomic mode's heads: over all 16 heads it ran documents at 219
        TFLOP/s at (256, 256), over 4 at 321-323 (plan order: 291; session 70).
        Where ``det_capped_heads`` is set ((256, 256), 128 KB Q blocks), half-full rows (causal's)
        take that many heads, and where ``det_stagger_heads`` is (also (192, 128)'s 88 KB blocks)
        sparse rows with staggered ends do: on an H100 at (256, 256), causal fwd+bwd ran at 312
        TFLOP/s over all 16 heads and 415 over 4, sliding-1024 at 268 and 347, documents at 291
        and 202 (session 50); causal at 423 and 421 over 8 against 415 and 413 over 4 in two
        rounds, 359 over 2 (sliding-1024: 351 and 351 over 8, 346 and 346 over 4, 326 over 2);
        at (192, 128) sliding-1024 at 370 over 16 heads and 395 over 4 (atomic 406), causal at
        504 and 485 over 4, so half-full rows keep all heads there (session 53). Half-full rows
        with staggered ends (windows of about half the sample: sliding-4096 at S = 8192) take
        ``det_stagger_heads`` before ``det_capped_heads``: at (256, 256) 358 TFLOP/s over 8 heads,
        417 over 4 (atomic 461), causal unchanged; at (192, 128) 467 over 16, 498 over 4 (atomic
        521; session 66, H100); not timed: (192, 128) causal, whose half-full rows now also take the
        ``staggered_row_ends`` sample (and keep all heads). Any order gives the same bits
        (dq_write_order fixes the adds)."""
        if const_expr(not self.deterministic or self.mirrored):  # mirrored: sparse rows, as atomic's
            return atomic_head_group(plan, n_qblk, kv_heads, self.sparse_heads)
        group = kv_heads
        fill = view_row_fill(plan, n_qblk)
        if fill >= self.DENSE_ROW_FILL:
            group = Int32(self.DENSE_HEAD_GROUP)
        else:
            if const_expr(self.det_capped_heads != 0):
                if fill >= SPARSE_ROW_FILL:
                    group = cutlass.min(kv_heads, Int32(self.det_capped_heads))
            if const_expr(self.det_stagger_heads != 0):  # sparse or half-full rows, staggered
                if staggered_row_ends(plan):
                    group = cutlass.min(kv_heads, Int32(self.det_stagger_heads))
        return group
