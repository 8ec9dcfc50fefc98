"""The SM90 forward's consumer main-loop schedules side by side, with cuDNN flex_attention, in one run.

    python benchmarks/bench_fwd_schedules.py [--dims 128[,64,256]] [--schedules simple,overlap]
                                             [--masks causal,sliding-1024,document,random-5]
                                             [--seqlen 8192] [--batch 2] [--heads 16]

Each schedule runs the same plan through ``flexattn_sm90.fwd_launch.run_forward(schedule=...)``;
two rounds alternate the systems so drift reaches all of them, and the better round counts.
Prints TFLOP/s (visible elements, as ``bench_fwd_sm90.py``) and the largest output difference
between schedules (they order the same floating-point operations: it is 0).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fwd_sm90 import known_names, require_cuda, timed  # noqa: E402
from masks_bench import MASK_FORMS, MASKS, endpoint_mask, visible_pairs  # noqa: E402

import flexattn  # noqa: E402
from flexattn_sm90.fwd_launch import run_forward  # noqa: E402


def systems(endpoints, q, k, v, schedules) -> dict:
    """name -> zero-argument callable: each schedule on one plan (THD views of q/k/v), and cuDNN."""
    b, s, h, d = q.shape
    qt, kt, vt = (t.reshape(b * s, h, d) for t in (q, k, v))
    scale = 1 / math.sqrt(d)
    view = flexattn.create_mask_plan(endpoints, q, k, v).view("forward")
    fns = {
        sch: lambda sch=sch: run_forward(view, qt, kt, vt, softmax_scale=scale, schedule=sch)[0]
        for sch in schedules
    }
    try:
        from cudnn import flex_attention as cfa

        cplan = cfa.create_mask_plan(endpoints, q, k, v)
        fns["cudnn"] = lambda: cfa.flex_attn_func(q, k, v, mask_plan=cplan, softmax_scale=scale)
    except ImportError as e:
        print(f"  cudnn flex_attention unavailable: {e}")
    return fns


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default="128")
    p.add_argument("--schedules", default="simple,overlap")
    p.add_argument(
        "--masks", default="causal,sliding-1024,document,random-5", help=f"of {'; '.join(MASK_FORMS)}"
    )
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    args = p.parse_args()
    known_names(p, "--masks", args.masks, MASKS)
    require_cuda(p.prog)
    schedules = args.schedules.split(",")
    b, s, h = args.batch, args.seqlen, args.heads
    print(f"{torch.cuda.get_device_name()}  B={b} S={s} H={h} bf16, TFLOP/s")
    for d in (int(x) for x in args.dims.split(",")):
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for name in args.masks.split(","):
            endpoints = endpoint_mask(name, b, s)
            flops = 4 * d * visible_pairs(endpoints) * h
            fns = systems(endpoints, q, k, v, schedules)
            best: dict[str, float] = {}
            for _ in range(2):
                for system, fn in fns.items():
                    best[system] = min(best.get(system, math.inf), timed(fn))
            outs = [fns[sch]().float() for sch in schedules if sch in fns]
            diff = max(((o - outs[0]).abs().max().item() for o in outs), default=0.0)
            cols = "  ".join(f"{system} {flops / ms / 1e9:6.1f}" for system, ms in best.items())
            print(f"D={d:<3d} {name:13s} {cols}   max|diff| {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
