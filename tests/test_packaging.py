"""What each package's wheel tells pip and type checkers: its version (as its module reports it), its
README, the ``py.typed`` marker, and the consumers' entry points."""

from __future__ import annotations

import importlib
from importlib.metadata import version
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PACKAGES = Path(__file__).parents[1] / "packages"
MODULES = {
    "maskplan-core": "maskplan_core",
    "maskplan-kernels": "maskplan_kernels",
    "flexattn-sm90": "flexattn_sm90",
    "flexattn-sm100": "flexattn_sm100",
    "flexattn": "flexattn",
}
CONSUMERS = {
    "maskplan-core": {"reference": "maskplan_core.reference.consumer:ReferenceConsumer"},
    "flexattn-sm90": {"sm90": "flexattn_sm90.consumer:Sm90Consumer"},
    "flexattn-sm100": {"sm100": "flexattn_sm100.consumer:Sm100Consumer"},
}


@pytest.mark.parametrize("dist", MODULES)
def test_a_package_ships_its_version_readme_and_type_marker(dist):
    root = PACKAGES / dist
    meta = tomllib.loads((root / "pyproject.toml").read_text())
    project, module = meta["project"], MODULES[dist]
    assert importlib.import_module(module).__version__ == project["version"] == version(dist)
    assert (root / project["readme"]).is_file()
    assert (root / "src" / module / "py.typed").is_file()
    assert "py.typed" in meta["tool"]["setuptools"]["package-data"][module]
    assert project.get("entry-points", {}).get("maskplan.consumers", {}) == CONSUMERS.get(dist, {})
