"""Attention throughput (forward, or forward + backward), side by side in one run on the same GPU.

    python benchmarks/bench_fwd_sm90.py [--mode fwd|train] [--seqlen 8192[,16384,...]]
                                        [--batch 2] [--heads 16] [--kv-heads 16] [--dim 128]
                                        [--dim-v 128] [--layout contiguous|packed|bhsd]
                                        [--masks causal,sliding-1024,document,random-5
                                                 [,sliding-<W>,document-short,random-<N>,prefix-lm,chunked-<C>]]
                                        [--systems flexattn,flexattn-det,cudnn,torch-flex,fa4-causal
                                                   [,flexattn-varlen,fa4-varlen,flexattn-contig]]
                                        [--out DIR]

``--mode train`` times forward + backward (``torch.autograd.grad`` of the output against a fixed
``dout``, plans with backward views); there ``flexattn-det`` is ``deterministic=True`` (the forward
has no such mode, so ``--mode fwd`` skips it). With
``--kv-heads`` below ``--heads`` (GQA) ``flexattn`` runs the default plan (which packs at 4, 8, 16, 32 or
64 q heads per kv head) and ``flexattn-pack`` / ``flexattn-unpacked`` the other choice. On the
``document`` and ``document-short`` masks, ``flexattn-varlen`` and ``fa4-varlen`` (name them in
``--systems``) take its documents as the samples of a varlen THD batch, causal in each (the same
visible pairs): ours through ``cu_seqlens`` and a causal plan, FA4's dense varlen causal kernel
without a mask.
``--layout packed`` makes q, k, v slices along the heads of one ``[B, S, Hq + 2 Hkv, D]`` tensor, a
fused QKV projection's output, for every system (strided views: no system gets contiguous ones);
``--layout bhsd`` makes them ``[B, H, S, D]`` tensors transposed to BSHD (what code that applies RoPE
in BHSD hands over). ``flexattn-contig`` runs ours on contiguous BSHD copies of them, made once
outside the timing: against ``flexattn`` in the same run, what the layout costs.
TFLOP/s count visible elements only: 2 * (Dqk + Dv) * visible pairs * heads for the forward,
(8 Dqk + 6 Dv) * visible pairs * heads for forward + backward (3.5 times the forward where
``--dim-v`` is ``--dim``, its default); dense causal FA4 is timed on the causal row only, as the ceiling.
Prints a table with ratios flexattn / peer, writes ``results-<mode>.json`` (the rows, and what
produced them: command, options, GPU, versions, commit) and (with matplotlib) ``<mode>_tflops.png``
to ``--out`` (``$OUT``, else ``benchmarks/results``; a later run of the same mode replaces them).
``--seqlen`` takes a comma-separated list for a sweep (one table row per length and mask).

Two timings per system. ``queued``: 10 calls issued back to back between two CUDA events, as a
training step issues them; when a call's host work (Python, argument checks, launches) outlasts
its GPU work, this measures the host. ``device``: the same 10 calls queued behind a GPU sleep that
outlasts their issue, so the events see only GPU work (the sleep is doubled and the timing
repeated until the host had issued all 10 before the sleep ended). The table's TFLOP/s and ratios
are from ``queued``; ``device`` TFLOP/s and ratios follow, and ``host ms`` is the issue time per
call. Where ``host ms`` exceeds the device time, a system is host-bound at this size.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from masks_bench import (  # noqa: E402
    MASK_FORMS,
    MASK_NAMES,
    MASKS,
    documents_of,
    endpoint_mask,
    mask_mod_from_endpoints,
    visible_pairs,
)

import flexattn  # noqa: E402
from flexattn import masks  # noqa: E402

#: what ``--systems`` can name (under GQA ``flexattn-pack`` or ``flexattn-unpacked``, the PackGQA
#: choice the default plan did not make, joins ``flexattn`` by itself)
SYSTEMS = (
    "flexattn", "flexattn-det", "cudnn", "torch-flex", "fa4-causal", "flexattn-varlen", "fa4-varlen",
    "flexattn-contig",
)  # fmt: skip


def require_cuda(prog: str) -> None:
    """Exit with a one-line message where there is no CUDA GPU to time (not a torch traceback)."""
    if not torch.cuda.is_available():
        sys.exit(f"{prog}: needs a CUDA GPU (torch.cuda.is_available() is False here)")


def int_list(parser: argparse.ArgumentParser, option: str, text: str) -> list[int]:
    """A comma-separated sweep (``--seqlen 2048,4096``), every value read before any work starts."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        parser.error(f"{option}: comma-separated integers, not {text!r}")


