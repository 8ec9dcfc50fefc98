"""examples/transformers_packed.py: a Hugging Face transformers model attending through flexattn.

transformers is no dependency of flexattn; CI's integration session installs it (noxfile.py) for
this example, which checks its own logits and gradients against SDPA run on each document alone
and exits non-zero past its tolerance."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo.testing

transformers = pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "transformers_packed.py"


@pytest.mark.slow
@pytest.mark.parametrize(
    "args", [["--model", "llama"], ["--model", "mistral"], ["--model", "qwen2", "--autocast"]], ids=" ".join
)
def test_the_example_matches_sdpa_per_document_and_trains(args):
    """Llama (no window), Mistral (every layer windowed), Qwen2 (every other layer) under bf16
    autocast, where float32 RoPE leaves q and k in float32 beside a bfloat16 v."""
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--seqlen", "256", "--steps", "2", *args],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "against SDPA per document" in run.stdout and "step 2: loss" in run.stdout


def _example():
    spec = importlib.util.spec_from_file_location("transformers_packed", EXAMPLE)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # importable (torch.compile)
    spec.loader.exec_module(module)  # registers attn_implementation="flexattn"
    return module


def test_the_attention_function_refuses_what_it_cannot_run():
    """A model called without its plans, with none for a layer's window, with attention dropout in
    training, or with layers that attend both ways, is told so (not run without what it asks)."""
    example = _example()
    sizes = dict(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        num_hidden_layers=1, vocab_size=64, attn_implementation="flexattn",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    tokens, positions = torch.randint(64, (1, 32)), torch.arange(32)[None]
    with pytest.raises(ValueError, match="flexattn_plan=packed_plans"):
        model(tokens, position_ids=positions, use_cache=False)
    plans = example.packed_plans(model.config, positions)
    logits = model(tokens, position_ids=positions, flexattn_plan=plans, use_cache=False).logits
    assert logits.shape == (1, 32, 64)
    windowed = transformers.MistralForCausalLM(transformers.MistralConfig(**sizes, sliding_window=8))
    with pytest.raises(ValueError, match=r"sliding_window=8, but flexattn_plan has plans for \[None\]"):
        windowed(tokens, position_ids=positions, flexattn_plan=plans, use_cache=False)
    for layer in model.model.layers:
        layer.self_attn.is_causal = False
    with pytest.raises(ValueError, match="attends both ways"):
        model(tokens, position_ids=positions, flexattn_plan=plans, use_cache=False)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match="no attention dropout"):
        model.train()(tokens, position_ids=positions, flexattn_plan=plans, use_cache=False)


@pytest.mark.slow
def test_the_whole_model_compiles_with_the_plans_as_inputs():
    """torch.compile(fullgraph=True) of the model under bf16 autocast: each batch's new plans enter
    the one graph as inputs, and the loss is the eager model's."""
    example = _example()
    config = transformers.LlamaConfig(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        num_hidden_layers=1, vocab_size=64, attn_implementation="flexattn",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    torch._dynamo.reset()
    backend = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        tokens, positions, labels = example.packed_batch(2, 128, 64, gen, mean_length=32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plans = example.packed_plans(config, positions)
            run = dict(position_ids=positions, labels=labels, flexattn_plan=plans, use_cache=False)
            assert torch.equal(compiled(tokens, **run).loss, model(tokens, **run).loss)
    assert backend.frame_count == 1
