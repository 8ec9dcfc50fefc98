"""flexattn demo: plan three masks, run attention forward and backward, check it against dense attention.

    python examples/demo.py              # or: python3 -m nox -s demo

On any machine (CPU tensors, the pure-torch reference consumer): builds plans for a causal, a
sliding-window and a packed-document mask, prints each plan's summary and the block map of its
first sample, runs ``flex_attn_func``
forward and backward and compares output and gradients with ``torch`` SDPA given the dense
boolean mask decoded from the plan (``plan.view("forward").to_dense()``). Exits non-zero if any
check fails.

On a machine with CUDA it then does the same with bf16 CUDA tensors through the installed GPU
consumer and prints its speed next to dense SDPA. Where the consumer has no kernel for a
direction (no CUDA consumer installed, or no backward kernel yet), flexattn raises
``ConsumerNotFoundError`` (it never falls back silently): the demo prints that message, skips
what it cannot run and still checks the rest.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F

import flexattn
from flexattn import ConsumerNotFoundError, masks

# Limits against dense SDPA: max abs error on CPU (float32), max abs error relative to the
# reference's max abs value on CUDA (bfloat16).
TOL = {
    torch.float32: {"out": 1e-4, "grad": 1e-3},
    torch.bfloat16: {"out": 2e-2, "grad": 2e-2},
}


def log(msg: str = "") -> None:
    print(msg, flush=True)


def random_doc_lens(batch: int, seqlen: int, n_docs: int, gen: torch.Generator) -> list[list[int]]:
    """``n_docs`` documents of random lengths (>= 1) per sample, each sample summing to ``seqlen``."""
    out = []
    for _ in range(batch):
        cuts = torch.randperm(seqlen - 1, generator=gen)[: n_docs - 1].add(1).sort().values.tolist()
        bounds = [0, *cuts, seqlen]
        out.append([b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    return out


def build_masks(batch: int, seqlen: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    window = max(1, seqlen // 8)
    docs = random_doc_lens(batch, seqlen, n_docs=4, gen=gen)
    sliding = masks.sliding_window(seqlen, window_left=window, batch=batch, device=device)
    document = masks.document(docs, device=device)
    return {
        "causal": masks.causal(seqlen, batch=batch, device=device),
        f"sliding-window (left {window})": sliding,
        f"document {docs[0] if batch == 1 else docs}": document,
        "document ∩ sliding-window (masks.intersect)": masks.intersect(document, sliding),
    }


def endpoints_to_dense(endpoints: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """Brute force: bool ``[Hmask, total_q, Sk]`` straight from the endpoints (fixed-length batches)."""
    e = endpoints.to(torch.int64)[..., None]  # (Hmask, nfunc, total_q, 1)
    kpos = torch.arange(seqlen_k, device=endpoints.device)
    visible = kpos < e[:, 0]
    for j in range(1, endpoints.shape[1], 2):
        visible |= (kpos >= e[:, j]) & (kpos < e[:, j + 1])
    return visible


def dense_attention(q, k, v, dense: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA with the boolean mask ``[Hmask, B*Sq, Sk]`` (BSHD in and out); rows seeing no key give 0."""
    b, sq, _, _ = q.shape
    mask = dense.view(dense.shape[0], b, sq, -1).transpose(0, 1)  # (B, Hmask, Sq, Sk)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    ).transpose(1, 2)
    seen = mask.any(-1).transpose(1, 2)[..., None]  # (B, Sq, Hmask, 1)
    return torch.where(seen, out, torch.zeros((), dtype=out.dtype, device=out.device))


def make_qkv(batch, seqlen, heads, headdim, dtype, device, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = (batch, seqlen, heads, headdim)
    return [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(3)]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return max_err(a, ref) / max(ref.float().abs().max().item(), 1e-30)


def warm_up(args) -> None:
    """One untimed plan + forward + backward, so the timings below leave out first-call costs."""
    shape = (args.batch, args.seqlen, args.heads, args.headdim)
    q, k, v = (t.requires_grad_() for t in make_qkv(*shape, torch.float32, "cpu", args.seed))
    plan = flexattn.create_mask_plan(
        masks.causal(args.seqlen, batch=args.batch), q, k, v, build_backward=True
    )
    out = flexattn.flex_attn_func(q, k, v, mask_plan=plan)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))