def known_names(parser: argparse.ArgumentParser, option: str, text: str, known) -> list[str]:
    """The comma-separated names of ``option`` (``--systems a,b``); ``parser.error`` naming those not
    in ``known``, before any work starts."""
    names = text.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"{option}: unknown {', '.join(map(repr, unknown))}; choose from {'; '.join(known)}")
    return names


def require_positive(parser: argparse.ArgumentParser, **sizes) -> None:
    """``parser.error`` for the first of ``sizes`` (``kv_heads=`` is ``--kv-heads``; an int or a list
    of them; None: not given) below 1, before any work starts."""
    for name, value in sizes.items():
        if value is not None and min(value if isinstance(value, list) else [value]) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def timed(fn, iters: int = 10, repeats: int = 5, warmup: int = 3) -> float:
    """Milliseconds per call: ``iters`` calls queued back to back between two CUDA events (as a
    training step issues them), median over ``repeats``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        for _ in range(iters):
            fn()
        en.record()
        torch.cuda.synchronize()
        times.append(st.elapsed_time(en) / iters)
    return sorted(times)[len(times) // 2]


#: the longest GPU sleep device_timed queues ahead of the calls
MAX_SLEEP_MS = 2000.0


def device_timed(fn, iters: int = 10, repeats: int = 5, sleep_ms: float = 20.0) -> tuple[float, float]:
    """``(device ms, host ms)`` per call: ``iters`` calls issued while the GPU runs a sleep queued
    ahead of them, so the events between the sleep and the last call time GPU work only; host ms
    is the issue time. Medians over ``repeats``; a repeat whose issue outlasted the sleep is redone
    with twice the sleep, up to ``MAX_SLEEP_MS`` (beyond it the calls wait for the GPU themselves, a
    host sync, and there is no device-only time to take)."""
    fn()
    torch.cuda.synchronize()
    cycles_per_ms = 2_000_000  # about an H100/H200 SM clock; the sleep need only outlast the issue
    device, host = [], []
    while len(device) < repeats:
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
        st.record()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        issued = time.perf_counter() - t0
        started_late = st.query()  # the sleep ended before the last call was issued
        en.record()
        torch.cuda.synchronize()
        if started_late:
            sleep_ms *= 2
            if sleep_ms > MAX_SLEEP_MS:
                raise RuntimeError(
                    f"{iters} calls took longer to issue than a {MAX_SLEEP_MS} ms GPU sleep: they wait "
                    "for the GPU (a host sync), so they have no device-only time"
                )
            continue
        device.append(st.elapsed_time(en) / iters)
        host.append(issued * 1e3 / iters)
    return sorted(device)[repeats // 2], sorted(host)[repeats // 2]


def systems(args, q, k, v, name, endpoints):
    """name -> zero-argument callable running that system's forward (``--mode train``: forward and
    backward), for the available peers."""
    scale = 1.0 / math.sqrt(args.dim)
    train = args.mode == "train"
    fwd = {}
    leaves = {}  # a system's own q, k, v where they are not the run's
    if "flexattn-contig" in args.systems:
        qc, kc, vc = leaves["flexattn-contig"] = [
            t.detach().contiguous().requires_grad_(train) for t in (q, k, v)
        ]
        contig_plan = flexattn.create_mask_plan(endpoints, qc, kc, vc, build_backward=train)
        fwd["flexattn-contig"] = lambda: flexattn.flex_attn_func(
            qc, kc, vc, mask_plan=contig_plan, softmax_scale=scale
        )
    if {"flexattn", "flexattn-det"} & set(args.systems):
        plan = flexattn.create_mask_plan(endpoints, q, k, v, build_backward=train)
        if "flexattn" in args.systems:
            fwd["flexattn"] = lambda: flexattn.flex_attn_func(q, k, v, mask_plan=plan, softmax_scale=scale)
        if train and "flexattn-det" in args.systems:
            fwd["flexattn-det"] = lambda: flexattn.flex_attn_func(
                q, k, v, mask_plan=plan, softmax_scale=scale, deterministic=True
            )
        if args.kv_heads != args.heads and "flexattn" in args.systems:
            # the other PackGQA choice than the default plan's
            pack = not plan.view("forward").signature.topology.pack_gqa
            other = flexattn.create_mask_plan(endpoints, q, k, v, build_backward=train, pack_gqa=pack)
            fwd["flexattn-pack" if pack else "flexattn-unpacked"] = lambda: flexattn.flex_attn_func(
                q, k, v, mask_plan=other, softmax_scale=scale
            )
    if "cudnn" in args.systems:
        try:
            from cudnn import flex_attention as cfa

            cplan = cfa.create_mask_plan(endpoints, q, k, v, build_backward=train)
            fwd["cudnn"] = lambda: cfa.flex_attn_func(q, k, v, mask_plan=cplan, softmax_scale=scale)
        except ImportError as e:
            print(f"  cudnn flex_attention unavailable: {e}")
    if "torch-flex" in args.systems:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = systems.flex or torch.compile(flex_attention)
        systems.flex = compiled
        s = q.shape[1]
        bm = create_block_mask(mask_mod_from_endpoints(endpoints, s), args.batch, None, s, s, device="cuda")
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        gqa = args.kv_heads != args.heads
        fwd["torch-flex"] = lambda: compiled(
            qt, kt, vt, block_mask=bm, scale=scale, enable_gqa=gqa
        ).transpose(1, 2)
    if "fa4-causal" in args.systems and name == "causal":
        try:
            from flash_attn.cute.interface import flash_attn_func

            fwd["fa4-causal"] = lambda: flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
        except ImportError as e:
            print(f"  FA4 unavailable: {e}")
    if (docs := documents_of(name, args.batch, q.shape[1])) is not None:
        fwd.update(varlen_systems(args, q, k, v, scale, docs))
    if not train:
        return fwd
    dout = torch.randn(*q.shape[:-1], v.shape[-1], device=q.device, dtype=q.dtype)

    def step(f, inputs):
        out = f()
        out = out[0] if isinstance(out, tuple) else out
        return torch.autograd.grad(out, inputs, dout.view(out.shape))  # BSHD, or THD (varlen)

    inputs = {name: leaves.get(name, (q, k, v)) for name in fwd}
    return {name: (lambda f=f, x=inputs[name]: step(f, x)) for name, f in fwd.items()}


systems.flex = None


def varlen_systems(args, q, k, v, scale, docs):
    """A document mask's documents (``docs``, per sample) as the samples of a varlen (THD) batch,
    causal in each: the same visible pairs. ``flexattn-varlen`` plans them with ``cu_seqlens``;
    ``fa4-varlen`` is FA4's dense varlen causal kernel, what packed-document training runs without
    a mask."""
    lens = [n for row in docs for n in row]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
    longest = max(lens)

    def thd(*ts):
        return [t.view(-1, *t.shape[2:]) for t in ts]

    fwd = {}
    if "flexattn-varlen" in args.systems:
        endpoints = masks.causal(cu_seqlens_q=cu, cu_seqlens_k=cu, device=q.device)
        plan = flexattn.create_mask_plan(
            endpoints, *thd(q, k, v), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
            max_seqlen_k=longest, build_backward=args.mode == "train",
        )  # fmt: skip
        fwd["flexattn-varlen"] = lambda: flexattn.flex_attn_func(
            *thd(q, k, v), mask_plan=plan, softmax_scale=scale
        )
    if "fa4-varlen" in args.systems:
        try:
            from flash_attn.cute.interface import flash_attn_varlen_func

            fwd["fa4-varlen"] = lambda: flash_attn_varlen_func(
                *thd(q, k, v), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                max_seqlen_k=longest, softmax_scale=scale, causal=True,
            )  # fmt: skip
        except ImportError as e:
            print(f"  FA4 unavailable: {e}")
    return fwd


def make_parser(description: str, sweep: bool = True) -> argparse.ArgumentParser:
    """The problem and peer options (shared with ``bench_kernels.py``, which times one length and
    writes no files: ``sweep=False``); :func:`finish` the parsed arguments."""
    defaults = argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(description=description, formatter_class=defaults)
    if sweep:
        p.add_argument("--seqlen", default="8192", help="tokens per sample, or a sweep: 2048,4096")
    else:
        p.add_argument("--seqlen", type=int, default=8192, help="tokens per sample")
    p.add_argument("--batch", type=int, default=2, help="samples")
    p.add_argument("--heads", type=int, default=16, help="q heads")
    p.add_argument("--kv-heads", type=int, default=None, help="kv heads, fewer for GQA; None: --heads")
    p.add_argument("--dim", type=int, default=128, help="head dim of Q and K")
    p.add_argument("--dim-v", type=int, default=None, help="head dim of V; None: --dim")
    p.add_argument("--mode", choices=("fwd", "train"), default="fwd", help="train: forward + backward")
    p.add_argument("--layout", choices=("contiguous", "packed", "bhsd"), default="contiguous",
                   help="packed: q, k, v slices of one [B, S, Hq + 2 Hkv, D] tensor; bhsd: [B, H, S, D] "
                        "tensors transposed to BSHD")  # fmt: skip
    p.add_argument("--masks", default=",".join(MASK_NAMES), help=f"of {'; '.join(MASK_FORMS)}")
    p.add_argument("--systems", default="flexattn,flexattn-det,cudnn,torch-flex,fa4-causal",
                   help=f"of {', '.join(SYSTEMS)}")  # fmt: skip
    if sweep:
        results = os.environ.get("OUT") or str(Path(__file__).resolve().parent / "results")
        p.add_argument("--out", default=results, help="folder of the JSON and chart ($OUT if set)")
    return p


def finish(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Checked names and defaults filled in; exits where there is no GPU to time."""
    known_names(parser, "--masks", args.masks, MASKS)
    args.systems = known_names(parser, "--systems", args.systems, SYSTEMS)
    if isinstance(args.seqlen, str):  # a sweep
        args.seqlen = int_list(parser, "--seqlen", args.seqlen)
    require_positive(parser, seqlen=args.seqlen, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
                     dim=args.dim, dim_v=args.dim_v)  # fmt: skip
    if args.kv_heads is not None and args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    require_cuda(parser.prog)
    args.kv_heads = args.kv_heads or args.heads
    args.dim_v = args.dim_v or args.dim
    if args.layout == "packed" and args.dim_v != args.dim:
        parser.error(f"--layout packed: q, k, v share a head dim, not {args.dim} and {args.dim_v}")
    return args


