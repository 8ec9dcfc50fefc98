"""The benchmarks' timing behind a GPU sleep, against a stand-in CUDA event clock (no GPU):
bench_fwd_sm90.py's device-only timing redoes late repeats with a longer sleep and gives up on
calls that never get ahead of the sleep; bench_host.py's host timing refuses a sleep that ended
before the calls were issued."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_fwd_sm90  # noqa: E402
import bench_host  # noqa: E402


class FakeCuda:
    """``torch.cuda`` as device_timed uses it: a sleep ends before the calls are issued unless it is
    at least ``needed_ms`` long; a timed interval is ``per_call_ms`` per call."""

    def __init__(self, needed_ms: float, per_call_ms: float = 0.5):
        self.needed_ms, self.per_call_ms, self.sleeps = needed_ms, per_call_ms, []
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                pass

            def record(self):
                pass

            def query(self):  # the start event has fired: the sleep ended during the issue
                return fake.sleeps[-1] < fake.needed_ms

            def elapsed_time(self, end):
                return 10 * fake.per_call_ms

        self.Event = Event

    def _sleep(self, cycles):
        self.sleeps.append(cycles / 2_000_000)

    def synchronize(self):
        pass


def test_late_repeats_are_redone_with_a_longer_sleep(monkeypatch):
    cuda = FakeCuda(needed_ms=70)
    monkeypatch.setattr(bench_fwd_sm90.torch, "cuda", cuda)
    device_ms, host_ms = bench_fwd_sm90.device_timed(lambda: None)
    assert device_ms == 0.5 and host_ms >= 0
    assert cuda.sleeps == [20, 40, 80, 80, 80, 80, 80]  # two late repeats discarded, then 5 kept


def test_calls_that_wait_for_the_gpu_give_up(monkeypatch):
    cuda = FakeCuda(needed_ms=float("inf"))  # a host sync: the issue never gets ahead of the sleep
    monkeypatch.setattr(bench_fwd_sm90.torch, "cuda", cuda)
    with pytest.raises(RuntimeError, match="no device-only time"):
        bench_fwd_sm90.device_timed(lambda: None)
    assert max(cuda.sleeps) <= bench_fwd_sm90.MAX_SLEEP_MS


def test_host_timing_counts_the_calls_behind_one_sleep(monkeypatch):
    cuda = FakeCuda(needed_ms=0)
    monkeypatch.setattr(bench_host.torch, "cuda", cuda)
    calls = []
    assert bench_host.behind_sleep(lambda: calls.append(1), 7) >= 0
    assert len(calls) == 7 and cuda.sleeps == [bench_host.SLEEP_CYCLES / 2_000_000]


def test_host_timing_refuses_calls_the_sleep_did_not_outlast(monkeypatch):
    monkeypatch.setattr(bench_host.torch, "cuda", FakeCuda(needed_ms=float("inf")))
    with pytest.raises(RuntimeError, match="fewer --calls"):
        bench_host.behind_sleep(lambda: None, 7)
