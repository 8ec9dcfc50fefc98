"""A Hugging Face transformers model attending through flexattn, on packed documents.

    pip install transformers                   # not a flexattn dependency (tested with 5.25.0)
    python examples/transformers_packed.py     # CPU reference path: checks, then a few steps
    python examples/transformers_packed.py --model mistral   # (or qwen2) sliding windows
    python examples/transformers_packed.py --device cuda --seqlen 8192 --batch 2 --dim 1024 \\
        --heads 8 --kv-heads 2 --steps 20      # Hopper, under bf16 autocast

transformers looks attention functions up by name (``AttentionInterface.register``); a model made
with ``attn_implementation="flexattn"`` calls :func:`flexattn_attention` in every layer, with the
keywords the model was called with and its ``position_ids``. A packing collator
(``DataCollatorWithFlattening``) gives ``position_ids`` that restart at 0 with each document: the
batch's plans come from them, one for each window the layers attend within (Mistral's every
layer, Qwen2's the layers its ``layer_types`` name, none for Llama; a layer names its window as
``sliding_window``), and every layer's forward and backward reuse them. Either

* the model is called as it is (``Trainer`` does): the first layer of a forward builds the plans
  from ``position_ids`` and the other layers reuse them (:func:`_batch_plan`); or
* the training step builds them, :func:`packed_plans`, and passes them as ``flexattn_plan=``:
  this way a model under ``torch.compile(fullgraph=True)`` runs one graph for every batch.

The plans are the whole mask, so transformers builds none (no mask hook is registered) and needs
no cache: call the model with ``use_cache=False`` (a cache would also turn off its own
packed-sequence detection for its other attention implementations). To generate with the trained
model, switch it to another implementation first: ``model.set_attn_implementation("sdpa")``.

The check runs the same weights with ``attn_implementation="sdpa"`` on each document alone and
compares logits and every parameter's gradient. Under bf16 autocast (``--device cuda``, or
``--autocast`` on the CPU) q and k leave Llama's RoPE in float32 beside a bfloat16 v;
flex_attn_func casts them to bfloat16 as SDPA does.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
from transformers import (
    AttentionInterface,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import flexattn
from flexattn import masks
from maskplan_core.reference import unary_dispatch
from maskplan_core.validation import autocast_region_dtype


def flexattn_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention function: q, k, v ``[B, H, S, D]`` in, ``([B, S, H, D], None)`` out.
    ``flexattn_plan`` (where given) maps each of the model's windows to its plan; a layer says its
    window as ``sliding_window`` (None: all of its document's earlier keys)."""
    if dropout:
        raise ValueError(f"flexattn has no attention dropout (got {dropout}): set config.attention_dropout=0")
    # what else a layer may ask for changes its scores or its keys, which the plans do not say
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError("flexattn takes no logit softcapping or attention sinks: use another implementation")
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise ValueError("the plans are causal, but this layer attends both ways: use another implementation")
    plans, window = kwargs.get("flexattn_plan"), kwargs.get("sliding_window")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # BSHD views, read in place
    if plans is None:
        plans = {window: _batch_plan(kwargs.get("position_ids"), window, q, k, v)}
    if window not in plans:
        raise ValueError(
            f"this layer attends within sliding_window={window}, but flexattn_plan has plans for "
            f"{sorted(plans, key=str)}: build them with packed_plans(model.config, position_ids)"
        )
    return flexattn.flex_attn_func(q, k, v, mask_plan=plans[window], softmax_scale=scaling), None


AttentionInterface.register("flexattn", flexattn_attention)

#: per thread (DataParallel's replicas, serving threads), the plans of the forward its layers last
#: ran, by window, and what they were built for: the layers of one forward (and a checkpointed
#: layer's recompute) see one ``position_ids`` tensor, held here so that its id cannot come to
#: name another batch's
_last_batch = threading.local()


