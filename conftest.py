"""Repository-wide pytest setup, loaded for every test directory (the rootdir holds pytest.ini).

The on-disk compile cache (on by default) is pointed at a directory of the test session unless
FLEXATTN_CACHE_DIR is set, so tests never read or fill the user's ``~/.cache/flexattn``.

Markers:
  gpu   needs a CUDA GPU; skipped (with the reason) where torch.cuda.is_available() is False.
  slow  takes more than a few seconds on the 2-core CI machine; deselect with -m "not slow".
"""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped where torch.cuda.is_available() is False")
    config.addinivalue_line("markers", "slow: long on the 2-core CI machine; deselect with -m 'not slow'")


@pytest.fixture(autouse=True, scope="session")
def _session_compile_cache(tmp_path_factory: pytest.TempPathFactory):
    if "FLEXATTN_CACHE_DIR" in os.environ:
        yield
        return
    os.environ["FLEXATTN_CACHE_DIR"] = str(tmp_path_factory.mktemp("flexattn-cache"))
    yield
    os.environ.pop("FLEXATTN_CACHE_DIR", None)


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