def main() -> None:
    parser = make_parser(__doc__.splitlines()[0])
    args = finish(parser, parser.parse_args())
    torch.manual_seed(0)
    train = args.mode == "train"
    rows = []
    for seqlen in args.seqlen:
        rows += run_length(args, seqlen, train)
    report(rows, Path(args.out), args.mode, run_record(args))


def inputs(args, seqlen: int, train: bool):
    """Random bf16 ``q, k, v`` (BSHD) of the problem, leaves with grad for ``train`` (``--layout
    packed``: views of one such leaf; ``bhsd``: transposed views of ``[B, H, S, D]`` leaves); prints
    the problem line."""

    def leaf(heads, dim):
        if args.layout == "bhsd":
            t = torch.randn(args.batch, heads, seqlen, dim, device="cuda", dtype=torch.bfloat16)
            return t.requires_grad_(train).transpose(1, 2)
        t = torch.randn(args.batch, seqlen, heads, dim, device="cuda", dtype=torch.bfloat16)
        return t.requires_grad_(train)

    print(f"{torch.cuda.get_device_name()}  {args.mode}  B={args.batch} S={seqlen} Hq={args.heads} "
          f"Hkv={args.kv_heads} D={args.dim}/{args.dim_v} bf16 {args.layout}")
    if args.layout == "packed":
        packed = leaf(args.heads + 2 * args.kv_heads, args.dim)
        return packed.split([args.heads, args.kv_heads, args.kv_heads], dim=2)
    return leaf(args.heads, args.dim), leaf(args.kv_heads, args.dim), leaf(args.kv_heads, args.dim_v)