@torch.compiler.disable  # eager under torch.compile: a graph would keep its first batch's plans
def _batch_plan(position_ids, window, q, k, v) -> flexattn.MaskPlan:
    """The plan for this layer's window of the batch ``position_ids`` numbers, built by the first
    layer that asks and reused by the others (q, k, v's shapes, dtypes, devices, the autocast
    region and whether a backward runs are part of what it was built for). ``position_ids`` of
    one row stand for every row, as in transformers. A write into ``position_ids`` that torch does
    not count (through ``.numpy()``, or under ``torch.inference_mode``) goes unseen: pass a new
    tensor for a new batch."""
    if position_ids is None:
        raise ValueError("flexattn plans from position_ids: pass them, or flexattn_plan=packed_plans(...)")
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            "flexattn's plans are for training batches (as many queries as keys); to generate, switch "
            "the model to another implementation: model.set_attn_implementation('sdpa')"
        )
    version = None if position_ids.is_inference() else position_ids._version  # no counter there
    key = (
        version, *(t.shape for t in (q, k, v)), *(t.dtype for t in (q, k, v)), q.device,
        autocast_region_dtype(q.device),
        torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
    )  # fmt: skip
    last = _last_batch
    if getattr(last, "position_ids", None) is not position_ids or last.key != key:
        last.position_ids, last.key, last.plans = position_ids, key, {}
    if window not in last.plans:
        positions = position_ids.expand(q.shape[0], -1)
        last.plans[window] = flexattn.create_mask_plan(_packed_mask(positions, window), q, k, v)
    return last.plans[window]


def packed_plans(
    config, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32
) -> dict[int | None, flexattn.MaskPlan]:
    """The plans of a packed batch, one for each window the model's layers attend within (None:
    no window), each of :func:`_packed_mask`. Only q, k, v's shapes, dtype and device are read,
    so empty stand-ins do; under autocast the plans take the region's dtype themselves."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"]  # Llama's, Mistral's
    windows = {window if kind == "sliding_attention" else None for kind in layer_types}
    batch, seqlen = position_ids.shape
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv = (
        torch.empty(batch, seqlen, heads, head_dim, dtype=dtype, device=position_ids.device)
        for heads in (config.num_attention_heads, config.num_key_value_heads)
    )
    backward = torch.is_grad_enabled()
    return {
        w: flexattn.create_mask_plan(_packed_mask(position_ids, w), q, kv, kv, build_backward=backward)
        for w in windows
    }


def _packed_mask(position_ids: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal attention inside each document, a document starting wherever ``position_ids`` is 0,
    and within ``window`` keys, the query's own included."""
    return masks.document_ids((position_ids == 0).cumsum(-1), window_left=window - 1 if window else None)


