"""Time the CPU reference planner (``flexattn.create_mask_plan`` on CPU tensors).

    python benchmarks/bench_plan_cpu.py                  # or: python3 -m nox -s bench_cpu
    python benchmarks/bench_plan_cpu.py --repeats 5 --target sm90

Geometry (issue 2's target): B=2, S=8192, Hq=Hkv=16, D=128, bf16, Hmask=1, for four masks:
causal, sliding window (left 1024), packed documents (random lengths, fixed seed) and a random
5-endpoint mask (nfunc=5, random sorted endpoints per row, fixed seed); each planned forward-only
and with the backward (K2Q) view. Every configuration runs in a fresh child process so its peak
RSS growth is its own: ``ru_maxrss`` after the inputs exist vs after the builds. Prints ms per
build (median and min over ``--repeats`` after one warm-up build), bytes per view, peak RSS delta.
Issue 2 asks for under 2 s per build at this size; this script reports, it does not assert.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from masks_bench import PLAN_MASKS as MASKS  # noqa: E402
from masks_bench import plan_bench_mask  # noqa: E402


def rss_peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_one(args) -> dict:
    """Child process: one mask, one direction setting."""
    import torch

    import flexattn

    b, s, h, d = args.batch, args.seqlen, args.heads, args.headdim
    q = torch.empty(b, s, h, d, dtype=torch.bfloat16)
    k = torch.empty(b, s, h, d, dtype=torch.bfloat16)
    v = torch.empty(b, s, h, d, dtype=torch.bfloat16)
    endpoints, _ = plan_bench_mask(args.one, b, s, args.seed)
    backward = args.backward

    def build():
        return flexattn.create_mask_plan(endpoints, q, k, v, build_backward=backward, target=args.target)

    base = rss_peak_mib()
    plan = build()  # warm-up (first-call costs)
    times = []
    for _ in range(args.repeats):
        del plan
        t0 = time.perf_counter()
        plan = build()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = rss_peak_mib()
    views = {role: plan.view(role) for role in ("forward", "backward") if role != "backward" or backward}
    return {
        "mask": args.one,
        "backward": backward,
        "nfunc": int(endpoints.shape[1]),
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "bytes": {role: view.nbytes() for role, view in views.items()},
        "density": views["forward"].stats()["density"],
        "rss_delta_mib": peak - base,
        "threads": torch.get_num_threads(),
        "consumer": plan.consumer,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2, help="samples")
    p.add_argument("--seqlen", type=int, default=8192, help="tokens per sample")
    p.add_argument("--heads", type=int, default=16, help="heads (q and kv)")
    p.add_argument("--headdim", type=int, default=128, help="head dim")
    p.add_argument("--seed", type=int, default=0, help="of the random masks")
    p.add_argument("--repeats", type=int, default=3, help="timed builds per row (median)")
    p.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS)
    p.add_argument(
        "--target", default=None, choices=("reference", "sm90", "sm100"),
        help="plan for this consumer's layout (default: the reference consumer's)",
    )  # fmt: skip
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--backward", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_fwd_sm90 import require_positive  # lazily, as torch is here

    require_positive(p, batch=args.batch, seqlen=args.seqlen, heads=args.heads, headdim=args.headdim,
                     repeats=args.repeats)  # fmt: skip

    if args.one:
        print(json.dumps(run_one(args)))
        return 0

    print(
        f"CPU reference planner: B={args.batch} S={args.seqlen} Hq=Hkv={args.heads} D={args.headdim} bf16 "
        f"Hmask=1, {args.repeats} timed builds after 1 warm-up, one child process per row "
        f"(cores: {os.cpu_count()})",
        flush=True,
    )
    dense_mib = args.batch * args.seqlen * args.seqlen / 2**20
    header = (
        f"{'mask':<13}{'nfunc':>6} {'views':<9}{'median ms':>10}{'min ms':>9}{'fwd KiB':>10}"
        f"{'bwd KiB':>10}{'density':>9}{'peak RSS +MiB':>15}"
    )
    print(header)
    print("-" * len(header), flush=True)
    results = []
    for name in args.masks:
        for backward in (False, True):
            cmd = [sys.executable, __file__, "--one", name, "--batch", str(args.batch)]
            cmd += ["--seqlen", str(args.seqlen), "--heads", str(args.heads), "--headdim", str(args.headdim)]
            cmd += ["--seed", str(args.seed), "--repeats", str(args.repeats)]
            cmd += ["--backward"] if backward else []
            if args.target:
                cmd += ["--target", args.target]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                views = "fwd+bwd" if backward else "fwd"
                print(f"{name:<13} {views}: FAILED\n{proc.stderr[-2000:]}", flush=True)
                return 1
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(r)
            bwd_kib = f"{r['bytes']['backward'] / 1024:10.1f}" if backward else f"{'-':>10}"
            print(
                f"{name:<13}{r['nfunc']:>6} {'fwd+bwd' if backward else 'fwd':<9}{r['median_ms']:>10.1f}"
                f"{r['min_ms']:>9.1f}{r['bytes']['forward'] / 1024:>10.1f}{bwd_kib}{r['density']:>9.3f}"
                f"{r['rss_delta_mib']:>15.1f}",
                flush=True,
            )
    print(
        f"\nconsumer {results[0]['consumer']}, torch threads {results[0]['threads']}. "
        f"For scale: a dense bool [B*S, S] mask would be {dense_mib:.0f} MiB."
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
