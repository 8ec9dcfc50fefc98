"""examples/transformers_packed.py: a Hugging Face transformers model attending through flexattn.

transformers is no dependency of flexattn; CI's integration session installs it (noxfile.py) for
this example, which checks its own logits and gradients against SDPA run on each document alone
and exits non-zero past its tolerance."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo.testing

import flexattn

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import transformers_packed as example  # noqa: E402  (registers attn_implementation="flexattn")

EXAMPLE = example.__file__


@pytest.mark.slow
@pytest.mark.parametrize(
    "args", [["--model", "llama"], ["--model", "mistral"], ["--model", "qwen2", "--autocast"]], ids=" ".join
)
def test_the_example_matches_sdpa_per_document_and_trains(args):
    """Llama (no window), Mistral (every layer windowed), Qwen2 (every other layer) under bf16
    autocast, where float32 RoPE leaves q and k in float32 beside a bfloat16 v."""
    run = subprocess.run(
        [sys.executable, EXAMPLE, "--seqlen", "256", "--steps", "2", *args],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "against SDPA per document" in run.stdout and "step 2: loss" in run.stdout


#: a tiny model's sizes (transformers' configs take them all)
SIZES = dict(
    hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
    num_hidden_layers=2, vocab_size=64, attn_implementation="flexattn",
)  # fmt: skip


def _qwen2_with_two_windows():
    """Qwen2 with a window of 8 keys on its first layer and none on its second."""
    layer_types = ["sliding_attention", "full_attention"]
    windows = dict(sliding_window=8, use_sliding_window=True, layer_types=layer_types)
    config = transformers.Qwen2Config(**SIZES, **windows)
    return transformers.Qwen2ForCausalLM(config)


def test_the_attention_function_refuses_what_it_cannot_run():
    """A layer whose window has no plan, attention dropout in training, layers that attend both
    ways, a call without position_ids or plans, and generation are told so (not run without what
    they ask)."""
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES))
    tokens, positions = torch.randint(64, (1, 32)), torch.arange(32)[None]
    plans = example.packed_plans(model.config, positions)
    windowed = transformers.MistralForCausalLM(transformers.MistralConfig(**SIZES, sliding_window=8))
    with pytest.raises(ValueError, match=r"sliding_window=8, but flexattn_plan has plans for \[None\]"):
        windowed(tokens, position_ids=positions, flexattn_plan=plans, use_cache=False)
    with pytest.raises(ValueError, match="flexattn plans from position_ids"):
        example.flexattn_attention(model.model.layers[0].self_attn, *[torch.zeros(1, 2, 4, 16)] * 3, None)
    with pytest.raises(ValueError, match=r"set_attn_implementation\('sdpa'\)"):
        model.eval().generate(tokens, max_new_tokens=2, do_sample=False)
    for layer in model.model.layers:
        layer.self_attn.is_causal = False
    with pytest.raises(ValueError, match="attends both ways"):
        model(tokens, position_ids=positions, flexattn_plan=plans, use_cache=False)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match="no attention dropout"):
        model.train()(tokens, position_ids=positions, flexattn_plan=plans, use_cache=False)


def test_a_model_called_as_it_is_plans_once_a_forward(monkeypatch):
    """Without flexattn_plan, a forward's first layer of each window builds its plan from
    position_ids and the others reuse it (a checkpointed layer's recompute too): the plans, and so
    the logits and gradients, are packed_plans' own. Another batch's position_ids, even of the
    same values, get new plans."""
    builds = []
    build = flexattn.create_mask_plan
    monkeypatch.setattr(flexattn, "create_mask_plan", lambda *a, **kw: builds.append(1) or build(*a, **kw))
    model = _qwen2_with_two_windows()
    gen = torch.Generator().manual_seed(0)
    tokens, positions, labels = example.packed_batch(2, 64, 64, gen, mean_length=16)

    def loss_and_grads(**plans):
        model.zero_grad()
        loss = model(tokens, position_ids=positions, labels=labels, use_cache=False, **plans).loss
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    explicit = loss_and_grads(flexattn_plan=example.packed_plans(model.config, positions))
    assert len(builds) == 2
    builds.clear()
    model.gradient_checkpointing_enable()
    as_it_is = loss_and_grads()
    assert len(builds) == 2  # one a window, whatever the layers and the recompute
    for a, b in zip(as_it_is, explicit, strict=True):
        assert torch.equal(a, b)
    builds.clear()
    positions = positions.clone()
    loss_and_grads()
    assert len(builds) == 2


def test_a_model_called_as_it_is_under_inference_mode_and_without_position_ids():
    """Under torch.inference_mode (position_ids without a version counter), and without
    position_ids (transformers numbers one row for every row: one document a row), the logits are
    those of the plans built by hand."""
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES)).eval()
    gen = torch.Generator().manual_seed(0)
    tokens, positions, _ = example.packed_batch(2, 64, 64, gen, mean_length=16)
    with torch.no_grad():
        expected = model(tokens, position_ids=positions, use_cache=False).logits
        unpacked = torch.arange(64).expand(2, -1)
        plans = example.packed_plans(model.config, unpacked)
        causal = model(tokens, position_ids=unpacked, flexattn_plan=plans, use_cache=False).logits
    with torch.inference_mode():
        assert torch.equal(model(tokens, position_ids=positions.clone(), use_cache=False).logits, expected)
        assert torch.equal(model(tokens, use_cache=False).logits, causal)


@pytest.mark.slow
def test_a_model_called_as_it_is_under_torch_compile_plans_each_batch(monkeypatch):
    """Compiled without fullgraph (Trainer's torch_compile), the plans from position_ids are built
    outside the graph, for each batch: a graph that built them once would keep the first batch's."""
    builds = []
    build = flexattn.create_mask_plan
    monkeypatch.setattr(flexattn, "create_mask_plan", lambda *a, **kw: builds.append(1) or build(*a, **kw))
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        tokens, positions, labels = example.packed_batch(2, 64, 64, gen, mean_length=16)
        builds.clear()
        run = dict(position_ids=positions, labels=labels, use_cache=False)
        assert torch.equal(compiled(tokens, **run).loss, model(tokens, **run).loss)
        assert len(builds) == 1  # the compiled call's; the eager call reused it (one position_ids)


@pytest.mark.slow
def test_the_whole_model_compiles_with_the_plans_as_inputs():
    """torch.compile(fullgraph=True) of the model under bf16 autocast: each batch's new plans enter
    the one graph as inputs, and the loss is the eager model's."""
    config = transformers.LlamaConfig(**SIZES)
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
