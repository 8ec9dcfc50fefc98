"""Time the GPU planner (``maskplan_kernels.build_plan_gpu``) next to its peers, in one run.

    python benchmarks/bench_plan_gpu.py                          # B=2, S=8192, Hq=16, D=128, bf16
    python benchmarks/bench_plan_gpu.py --sweep                  # + causal S = 1k .. 128k
    python benchmarks/bench_plan_gpu.py --json $OUT/plan_gpu.json
    python benchmarks/bench_plan_gpu.py --target sm100           # the SM100 consumer's views
    python benchmarks/bench_plan_gpu.py --with-reference         # + the reference planner on CUDA

Masks (Hmask = 1, as the peers share one mask across heads): causal, sliding window (left 1024),
packed documents (random lengths, fixed seed), random 5-endpoint (nfunc = 5, sorted random
endpoints per row, fixed seed); each planned forward-only and with the backward (K2Q) view.

Columns, all synchronised wall time of a warm build (median of ``--repeats``, after ``--warmup``;
ours and cuDNN take turns in five rounds, so drift during the run reaches both alike):

* ``ours``: validate_plan_inputs + consumer view resolution (memoised, as in ``create_mask_plan``)
  + ``build_plan_gpu`` (what a ``create_mask_plan`` call costs), with the views of ``--target``:
  ``sm90`` (the default), ``sm100`` (what a Blackwell GPU plans, built here on any GPU) or
  ``reference`` (128x128 row-major);
* ``cudnn``: ``cudnn.flex_attention.create_mask_plan(mask_func, q, k, v, build_backward=...)``
  (skipped when cudnn is not importable);
* ``torch``: ``torch.nn.attention.flex_attention.create_block_mask`` for the equivalent mask_mod
  (forward rows only: a BlockMask carries both directions);
* ratios ours / peer (< 1 is faster), plan bytes (ours: every view tensor; cudnn: best effort).

A per-stage split follows: device time between CUDA events around each stage and host wall time
per stage; where host time exceeds device time the stage is launch-bound. Reports, never asserts.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import sys
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from masks_bench import PLAN_MASKS as MASKS  # noqa: E402
from masks_bench import plan_bench_mask  # noqa: E402

#: --target: (module, class, the compute capability its views are requested for)
CONSUMERS = {
    "sm90": ("flexattn_sm90.consumer", "Sm90Consumer", (9, 0)),
    "sm100": ("flexattn_sm100.consumer", "Sm100Consumer", (10, 0)),
    "reference": ("maskplan_core.reference", "ReferenceConsumer", None),
}
STAGES = (
    "geometry",
    "classify_fwd",
    "classify_bwd",
    "k2q_count",
    "scan_header",
    "header_read",
    "materialize_q2k",
    "schedule",
    "materialize_k2q",
)


# ------------------------------------------------------------------------------------------------
# problems


def make_problem(name: str, batch: int, seqlen: int, heads: int, head_dim: int, seed: int):
    """(mask_func [1, nfunc, B*S] int32 CUDA, q, k, v BSHD bf16, mask_mod for torch)."""
    import torch

    dev = torch.device("cuda")
    mask, docs = plan_bench_mask(name, batch, seqlen, seed)
    doc_id = None
    if docs is not None:
        ids = [torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)) for lens in docs]
        doc_id = torch.stack(ids).to(dev)
    mask = mask.to(dev).contiguous()
    q = torch.randn(batch, seqlen, heads, head_dim, device=dev, dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    return mask, q, k, v, mask_mod(name, mask, seqlen, doc_id)


def mask_mod(name: str, mask, seqlen: int, doc_id):
    if name == "causal":
        return lambda b, h, qi, kv: qi >= kv
    if name == "sliding-1024":
        return lambda b, h, qi, kv: (qi >= kv) & (qi - kv <= 1024)
    if name == "document":
        return lambda b, h, qi, kv: (doc_id[b, qi] == doc_id[b, kv]) & (qi >= kv)
    ends = mask[0].t().contiguous()  # [B*S, 5]

    def random_5(b, h, qi, kv):  # visible iff an odd number of G = [0, F0..F4] values are <= kv
        return ((ends[b * seqlen + qi] <= kv).sum() % 2) == 0

    return random_5


# ------------------------------------------------------------------------------------------------
# the three planners


class Ours:
    name = "ours"

    def __init__(self, family: str):
        from maskplan_core import validate_plan_inputs
        from maskplan_kernels.builder import build_plan_gpu

        self._validate, self._build = validate_plan_inputs, build_plan_gpu
        self._resolved = {}
        self.family, self.cc = family, CONSUMERS[family][2]
        module, cls = CONSUMERS[family][:2]
        self.consumer = getattr(importlib.import_module(module), cls)()

    def _request(self, g, direction):
        from maskplan_core.consumer import ViewRequest

        return ViewRequest(
            arch_family=self.family,
            compute_capability=self.cc,
            direction=direction,
            head_dim_qk=g.head_dim_qk,
            head_dim_v=g.head_dim_v,
            num_heads_q=g.num_heads_q,
            num_heads_kv=g.num_heads_kv,
            mask_heads=g.mask_heads,
            dtype="bfloat16",
            varlen=g.varlen,
        )

    def plan(self, mask, q, k, v, backward: bool, stage_timer=None):
        return self.plan_with(self._build, mask, q, k, v, backward, stage_timer=stage_timer)

    def plan_with(self, build, mask, q, k, v, backward: bool, **options):
        """A build with ``build`` (``build_plan_gpu`` or the reference ``build_plan``) as
        ``create_mask_plan`` makes it: checked inputs, the consumer's memoised views."""
        g = self._validate(mask, q, k, v)
        fwd, bwd = self._views(g, backward)
        return build(mask, g, fwd, bwd, self.consumer.name, **options)

    def _views(self, g, backward: bool):
        """The consumer's views, memoised per problem shape as ``create_mask_plan`` memoises them."""
        key = (g.head_dim_qk, g.head_dim_v, g.num_heads_q, g.num_heads_kv, g.mask_heads, g.varlen, backward)
        views = self._resolved.get(key)
        if views is None:
            fwd = self.consumer.resolve(self._request(g, "forward"))
            bwd = self.consumer.resolve(self._request(g, "backward")) if backward else None
            views = self._resolved[key] = (fwd, bwd)
        return views

    @staticmethod
    def nbytes(plan) -> int:
        return sum(plan.view(role).nbytes() for role in plan.roles)


