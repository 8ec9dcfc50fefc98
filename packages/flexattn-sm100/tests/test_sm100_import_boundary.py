"""Importing the SM100 consumer (and maskplan_core) pulls in neither CuTe DSL nor another consumer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[2]
SRC_PATHS = [PACKAGES / "maskplan-core" / "src", PACKAGES / "flexattn-sm100" / "src"]


def imported_modules(*modules: str) -> set[str]:
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "print('\\n'.join(sys.modules))"
    path = os.pathsep.join([*map(str, SRC_PATHS), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


def test_no_cutlass_and_no_other_consumer():
    mods = imported_modules("maskplan_core", "flexattn_sm100", "flexattn_sm100.consumer")
    assert "flexattn_sm100.payload_layout" in mods
    # (nvidia_cutlass_dsl itself may be present: its .pth file imports it at interpreter start-up to
    # put the DSL on sys.path; the DSL is the `cutlass` package)
    assert not {m for m in mods if m == "cutlass" or m.startswith("cutlass.")}
    assert not {m for m in mods if m.startswith("flexattn_sm90")}
