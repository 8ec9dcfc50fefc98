"""Host time of flex_attn_func per call on an SM90 GPU: forward, forward + backward (the backward
on autograd's device thread, as torch runs it, and on the calling thread), and a cProfile of the
Python behind forward + backward.

    python benchmarks/bench_host.py [--mask sliding-1024] [--calls 200] [--top 40]

B=2, S=8192, H=16, D=128, bf16, one plan with backward views. Calls are issued while the GPU runs
a sleep that outlasts them, so the times are the host's alone. A model's backward pass hands over
to autograd's device thread once, not once per attention call: the difference between the two
forward + backward figures is that handover, which ``bench_fwd_sm90.py --mode train``'s ``host ms``
(one ``torch.autograd.grad`` per call) includes for every system.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fwd_sm90 import known_names, require_cuda  # noqa: E402
from masks_bench import MASK_FORMS, MASKS, endpoint_mask  # noqa: E402

import flexattn  # noqa: E402

B, S, H, D = 2, 8192, 16, 128
#: GPU sleep ahead of the timed calls (cycles at about 2 GHz): longer than issuing them takes
SLEEP_CYCLES = 800_000_000


def behind_sleep(fn, calls: int) -> float:
    """Seconds the host takes to issue ``calls`` calls of ``fn`` behind a GPU sleep; raises where
    the sleep ended first (the calls may then have waited for the GPU)."""
    torch.cuda._sleep(SLEEP_CYCLES)
    slept = torch.cuda.Event()
    slept.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    if slept.query():
        raise RuntimeError(f"the GPU sleep ended before {calls} calls were issued: ask for fewer --calls")
    torch.cuda.synchronize()
    return elapsed


def host_ms(fn, calls: int) -> float:
    """Milliseconds of host time per call of ``fn``, issued behind a GPU sleep."""
    return behind_sleep(fn, calls) / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mask", default="sliding-1024", help=f"one of {'; '.join(MASK_FORMS)}")
    p.add_argument("--calls", type=int, default=200, help="calls per timing and in the profile")
    p.add_argument("--top", type=int, default=40, help="profile rows printed per ordering")
    args = p.parse_args()
    known_names(p, "--mask", args.mask, MASKS)
    require_cuda(p.prog)
    q, k, v = (
        torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "qkv"
    )
    plan = flexattn.create_mask_plan(endpoint_mask(args.mask, B, S), q, k, v, build_backward=True)
    dout = torch.randn_like(q)

    def forward():
        return flexattn.flex_attn_func(q, k, v, mask_plan=plan)

    def step():
        return torch.autograd.grad(forward(), (q, k, v), dout)

    for _ in range(20):  # compiles, warms the caches
        step()
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()}  B={B} S={S} H={H} D={D} bf16 {args.mask}")
    print(f"host ms per call: forward {host_ms(forward, args.calls):.3f}, "
          f"forward + backward {host_ms(step, args.calls):.3f}", end="")  # fmt: skip
    with torch.autograd.set_multithreading_enabled(False):
        print(f", forward + backward on the calling thread {host_ms(step, args.calls):.3f}")
        profile = cProfile.Profile()  # profiles its own thread only: the backward runs there now

        def profiled():
            profile.enable()
            step()
            profile.disable()

        behind_sleep(profiled, args.calls)
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(args.top)
        print(text.getvalue())


if __name__ == "__main__":
    main()
