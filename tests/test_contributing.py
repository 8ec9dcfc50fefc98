"""CONTRIBUTING.md names what exists: every repository path it gives and every nox session it runs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "CONTRIBUTING.md").read_text()


def _nox_sessions() -> set[str]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any("nox.session" in ast.unparse(d) for d in node.decorator_list)
    }


def test_the_paths_it_names_exist():
    repo_paths = re.findall(r"\b((?:packages|tests|benchmarks|examples)/[\w./-]*[\w/])", TEXT)
    module_paths = re.findall(r"`((?:maskplan|flexattn)_\w+/[\w/]+\.py)`", TEXT)  # under a package's src/
    assert len(repo_paths) > 10 and module_paths
    files = re.findall(r"`([\w.-]+\.(?:py|md|toml|ini)|\.ci/run)`", TEXT)  # named alone, somewhere
    files.remove("utils.py")  # the style rule's file not to write
    assert "ruff.toml" in files and "bench_plan_cpu.py" in files
    missing = [p for p in repo_paths if not (ROOT / p).exists()]
    missing += [p for p in module_paths if not any(ROOT.glob(f"packages/*/src/{p}"))]
    missing += [p for p in files if not any(ROOT.glob(p)) and not any(ROOT.glob(f"**/{p}"))]
    assert not missing, f"CONTRIBUTING.md names paths that do not exist: {missing}"


def test_the_nox_sessions_it_runs_exist():
    named = set(re.findall(r"nox -s (\w+)", TEXT))
    for row in re.findall(r"^\|[^|\n]*\|[^|\n]*\| ([^|\n]*) \|$", TEXT, re.M):  # the table's test column
        named |= set(re.findall(r"`(\w+)`", row.split("(")[0]))
    assert {"core", "sm90", "bench", "integration"} <= named
    assert named <= _nox_sessions(), f"not nox sessions: {sorted(named - _nox_sessions())}"
