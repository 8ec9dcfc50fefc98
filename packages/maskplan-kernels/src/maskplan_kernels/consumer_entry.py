"""Host entries of the attention kernels that consume a plan view (CuTe DSL): raw global pointers
plus int32 sizes, the project's launch convention (no size triggers a recompile), turned into the
row-major tensors and the plan's tensors (:class:`maskplan_kernels.consumer_plan.FwdPlanTensors`,
:class:`~maskplan_kernels.consumer_plan.BwdPlanTensors`) a kernel class's ``@cute.jit __call__``
takes. The same for every consumer: :class:`FwdHostEntry`, :class:`BwdHostEntry` and
:class:`DqPostprocessHostEntry`; :func:`thd_tensor` and :func:`rows_from` are the THD views they
and the kernels build.
"""

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ._cute_args import row_major
from .consumer_plan import (
    BwdPlanTensors,
    FwdPlanTensors,
    make_sequence_desc,
)


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
    :func:`maskplan_kernels.consumer_launch.fwd_placeholders` and ``ForwardIO.arguments``
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
    backward view's :class:`maskplan_kernels.consumer_plan.SequenceDesc` with Q columns only; the
    ``(B,)`` first padded Q block of each sample) for the class's ``@cute.kernel kernel(*those,
    *self.kernel_operands(), softmax_scale)``, one CTA of ``num_threads`` per (Q block, q head,
    sample).

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
    """The backward (K2Q) view's :class:`maskplan_kernels.consumer_plan.SequenceDesc` for the
    kernels around the main one (pre- and postprocess), which walk Q blocks and are not given the
    K sizes: Q columns and INNER_BLOCKS."""
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
    :meth:`io_head_dims`. A ``persistent`` kernel (one whose CTAs take (K row, kv head) items
    from :func:`maskplan_kernels.consumer_k2q.take_ticket`) also takes ``max_ctas`` (its grid is
    at most that) after ``plan``, and its ticket counter is the int32 after the turnstiles (the
    preprocess zeroes both). ``mdK`` / ``mdV`` have ``dkv_heads`` heads: Hkv, or, for a kernel whose
    items split each kv head's q heads (``BackwardCompiler.kv_head_split``), one per item of a K
    block, holding that item's part of dK / dV.
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
        dk: cute.Pointer,  # (total_k, dkv_heads, Dqk)  output, input dtype
        dv: cute.Pointer,  # (total_k, dkv_heads, Dv)  output
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
        dkv_heads: Int32,  # Hkv, or Hkv x a split of each kv head's q heads (launch_backward's kv_split)
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
            thd_tensor(dk, total_k, dkv_heads, dqk),
            thd_tensor(dv, total_k, dkv_heads, dv_),
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


__all__ = [
    "BwdHostEntry",
    "DqPostprocessHostEntry",
    "FwdHostEntry",
    "backward_q_desc",
    "bwd_plan_tensors",
    "thd_tensor",
]
