"""Time attention on CPU tensors: flexattn's reference consumer against torch's SDPA, same run.

    python benchmarks/bench_attention_cpu.py [--seqlen 1024,4096] [--heads 4] [--dim 64] [--repeats 3]
                                             [--sample-len L]

The laptop case: a causal mask, B=1, fp32, forward and backward (``torch.autograd.grad`` of the
output's sum) timed separately for flexattn (plan built once, outside the timing) and together
for SDPA (``is_causal=True``, BHSD), median of ``--repeats`` after one warm-up. The reference walks
the plan tile by tile the way a kernel does (it is the GPU kernels' oracle), so it trails SDPA's
dense kernel; this shows by how much. ``--sample-len L``: the S tokens as varlen THD samples of L
tokens each, causal within each (SDPA: a batch of S / L samples), where a sample shorter than the
reference's 128 x 128 tiles leaves most of each tile outside it. Time it on an otherwise idle
machine.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

import flexattn
from flexattn import masks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fwd_sm90 import int_list, require_positive  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def one_length(
    seqlen: int, heads: int, dim: int, repeats: int, sample_len: int | None = None
) -> tuple[float, float, float]:
    """(flexattn forward, flexattn backward, SDPA forward + backward) in ms."""
    gen = torch.Generator().manual_seed(0)
    samples, length = (1, seqlen) if sample_len is None else (seqlen // sample_len, sample_len)
    q, k, v = (torch.randn(samples, length, heads, dim, generator=gen, requires_grad=True) for _ in range(3))
    if sample_len is None:
        plan = flexattn.create_mask_plan(masks.causal(seqlen), q, k, v)
        run = functools.partial(flexattn.flex_attn_func, q, k, v, mask_plan=plan)
    else:  # THD: the batch's rows, samples delimited by cu_seqlens
        cu = torch.arange(0, samples * length + 1, length, dtype=torch.int32)
        thd = [x.view(-1, heads, dim) for x in (q, k, v)]
        varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=length, max_seqlen_k=length)
        plan = flexattn.create_mask_plan(masks.causal(cu_seqlens_q=cu, cu_seqlens_k=cu), *thd, **varlen)
        run = functools.partial(flexattn.flex_attn_func, *thd, mask_plan=plan)
    out = run()
    fwd = median_ms(run, repeats)
    bwd = median_ms(lambda: torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True), repeats)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))

    def sdpa():
        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        torch.autograd.grad(o.sum(), (qt, kt, vt))

    return fwd, bwd, median_ms(sdpa, repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", default="1024,4096", help="tokens, or a sweep: 1024,4096")
    p.add_argument("--heads", type=int, default=4, help="heads")
    p.add_argument("--dim", type=int, default=64, help="head dim")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per system (median)")
    p.add_argument("--sample-len", type=int, default=None,
                   help="varlen samples of this many tokens (a divisor of every --seqlen)")  # fmt: skip
    args = p.parse_args()
    args.seqlen = int_list(p, "--seqlen", args.seqlen)
    require_positive(p, seqlen=args.seqlen, heads=args.heads, dim=args.dim, repeats=args.repeats,
                     sample_len=args.sample_len)  # fmt: skip
    if args.sample_len is not None and any(s % args.sample_len for s in args.seqlen):
        p.error(f"--sample-len {args.sample_len} must divide every --seqlen ({args.seqlen})")
    layout = "B=1" if args.sample_len is None else f"varlen samples of {args.sample_len}"
    print(f"CPU, {torch.get_num_threads()} threads, {layout} H={args.heads} D={args.dim} fp32, causal")
    print(f"{'S':>6} {'flexattn fwd ms':>16} {'flexattn bwd ms':>16} {'SDPA fwd+bwd ms':>16} {'ratio':>7}")
    for s in args.seqlen:
        fwd, bwd, dense = one_length(s, args.heads, args.dim, args.repeats, args.sample_len)
        print(f"{s:>6} {fwd:>16.1f} {bwd:>16.1f} {dense:>16.1f} {(fwd + bwd) / dense:>6.1f}x")


if __name__ == "__main__":
    main()
