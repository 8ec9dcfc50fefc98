"""Test helper (not a test module): the SM90 backward's launch order, as the kernel decides it and as
the host reckons it.

:class:`LaunchOrderProbe` is a one-warp kernel that calls the main kernel's own
``Sm90BwdKernel.launch_head_group`` and ``consumer_k2q.staggered_row_ends`` on a backward view's
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
from cutlass import Float32, Int32

from flexattn_sm90.bwd_kernel import Sm90BwdKernel
from flexattn_sm90.bwd_launch import COMPILER, config_for_view
from flexattn_sm90.heuristics import select_bwd_config
from maskplan_kernels import compile_cache
from maskplan_kernels._cute_args import torch_stream
from maskplan_kernels.consumer_k2q import STAGGER_PAIRS, stagger_pair_row, staggered_row_ends
from maskplan_kernels.consumer_launch import bwd_placeholders, bwd_view_args, cute_dtype
from maskplan_kernels.consumer_plan import BwdPlanTensors


class LaunchOrderProbe(Sm90BwdKernel):
    """The main kernel's host entry (``BwdHostEntry.from_pointers``: the same arguments, the same
    plan tensors) with a one-warp body in place of the main kernel's: thread 0 writes the kv heads
    its launch order takes at a time and ``staggered_row_ends`` (0 or 1) into the first two int32
    of ``dq_semaphore``."""

    @cute.jit
    def __call__(
        self, mQ, mK, mV, mdO, mdK, mdV, mLSE, mDsum, mdQaccum, mdQsem: cute.Tensor, plan: BwdPlanTensors,
        max_ctas: Int32, softmax_scale: Float32, stream: cuda.CUstream,
    ):  # fmt: skip
        out = cute.make_tensor(mdQsem.iterator, cute.make_layout(2))
        kv_heads = mdK.shape[1]  # the items' kv heads, as the main kernel takes them: THD (rows, heads, d)
        n_qblk = mdQsem.shape[1]
        self.probe(plan, out, n_qblk, kv_heads).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def probe(self, plan: BwdPlanTensors, out: cute.Tensor, n_qblk: Int32, kv_heads: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        group = self.launch_head_group(plan, n_qblk, kv_heads)
        staggered = Int32(staggered_row_ends(plan))
        if tidx == 0:
            out[0] = group
            out[1] = staggered


@functools.cache
def compile_probe(head_dim_qk: int, head_dim_v: int, deterministic: bool, mirrored: bool = False):
    """The compiled probe for the backward kernel of these head dims, mode and order, against the
    main kernel's placeholders (no GPU needed). Compiled once per process, not through the on-disk
    cache, whose key would not cover this module."""
    config = select_bwd_config(head_dim_qk=head_dim_qk, head_dim_v=head_dim_v, dtype="bfloat16")
    probe = LaunchOrderProbe(config, deterministic=deterministic, first_dq_stored=deterministic or mirrored,
                             mirrored=mirrored)  # fmt: skip
    args = bwd_placeholders("main", cute_dtype(torch.bfloat16))
    return cute.compile(
        probe.from_pointers, *args, options=f"--gpu-arch sm_90a {compile_cache.CALL_OPTIONS}"
    )


def probe_launch_order(view, *, deterministic: bool, device: torch.device) -> tuple[int, int]:
    """``(kv heads at a time, staggered)`` as the main kernel ``run_backward`` would build for
    backward ``view`` decides them (a bf16 view; the mirrored order where the compiler takes it).
    Arguments the probe does not read (q ... dq_accum) point at one small buffer."""
    config = config_for_view(view)
    prep = bwd_view_args(view, device)
    mirrored = COMPILER.mirrored(config, deterministic, prep.sparse_rows)
    compiled = compile_probe(config.head_dim_qk, config.head_dim_v, deterministic, mirrored)
    g = view.geometry
    unread = torch.zeros(64, dtype=torch.int32, device=device).data_ptr()
    out = torch.full((2,), -1, dtype=torch.int32, device=device)
    hq, hkv, dqk, dv = g.num_heads_q, g.num_heads_kv, config.head_dim_qk, config.head_dim_v
    strides = (hq * dqk, dqk, hkv * dqk, dqk, hkv * dv, dv, 0, 0, 0)  # THD q, k, v
    compiled(
        *(unread,) * 9, out.data_ptr(), *prep.pointers,
        g.total_q, g.total_k, hq, hkv, hkv, prep.mask_heads, prep.k_rows, prep.partial_nnz, prep.full_nnz,
        prep.batch, prep.n_qblk, prep.varlen, 1, *strides, 1.0, torch_stream(device),
    )  # fmt: skip
    group, staggered = out.tolist()
    return group, staggered


def host_stagger(view) -> tuple[int, int]:
    """``consumer_k2q.staggered_row_ends`` on the host, from the view's tensors: ``(staggered,
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
