"""Test support shared by the compile tests of this package and of the consumers (flexattn-sm90,
flexattn-sm100): ptxas's resource report on a compiled kernel's PTX. Standard library only; it needs
``ptxas`` on PATH for a report, never a GPU.

::

    compiled = cute.compile(..., options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}")
    assert_ptxas_clean(compiled.__ptx__, "sm_90a", tmp_path)
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

#: what ``ptxas -v`` prints for a kernel without register spills
NO_SPILLS = "0 bytes spill stores, 0 bytes spill loads"
#: ptxas's notes when it serialises WGMMAs: wgmma.mma_async serialised / warpgroup.wait injected
WGMMA_SERIALISED = ("(C7515)", "(C7517)")


def ptxas_report(ptx: str, arch: str, workdir: str | os.PathLike) -> str | None:
    """``ptxas -v``'s report (registers, spills, SMEM) of ``ptx`` assembled for ``arch`` (e.g.
    ``"sm_90a"``), or None when ptxas is not on PATH. The PTX is written to ``workdir/kernel.ptx``;
    a ptxas error raises :class:`subprocess.CalledProcessError`."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    src = Path(workdir) / "kernel.ptx"
    src.write_text(ptx)
    run = subprocess.run(
        [ptxas, f"-arch={arch}", "-v", str(src), "-o", os.devnull], capture_output=True, text=True, check=True
    )
    return run.stderr + run.stdout


def assert_ptxas_clean(ptx: str, arch: str, workdir: str | os.PathLike) -> None:
    """Assert ptxas reports no register spills for ``ptx`` and did not serialise a WGMMA pipeline
    (C7515, or a C7517 wait it injected: a GEMM the kernel meant to overlap would then run alone).
    Nothing is checked without ptxas."""
    report = ptxas_report(ptx, arch, workdir)
    if report is not None:
        assert NO_SPILLS in report, report
        serialised = [line for line in report.splitlines() if any(code in line for code in WGMMA_SERIALISED)]
        assert not serialised, "\n".join(serialised)


__all__ = ["NO_SPILLS", "assert_ptxas_clean", "ptxas_report"]
