"""A Hugging Face transformers Llama's training step on packed documents, by attention implementation:
flexattn (``examples/transformers_packed.py``'s function and plans), torch FlexAttention
(transformers' ``flex_attention``, its block mask from the same ``position_ids``) and SDPA (its
dense mask from them), same weights and batch, one run.

    python benchmarks/bench_transformers.py [--systems flexattn,flex_attention,sdpa] [--mean-length 1024]

B=2, S=8192, a 4-layer Llama of width 2048 (16 q heads, 4 kv heads, head dim 128), fp32 weights
under bf16 autocast, AdamW; documents of random lengths (``--mean-length`` tokens on average).
A step is the forward, backward and optimizer step, the plans (flexattn) or masks (the others)
included; ms a step is the median of ``--steps`` CUDA-event-timed steps after ``--warmup``. The
first step's loss is printed for each system (same weights and batch: one that attended otherwise,
or in another dtype, shows there; transformers' ``flex_attention`` gets float32 q and k beside a
bfloat16 v under autocast and casts nothing itself). transformers is not a dependency of flexattn:
without it this prints so and exits.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def step_times(example, system: str, args, batches) -> tuple[list[float], float]:
    """ms of each step after the warm-up, and the first step's loss (the same for every system
    that attends as the mask says: a system that did not would show here)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=args.dim, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        intermediate_size=4 * args.dim, num_hidden_layers=args.layers, vocab_size=32000,
        attn_implementation=system,
    )  # fmt: skip
    model = LlamaForCausalLM(config).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, first_loss = [], None
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    for i, batch in enumerate(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = example.train_step(model, optimizer, *batch, autocast, flexattn_model=system == "flexattn")
        end.record()
        end.synchronize()
        first_loss = loss.item() if first_loss is None else first_loss
        if i >= args.warmup:
            times.append(start.elapsed_time(end))
    del model, optimizer
    torch.cuda.empty_cache()
    return times, first_loss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default="flexattn,flex_attention,sdpa")
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--mean-length", type=int, default=1024, help="mean document length in tokens")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    if importlib.util.find_spec("transformers") is None:
        print("bench_transformers: transformers is not installed (pip install transformers); nothing run")
        return
    if not torch.cuda.is_available():
        sys.exit("bench_transformers needs a CUDA GPU")
    sys.path.insert(0, str(EXAMPLES))
    import transformers_packed as example  # registers attn_implementation="flexattn"

    gen = torch.Generator().manual_seed(0)
    batches = [
        tuple(t.cuda() for t in example.packed_batch(args.batch, args.seqlen, 32000, gen, args.mean_length))
        for _ in range(args.warmup + args.steps)
    ]
    print(
        f"B={args.batch} S={args.seqlen} Llama dim {args.dim}, {args.layers} layers, heads "
        f"{args.heads}/{args.kv_heads}, documents of {args.mean_length} tokens on average; "
        f"{torch.cuda.get_device_name()}"
    )
    results = {}
    for system in args.systems.split(","):
        times, first_loss = step_times(example, system, args, batches)
        results[system] = statistics.median(times)
        spread = f"(min {min(times):.2f}, max {max(times):.2f}); first loss {first_loss:.4f}"
        print(f"{system:>15}: {results[system]:8.2f} ms a step {spread}", flush=True)
    if "flexattn" in results:
        for system, ms in results.items():
            if system != "flexattn":
                print(f"flexattn / {system}: {ms / results['flexattn']:.2f}x the speed")


if __name__ == "__main__":
    main()
