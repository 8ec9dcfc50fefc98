"""Test helper (not a test module): the SM90 backward's launch order, as the kernel decides it and as
the host reckons it.

:class:`LaunchOrderProbe` is a one-warp kernel that calls the main kernel's own
``Sm90BwdKernel.launch_head_group`` and ``consumer_plan.staggered_row_ends`` on a backward view's
tensors and writes ``(kv heads at a time, staggered)``: every launch order gives the same bits, so
only a probe shows which one the kernel picked. :func:`host_stagger` counts the sampled pairs from the
view's tensors on the CPU, the probe's oracle (and the plan-contract tests' rule on the
benchmark masks).
"""

from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import torch
from cutlass import Int32

from flexattn_sm90.bwd_kernel import Sm90BwdKernel
from flexattn_sm90.bwd_launch import config_for_view
from flexattn_sm90.heuristics import select_bwd_config
from maskplan_kernels import compile_cache
from maskplan_kernels._cute_args import row_major, torch_stream
from maskplan_kernels.consumer_launch import bwd_view_args, gmem_ptr
from maskplan_kernels.consumer_plan import (
    STAGGER_PAIRS,
    bwd_plan_tensors,
    stagger_pair_row,
    staggered_row_ends,
)

#: the view's 12 plan pointers, then the probe's output
POINTERS = 13
#: mask_heads, k_rows, partial_nnz, full_nnz, batch, varlen, total_q, total_k, n_qblk, kv_heads
SIZES = 10


class LaunchOrderProbe:
    """One warp; thread 0 writes ``out[0]``: the kv heads ``kernel``'s launch order takes at a time,
    ``out[1]``: ``staggered_row_ends`` (0 or 1)."""

    def __init__(self, kernel: Sm90BwdKernel):
        self.kernel = kernel

    @cute.jit
    def __call__(
        self,
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
        out: cute.Pointer,
        mask_heads: Int32,
        k_rows: Int32,
        partial_nnz: Int32,
        full_nnz: Int32,
        batch: Int32,
        varlen: Int32,
        total_q: Int32,
        total_k: Int32,
        n_qblk: Int32,
        kv_heads: Int32,
        stream: cuda.CUstream,
    ):
        k = self.kernel
        plan = bwd_plan_tensors(
            mask_block_cnt, mask_block_offset, mask_block_idx, mask_block_masks,
            full_block_cnt, full_block_offset, full_block_idx, dq_write_order, dq_write_order_full,
            sequence_desc, k_row_batch, q_block_begin,
            mask_heads=mask_heads, k_rows=k_rows, partial_nnz=partial_nnz, full_nnz=full_nnz,
            batch=batch, varlen=varlen, total_q=total_q, total_k=total_k,
            block=(k.tile_m, k.tile_n), plane=k.payload_plane,
        )  # fmt: skip
        self.probe(plan, row_major(out, 2), n_qblk, kv_heads).launch(
            grid=[1, 1, 1], block=[32, 1, 1], stream=stream
        )

    @cute.kernel
    def probe(self, plan, m_out: cute.Tensor, n_qblk: Int32, kv_heads: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        group = self.kernel.launch_head_group(plan, n_qblk, kv_heads)
        staggered = Int32(staggered_row_ends(plan))
        if tidx == 0:
            m_out[0] = group
            m_out[1] = staggered


@functools.cache
def compile_probe(head_dim_qk: int, head_dim_v: int, deterministic: bool):
    """The compiled probe of the launch-order rule of the backward kernel for these head dims and
    mode (no GPU needed: placeholder pointers). Compiled once per process, not through the on-disk
    cache, whose key would not cover this module."""
    kernel = Sm90BwdKernel(
        select_bwd_config(head_dim_qk=head_dim_qk, head_dim_v=head_dim_v, dtype="bfloat16"),
        deterministic=deterministic,
    )
    ptr = gmem_ptr(Int32)
    args = (*(ptr,) * POINTERS, *(Int32(1),) * SIZES, cute.runtime.make_fake_stream())
    return cute.compile(
        LaunchOrderProbe(kernel), *args, options=f"--gpu-arch sm_90a {compile_cache.CALL_OPTIONS}"
    )


def probe_launch_order(view, *, deterministic: bool, device: torch.device) -> tuple[int, int]:
    """``(kv heads at a time, staggered)`` as the main kernel decides them for backward ``view``."""
    config = config_for_view(view)
    compiled = compile_probe(config.head_dim_qk, config.head_dim_v, deterministic)
    prep = bwd_view_args(view, device)
    g = view.geometry
    out = torch.full((2,), -1, dtype=torch.int32, device=device)
    compiled(
        *prep.pointers, out.data_ptr(), prep.mask_heads, prep.k_rows, prep.partial_nnz, prep.full_nnz,
        prep.batch, prep.varlen, g.total_q, g.total_k, prep.n_qblk, g.num_heads_kv, torch_stream(device),
    )  # fmt: skip
    group, staggered = out.tolist()
    return group, staggered


def host_stagger(view) -> tuple[int, int]:
    """``consumer_plan.staggered_row_ends`` on the host, from the view's tensors: ``(staggered,
    pairs)`` over the sampled pairs of adjacent K rows of one sample that both visit a Q block
    (mask head 0)."""
    k_row_batch = bwd_view_args(view, torch.device("cpu")).tensors[10].tolist()
    t = {name: view.tensors[name].cpu().to(torch.int64) for name in view.tensors}

    def last_q_block(row):
        ends = [-1]
        for kind in ("mask", "full"):
            cnt, off = int(t[f"{kind}_block_cnt"][0, row]), int(t[f"{kind}_block_offset"][0, row])
            ends += t[f"{kind}_block_idx"][off : off + cnt].tolist()
        return max(ends)

    k_rows = len(k_row_batch)
    rows = [stagger_pair_row(p, k_rows) for p in range(STAGGER_PAIRS)]
    rows = [r for r in rows if r + 1 < k_rows and k_row_batch[r] == k_row_batch[r + 1]]
    ends = [(last_q_block(r), last_q_block(r + 1)) for r in rows]
    ends = [(lower, upper) for lower, upper in ends if min(lower, upper) >= 0]
    return sum(lower != upper for lower, upper in ends), len(ends)


__all__ = ["LaunchOrderProbe", "compile_probe", "host_stagger", "probe_launch_order"]
