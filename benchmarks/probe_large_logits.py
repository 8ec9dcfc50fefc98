"""Where huge logits break attention: flexattn against cuDNN's ``flex_attention`` and SDPA's backends.

    python benchmarks/probe_large_logits.py [--dtype bfloat16] [--systems flexattn,cudnn,sdpa]

Causal attention (B=1, S=256, H=2, D=64) on three inputs whose scaled scores reach far past fp32's
exponent range once multiplied out: randn q, k, v at ``softmax_scale`` 1e8 and 1e30, and PyTorch issue
121558's q = k = v = 133120 at the default scale. Prints, per input and system, the non-finite
outputs and the all-zero output rows. A kernel that forms ``s * c - max * c`` in one fused
multiply-add keeps the rounding of ``max * c`` in the exponent (README, "Huge logits"); the CPU
reference and a separate multiply and add stay finite. A numerics probe: it reports, asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import flexattn
from flexattn import masks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fwd_sm90 import known_names, require_cuda  # noqa: E402

SYSTEMS = ("flexattn", "cudnn", "sdpa")

INPUTS = (
    ("randn, scale 1e8", None, 1e8),
    ("randn, scale 1e30", None, 1e30),
    ("q=k=v=133120", 133120.0, None),
)
B, S, H, D = 1, 256, 2, 64


def _report(label: str, system: str, out: torch.Tensor) -> None:
    out = out.float()
    nonfinite = int((~torch.isfinite(out)).sum())
    zero_rows = int((out.abs().sum(-1) == 0).sum())
    print(
        f"{label:20s} {system:24s} non-finite {nonfinite:6d} / {out.numel()}   zero rows {zero_rows}",
        flush=True,
    )


def _interval_systems(names: list[str]) -> list:
    systems = [flexattn] if "flexattn" in names else []
    if "cudnn" in names:
        try:
            import cudnn.flex_attention as cfa
        except ImportError:
            print("cudnn: cuDNN's frontend is not installed, skipped")
        else:
            systems.append(cfa)
    return systems


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"of {', '.join(SYSTEMS)}")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu runs flexattn's reference (and SDPA's math)")  # fmt: skip
    args = p.parse_args()
    names = known_names(p, "--systems", args.systems, SYSTEMS)
    if args.device == "cuda":
        require_cuda(p.prog)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    for label, fill, scale in INPUTS:
        if fill is not None and fill > torch.finfo(dtype).max:
            print(f"{label:20s} skipped: {fill:g} is past {args.dtype}'s largest value")
            continue
        if fill is None:
            q, k, v = (torch.randn(B, S, H, D, generator=gen).to(args.device, dtype) for _ in range(3))
        else:
            q = k = v = torch.full((B, S, H, D), fill, dtype=dtype, device=args.device)
        mask = masks.causal(S, batch=B, device=args.device)
        for lib in _interval_systems(names):
            plan = lib.create_mask_plan(mask, q, k, v)
            out = lib.flex_attn_func(q, k, v, mask_plan=plan, softmax_scale=scale)
            _report(label, lib.__name__, out[0] if isinstance(out, tuple) else out)
        if "sdpa" in names:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            # named, not iterated: SDPBackend is a pybind11 enum, which torch 2.11 cannot iterate
            gpu = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
            backends = [SDPBackend.MATH] if args.device == "cpu" else [*gpu, SDPBackend.MATH]
            for backend in backends:
                try:
                    with sdpa_kernel(backend):
                        o = torch.nn.functional.scaled_dot_product_attention(
                            *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, scale=scale
                        )
                except RuntimeError as e:  # a backend that does not take this problem
                    print(f"{label:20s} sdpa {backend.name}: not run ({str(e).splitlines()[0][:80]})")
                    continue
                _report(label, f"sdpa {backend.name}", o.transpose(1, 2))


if __name__ == "__main__":
    main()
