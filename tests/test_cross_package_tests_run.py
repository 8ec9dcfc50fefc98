"""A package's test that needs another local package skips itself in that package's CI session
(which installs the package and its dependencies only), so CI must run it elsewhere: every such
test (a ``pytest.importorskip`` of another local package, or a test file that imports one in a
``try``) is in the noxfile's
``CROSS_PACKAGE_TESTS``, which the integration session runs with every package installed. GPU test
files are exempt: they run on the GPU machine, where every package is installed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cross_package_tests() -> set[str]:
    """``path::function`` of the package tests that import-or-skip another local package."""
    own = {
        pkg: {p.parent.name for p in (pkg / "src").glob("*/__init__.py")}
        for pkg in (ROOT / "packages").iterdir()
    }
    local = set().union(*own.values())
    found = set()
    for pkg, modules in own.items():
        for path in sorted((pkg / "tests").glob("test_*.py")):
            if path.stem.endswith("_gpu"):
                continue
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if not isinstance(node, ast.FunctionDef):
                    continue
                for call in ast.walk(node):
                    if (
                        isinstance(call, ast.Call)
                        and isinstance(call.func, ast.Attribute)
                        and call.func.attr == "importorskip"
                        and call.args
                        and isinstance(call.args[0], ast.Constant)
                    ):
                        top = call.args[0].value.split(".")[0]
                        if top in local and top not in modules:
                            found.add(f"{path.relative_to(ROOT)}::{node.name}")
            module_level = re.search(r"^\w+ = pytest\.importorskip\(\"(\w+)", path.read_text(), re.M)
            if module_level and module_level.group(1) in local - modules:
                found.add(str(path.relative_to(ROOT)))
            if _tries_to_import(tree) & (local - modules):  # its tests skip themselves without it
                found.add(str(path.relative_to(ROOT)))
    return found


def _tries_to_import(tree: ast.Module) -> set[str]:
    """Top-level packages a module imports inside a ``try``, at module level (``try: import
    flexattn / except ImportError: flexattn = None``, then ``skipif(flexattn is None)`` on some
    tests) or in a function (a helper adding another package's cases to a parametrization where it
    imports: without it they are not skipped but never made)."""
    names = set()
    tried = (stmt for node in ast.walk(tree) if isinstance(node, ast.Try) for stmt in node.body)
    for top in tried:
        for stmt in ast.walk(top):
            if isinstance(stmt, ast.Import):
                names.update(alias.name.split(".")[0] for alias in stmt.names)
            elif isinstance(stmt, ast.ImportFrom) and stmt.module and not stmt.level:
                names.add(stmt.module.split(".")[0])
    return names


def _listed() -> set[str]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "CROSS_PACKAGE_TESTS" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    raise AssertionError("noxfile.py lost CROSS_PACKAGE_TESTS")


def test_every_cross_package_test_runs_in_ci():
    found, listed = _cross_package_tests(), _listed()
    assert found, "the scan found no cross-package test at all: it is broken"
    assert found <= listed, f"not run by any CI session: {sorted(found - listed)}"
    stale = sorted(listed - found)
    assert not stale, f"CROSS_PACKAGE_TESTS names tests that are not cross-package: {stale}"
