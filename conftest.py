"""Repository-wide pytest setup, loaded for every test directory (the rootdir holds pytest.ini).

Markers:
  gpu   needs a CUDA GPU; skipped (with the reason) where torch.cuda.is_available() is False.
  slow  takes more than a few seconds on the 2-core CI machine; deselect with -m "not slow".
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped where torch.cuda.is_available() is False")
    config.addinivalue_line("markers", "slow: long on the 2-core CI machine; deselect with -m 'not slow'")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # only when a gpu test was collected

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: torch.cuda.is_available() is False on this machine")
    for item in gpu_items:
        item.add_marker(skip)
