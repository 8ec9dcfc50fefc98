"""Where one kernel's warps stall, per SASS instruction, from Nsight Compute's source page.

    python benchmarks/ncu_source_summary.py ours_source.csv [--top 30] [--window 0x2000:0x2400]

The input is the CSV that ``ncu --import R.ncu-rep --page source --csv --print-source sass`` prints
(``benchmarks/README.md``: a report taken with ``--section WarpStateStats --section
SourceCounters``). Printed: the total of warp-state samples, the samples per stall reason (largest
first), and the ``--top`` instructions by samples, each with its offset from the kernel's first
instruction, how often it executed and its two largest stall reasons. ``--window LO:HI`` (offsets,
as printed) adds the samples of that stretch of code, instruction by instruction: a loop of one
warp role, such as the backward's dQ writer, to see which of its steps it waits in.
"""

from __future__ import annotations

import argparse
import csv
from dataclasses import dataclass
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
STALL_PREFIX = "stall_"


@dataclass(frozen=True)
class Instruction:
    offset: int  # bytes from the kernel's first instruction
    source: str  # the SASS text
    samples: int
    executed: int
    stalls: dict[str, int]  # stall reason (without "stall_") -> samples, issued or not

    @property
    def other(self) -> int:
        """Samples of reasons the CSV has no column for (the WGMMA wait on Hopper, for one)."""
        return max(0, self.samples - sum(self.stalls.values()))

    def top_stalls(self, n: int = 2) -> list[tuple[str, int]]:
        reasons = {**self.stalls, "other": self.other}
        return sorted(reasons.items(), key=lambda kv: -kv[1])[:n]


def _count(text: str) -> int:
    text = text.strip()
    return int(text) if text and text != "-" else 0


def read_source(path: str | Path) -> tuple[str, list[Instruction]]:
    """``(kernel name, instructions in address order)`` of the CSV at ``path``."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2 or not rows[0] or rows[0][0] != "Kernel Name":
        raise ValueError(f"{path}: not an ncu source-page CSV (its first row names no kernel)")
    kernel, header, body = rows[0][1], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    missing = [name for name in ("Address", "Source", SAMPLES, EXECUTED) if name not in col]
    if missing:
        raise ValueError(f"{path}: no column {missing} (take the report with --section SourceCounters)")
    # "stall_x" counts every sample of the reason; "stall_x (Not Issued)" is a subset of it
    reasons = [name for name in header if name.startswith(STALL_PREFIX) and "(" not in name]
    addresses = [int(r[col["Address"]], 16) for r in body]
    first = min(addresses, default=0)
    instructions = [
        Instruction(
            offset=address - first,
            source=r[col["Source"]].strip(),
            samples=_count(r[col[SAMPLES]]),
            executed=_count(r[col[EXECUTED]]),
            stalls={name[len(STALL_PREFIX) :]: _count(r[col[name]]) for name in reasons},
        )
        for address, r in zip(addresses, body, strict=True)
    ]
    return kernel, sorted(instructions, key=lambda i: i.offset)


def stall_totals(instructions: list[Instruction]) -> list[tuple[str, int]]:
    """Samples per stall reason over the kernel, largest first (``other``: reasons without a
    column)."""
    totals: dict[str, int] = {}
    for ins in instructions:
        for reason, n in {**ins.stalls, "other": ins.other}.items():
            totals[reason] = totals.get(reason, 0) + n
    return sorted(totals.items(), key=lambda kv: -kv[1])


def top_instructions(instructions: list[Instruction], n: int) -> list[Instruction]:
    return sorted(instructions, key=lambda i: -i.samples)[:n]


def window(instructions: list[Instruction], lo: int, hi: int) -> list[Instruction]:
    """The instructions at offsets ``lo`` .. ``hi`` (inclusive)."""
    return [i for i in instructions if lo <= i.offset <= hi]


def _line(ins: Instruction, total: int) -> str:
    stalls = ", ".join(f"{reason} {n}" for reason, n in ins.top_stalls() if n)
    share = 100.0 * ins.samples / total if total else 0.0
    head = f"  +{ins.offset:#07x} {ins.samples:8d} {share:5.1f}% {ins.executed:10d}"
    return f"{head}  {ins.source[:64]:64s} {stalls}"


def _offsets(text: str) -> tuple[int, int]:
    """``--window``'s ``LO:HI``, checked before the report is read."""
    try:
        lo, hi = (int(x, 0) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LO:HI, e.g. 0x2000:0x2400") from None
    return lo, hi


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    p.add_argument("--top", type=int, default=30, help="instructions to list, most samples first")
    p.add_argument("--window", type=_offsets, help="LO:HI offsets (hex or decimal) to list in full")
    args = p.parse_args()
    kernel, instructions = read_source(args.csv)
    total = sum(i.samples for i in instructions)
    print(f"{kernel[:100]}\n{len(instructions)} instructions, {total} samples")
    print("per stall reason: " + ", ".join(f"{r} {n}" for r, n in stall_totals(instructions) if n))
    print(f"top {args.top} (offset, samples, share, executed, SASS, largest stall reasons):")
    for ins in top_instructions(instructions, args.top):
        print(_line(ins, total))
    if args.window:
        lo, hi = args.window
        part = window(instructions, lo, hi)
        print(f"window {lo:#x}:{hi:#x}: {sum(i.samples for i in part)} samples")
        for ins in part:
            print(_line(ins, total))


if __name__ == "__main__":
    main()
