"""What a static type checker (mypy) sees of the public API: the wrappers that run the mask builders
eagerly under ``torch.compile`` and refuse torch's keywords keep their functions' signatures, and
``flex_attn_func``'s return type follows its flags. Before, mypy typed ``flex_attn_func`` and every
``flexattn.masks`` builder as ``Any``: no completion, and no error for a wrong keyword."""

from __future__ import annotations

import inspect
import re
import sys

import pytest

import flexattn
from flexattn import masks

mypy_api = pytest.importorskip("mypy.api", reason="mypy comes with flexattn's test extra")
pytestmark = pytest.mark.slow  # a cold mypy run: about 10-15 s


USER_CODE = """\
import maskplan_core.masks
import torch
import flexattn
from flexattn import masks

q = torch.randn(1, 64, 2, 16)
plan = flexattn.create_mask_plan(masks.causal(64, batch=1), q, q, q)
reveal_type(flexattn.flex_attn_func(q, q, q, mask_plan=plan))
reveal_type(flexattn.flex_attn_func(q, q, q, mask_plan=plan, return_lse=True))
reveal_type(flexattn.flex_attn_func(q, q, q, mask_plan=plan, return_max_logit=True))
reveal_type(flexattn.flex_attn_func(q, q, q, mask_plan=plan, return_lse=True, return_max_logit=True))
flag = q.numel() > 0
reveal_type(flexattn.flex_attn_func(q, q, q, mask_plan=plan, return_lse=flag))
flexattn.flex_attn_func(q, q, q, mask_plan=plan, block_mask=None)  # line 14: torch's keyword
flexattn.flex_attn_func(q, q, q, mask_plan=plan, softmax_scale="0.1")  # line 15: not a float
"""
T = "torch._tensor.Tensor"
FLAG_RETURNS = [T, f"tuple[{T}, {T}]", f"tuple[{T}, {T}]", f"tuple[{T}, {T}, {T}]", f"{T} | tuple[{T}, ...]"]


#: what a library author implements or calls to run plans with kernels of its own (maskplan-core)
CONSUMER_ABI = [
    "maskplan_core.Consumer.build_plan", "maskplan_core.Consumer.forward", "maskplan_core.Consumer.backward",
    "maskplan_core.require_view_signature",
]


def _public_functions() -> list[str]:
    """flexattn's functions, its mask builders, the consumer ABI, then maskplan-core's builders (which
    flexattn's wrap: a wrapper must show what it wraps)."""
    names = [f"flexattn.{n}" for n in flexattn.__all__ if inspect.isfunction(getattr(flexattn, n))]
    names += [f"flexattn.masks.{n}" for n in masks.__all__] + CONSUMER_ABI
    return names + [f"maskplan_core.masks.{n}" for n in masks.__all__]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> list[str]:
    """mypy's report lines on USER_CODE, then a reveal_type of every public function (one run: a
    cold one reads torch's annotations for about 15 s), checked against the installed packages."""
    tmp = tmp_path_factory.mktemp("mypy")
    path = tmp / "user_code.py"
    reveals = "".join(f"reveal_type({n})\n" for n in _public_functions())
    path.write_text(USER_CODE + reveals)
    args = ["--python-executable", sys.executable, "--follow-imports=silent", "--no-error-summary"]
    stdout, stderr, _ = mypy_api.run(args + ["--cache-dir", str(tmp / "cache"), str(path)])
    assert not stderr, stderr
    return stdout.splitlines()


def _revealed(lines: list[str]) -> list[str]:
    return [m.group(1) for m in map(re.compile(r'Revealed type is "(.*)"$').search, lines) if m]


def test_every_public_function_keeps_its_signature(report):
    names = _public_functions()
    assert {"flexattn.flex_attn_func", "flexattn.create_mask_plan", "flexattn.masks.causal"} <= set(names)
    revealed = _revealed(report)[len(FLAG_RETURNS) :]
    assert len(revealed) == len(names)
    for name, typ in zip(names, revealed, strict=True):
        assert typ.startswith(("def ", "Overload(")), f"mypy sees {name} as {typ}"
        assert name not in CONSUMER_ABI or "Any" not in typ, f"mypy sees {name} as {typ}"
    seen = dict(zip(names, revealed, strict=True))
    for n in masks.__all__:
        assert seen[f"flexattn.masks.{n}"] == seen[f"maskplan_core.masks.{n}"], n


def test_flex_attn_func_returns_what_its_flags_ask_for(report):
    assert _revealed(report)[: len(FLAG_RETURNS)] == FLAG_RETURNS


def test_wrong_arguments_are_flagged(report):
    errors = [line for line in report if ": error:" in line]
    assert {int(line.split(":")[1]) for line in errors} == {14, 15}, errors
    assert any('keyword argument "block_mask"' in line for line in errors), errors