class Cudnn:
    name = "cudnn"

    def __init__(self):
        from cudnn.flex_attention import create_mask_plan  # noqa: F401 - availability probe

        self._create = create_mask_plan

    def plan(self, mask, q, k, v, backward: bool, stage_timer=None):
        return self._create(mask, q, k, v, build_backward=backward)

    @staticmethod
    def nbytes(plan) -> int | None:
        for attr in ("nbytes", "num_bytes", "memory_bytes"):
            value = getattr(plan, attr, None)
            if value is not None:
                return int(value() if callable(value) else value)
        return _tensor_bytes(plan)


class TorchBlockMask:
    name = "torch"

    def __init__(self):
        from torch.nn.attention.flex_attention import create_block_mask

        self._create = create_block_mask

    def plan(self, mask_mod_fn, batch, seqlen):
        return self._create(mask_mod_fn, batch, None, seqlen, seqlen, device="cuda")


def _tensor_bytes(obj, depth: int = 0, seen=None) -> int | None:
    """Best effort: bytes of the distinct tensor storages reachable through attributes/containers."""
    import torch

    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if depth > 4:
        return 0
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
        names = list(getattr(obj, "__dict__", {})) + list(getattr(obj, "__slots__", ()))
        items = [getattr(obj, n, None) for n in names]
    else:
        return 0
    total = 0
    for item in items:
        total += _tensor_bytes(item, depth + 1, seen) or 0
    return total if depth or total else None


