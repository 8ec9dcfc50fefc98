"""Train a small transformer on packed documents: one MaskPlan per batch, reused by every layer's
forward and backward, the whole model optionally under ``torch.compile(fullgraph=True)``.

    python examples/train_packed_documents.py                       # CPU reference path, seconds
    python examples/train_packed_documents.py --prompt              # SFT: prompts seen both ways
    python examples/train_packed_documents.py --device cuda --seqlen 8192 --batch 2 --dim 1024 \\
        --heads 8 --kv-heads 2 --lr 3e-4 --steps 60 [--compile] [--plan-ahead] [--layers 8]  # Hopper

The loop waits for the GPU only where it prints (every 10 steps): the time a step is the average
since the last print, plans included. On an H100 (session 56) the Hopper command took the loss
from 4.13 to 2.50 in 60 steps at 12.5-13.2 ms a step, plans included; on the H200 (session 25) at
10.0-11.3 ms, the same with ``--compile`` (9.9-11.5 ms) or ``--plan-ahead`` (9.6-11.2 ms): with
2 layers the host issues work no faster than the GPU runs it, so there is nothing to overlap.
With ``--layers 8`` (and ``--steps 40``) the GPU runs ahead of the host, and ``--plan-ahead`` took
a step from 31.8-34.6 ms to 30.4-31.4 ms (two runs each, alternated): built in the step, a
plan's one host read waits for the previous step to finish, so the GPU idles while the host
completes the plan and issues the next step; built on a side stream, the read waits for the
plan's own small kernels.

Each sample packs documents of random lengths; every document repeats a short random token
pattern, so a token is predictable only from earlier tokens of its own document, which is what the
document (+ optional sliding window) mask lets attention see: the loss falls below ln(vocab) as the
model learns to copy within documents. With ``--prompt`` each document opens with one copy of its
pattern as a prompt, as in supervised fine-tuning: its tokens see one another both ways (prefix-LM
inside each document, ``masks.document(..., prefix_lens=)``), and only the tokens after it are
trained on (a prompt token's target may lie inside the prompt, which it sees). The plan is built
outside the model and passed to it as an argument; a compiled model runs one graph for every
batch's new plan (the plan enters it as ``plan.handle_tensor``, a graph input).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import flexattn
from flexattn import masks


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor, plan: flexattn.MaskPlan) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1
        )
        q = q.view(b, s, self.heads, self.head_dim)
        k, v = (t.view(b, s, self.kv_heads, self.head_dim) for t in (k, v))
        attn = flexattn.flex_attn_func(q, k, v, mask_plan=plan)  # BSHD, the same plan in every layer
        x = x + self.out(attn.reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, plan: flexattn.MaskPlan) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, plan)
        return self.head(self.norm(x))


def packed_batch(batch: int, seqlen: int, vocab: int, gen: torch.Generator, prompt: bool = False):
    """Tokens ``[batch, seqlen]``, next-token targets (-100 where a document ends, and with
    ``prompt`` inside its prompt), and each sample's document lengths and prompt lengths (one
    period of the document's pattern with ``prompt``, else 0)."""
    tokens, targets, doc_lens, prompt_lens = [], [], [], []
    for _ in range(batch):
        lens, left = [], seqlen
        while left:
            lens.append(min(left, int(torch.randint(seqlen // 8, seqlen // 2 + 1, (1,), generator=gen))))
            left -= lens[-1]
        row, prompts = [], []
        for n in lens:
            period = int(torch.randint(2, 9, (1,), generator=gen))
            pattern = torch.randint(0, vocab, (period,), generator=gen)
            row.append(pattern.repeat(n // period + 1)[:n])
            prompts.append(min(period, n - 1) if prompt else 0)  # a document keeps a trained target
        row = torch.cat(row)
        target = torch.cat([row[1:], row[:1]])
        starts = torch.tensor([0, *lens[:-1]]).cumsum(0)
        for start, p in zip(starts.tolist(), prompts, strict=True):
            target[start : start + max(p - 1, 0)] = -100  # seen by the prompt itself: no target
        target[starts + torch.tensor(lens) - 1] = -100  # the next document's first token is not predictable
        tokens.append(row)
        targets.append(target)
        doc_lens.append(lens)
        prompt_lens.append(prompts)
    return torch.stack(tokens), torch.stack(targets), doc_lens, prompt_lens


def main() -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (wider models want less)")
    p.add_argument("--window", type=int, default=None, help="also limit attention to this many keys back")
    p.add_argument("--prompt", action="store_true", help="documents open with a prompt seen both ways (SFT)")
    p.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the model")
    p.add_argument("--plan-ahead", action="store_true", help="build the next plan on a side stream (CUDA)")
    args = p.parse_args()
    for name in ("steps", "batch", "seqlen", "dim", "layers", "heads", "kv_heads", "vocab"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.seqlen < 16:  # most documents then have seqlen // 8 >= 2 tokens, so a target
        p.error(f"--seqlen must be at least 16, got {args.seqlen}")
    if args.dim % args.heads or args.heads % args.kv_heads:
        p.error(f"--dim ({args.dim}) must be a multiple of --heads ({args.heads}), and --heads of --kv-heads "
                f"({args.kv_heads})")  # fmt: skip
    if args.window is not None and args.window < 1:
        p.error(f"--window must be at least 1, got {args.window}")
    if args.plan_ahead and torch.device(args.device).type != "cuda":
        p.error(f"--plan-ahead builds plans on a CUDA side stream; --device is {args.device}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch.cuda.is_available() is False (--device cpu runs anywhere)")

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the GPU kernels take fp16/bf16
    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, args.kv_heads).to(device)
    step_fn = torch.compile(model, fullgraph=True) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(0)
    head_dim = args.dim // args.heads
    # create_mask_plan reads only the shapes, dtype and device of q/k/v
    q_like = torch.empty(args.batch, args.seqlen, args.heads, head_dim, device=device, dtype=dtype)
    kv_like = torch.empty(args.batch, args.seqlen, args.kv_heads, head_dim, device=device, dtype=dtype)

    # --plan-ahead: the next batch's plan is built on a side stream (high priority, so its small
    # kernels start between the step's) while the step's work is queued on the main stream; the
    # build's one host read then waits for the side stream only, not for the step. The attention
    # calls of the next step wait for that plan on the GPU by themselves.
    side = torch.cuda.Stream(device, priority=-1) if args.plan_ahead else None

    def next_batch():
        """The next batch, and with --plan-ahead its plan and the host seconds building it took."""
        tokens, targets, *lens = packed_batch(args.batch, args.seqlen, args.vocab, gen, args.prompt)
        if device.type == "cuda":  # pinned, so the copies do not wait for the queued step
            tokens, targets = (t.pin_memory().to(device, non_blocking=True) for t in (tokens, targets))
        if side is None:
            return (tokens, targets, lens, None), 0.0
        t0 = time.perf_counter()
        with torch.cuda.stream(side):
            plan = make_plan(lens)
        return (tokens, targets, lens, plan), time.perf_counter() - t0

    def make_plan(lens):
        doc_lens, prompt_lens = lens
        prefix_lens = prompt_lens if args.prompt else None
        mask = masks.document(doc_lens, window_left=args.window, prefix_lens=prefix_lens, device=device)
        return flexattn.create_mask_plan(mask, q_like, kv_like, kv_like, build_backward=True)

    print(f"{args.layers} layers, {args.heads}/{args.kv_heads} heads of {head_dim}, B={args.batch} "
          f"S={args.seqlen}, {device} {dtype}, plans built {'ahead' if side else 'in the step'}; "
          f"ln(vocab) = {math.log(args.vocab):.2f}")  # fmt: skip
    batch, _ = next_batch()
    since, plan_s, last = time.perf_counter(), 0.0, 0
    for step in range(1, args.steps + 1):
        tokens, targets, lens, plan = batch
        t0 = time.perf_counter()
        if plan is None:
            plan = make_plan(lens)
        plan_s += time.perf_counter() - t0
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            logits = step_fn(tokens, plan)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step < args.steps:
            batch, build_s = next_batch()
            plan_s += build_s
        if step == 1 or step % 10 == 0 or step == args.steps:
            value = loss.item()  # waits for the step: the average below is of whole steps
            n, now = step - last, time.perf_counter()
            print(f"step {step:4d}  loss {value:.3f}  {1e3 * (now - since) / n:8.1f} ms a step, "
                  f"{1e3 * plan_s / n:6.2f} ms of it building plans (host)")  # fmt: skip
            since, plan_s, last = time.perf_counter(), 0.0, step
    if not math.isfinite(loss.item()):
        raise SystemExit("the loss is not finite")


if __name__ == "__main__":
    main()
