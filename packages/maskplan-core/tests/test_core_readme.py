"""The package README's library-author example (a consumer of its own, maskplan-core alone) runs
as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_consumer_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README.md lost its example"
    scope: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), scope)
    assert scope["fwd"].signature.kernel_family == "mine-v1"
    assert scope["out"].shape == (2 * 200, 2, 16)
    fields = {d.field for d in scope["refused"].diffs}  # the reference's plan, refused by MyConsumer
    assert {"arch_family", "kernel_family", "topology.tile_m", "topology.tile_n"} <= fields
    # the remedy names what this package has, not only the facade's create_mask_plan
    assert "build_plan and resolve (maskplan-core)" in str(scope["refused"])
    assert "scheduler_layout" in fields  # the README's comment lists it
