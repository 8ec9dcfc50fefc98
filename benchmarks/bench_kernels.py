"""Per-kernel GPU time of one step of each system, to see where a system's time goes.

    python benchmarks/bench_kernels.py [--mode fwd|train] [--dim 128] [--masks causal]
                                       [--systems flexattn,flexattn-det,cudnn,fa4-causal]
                                       [--steps 5] [--plain]

The same problem, masks, peers and options as ``bench_fwd_sm90.py``, at one length, writing no
files. Each system's step is warmed up 3 times, then ``--steps`` steps run under
``torch.profiler``; the table lists every GPU kernel (name cut to 100 characters) with its time per
step, largest first, and the sum. The profiler adds little to kernels of this length, but compare
kernels within one run. ``--plain`` runs the same steps without ``torch.profiler`` and prints
nothing per kernel: for an external profiler (Nsight Compute), which CUPTI cannot share.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fwd_sm90 import finish, inputs, make_parser, systems  # noqa: E402
from masks_bench import endpoint_mask  # noqa: E402


def warm_up(fn, steps: int = 3) -> None:
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()


def kernel_times(fn, steps: int) -> list[tuple[float, str]]:
    """``(ms per step, kernel name)`` of every GPU kernel ``fn`` launches, largest first."""
    warm_up(fn)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = [
        (e.self_device_time_total / steps / 1000, e.key)
        for e in prof.key_averages()
        if e.self_device_time_total > 0
    ]
    return sorted(rows, reverse=True)


def main() -> None:
    p = make_parser(__doc__.splitlines()[0], sweep=False)
    p.set_defaults(masks="causal", systems="flexattn,flexattn-det,cudnn,fa4-causal")
    p.add_argument("--steps", type=int, default=5, help="profiled steps per system")
    p.add_argument("--plain", action="store_true", help="no torch.profiler (run under ncu)")
    args = finish(p, p.parse_args())
    seqlen = args.seqlen
    torch.manual_seed(0)
    q, k, v = inputs(args, seqlen, args.mode == "train")
    for name in args.masks.split(","):
        endpoints = endpoint_mask(name, args.batch, seqlen)
        for system, fn in systems(args, q, k, v, name, endpoints).items():
            try:
                if args.plain:
                    warm_up(fn, 3 + args.steps)
                    print(f"{name} {system}: {3 + args.steps} steps run")
                    continue
                rows = kernel_times(fn, args.steps)
            except Exception as e:  # a peer failing must not hide the others' numbers
                print(f"{name} {system}: failed: {type(e).__name__}: {e}")
                continue
            print(f"{name} {system}: {sum(ms for ms, _ in rows):.3f} ms per step")
            for ms, kernel in rows:
                print(f"  {ms:8.3f}  {kernel[:100]}")


if __name__ == "__main__":
    main()