# ------------------------------------------------------------------------------------------------
# timing


def timed(fn, repeats: int, warmup: int) -> tuple[float, object]:
    """Median synchronised wall milliseconds of ``fn()`` and its last result."""
    (t,), (out,) = timed_together([fn], repeats, warmup)
    return t, out


def timed_together(fns, repeats: int, warmup: int, rounds: int = 5) -> tuple[list[float], list]:
    """Median synchronised wall milliseconds of each of ``fns`` and their last results. The systems
    take turns, ``rounds`` blocks of about ``repeats / rounds`` calls each, so a drift of the host or GPU
    clocks during the measurement reaches every system alike instead of the one timed first."""
    import torch

    outs = [None] * len(fns)
    for i, fn in enumerate(fns):
        for _ in range(warmup):
            outs[i] = fn()
    torch.cuda.synchronize()
    samples = [[] for _ in fns]
    repeats = max(repeats, 1)  # a median needs a sample
    for r in range(rounds):
        calls = repeats // rounds + (r < repeats % rounds)  # ``repeats`` calls in all
        for i, fn in enumerate(fns):
            for _ in range(calls):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs[i] = fn()
                torch.cuda.synchronize()
                samples[i].append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(x) for x in samples], outs


def time_ours_and_cudnn(ours: Ours, peers: dict, mask, q, k, v, backward: bool, args):
    """(ours ms, ours plan, cudnn ms or None, cudnn plan or None), timed in turns."""
    fns = [functools.partial(ours.plan, mask, q, k, v, backward)]
    if "cudnn" in peers:
        fns.append(functools.partial(peers["cudnn"].plan, mask, q, k, v, backward))
    try:
        times, plans = timed_together(fns, args.repeats, args.warmup)
    except Exception as exc:  # noqa: BLE001 - report, then time ours alone
        print(f"  cudnn create_mask_plan failed: {type(exc).__name__}: {exc}")
        t, plan = timed(fns[0], args.repeats, args.warmup)
        return t, plan, None, None
    if len(fns) == 1:
        return times[0], plans[0], None, None
    return times[0], plans[0], times[1], plans[1]


def stage_split(ours: Ours, mask, q, k, v, backward: bool, repeats: int) -> dict[str, dict[str, float]]:
    """Median device / host ms per stage over ``repeats`` timed builds."""
    import torch

    from maskplan_kernels._launch import CudaEventTimer

    device, host = {}, {}
    for _ in range(repeats):
        timer = CudaEventTimer()
        torch.cuda.synchronize()
        ours.plan(mask, q, k, v, backward, stage_timer=timer)
        torch.cuda.synchronize()
        for name, ms in timer.elapsed_ms().items():
            device.setdefault(name, []).append(ms)
        for name, ms in timer.host_ms().items():
            host.setdefault(name, []).append(ms)
    return {
        name: {"device_ms": statistics.median(device[name]), "host_ms": statistics.median(host[name])}
        for name in device
    }


def ratio(a, b) -> str:
    return f"{a / b:6.2f}" if a is not None and b else "     -"


def fmt(x, unit="") -> str:
    return f"{x:8.3f}{unit}" if isinstance(x, float) else f"{'-':>8}{unit}"


def warm_up_systems(ours: Ours, peers: dict, args) -> None:
    """Untimed builds of every system before the table. Without them the first configuration timed
    in a process was slow for us (causal B=2 S=8k forward: 0.28 ms in the table, 0.16 ms for the
    same configuration in the sweep of the same run), which is not what a training loop sees."""
    problem = make_problem(args.masks[0], args.batch, args.seqlen, args.heads, args.head_dim, args.seed)
    mask, q, k, v = problem[:4]
    systems = [ours.plan] + ([peers["cudnn"].plan] if "cudnn" in peers else [])
    for plan in systems:
        for backward in (False, True):
            try:
                timed(functools.partial(plan, mask, q, k, v, backward), args.warmup, args.warmup)
            except Exception:  # noqa: BLE001 - a failing system is reported by its timed row
                pass


