"""Import boundaries of the monorepo (ARCHITECTURE.md "The house").

Dependencies point down only: ``flexattn -> flexattn_sm90 | flexattn_sm100 -> maskplan_kernels ->
maskplan_core``. ``maskplan_core`` never imports CuTe DSL, a consumer never imports another
consumer, and importing the CPU layers pulls in no GPU compiler stack.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[1] / "packages"
GPU_STACKS = ("cutlass", "triton")
SOURCE_DIRS = {
    "maskplan_core": PACKAGES / "maskplan-core" / "src" / "maskplan_core",
    "maskplan_kernels": PACKAGES / "maskplan-kernels" / "src" / "maskplan_kernels",
    "flexattn_sm90": PACKAGES / "flexattn-sm90" / "src" / "flexattn_sm90",
    "flexattn_sm100": PACKAGES / "flexattn-sm100" / "src" / "flexattn_sm100",
    "flexattn": PACKAGES / "flexattn" / "src" / "flexattn",
}
CONSUMERS = ("flexattn_sm90", "flexattn_sm100")
#: package -> top-level modules its source must never import
FORBIDDEN = {
    "maskplan_core": ("flexattn", "flexattn_sm90", "flexattn_sm100", "maskplan_kernels", "cutlass"),
    "maskplan_kernels": ("flexattn", "flexattn_sm90", "flexattn_sm100"),
    "flexattn_sm90": ("flexattn", "flexattn_sm100"),
    "flexattn_sm100": ("flexattn", "flexattn_sm90"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a file, including
    ``importlib.import_module("x")`` / ``__import__("x")`` with a literal name."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def violations(package: str) -> list[str]:
    root = SOURCE_DIRS[package]
    bad = []
    for path in sorted(root.rglob("*.py")):
        for line, module in imported_modules(path):
            if module.split(".")[0] in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(PACKAGES)}:{line} imports {module}")
    return bad


def fresh_interpreter_modules(*imports: str) -> list[str]:
    """Top-level names of GPU stacks present in sys.modules after ``imports`` in a new interpreter."""
    code = (
        "import json, sys\n"
        + "".join(f"import {name}\n" for name in imports)
        + f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {GPU_STACKS!r})))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_maskplan_core_pulls_in_no_gpu_stack():
    assert fresh_interpreter_modules("maskplan_core", "maskplan_core.reference", "maskplan_core.masks") == []


def test_importing_flexattn_pulls_in_no_gpu_stack():
    assert fresh_interpreter_modules("flexattn", "flexattn.masks") == []


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_importing_a_consumer_pulls_in_no_gpu_stack(consumer):
    """Consumers load CuTe DSL when a kernel is first used, not on import (entry-point lookup
    imports every installed consumer)."""
    pytest.importorskip(consumer)
    assert fresh_interpreter_modules(consumer, f"{consumer}.consumer", f"{consumer}.payload_layout") == []


def test_maskplan_core_source_exists():
    files = list(SOURCE_DIRS["maskplan_core"].rglob("*.py"))
    assert len(files) > 5, "maskplan_core sources not found; is the layout packages/maskplan-core/src/?"
    assert any(module == "torch" for f in files for _, module in imported_modules(f))  # the scan sees imports


@pytest.mark.parametrize("package", list(FORBIDDEN))
def test_source_imports_point_down_only(package):
    if not SOURCE_DIRS[package].is_dir():
        pytest.skip(f"{package} has no sources yet")
    assert violations(package) == []


def test_consumers_never_import_each_other():
    present = [c for c in CONSUMERS if SOURCE_DIRS[c].is_dir()]
    if not present:
        pytest.skip("no consumer package sources yet")
    for consumer in present:
        others = set(CONSUMERS) - {consumer}
        for path in SOURCE_DIRS[consumer].rglob("*.py"):
            for line, module in imported_modules(path):
                assert module.split(".")[0] not in others, f"{path}:{line} imports {module}"


def test_scanner_catches_every_import_form(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import os\nimport cutlass.cute as cute\nfrom flexattn import x\nfrom . import sibling\n"
        "import importlib\nmod = importlib.import_module('flexattn_sm100.kernel')\n"
        "def f():\n    from maskplan_kernels.scan import y\n    return __import__('triton')\n",
        encoding="utf-8",
    )
    names = sorted(m for _, m in imported_modules(src))  # relative imports are in-package: not listed
    expected = ["os", "cutlass.cute", "flexattn", "importlib", "flexattn_sm100.kernel"]
    assert names == sorted([*expected, "maskplan_kernels.scan", "triton"])
