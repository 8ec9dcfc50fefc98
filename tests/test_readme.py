"""The README's usage example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_usage_example_runs():
    block = re.search(r"## Usage \(runs on CPU\)\n\n```python\n(.*?)```", README.read_text(), re.S)
    assert block, "README.md lost its usage example"
    scope: dict = {}
    exec(compile(block.group(1), str(README), "exec"), scope)
    assert scope["dense"].shape == (1, 2 * 1024, 1024)
    assert scope["q"].grad is not None and scope["lse"].shape == (2, 4, 1024)


def test_facade_package_readme_example_runs():
    path = Path(__file__).resolve().parents[1] / "packages" / "flexattn" / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
    assert blocks, f"{path} lost its example"
    scope: dict = {}
    for block in blocks:
        exec(compile(block, str(path), "exec"), scope)
    assert scope["q"].grad is not None and scope["out"].shape == (2, 1024, 4, 64)