def run(args) -> dict:
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_plan_gpu.py: needs a CUDA GPU (torch.cuda.is_available() is False here)")
    try:
        ours = Ours(args.target)
    except ImportError as exc:
        raise SystemExit(f"bench_plan_gpu: --target {args.target} needs its package ({exc})") from None
    peers = {}
    try:
        peers["cudnn"] = Cudnn()
    except Exception as exc:  # noqa: BLE001 - report and go on without the column
        print(f"cudnn.flex_attention not importable ({type(exc).__name__}: {exc}); skipping that column")
    try:
        peers["torch"] = TorchBlockMask()
    except Exception as exc:  # noqa: BLE001
        print(f"torch create_block_mask not available ({type(exc).__name__}: {exc}); skipping that column")

    print(
        f"# {torch.cuda.get_device_name()}  B={args.batch} S={args.seqlen} Hq={args.heads} D={args.head_dim} "
        f"bf16, Hmask=1, consumer={ours.consumer.name}, median of {args.repeats} warm builds"
    )
    header = (
        f"{'mask':<13} {'views':<8} {'ours ms':>8} {'cudnn ms':>8} {'torch ms':>8} {'ours/cudnn':>10} "
        f"{'ours/torch':>10} {'ours KiB':>9} {'cudnn KiB':>9}"
    )
    print(header)
    print("-" * len(header))
    warm_up_systems(ours, peers, args)
    rows = []
    for mask_name in args.masks:
        mask, q, k, v, mm = make_problem(
            mask_name, args.batch, args.seqlen, args.heads, args.head_dim, args.seed
        )
        t_torch = None
        if "torch" in peers:
            try:
                t_torch, _ = timed(
                    functools.partial(peers["torch"].plan, mm, args.batch, args.seqlen), args.repeats, 1
                )
            except Exception as exc:  # noqa: BLE001
                print(f"  torch create_block_mask failed for {mask_name}: {type(exc).__name__}: {exc}")
        for backward in (False, True):
            t_ours, plan, t_cudnn, cplan = time_ours_and_cudnn(ours, peers, mask, q, k, v, backward, args)
            ours_bytes = Ours.nbytes(plan)
            cudnn_bytes = Cudnn.nbytes(cplan) if cplan is not None else None
            split = stage_split(ours, mask, q, k, v, backward, max(3, args.repeats // 4))
            views = "fwd+bwd" if backward else "fwd"
            t_torch_row = None if backward else t_torch
            cudnn_kib = cudnn_bytes / 1024 if cudnn_bytes else float("nan")
            print(
                f"{mask_name:<13} {views:<8} {fmt(t_ours)} {fmt(t_cudnn)} {fmt(t_torch_row)} "
                f"{ratio(t_ours, t_cudnn):>10} {ratio(t_ours, t_torch_row):>10} "
                f"{ours_bytes / 1024:9.1f} {cudnn_kib:9.1f}"
            )
            rows.append(
                {
                    "mask": mask_name,
                    "views": views,
                    "ours_ms": t_ours,
                    "cudnn_ms": t_cudnn,
                    "torch_ms": t_torch,
                    "ours_bytes": ours_bytes,
                    "cudnn_bytes": cudnn_bytes,
                    "stages": split,
                    "header": plan.metadata["allocation_header"],
                }
            )
    print()
    print("per-stage split (median ms: device between CUDA events / host wall)")
    names = [s for s in STAGES if any(s in r["stages"] for r in rows)]
    print(f"{'mask':<13} {'views':<8} " + " ".join(f"{n[:15]:>15}" for n in names))
    for r in rows:
        cells = []
        for n in names:
            st = r["stages"].get(n)
            cells.append(f"{st['device_ms']:6.3f}/{st['host_ms']:6.3f}  " if st else f"{'-':>15}")
        print(f"{r['mask']:<13} {r['views']:<8} " + " ".join(f"{c:>15}" for c in cells))
    sweep = run_sweep(args, ours, peers) if args.sweep else []
    reference = run_reference(args, ours) if args.with_reference else []
    return {"config": vars(args), "rows": rows, "sweep": sweep, "reference": reference}


def run_reference(args, ours: Ours) -> list[dict]:
    """The pure-torch reference planner on the same CUDA tensors and views: what a consumer without
    planner kernels builds with (a library author's on maskplan-core alone; SM100's until session 33)."""
    from maskplan_core.reference import build_plan

    reference = functools.partial(ours.plan_with, build_plan)
    print()
    print(f"reference planner on the same CUDA tensors (median of {max(3, args.repeats // 10)} builds)")
    print(f"{'mask':<13} {'views':<8} {'ours ms':>8} {'ref ms':>8} {'ours/ref':>9}")
    out = []
    for mask_name in args.masks:
        problem = make_problem(mask_name, args.batch, args.seqlen, args.heads, args.head_dim, args.seed)
        mask, q, k, v = problem[:4]
        for backward in (False, True):
            (t_ours, t_ref), _ = timed_together(
                [functools.partial(f, mask, q, k, v, backward) for f in (ours.plan, reference)],
                max(3, args.repeats // 10), 1, rounds=1,
            )  # fmt: skip
            views = "fwd+bwd" if backward else "fwd"
            print(f"{mask_name:<13} {views:<8} {fmt(t_ours)} {fmt(t_ref)} {ratio(t_ours, t_ref):>9}")
            out.append({"mask": mask_name, "views": views, "ours_ms": t_ours, "reference_ms": t_ref})
    return out


def run_sweep(args, ours: Ours, peers: dict) -> list[dict]:
    print()
    print(f"sweep: causal, B={args.batch}, Hq={args.heads}, D={args.head_dim} (torch above 32k skipped)")
    print(f"{'S':>7} {'views':<8} {'ours ms':>8} {'cudnn ms':>8} {'torch ms':>8} {'ours/cudnn':>10}")
    out = []
    for s in args.sweep_lengths:
        mask, q, k, v, mm = make_problem("causal", args.batch, s, args.heads, args.head_dim, args.seed)
        t_torch = None
        if "torch" in peers and s <= 32 * 1024:
            t_torch, _ = timed(
                functools.partial(peers["torch"].plan, mm, args.batch, s), max(3, args.repeats // 4), 1
            )
        for backward in (False, True):
            t_ours, _, t_cudnn, _ = time_ours_and_cudnn(ours, peers, mask, q, k, v, backward, args)
            views = "fwd+bwd" if backward else "fwd"
            print(
                f"{s:>7} {views:<8} {fmt(t_ours)} {fmt(t_cudnn)} {fmt(t_torch if not backward else None)} "
                f"{ratio(t_ours, t_cudnn):>10}"
            )
            out.append({"S": s, "views": views, "ours_ms": t_ours, "cudnn_ms": t_cudnn, "torch_ms": t_torch})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", action="store_true", help="also time causal plans for S = 1k .. 128k")
    p.add_argument("--sweep-lengths", type=int, nargs="+", default=[1 << i for i in range(10, 18)])
    p.add_argument("--target", choices=sorted(CONSUMERS), default="sm90", help="whose views to plan")
    p.add_argument(
        "--with-reference", action="store_true", help="also time the reference planner on these CUDA tensors"
    )
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_fwd_sm90 import require_positive  # lazily, as torch is here

    require_positive(p, batch=args.batch, seqlen=args.seqlen, heads=args.heads, head_dim=args.head_dim,
                     repeats=args.repeats)  # fmt: skip
    result = run(args)
    if args.json and result:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
