"""Test support shared by the compile tests of this package and of the consumers (flexattn-sm90,
flexattn-sm100): ptxas's resource report on a compiled kernel's PTX, the PTX-order check of a
kernel launched with programmatic dependent launch, and the check that an SMEM operand tile is the
row view the tail zeroing takes (``stage_fill.row_view``), and counts of PTX instructions the
consumers' compile tests compare between kernel variants. Standard library only; it needs
``ptxas`` on PATH for a report, never a GPU.

::

    compiled = cute.compile(..., options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}")
    assert_ptxas_clean(compiled.__ptx__, "sm_90a", tmp_path)
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

#: a PTX module's ISA version line
PTX_VERSION = re.compile(r"^\.version (\d+\.\d+)", re.MULTILINE)
#: ``ptxas -v``'s spill line of a kernel
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
#: ptxas's notes when it serialises WGMMAs: for want of registers / wgmma.mma_async serialised /
#: warpgroup.wait injected
WGMMA_SERIALISED = ("(C7512)", "(C7515)", "(C7517)")
#: a WGMMA of a bf16 / fp16 kernel, its shape as group 1
WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)\.f32\.(?:bf16|f16)")
#: an integer division or remainder by a value known only at run time (a static divisor is a
#: shift or a multiply by then)
INTEGER_DIVISION = re.compile(r"\b(?:div|rem)\.[su](?:32|64)\b")


def wgmma_shapes(ptx: str) -> dict[str, int]:
    """How many WGMMAs of each shape (``m64n128k16``, ...) the PTX holds."""
    shapes: dict[str, int] = {}
    for m in WGMMA.finditer(ptx):
        shapes[m.group(1)] = shapes.get(m.group(1), 0) + 1
    return shapes


def integer_divisions(ptx: str) -> int:
    """How many 32- and 64-bit integer divisions and remainders the PTX holds (each some twenty
    SASS instructions or more)."""
    return len(INTEGER_DIVISION.findall(ptx))


def ptxas_report(ptx: str, arch: str, workdir: str | os.PathLike) -> str | None:
    """``ptxas -v``'s report (registers, spills, SMEM) of ``ptx`` assembled for ``arch`` (e.g.
    ``"sm_90a"``), or None when no ptxas on PATH reads ``ptx``'s ISA version: the DSL compiles with
    its own compiler, which may be newer (the CUDA 13 DSL's PTX against the H200 image's ptxas 13.0).
    The PTX is written to ``workdir/kernel.ptx``; a ptxas error raises :class:`RuntimeError` with
    ptxas's version and messages."""
    ptxas = shutil.which("ptxas")
    header = PTX_VERSION.search(ptx)
    if ptxas is None or (header and not _reads_isa(ptxas, header.group(1))):
        return None
    src = Path(workdir) / "kernel.ptx"
    src.write_text(ptx)
    command = [ptxas, f"-arch={arch}", "-v", str(src), "-o", os.devnull]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode:
        version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip()
        raise RuntimeError(
            f"{ptxas} ({version.splitlines()[-1] if version else 'version unknown'}) exited "
            f"{run.returncode} on {src}:\n{run.stderr[-4000:]}{run.stdout[-2000:]}"
        )
    return run.stderr + run.stdout


