"""benchmarks/ab_overlay.py: variants swap files in and always put them back, rounds alternate, and
the benchmark's table rows come out side by side."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ab_overlay  # noqa: E402

# a stand-in benchmark: prints its cache dir and a final-table row whose TFLOP/s is the module's value
BENCH = """
import os, sys, time
value = open("pkg/mod.txt").read().strip()
print("cache", os.environ["FLEXATTN_CACHE_DIR"])
if value == "fail":
    sys.exit(3)
if value == "hang":
    time.sleep(30)
print(f"  8192 causal         flexattn        {value}     1.00x")
"""


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.txt").write_text("100.0\n")
    (root / "bench.py").write_text(BENCH)
    return root


def overlay(tmp_path, name, value):
    d = tmp_path / name / "pkg"
    d.mkdir(parents=True)
    (d / "mod.txt").write_text(value)
    return str(tmp_path / name)


def test_alternates_rounds_swaps_files_and_restores_them(tree, tmp_path, capsys):
    new = overlay(tmp_path, "new", "120.5")
    rc = ab_overlay.main(["--variant", "base=", "--variant", f"new={new}", "--rounds", "3", "--", "bench.py"],
                         tree)  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    runs = [line for line in out.splitlines() if line.startswith("== ")]
    assert runs == ["== base round 1", "== new round 1", "== new round 2", "== base round 2",
                    "== base round 3", "== new round 3"]  # fmt: skip
    assert (tree / "pkg" / "mod.txt").read_text() == "100.0\n"  # the tree is as it was
    assert out.count("/base\n") == 3 and out.count("/new\n") == 3  # one compile cache per variant
    table = out.split("\n\n")[-1].splitlines()
    assert table[0].split()[3:] == [w for n in ("base", "new") for r in ("r1", "r2", "r3") for w in (n, r)]
    assert table[1].split() == ["8192", "causal", "flexattn"] + ["100.0"] * 3 + ["120.5"] * 3


def test_failures_and_timeouts_restore_the_tree_and_show_in_the_table(tree, tmp_path, capsys):
    fail, hang = overlay(tmp_path, "fail", "fail"), overlay(tmp_path, "hang", "hang")
    args = ["--variant", f"f={fail}", "--variant", f"h={hang}", "--rounds", "1", "--timeout", "2",
            "--", "bench.py"]  # fmt: skip
    assert ab_overlay.main(args, tree) == 1
    out = capsys.readouterr().out
    assert "[exit status 3]" in out and "[timed out after 2 s]" in out
    assert "no table rows found" in out and "2 of 2 runs failed or timed out" in out
    assert (tree / "pkg" / "mod.txt").read_text() == "100.0\n"


def test_refuses_a_variant_naming_a_file_the_tree_lacks(tree, tmp_path):
    d = tmp_path / "typo" / "pkg"
    d.mkdir(parents=True)
    (d / "mdo.txt").write_text("1")
    with pytest.raises(argparse.ArgumentTypeError, match="no such file in the tree: pkg/mdo.txt"):
        ab_overlay.parse_variant(f"typo={tmp_path / 'typo'}", tree)
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=DIR"):
        ab_overlay.parse_variant("no-equals-sign", tree)


def test_table_rows_reads_the_final_table_only():
    progress = "  causal        flexattn     3.210 ms   562.6 TFLOP/s"  # printed while it runs
    out = f"{progress}\n  8192 causal         flexattn-det    529.2     1.04x\n"
    assert ab_overlay.table_rows(out) == {("8192", "causal", "flexattn-det"): 529.2}


def test_table_rows_read_the_benchmarks_own_table_with_device_timings(tmp_path, capsys):
    """The rows bench_fwd_sm90.report prints (queued and device TFLOP/s, host ms) parse back."""
    import bench_fwd_sm90

    def row(system, tflops, device_tflops):
        return {"seqlen": 8192, "mask": "causal", "system": system, "ms": 1.0, "tflops": tflops,
                "device_ms": 1.0, "device_tflops": device_tflops, "host_ms": 0.4}  # fmt: skip

    rows, run = [row("flexattn", 562.6, 590.1), row("cudnn", 540.0, 580.0)], {"command": "python bench.py"}
    bench_fwd_sm90.report(rows, tmp_path, "train", run)
    assert json.loads((tmp_path / "results-train.json").read_text()) == {"run": run, "rows": rows}
    assert ab_overlay.table_rows(capsys.readouterr().out) == {
        ("8192", "causal", "flexattn"): 562.6,
        ("8192", "causal", "flexattn@device"): 590.1,
        ("8192", "causal", "cudnn"): 540.0,
        ("8192", "causal", "cudnn@device"): 580.0,
    }


def test_table_rows_keep_a_system_without_device_time(tmp_path, capsys):
    """A system whose calls sync has no device-only time (bench_fwd_sm90.device_timed: NaN); its
    queued TFLOP/s still parses, and it has no ``@device`` row."""
    import bench_fwd_sm90

    def row(system, device_tflops, host_ms):
        return {"seqlen": 8192, "mask": "causal", "system": system, "ms": 1.0, "tflops": 500.0,
                "device_ms": 1.0, "device_tflops": device_tflops, "host_ms": host_ms}  # fmt: skip

    nan = float("nan")
    bench_fwd_sm90.report([row("flexattn", 590.1, 0.4), row("torch-flex", nan, nan)], tmp_path, "fwd", {})
    assert ab_overlay.table_rows(capsys.readouterr().out) == {
        ("8192", "causal", "flexattn"): 500.0,
        ("8192", "causal", "flexattn@device"): 590.1,
        ("8192", "causal", "torch-flex"): 500.0,
    }


def test_rows_without_a_ratio(tree, capsys):
    """``--systems flexattn-det`` alone: the benchmark prints "-" for the ratio to flexattn."""
    row = BENCH.replace("flexattn        {value}     1.00x", "flexattn-det    {value}     -")
    (tree / "bench.py").write_text(row)
    ab_overlay.main(["--variant", "base=", "--rounds", "1", "--", "bench.py"], tree)
    table = capsys.readouterr().out.split("\n\n")[-1].splitlines()
    assert table[1].split() == ["8192", "causal", "flexattn-det", "100.0"]


def test_refuses_a_package_python_imports_from_another_tree(tree, tmp_path, monkeypatch, capsys):
    """A variant replacing ``packages/*/src/MODULE/...`` times nothing new where Python imports
    MODULE from elsewhere (an editable install of another checkout): refused before any run."""
    src = tree / "packages" / "foo" / "src" / "foomod"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "k.py").write_text("VALUE = 1\n")
    other = tmp_path / "other" / "foomod"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    new = tmp_path / "new" / "packages" / "foo" / "src" / "foomod"
    new.mkdir(parents=True)
    (new / "k.py").write_text("VALUE = 2\n")
    args = ["--variant", "base=", "--variant", f"new={tmp_path / 'new'}", "--rounds", "1", "--", "bench.py"]
    monkeypatch.setenv("PYTHONPATH", str(other.parent))
    with pytest.raises(SystemExit) as info:
        ab_overlay.main(args, tree)
    assert info.value.code == 2 and "foomod from" in capsys.readouterr().err
    assert (src / "k.py").read_text() == "VALUE = 1\n"  # nothing ran, nothing swapped
    monkeypatch.setenv("PYTHONPATH", str(src.parent))  # the tree's own source: runs
    assert ab_overlay.main(args, tree) == 0


def test_help_and_a_missing_benchmark(tree, capsys):
    with pytest.raises(SystemExit) as info:
        ab_overlay.main(["--help"], tree)
    assert info.value.code == 0 and "--variant" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        ab_overlay.main(["--variant", "base="], tree)
    assert info.value.code == 2 and "give the benchmark to run after --" in capsys.readouterr().err
