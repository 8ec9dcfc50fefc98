"""A/B a code change on the GPU: run one benchmark alternately over variants of the source tree.

    python benchmarks/ab_overlay.py --variant base= --variant new=ab/new [--rounds 2] [--timeout 300] \\
        -- benchmarks/bench_fwd_sm90.py --mode train --systems flexattn --masks causal,document

A variant is ``NAME=DIR``: the files under ``DIR`` mirror repository paths (``ab/new/packages/
flexattn-sm90/src/flexattn_sm90/bwd_kernel.py``) and replace those files while the variant runs;
an empty ``DIR`` is the tree as it is. Each run gets its variant's own compile cache
(``FLEXATTN_CACHE_DIR``), so no variant loads another's kernels (``--cache DIR`` keeps them for a
later call), and every replaced file is put back after each run, also after a failure or a
timeout. Rounds alternate the order (A B, B A, ...) so drift of the machine over the session does
not favour one variant. The packages must be installed editable from this tree (as the GPU
procedure does), so the replaced sources are what Python imports; a variant replacing a package's
source is refused where Python would import that package from elsewhere.

Printed: each run's output under ``== NAME round R``, then every table row of the benchmark
(``bench_fwd_sm90.py``'s final table: S, mask, system, TFLOP/s; ``system@device`` rows hold its
device-only TFLOP/s) per variant and round, side by side.
Differences of a few percent between rounds are the machine's noise; compare the rounds. Exits 1
where a run failed or timed out, or no run printed a table row.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: a row of bench_fwd_sm90.py's final table: "  8192 causal  flexattn  562.6  1.00x  590.1  1.02x  0.407"
#: (queued TFLOP/s and ratio, then device TFLOP/s, its ratio and host ms; older tables end after
#: the first ratio; a ratio is "-" where flexattn itself did not run, e.g. ``--systems flexattn-det``;
#: the device fields are "nan" for a system without device-only time, one whose calls sync)
TABLE_ROW = re.compile(
    r"^\s*(\d+)\s+(\S+)\s+(\S+)\s+([\d.]+)\s+(?:[\d.]+x|-)"
    r"(?:\s+([\d.]+|nan)\s+(?:[\d.]+x|nanx|-)\s+(?:[\d.]+|nan))?\s*$"
)


@dataclass(frozen=True)
class Variant:
    name: str
    overlay: Path | None  # None: the tree as it is

    def files(self) -> list[Path]:
        """Repository-relative paths this variant replaces."""
        if self.overlay is None:
            return []
        return sorted(p.relative_to(self.overlay) for p in self.overlay.rglob("*") if p.is_file())


def parse_variant(text: str, root: Path) -> Variant:
    name, sep, directory = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME=DIR (DIR may be empty)")
    if not directory:
        return Variant(name, None)
    overlay = Path(directory)
    if not overlay.is_dir():
        raise argparse.ArgumentTypeError(f"--variant {text!r}: {directory} is not a directory")
    variant = Variant(name, overlay.resolve())
    missing = [str(p) for p in variant.files() if not (root / p).is_file()]
    if missing:
        # a misspelt path would otherwise add a file nothing imports and time the unchanged tree
        listed = ", ".join(missing)
        raise argparse.ArgumentTypeError(f"--variant {text!r}: no such file in the tree: {listed}")
    return variant


def foreign_imports(variants: list[Variant], root: Path) -> list[str]:
    """The packages whose sources a variant replaces (``packages/*/src/MODULE/...``) that Python,
    started from ``root``, imports from elsewhere: an A/B there would time one tree twice."""
    sources = {}
    for v in variants:
        for p in v.files():
            if len(p.parts) > 4 and p.parts[0] == "packages" and p.parts[2] == "src":
                sources[p.parts[3]] = root / Path(*p.parts[:4])
    if not sources:
        return []
    code = (
        "import importlib.util, sys\n"
        "for m in sys.argv[1:]:\n"
        "    spec = importlib.util.find_spec(m)\n"
        "    where = spec.submodule_search_locations if spec else None\n"
        "    print(m, where[0] if where else '-')"
    )
    done = subprocess.run([sys.executable, "-c", code, *sources], cwd=root, capture_output=True, text=True)
    found = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    return [
        f"{m} from {found.get(m, '-')} (not {src})"
        for m, src in sources.items()
        if found.get(m, "-") == "-" or Path(found[m]).resolve() != src.resolve()
    ]


def run_variant(
    variant: Variant, root: Path, command: list[str], cache: Path, timeout: float
) -> tuple[str, bool]:
    """Run ``command`` (from ``root``) with ``variant``'s files in place; returns its output and
    whether it exited 0 in time."""
    saved = {p: (root / p).read_bytes() for p in variant.files()}
    try:
        for p in saved:
            shutil.copyfile(variant.overlay / p, root / p)
        env = {**os.environ, "FLEXATTN_CACHE_DIR": str(cache / variant.name)}
        try:
            done = subprocess.run(
                command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout, check=False
            )
            out = done.stdout + done.stderr
            if done.returncode:
                out += f"\n[exit status {done.returncode}]"
            return out, done.returncode == 0
        except subprocess.TimeoutExpired as e:  # its captured output is bytes, whatever text= says
            out = b"".join(x for x in (e.stdout, e.stderr) if x).decode(errors="replace")
            return out + f"\n[timed out after {timeout:.0f} s]", False
    finally:
        for p, data in saved.items():
            (root / p).write_bytes(data)


def schedule(variants: list[Variant], rounds: int) -> list[tuple[int, Variant]]:
    """``(round, variant)`` in run order: A B, then B A, ..."""
    order = []
    for r in range(rounds):
        order += [(r + 1, v) for v in (variants if r % 2 == 0 else variants[::-1])]
    return order


def table_rows(output: str) -> dict[tuple[str, str, str], float]:
    """``(S, mask, system) -> TFLOP/s`` of the benchmark's final table in ``output``; where the
    table has device timings, also ``(S, mask, system + "@device")`` -> device TFLOP/s."""
    rows = {}
    for line in output.splitlines():
        m = TABLE_ROW.match(line)
        if m:
            rows[m.group(1), m.group(2), m.group(3)] = float(m.group(4))
            if m.group(5) not in (None, "nan"):
                rows[m.group(1), m.group(2), m.group(3) + "@device"] = float(m.group(5))
    return rows


def summary(results: dict[tuple[str, int], dict], variants: list[Variant], rounds: int) -> str:
    keys = list(dict.fromkeys(k for rows in results.values() for k in rows))
    if not keys:
        return "no table rows found in the outputs"
    cols = [(v.name, r) for v in variants for r in range(1, rounds + 1)]
    head = f"{'S':>6} {'mask':14s} {'system':14s}" + "".join(f" {f'{n} r{r}':>12s}" for n, r in cols)
    lines = [head]
    for k in keys:
        cells = "".join(
            f" {results[c][k]:12.1f}" if k in results.get(c, {}) else f" {'-':>12s}" for c in cols
        )
        lines.append(f"{k[0]:>6} {k[1]:14s} {k[2]:14s}{cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    usage = "%(prog)s --variant NAME=DIR ... [options] -- SCRIPT [ARGS]"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage=usage)
    p.add_argument("--variant", action="append", required=True, type=lambda t: parse_variant(t, root))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--cache", default=None, help="compile caches' root, kept (default: a temporary one)")
    args = p.parse_args(argv[:split])
    if len({v.name for v in args.variant}) != len(args.variant):
        p.error("variant names must differ")
    if split >= len(argv) - 1:
        p.error("give the benchmark to run after --, e.g. -- benchmarks/bench_fwd_sm90.py --mode train")
    elsewhere = foreign_imports(args.variant, root)
    if elsewhere:
        p.error(f"Python imports {'; '.join(elsewhere)}: install the packages editable from {root}")
    command = [sys.executable, *argv[split + 1 :]]
    results, failed = {}, 0
    with tempfile.TemporaryDirectory(prefix="ab_cache_") as tmp:
        cache = Path(args.cache or tmp)
        for r, variant in schedule(args.variant, args.rounds):
            out, ok = run_variant(variant, root, command, cache, args.timeout)
            print(f"== {variant.name} round {r}\n{out.rstrip()}", flush=True)
            results[variant.name, r] = table_rows(out)
            failed += not ok
    print("\n" + summary(results, args.variant, args.rounds))
    if failed:
        print(f"{failed} of {len(results)} runs failed or timed out")
    return 1 if failed or not any(results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