@functools.cache
def _reads_isa(ptxas: str, version: str) -> bool:
    """Whether ``ptxas`` accepts PTX of ISA ``version`` (it assembles an empty module of it)."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.ptx"
        probe.write_text(f".version {version}\n.target sm_90a\n.address_size 64\n")
        run = subprocess.run([ptxas, "-arch=sm_90a", str(probe), "-o", os.devnull], capture_output=True)
        return run.returncode == 0


def spill_bytes(report: str) -> int:
    """The most bytes any kernel of a ``ptxas -v`` report spills (stores or loads); 0 without a
    spill line."""
    return max((max(int(st), int(ld)) for st, ld in SPILLS.findall(report)), default=0)


#: set to 1 where compile tests must check what ptxas reports (the noxfile's compile sessions): a
#: missing ptxas, or one that does not read the DSL's PTX, then fails them instead of warning
REQUIRE_PTXAS = "FLEXATTN_REQUIRE_PTXAS"


def unchecked_by_ptxas(arch: str, stacklevel: int = 2) -> None:
    """Say that no ptxas on PATH read a kernel's PTX, so its ``arch`` spills and WGMMA serialisation
    went unchecked: a warning (at the caller's ``stacklevel``, as ``warnings.warn`` counts), or an
    AssertionError where ``REQUIRE_PTXAS`` is 1."""
    message = f"no ptxas on PATH reads this PTX's ISA: its {arch} register spills and WGMMA pipeline "
    message += "are unchecked"
    if os.environ.get(REQUIRE_PTXAS) == "1":
        raise AssertionError(f"{message} ({REQUIRE_PTXAS}=1: put a CUDA 13 ptxas on PATH)")
    warnings.warn(message, stacklevel=stacklevel + 1)


def assert_ptxas_clean(ptx: str, arch: str, workdir: str | os.PathLike, *, max_spill_bytes: int = 0) -> None:
    """Assert ptxas reports no register spills for ``ptx`` (at most ``max_spill_bytes``, for spills a
    caller has shown harmless and says where they sit) and did not serialise a WGMMA pipeline
    (C7512 for want of registers, C7515, or a C7517 wait it injected: a GEMM the kernel meant to
    overlap would then run alone). Without a ptxas that reads ``ptx``: :func:`unchecked_by_ptxas`."""
    report = ptxas_report(ptx, arch, workdir)
    if report is None:
        unchecked_by_ptxas(arch, stacklevel=3)
        return
    assert SPILLS.search(report) and spill_bytes(report) <= max_spill_bytes, report
    serialised = [line for line in report.splitlines() if any(code in line for code in WGMMA_SERIALISED)]
    assert not serialised, "\n".join(serialised)


#: PTX instructions that may touch global memory: loads, stores, atomics and reductions in the
#: global or the generic state space (not ``.shared``, ``.param``, ``.local`` or ``.const``), and
#: every ``cp.async`` / ``cp.reduce.async`` copy (a descriptor prefetch is not one)
GLOBAL_ACCESS = re.compile(
    r"^\s*(?:@!?%p\d+\s+)?(?:(?:ld|st|atom|red)(?![\w.:]*\.(?:shared|param|local|const)\b)\.[\w.:]+"
    r"|cp\.(?:reduce\.)?async\b)",
    re.MULTILINE,
)


def assert_waits_before_global_access(ptx: str) -> None:
    """Assert the kernel waits for its predecessor (``griddepcontrol.wait``, then
    ``launch_dependents``) before any instruction that reads or writes global memory: the rule of
    ``consumer_plan.after_predecessor`` for a kernel launched with PDL. The kernels' prologue is
    structured code, which the PTX lists in source order."""
    wait = ptx.find("griddepcontrol.wait;")
    assert wait >= 0, "no griddepcontrol.wait"
    assert ptx.find("griddepcontrol.launch_dependents;") > wait
    early = GLOBAL_ACCESS.search(ptx[:wait])
    assert early is None, f"global access before griddepcontrol.wait: {early.group(0).strip()!r}"


def assert_row_view(offsets: list[list[int]], swizzle: tuple[int, int, int], element_bits: int = 16) -> None:
    """``offsets[row][col // 8]``, the element offsets CuTe gives each 8-element piece of an SMEM
    operand tile (``rows x cols``, one stage, before the swizzle), and the tile's swizzle
    ``(bits, base, shift)`` must be what ``stage_fill.row_view(stage, rows, cols, bits)`` assumes:
    rows of ``w = (16 << bits)`` bytes, ``cols / w`` blocks of ``rows`` rows one after the other,
    and a swizzle that keeps each such row in place (it XORs byte-address bits [base, base + bits)
    with higher ones: base 4 moves 16-byte pieces only within a ``16 << bits``-byte row). Then
    ``zero_rows``'s runs of whole rows past the sample are exactly those rows' bytes."""
    bits, base, shift = swizzle
    w = (16 << bits) * 8 // element_bits
    rows, pieces = len(offsets), len(offsets[0])
    want = [[r * w + (8 * p) % w + (8 * p) // w * rows * w for p in range(pieces)] for r in range(rows)]
    assert offsets == want, "the tile is not the row view"
    assert bits == 0 or (base == 4 and shift >= bits), f"swizzle {swizzle} moves bytes across rows"


__all__ = [
    "GLOBAL_ACCESS",
    "SPILLS",
    "assert_ptxas_clean",
    "assert_row_view",
    "assert_waits_before_global_access",
    "ptxas_report",
    "spill_bytes",
]