def run_length(args, seqlen: int, train: bool) -> list[dict]:
    q, k, v = inputs(args, seqlen, train)
    rows = []
    for name in args.masks.split(","):
        endpoints = endpoint_mask(name, args.batch, seqlen)
        per_pair = 8 * args.dim + 6 * args.dim_v if train else 2 * (args.dim + args.dim_v)
        flops = per_pair * visible_pairs(endpoints) * args.heads
        for system, fn in systems(args, q, k, v, name, endpoints).items():
            try:
                ms = timed(fn)
            except Exception as e:  # a peer failing must not hide the others' numbers
                print(f"  {name} {system}: failed: {type(e).__name__}: {e}")
                continue
            try:
                device_ms, host_ms = device_timed(fn)
            except RuntimeError as e:  # a system that syncs: its queued time stands alone
                print(f"  {name} {system}: no device-only time: {e}")
                device_ms = host_ms = math.nan
            tflops, device_tflops = flops / ms / 1e9, flops / device_ms / 1e9
            rows.append({
                "seqlen": seqlen, "mask": name, "system": system, "ms": ms, "tflops": tflops,
                "device_ms": device_ms, "device_tflops": device_tflops, "host_ms": host_ms,
            })  # fmt: skip
            print(
                f"  {name:13s} {system:12s} {ms:8.3f} ms {tflops:7.1f} TFLOP/s   device {device_ms:8.3f} ms "
                f"{device_tflops:7.1f} TFLOP/s   host {host_ms:6.3f} ms",
                flush=True,
            )
    return rows