def check_cpu(name: str, endpoints: torch.Tensor, args) -> bool:
    q, k, v = (
        t.requires_grad_()
        for t in make_qkv(args.batch, args.seqlen, args.heads, args.headdim, torch.float32, "cpu", args.seed)
    )
    t0 = time.perf_counter()
    plan = flexattn.create_mask_plan(endpoints, q, k, v, build_backward=True)
    t_plan = time.perf_counter() - t0
    log(f"\n[{name}] plan built in {t_plan * 1e3:.1f} ms")
    log(plan.summary())
    log(plan.view("forward").block_map_text(width=64, legend=True))

    dense = plan.view("forward").to_dense()
    decoded_ok = torch.equal(dense, endpoints_to_dense(endpoints, args.seqlen))
    log(f"  to_dense() equals the mask expanded from the endpoints: {'yes' if decoded_ok else 'NO'}")

    t0 = time.perf_counter()
    out = flexattn.flex_attn_func(q, k, v, mask_plan=plan)
    t_fwd = time.perf_counter() - t0
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(args.seed + 1))
    t0 = time.perf_counter()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    t_bwd = time.perf_counter() - t0
    log(f"  flex_attn_func forward {t_fwd * 1e3:.1f} ms, backward {t_bwd * 1e3:.1f} ms (CPU reference)")

    ref = dense_attention(q, k, v, dense, 1.0 / math.sqrt(args.headdim))
    rdq, rdk, rdv = torch.autograd.grad(ref, (q, k, v), dout)
    tol = TOL[torch.float32]
    errs = {"out": max_err(out, ref), "dq": max_err(dq, rdq), "dk": max_err(dk, rdk), "dv": max_err(dv, rdv)}
    ok = decoded_ok and errs["out"] <= tol["out"] and max(errs["dq"], errs["dk"], errs["dv"]) <= tol["grad"]
    listing = "  ".join(f"{key} {val:.2e}" for key, val in errs.items())
    log(f"  max |flexattn - dense SDPA|: {listing}  (tol out {tol['out']:.0e}, grads {tol['grad']:.0e})")
    log(f"  {'PASS' if ok else 'FAIL'}: {name}")
    return ok