def packed_batch(batch: int, seqlen: int, vocab: int, gen: torch.Generator, mean_length: int = 128):
    """Rows of documents of random lengths (``mean_length`` tokens on average), each repeating a
    random pattern of 8 tokens (predictable from its own earlier tokens alone), the position_ids a
    packing collator gives, and labels without each document's first token (predicted from the
    previous document)."""
    tokens, positions = [], []
    for _ in range(batch):
        cuts = torch.randperm(seqlen - 1, generator=gen)[: max(1, seqlen // mean_length)].add(1).sort().values
        bounds = [0, *cuts.tolist(), seqlen]
        for s, e in zip(bounds, bounds[1:], strict=False):
            tokens.append(torch.randint(vocab, (8,), generator=gen).repeat((e - s) // 8 + 1)[: e - s])
            positions.append(torch.arange(e - s))
    tokens, positions = torch.cat(tokens).view(batch, seqlen), torch.cat(positions).view(batch, seqlen)
    return tokens, positions, tokens.masked_fill(positions == 0, -100)


def check(model, reference, tokens, position_ids, autocast, tolerance) -> None:
    """flexattn on the packed batch (the model called as it is: plans from its position_ids) against
    SDPA on each document alone: logits and gradients."""
    # RoPE's cos and sin: a process's first call of each on several CPU threads may run a kernel
    # 1e-4 off (pytorch/pytorch#188792), which the comparison would see as flexattn's error
    unary_dispatch.settle(torch.cos, torch.sin)
    weights = torch.randn(*tokens.shape, model.config.vocab_size, generator=torch.Generator().manual_seed(1))
    weights = weights.to(tokens.device)
    with autocast:
        logits = model(tokens, position_ids=position_ids, use_cache=False).logits
    (logits.float() * weights).sum().backward()
    expected = torch.empty_like(logits, dtype=torch.float32)
    for b, row in enumerate(position_ids.tolist()):
        starts = [i for i, p in enumerate(row) if p == 0] + [len(row)]
        for s, e in zip(starts, starts[1:], strict=False):
            with autocast:
                out = reference(input_ids=tokens[b : b + 1, s:e], use_cache=False).logits[0].float()
            expected[b, s:e] = out
            (out * weights[b, s:e]).sum().backward()
    logit_error = ((logits.float() - expected).abs().max() / expected.abs().max()).item()
    grad_error = max(
        ((p.grad - r.grad).abs().max() / r.grad.abs().max().clamp(min=1e-30)).item()
        for p, r in zip(model.parameters(), reference.parameters(), strict=True)
    )
    print(f"against SDPA per document: logits {logit_error:.1e}, gradients {grad_error:.1e} (relative, max)")
    if max(logit_error, grad_error) > tolerance:
        raise SystemExit(f"flexattn and SDPA differ by more than {tolerance}")
    model.zero_grad()


def train_step(model, optimizer, tokens, position_ids, labels, autocast, flexattn_model=True) -> torch.Tensor:
    """One step on a packed batch: its plans (a flexattn model's, built once a batch for every
    layer), forward, backward, optimizer step. Returns the loss."""
    with autocast:
        plans = {"flexattn_plan": packed_plans(model.config, position_ids)} if flexattn_model else {}
        loss = model(tokens, position_ids=position_ids, labels=labels, use_cache=False, **plans).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


#: Mistral is Llama with a sliding window; Qwen2 takes one on the layers its layer_types name
MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--model", choices=MODELS, default="llama",
        help="mistral: every layer within --window keys; qwen2: every other layer",
    )  # fmt: skip
    parser.add_argument("--window", type=int, default=48, help="mistral's and qwen2's sliding_window")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--autocast", action="store_true", help="bf16 autocast on the CPU (always on CUDA)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = dict(
        hidden_size=args.dim, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        intermediate_size=4 * args.dim, num_hidden_layers=args.layers, vocab_size=256,
    )  # fmt: skip
    Config, Model = MODELS[args.model]
    if args.model != "llama":
        config["sliding_window"] = args.window
    if args.model == "qwen2":
        alternate = ["sliding_attention", "full_attention"] * args.layers
        config.update(use_sliding_window=True, layer_types=alternate[: args.layers])
    model = Model(Config(**config, attn_implementation="flexattn")).to(device)
    reference = Model(Config(**config, attn_implementation="sdpa")).to(device)
    reference.load_state_dict(model.state_dict())
    half = device.type == "cuda" or args.autocast  # fp32 weights, bf16 matmuls and attention
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=half)
    gen = torch.Generator().manual_seed(0)
    tokens, position_ids, _ = (t.to(device) for t in packed_batch(args.batch, args.seqlen, 256, gen))
    check(model, reference, tokens, position_ids, autocast, 3e-2 if half else 1e-4)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = [t.to(device) for t in packed_batch(args.batch, args.seqlen, 256, gen)]
        loss = train_step(model, optimizer, *batch, autocast)
        if step == args.steps or step % 10 == 0:
            elapsed = (time.perf_counter() - start) / step
            print(f"step {step}: loss {loss.item():.3f}, {1e3 * elapsed:.1f} ms a step")


if __name__ == "__main__":
    main()