def run_record(args) -> dict:
    """What produced a results file: the command, the parsed options, the GPU and the versions."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                                capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        commit = None  # not a checkout
    versions = {}
    for dist in ("flexattn", "flexattn-sm90", "nvidia-cutlass-dsl", "nvidia-cudnn-frontend", "flash-attn-4"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "options": {k: v for k, v in vars(args).items() if k != "out"},
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "versions": versions,
        "commit": commit,
    }


def report(rows: list[dict], out: Path, mode: str, run: dict) -> None:
    if not rows:
        sys.exit("no system ran (see the failures above): nothing to report")
    ours = {(r["seqlen"], r["mask"]): r for r in rows if r["system"] == "flexattn"}

    def ratio(r, field):  # "-" where flexattn itself did not run
        key = (r["seqlen"], r["mask"])
        return f"{ours[key][field] / r[field]:6.2f}x" if key in ours else "      -"

    print(
        f"\n{mode}:  S     mask           system        TFLOP/s   flexattn/system"
        "   device TFLOP/s   flexattn/system   host ms"
    )
    for r in rows:
        print(
            f"{r['seqlen']:6d} {r['mask']:14s} {r['system']:12s} {r['tflops']:8.1f}   {ratio(r, 'tflops')}"
            f"          {r['device_tflops']:8.1f}           {ratio(r, 'device_tflops')}   {r['host_ms']:7.3f}"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / f"results-{mode}.json").write_text(json.dumps({"run": run, "rows": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart written")
        return
    label = (lambda r: r["mask"]) if len({r["seqlen"] for r in rows}) == 1 else (
        lambda r: f"{r['mask']}@{r['seqlen'] // 1024}k"
    )
    mask_names = list(dict.fromkeys(label(r) for r in rows))
    system_names = list(dict.fromkeys(r["system"] for r in rows))
    width = 0.8 / len(system_names)
    fig, ax = plt.subplots(figsize=(max(8, len(mask_names)), 4))
    tflops = {(label(r), r["system"]): r["tflops"] for r in rows}
    for i, s in enumerate(system_names):
        xs = [x for x, m in enumerate(mask_names) if (m, s) in tflops]
        ax.bar([x + i * width for x in xs], [tflops[mask_names[x], s] for x in xs], width, label=s)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(mask_names))], mask_names)
    ax.set_ylabel("TFLOP/s (visible elements)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{mode}_tflops.png", dpi=120)
    print(f"chart: {out / f'{mode}_tflops.png'}")


if __name__ == "__main__":
    main()
