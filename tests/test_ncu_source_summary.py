"""benchmarks/ncu_source_summary.py reads Nsight Compute's source-page CSV as ncu writes it."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from ncu_source_summary import read_source, stall_totals, top_instructions, window  # noqa: E402

HEADER = [
    "Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
    "Instructions Executed", "stall_barrier", "stall_long_sb", "stall_wait",
    "stall_barrier (Not Issued)", "stall_long_sb (Not Issued)", "stall_wait (Not Issued)",
]  # fmt: skip
ROWS = [  # out of address order, as a kernel's blocks may come
    ["0x7f0000001020", "      HGMMA.64x128x16.F32.BF16 R88, gdesc[UR16], R88", "50", "48", "10",
     "0", "0", "5", "0", "0", "5"],
    ["0x7f0000001000", "      LDG.E R2, desc[UR4][R2.64]", "3", "1", "10", "0", "0", "3", "0", "0", "1"],
    ["0x7f0000001010", "      R2UR UR16, R2", "40", "40", "10", "0", "38", "2", "0", "38", "2"],
    ["0x7f0000001030", "      BAR.SYNC 0x1, 0x100", "7", "7", "-", "7", "0", "0", "7", "0", "0"],
]  # fmt: skip


def _write(path: Path, rows=ROWS, header=HEADER, kernel="kernel_x") -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", kernel])
        w.writerow(header)
        w.writerows(rows)
    return path


def test_reads_instructions_in_address_order_with_their_stalls(tmp_path):
    kernel, ins = read_source(_write(tmp_path / "s.csv"))
    assert kernel == "kernel_x"
    assert [i.offset for i in ins] == [0, 0x10, 0x20, 0x30]
    assert ins[1].source == "R2UR UR16, R2" and ins[1].samples == 40 and ins[1].executed == 10
    assert ins[1].stalls == {"barrier": 0, "long_sb": 38, "wait": 2}  # "(Not Issued)" columns are subsets
    assert ins[3].executed == 0  # "-" counts as none
    # the HGMMA's samples beyond the exported reasons are "other" (Hopper's WGMMA wait has no column)
    assert ins[2].other == 45 and ins[2].top_stalls() == [("other", 45), ("wait", 5)]


def test_totals_top_and_window(tmp_path):
    _, ins = read_source(_write(tmp_path / "s.csv"))
    totals = dict(stall_totals(ins))
    assert totals == {"other": 45, "long_sb": 38, "wait": 10, "barrier": 7}
    assert sum(totals.values()) == sum(i.samples for i in ins)
    assert [i.offset for i in top_instructions(ins, 2)] == [0x20, 0x10]
    assert [i.offset for i in window(ins, 0x10, 0x20)] == [0x10, 0x20]


def test_refuses_a_csv_that_is_not_the_source_page(tmp_path):
    other = tmp_path / "details.csv"
    other.write_text('"ID","Section Name"\n"0","SpeedOfLight"\n')
    with pytest.raises(ValueError, match="names no kernel"):
        read_source(other)
    no_samples = _write(tmp_path / "nosamples.csv", rows=[r[:2] for r in ROWS], header=HEADER[:2])
    with pytest.raises(ValueError, match="SourceCounters"):
        read_source(no_samples)
