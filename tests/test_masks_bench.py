"""benchmarks/masks_bench.py: the masks the GPU benchmarks' ``--masks`` name, built on the CPU, and
the names refused before any work starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_fwd_sm90  # noqa: E402
from masks_bench import MASK_NAMES, MASKS, PLAN_MASKS, documents_of, endpoint_mask, plan_bench_mask  # noqa: E402

from flexattn import masks  # noqa: E402

B, S = 2, 4096


def test_the_parametrised_forms_are_the_builders_masks():
    assert torch.equal(
        endpoint_mask("sliding-256", B, S, "cpu"), masks.sliding_window(S, window_left=256, batch=B)
    )
    assert torch.equal(endpoint_mask("chunked-1024", B, S, "cpu"), masks.chunked(S, 1024, batch=B))
    assert torch.equal(endpoint_mask("prefix-lm", B, S, "cpu"), masks.prefix_lm(S, S // 4, batch=B))
    assert endpoint_mask("random-3", B, S, "cpu").shape == (1, 3, B * S)


def test_short_documents_are_short_and_causal():
    docs = documents_of("document-short", B, S)
    assert [sum(row) for row in docs] == [S] * B
    assert all(64 <= n <= 512 for row in docs for n in row[:-1]) and len(docs[0]) > S // 512
    want = masks.document(docs, causal=True)
    assert torch.equal(endpoint_mask("document-short", B, S, "cpu"), want)
    assert documents_of("document", B, S) != docs and documents_of("sliding-1024", B, S) is None
    local = torch.arange(S).repeat(B)
    assert bool((want[0, -1] <= local + 1).all())  # causal: no row sees past itself


@pytest.mark.parametrize(
    "name", [*MASK_NAMES, "sliding-1", "random-7", "document-short", "prefix-lm", "chunked-64"]
)
def test_every_form_is_taken(name):
    assert name in MASKS
    assert bench_fwd_sm90.known_names(bench_fwd_sm90.make_parser("x"), "--masks", name, MASKS) == [name]


@pytest.mark.parametrize(
    "name", ["sliding-0", "sliding-", "random-4", "random-0", "chunked-x", "document-long", "banded"]
)
def test_other_names_are_refused_with_the_forms(name, capsys):
    assert name not in MASKS
    with pytest.raises(ValueError, match="sliding-<W>"):
        endpoint_mask(name, B, S, "cpu")
    with pytest.raises(SystemExit):
        bench_fwd_sm90.known_names(bench_fwd_sm90.make_parser("x"), "--masks", f"causal,{name}", MASKS)
    err = capsys.readouterr().err
    assert (
        repr(name) in err and "random-<N>" in err and "'causal'" not in err.split("unknown")[1].split(";")[0]
    )


def test_the_plan_benchmarks_masks():
    """bench_plan_cpu.py's and bench_plan_gpu.py's masks: one generator, seeded, documents of 2 to 32
    a sample summing to S (their lengths returned for torch's mask_mod), an unknown name refused."""
    for name in PLAN_MASKS:
        mask, docs = plan_bench_mask(name, B, S, seed=3)
        assert torch.equal(mask, plan_bench_mask(name, B, S, seed=3)[0]) and mask.shape[-1] == B * S
        assert (docs is not None) == (name == "document")
    _, docs = plan_bench_mask("document", B, S, seed=3)
    assert all(sum(row) == S and 2 <= len(row) <= 32 for row in docs)
    with pytest.raises(ValueError, match="random-5"):
        plan_bench_mask("random-7", B, S, seed=0)