def cuda_time_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def run_gpu(mask_list: dict[str, torch.Tensor], args) -> bool:
    dev = torch.device("cuda")
    b, s, h, d = args.gpu_batch, args.gpu_seqlen, args.gpu_heads, args.gpu_headdim
    log(f"\n== CUDA ({torch.cuda.get_device_name(dev)}): B={b} S={s} H={h} D={d} bfloat16 ==")
    q, k, v = (t.requires_grad_() for t in make_qkv(b, s, h, d, torch.bfloat16, dev, args.seed))
    scale = 1.0 / math.sqrt(d)
    tol = TOL[torch.bfloat16]
    all_ok = True
    for name, endpoints in mask_list.items():
        t0 = time.perf_counter()
        plan = flexattn.create_mask_plan(endpoints, q, k, v, build_backward=True)
        torch.cuda.synchronize()
        log(f"\n[{name}] plan built in {(time.perf_counter() - t0) * 1e3:.1f} ms (first call)")
        log(plan.summary())
        dense = plan.view("forward").to_dense()
        with torch.no_grad():  # raises ConsumerNotFoundError where the consumer has no forward kernel
            out = flexattn.flex_attn_func(q, k, v, mask_plan=plan)
            e_out = rel_err(out, dense_attention(q, k, v, dense, scale))
        ok = e_out <= tol["out"]
        log(f"  max |flexattn - dense SDPA| / max |SDPA|: out {e_out:.2e} (tol {tol['out']:.0e})  "
            f"{'PASS' if ok else 'FAIL'}")
        visible = dense.sum().item() * (h // dense.shape[0])
        flops_fwd = 4.0 * visible * d  # QK^T and PV over the visible score elements

        def flex_fwd(plan=plan):
            with torch.no_grad():
                flexattn.flex_attn_func(q, k, v, mask_plan=plan)

        def sdpa_fwd(dense=dense):
            with torch.no_grad():
                dense_attention(q, k, v, dense, scale)

        rows = [
            ("flexattn fwd", cuda_time_ms(flex_fwd, args.iters), flops_fwd),
            ("dense SDPA (bool mask) fwd", cuda_time_ms(sdpa_fwd, args.iters), flops_fwd),
        ]
        try:
            ok &= check_gpu_backward(plan, q, k, v, dense, scale, tol, rows, flops_fwd, args)
        except ConsumerNotFoundError as exc:
            log(f"  backward: not available, so no training numbers: {exc}")
        all_ok &= ok
        for label, ms, flops in rows:
            log(f"  {label:<28} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s (visible elements only)")
        log(f"  speed-up over dense SDPA (fwd): {rows[1][1] / rows[0][1]:.2f}x")
    return all_ok


def check_gpu_backward(plan, q, k, v, dense, scale, tol, rows, flops_fwd, args) -> bool:
    """Gradients against dense SDPA, and the fwd+bwd time appended to ``rows``."""
    out = flexattn.flex_attn_func(q, k, v, mask_plan=plan)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(dense_attention(q, k, v, dense, scale), (q, k, v), dout)
    e_grad = max(rel_err(a, r) for a, r in zip(grads, ref_grads, strict=True))
    ok = e_grad <= tol["grad"]
    log(f"  grads: max rel error {e_grad:.2e} (tol {tol['grad']:.0e})  {'PASS' if ok else 'FAIL'}")

    def flex_fwd_bwd():
        torch.autograd.grad(flexattn.flex_attn_func(q, k, v, mask_plan=plan), (q, k, v), dout)

    rows.append(("flexattn fwd+bwd", cuda_time_ms(flex_fwd_bwd, args.iters), 3.5 * flops_fwd))
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-only", action="store_true", help="skip the CUDA part even where CUDA is available")
    p.add_argument("--gpu-batch", type=int, default=2)
    p.add_argument("--gpu-seqlen", type=int, default=8192)
    p.add_argument("--gpu-heads", type=int, default=16)
    p.add_argument("--gpu-headdim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)

    log(f"flexattn {flexattn.__version__}, torch {torch.__version__}")
    log("warming up (one untimed causal plan, forward and backward) ...")
    warm_up(args)
    log(f"== CPU reference: B={args.batch} S={args.seqlen} H={args.heads} D={args.headdim} float32 ==")
    cpu_masks = build_masks(args.batch, args.seqlen, torch.device("cpu"), args.seed)
    results = {name: check_cpu(name, ep, args) for name, ep in cpu_masks.items()}
    cpu_ok = all(results.values())
    log(f"\nCPU: {sum(results.values())}/{len(results)} masks PASS" + ("" if cpu_ok else " -- FAIL"))
    if not cpu_ok:
        return 1

    if args.cpu_only or not torch.cuda.is_available():
        log("CUDA: not available here (or --cpu-only): CPU reference check only.")
        return 0
    gpu_masks = build_masks(args.gpu_batch, args.gpu_seqlen, torch.device("cuda"), args.seed)
    try:
        gpu_ok = run_gpu(gpu_masks, args)
    except ConsumerNotFoundError as exc:
        log("\nCUDA: flexattn's GPU kernels are not available, so there are no CUDA numbers:")
        log(f"  ConsumerNotFoundError: {exc}")
        log("CUDA: nothing fell back to another implementation; the CPU reference checks above PASSED.")
        return 0
    log(f"\nCUDA: {'PASS' if gpu_ok else 'FAIL'}")
    return 0 if gpu_ok else 1


if __name__ == "__main__":
    sys.exit(main())
