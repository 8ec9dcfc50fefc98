"""First-call latency of a fresh process: flexattn (cold and warm on-disk compile cache) next to
cuDNN ``flex_attention``, each run twice in its own child process.

    python benchmarks/bench_first_call.py [--seqlen 4096] [--batch 2] [--heads 16] [--dim 128]
                                          [--systems flexattn,cudnn]

A child process times, after its imports: the first plan build (with backward views), the first
forward, then the first backward (``torch.autograd.grad``), each synchronised. flexattn's runs
share one fresh cache directory, so its first run compiles every kernel and its second loads them
from disk; cuDNN's runs use whatever caching cuDNN does itself. Imports are timed separately:
importing torch, CuTe DSL or cuDNN is a per-process cost that no kernel cache removes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch  # the parent's own; each child times its imports

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fwd_sm90 import known_names, require_cuda, require_positive  # noqa: E402

CHILD = """
import json, time
import torch
torch.cuda.init()
t0 = time.perf_counter()
if {system!r} == "flexattn":
    import flexattn as api
    from flexattn.registry import installed_consumers
    installed_consumers()  # imports the SM90 consumer (and CuTe DSL)
else:
    from cudnn import flex_attention as api
t_import = time.perf_counter() - t0
gen = torch.Generator(device="cuda").manual_seed(0)
shape = ({batch}, {seqlen}, {heads}, {dim})
q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
           for _ in range(3))
ends = torch.arange(1, {seqlen} + 1, device="cuda", dtype=torch.int32).repeat({batch})
mask = ends.view(1, 1, -1).contiguous()  # causal endpoints [1, 1, B*S]
times = {{}}

def timed(name, fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    times[name] = time.perf_counter() - start
    return result

plan = timed("plan_s", lambda: api.create_mask_plan(mask, q, k, v, build_backward=True))
out = timed("forward_s", lambda: api.flex_attn_func(q, k, v, mask_plan=plan))
timed("backward_s", lambda: torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
stats = {{}}
if {system!r} == "flexattn":
    from maskplan_kernels import compile_cache
    stats = dict(compile_cache.STATS)  # compiles vs disk hits: a warm run should compile nothing
print(json.dumps(dict(import_s=t_import, **times, cache=stats)))
"""


def run_child(system: str, args, env: dict) -> dict | str:
    code = CHILD.format(system=system, batch=args.batch, seqlen=args.seqlen, heads=args.heads, dim=args.dim)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--seqlen", type=int, default=4096, help="tokens per sample")
    p.add_argument("--batch", type=int, default=2, help="samples")
    p.add_argument("--heads", type=int, default=16, help="heads (q and kv)")
    p.add_argument("--dim", type=int, default=128, help="head dim")
    p.add_argument("--systems", default="flexattn,cudnn", help="of flexattn, cudnn")
    args = p.parse_args()
    systems = known_names(p, "--systems", args.systems, ("flexattn", "cudnn"))
    require_positive(p, seqlen=args.seqlen, batch=args.batch, heads=args.heads, dim=args.dim)
    require_cuda(p.prog)
    if "cudnn" in systems and importlib.util.find_spec("cudnn") is None:
        print("cudnn: cuDNN's frontend is not installed, skipped")
        systems.remove("cudnn")
    failed = 0
    print(f"first call of a process on {torch.cuda.get_device_name()}: B={args.batch} S={args.seqlen} "
          f"H={args.heads} D={args.dim} bf16 causal")  # fmt: skip
    heads = ("import s", "plan s", "fwd s", "bwd s", "total s")
    print(f"{'system':10s} {'process':8s} " + " ".join(f"{h:>9s}" for h in heads))
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "FLEXATTN_CACHE": "1", "FLEXATTN_CACHE_DIR": cache}
        for system in systems:
            for run in ("first", "second"):
                r = run_child(system, args, env)
                if isinstance(r, str):
                    print(f"{system:10s} {run:8s} failed: {r}")
                    failed += 1
                    break
                total = r["plan_s"] + r["forward_s"] + r["backward_s"]
                values = (r["import_s"], r["plan_s"], r["forward_s"], r["backward_s"], total)
                cache = f"  cache {r['cache']}" if r["cache"] else ""
                print(f"{system:10s} {run:8s} " + " ".join(f"{x:9.3f}" for x in values) + cache, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
