"""CPU tier of the project's compile cache (``maskplan_kernels.compile_cache`` + ``settings``).

The cache mechanics (keys, atomic entries, corrupt-entry rebuild, per-key locking across processes)
are tested with a fake "compile" (bytes in, bytes out), and end to end with a real planner kernel:
CuTe DSL compiles for ``CUTE_DSL_ARCH`` without a GPU, exports the object and loads it back, so the
whole round trip except running the loaded kernel is checked here (running it needs a GPU).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import tvm_ffi

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # also when this file is run on its own

from maskplan_kernels import compile_cache, settings  # noqa: E402
from maskplan_kernels.compile_cache import (  # noqa: E402
    MAGIC,
    TRAILER_BYTES,
    CacheKey,
    CorruptEntry,
    DiskCache,
    canonical,
    make_key,
    package_fingerprint,
)
from maskplan_kernels.k2q_count import K2QCountConfig, compile_k2q_count  # noqa: E402


def fake_key(**changes) -> CacheKey:
    fields = dict(
        kernel="fake",
        config="('fake', 1)",
        options="",
        arch="sm_90a",
        dsl="nvidia-cutlass-dsl==4.8.1;arch='sm_90a';",
        packages=(("maskplan_kernels", "0.1.0", "0" * 64),),
    )
    return CacheKey(**{**fields, **changes})


class FakeCompiler:
    """A "compile" that returns bytes and counts its calls; dump/load are the identity on bytes."""

    def __init__(self, value: bytes = b"compiled kernel bytes " * 50):
        self.value, self.calls = value, 0

    def create(self) -> bytes:
        self.calls += 1
        return self.value

    @staticmethod
    def dump(value: bytes) -> bytes:
        return value

    @staticmethod
    def load(path: Path, payload: bytes) -> bytes:
        return payload


@pytest.fixture
def stats():
    """Counter deltas of compile_cache.STATS over the test."""
    before = dict(compile_cache.STATS)
    return lambda: {k: v - before.get(k, 0) for k, v in compile_cache.STATS.items() if v != before.get(k, 0)}


# --------------------------------------------------------------------------------------------------
# settings
# --------------------------------------------------------------------------------------------------


def test_settings_defaults_and_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("FLEXATTN_CACHE_DIR", raising=False)
    monkeypatch.delenv("FLEXATTN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    s = settings.settings()
    assert s.cache_enabled is settings.CACHE_DEFAULT and s.cache_dir == tmp_path / "xdg" / "flexattn"
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(tmp_path / "elsewhere"))
    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv("FLEXATTN_CACHE", off)
        assert settings.settings() == settings.Settings(False, tmp_path / "elsewhere")
    monkeypatch.setenv("FLEXATTN_CACHE", "1")
    assert settings.settings().cache_enabled
    monkeypatch.setenv("FLEXATTN_CACHE", "maybe")
    with pytest.raises(ValueError, match="FLEXATTN_CACHE must be one of .*'maybe'"):
        settings.settings()


def test_logger_is_silent_by_default():
    log = settings.logger()
    assert log.name == "flexattn"
    assert any(isinstance(h, logging.NullHandler) for h in log.handlers)
    settings.logger()
    assert sum(isinstance(h, logging.NullHandler) for h in log.handlers) == 1


# --------------------------------------------------------------------------------------------------
# keys
# --------------------------------------------------------------------------------------------------


def test_canonical_text_is_deterministic_and_refuses_opaque_objects():
    a = canonical(("k2q_count", K2QCountConfig(num_warps=8), {"b": 1, "a": (True, None, 1.5)}))
    assert a == canonical(("k2q_count", K2QCountConfig(num_warps=8), {"a": (True, None, 1.5), "b": 1}))
    assert "maskplan_kernels.k2q_count.K2QCountConfig(num_warps=8)" in a
    assert a != canonical(("k2q_count", K2QCountConfig(num_warps=4), {"b": 1, "a": (True, None, 1.5)}))
    with pytest.raises(TypeError, match="object"):
        canonical(("kernel", object()))


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(CacheKey)])
def test_every_key_field_changes_the_entry(field):
    base = fake_key()
    value = getattr(base, field)
    if isinstance(value, int):
        changed = value + 1
    elif isinstance(value, tuple):
        changed = (*value, ("maskplan_core", "0.1.0", "1" * 64))
    else:
        changed = value + "x"
    other = dataclasses.replace(base, **{field: changed})
    assert other.digest != base.digest and other.filename != base.filename and other.symbol != base.symbol
    assert base.digest == fake_key().digest  # and nothing else does


def test_make_key_tracks_config_options_arch_and_packages():
    base = make_key(("k2q_count", K2QCountConfig()))
    assert base == make_key(("k2q_count", K2QCountConfig()))
    assert base.kernel == "k2q_count" and base.arch == "sm_90a" and "nvidia-cutlass-dsl==" in base.dsl
    assert [p[0] for p in base.packages] == ["maskplan_kernels", "maskplan_core"]
    assert make_key(("k2q_count", K2QCountConfig(num_warps=4))).config != base.config
    sm100 = make_key(("k2q_count", K2QCountConfig()), options="--gpu-arch sm_100a")
    assert sm100.arch == "sm_100a" and sm100.options and sm100.digest != base.digest
    assert make_key(("k2q_count", K2QCountConfig()), packages=("maskplan_kernels",)).digest != base.digest


def test_package_fingerprint_follows_the_sources(tmp_path, monkeypatch):
    pkg = tmp_path / "fp_probe_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '1.2.3'\n")
    (pkg / "sub" / "kernel.py").write_text("TILE = 128\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    package_fingerprint.cache_clear()
    name, version, first = package_fingerprint("fp_probe_pkg")
    assert (name, version) == ("fp_probe_pkg", "1.2.3")
    (pkg / "sub" / "kernel.py").write_text("TILE = 64\n")
    package_fingerprint.cache_clear()
    assert package_fingerprint("fp_probe_pkg")[2] != first
    package_fingerprint.cache_clear()


# --------------------------------------------------------------------------------------------------
# the on-disk layer with a fake compiler
# --------------------------------------------------------------------------------------------------


def test_entry_round_trip(tmp_path, stats):
    fake = FakeCompiler()
    key = fake_key()
    assert DiskCache(tmp_path).get_or_create(key, fake.create, fake.dump, fake.load) == fake.value
    path = tmp_path / key.filename
    data = path.read_bytes()
    assert data[-len(MAGIC) :] == MAGIC and len(data) == len(fake.value) + TRAILER_BYTES
    assert data[-TRAILER_BYTES : -len(MAGIC)] == hashlib.sha256(fake.value).digest()
    again = FakeCompiler(b"never used")  # a second process: a new cache object, a new compiler
    assert DiskCache(tmp_path).get_or_create(key, again.create, again.dump, again.load) == fake.value
    assert (fake.calls, again.calls) == (1, 0)
    assert stats() == {"write": 1, "disk_hit": 1}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary left behind


CORRUPTIONS = {
    "empty": lambda data: b"",
    "truncated": lambda data: data[: len(data) // 2],
    "flipped-byte": lambda data: data[:100] + bytes([data[100] ^ 0xFF]) + data[101:],
    "garbage": lambda data: os.urandom(len(data)),
}


@pytest.mark.parametrize("how", sorted(CORRUPTIONS) + ["loader-rejects"])
def test_corrupt_entry_is_reported_deleted_and_rebuilt(tmp_path, caplog, stats, how):
    fake, key = FakeCompiler(), fake_key()
    cache = DiskCache(tmp_path)
    cache.get_or_create(key, fake.create, fake.dump, fake.load)
    path = tmp_path / key.filename
    load = fake.load
    if how == "loader-rejects":
        calls = []

        def load(path, payload):
            calls.append(path)
            if len(calls) <= 2:  # the unlocked look and the look under the lock
                raise RuntimeError("BinaryExecutionEngine: Failed to add object file")
            return payload

    else:
        path.write_bytes(CORRUPTIONS[how](path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="flexattn"):
        assert cache.get_or_create(key, fake.create, fake.dump, load) == fake.value
    assert fake.calls == 2  # compiled again
    warnings = [r for r in caplog.records if r.name == "flexattn" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "corrupt" in warnings[0].getMessage()
    assert key.filename in warnings[0].getMessage()
    assert DiskCache.read_payload(path) == fake.value  # rewritten, valid
    assert stats() == {"write": 2, "corrupt": 1}


def test_read_payload_refuses_foreign_files(tmp_path):
    path = tmp_path / "x.o"
    assert DiskCache.read_payload(path) is None
    path.write_bytes(b"\x7fELF" + bytes(100))
    with pytest.raises(CorruptEntry, match="no trailer"):
        DiskCache.read_payload(path)


def test_unusable_cache_directory_still_compiles(tmp_path, caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    fake = FakeCompiler()
    with caplog.at_level(logging.WARNING, logger="flexattn"):
        value = DiskCache(blocker / "kernels").get_or_create(fake_key(), fake.create, fake.dump, fake.load)
    assert value == fake.value and fake.calls == 1
    assert any("unavailable" in r.getMessage() for r in caplog.records)


def test_lock_timeout_compiles_without_caching(tmp_path, caplog):
    key, fake = fake_key(), FakeCompiler()
    with open(tmp_path / (key.filename + ".lock"), "w") as holder:  # another "process" compiling
        fcntl.flock(holder, fcntl.LOCK_EX)
        cache = DiskCache(tmp_path, lock_timeout_s=0.2)
        with caplog.at_level(logging.WARNING, logger="flexattn"):
            value = cache.get_or_create(key, fake.create, fake.dump, fake.load)
    assert value == fake.value and fake.calls == 1 and not (tmp_path / key.filename).exists()
    assert any("another process held it" in r.getMessage() for r in caplog.records)


def test_failed_export_is_logged_and_the_compiled_value_used(tmp_path, caplog):
    fake = FakeCompiler()

    def dump(value):
        raise NotImplementedError("dump_to_object is not supported by this backend")

    with caplog.at_level(logging.WARNING, logger="flexattn"):
        assert DiskCache(tmp_path).get_or_create(fake_key(), fake.create, dump, fake.load) == fake.value
    assert any("cannot export" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / fake_key().filename).exists()


# --------------------------------------------------------------------------------------------------
# concurrent processes
# --------------------------------------------------------------------------------------------------

_RACER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from maskplan_kernels.compile_cache import CacheKey, DiskCache

    root, log, ready, go = (Path(a) for a in sys.argv[1:5])
    mode = sys.argv[5]
    key = CacheKey(kernel="race", config="c", options="", arch="sm_90a", dsl="d", packages=())
    cache = DiskCache(root)
    ready.touch()
    while not go.exists():
        time.sleep(0.01)
    if mode == "compile":
        def create():
            with open(log, "a") as f:
                f.write(f"{os.getpid()}\\n")
            time.sleep(1.0)  # a slow compile: the other process must wait for it, not repeat it
            return b"kernel from the one compile " * 1000
        value = cache.get_or_create(key, create, lambda v: v, lambda p, b: b)
        print(len(value))
    else:  # hammer the entry with complete, different payloads
        path = cache.path(key)
        root.mkdir(parents=True, exist_ok=True)
        for i in range(150):
            payload = bytes([i % 251]) * (256 * 1024 + i)
            cache._store(path, lambda v: v, payload)
    """
)


def _start_racers(tmp_path: Path, mode: str, n: int) -> list[subprocess.Popen]:
    script = tmp_path / "racer.py"
    script.write_text(_RACER)
    go = tmp_path / "go"
    procs, readies = [], []
    for i in range(n):
        ready = tmp_path / f"ready{i}"
        readies.append(ready)
        paths = (tmp_path / "cache", tmp_path / "log", ready, go)
        args = [sys.executable, str(script), *map(str, paths), mode]
        procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in readies):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "racers did not start"
        time.sleep(0.05)
    go.touch()
    return procs


def _finish(procs: list[subprocess.Popen]) -> list[str]:
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out.strip())
    return outs


def test_two_processes_compile_a_key_once(tmp_path):
    outs = _finish(_start_racers(tmp_path, "compile", 2))
    assert outs == [str(len(b"kernel from the one compile " * 1000))] * 2
    assert len((tmp_path / "log").read_text().split()) == 1  # one compile, the other process loaded it
    key = CacheKey(kernel="race", config="c", options="", arch="sm_90a", dsl="d", packages=())
    assert DiskCache.read_payload(tmp_path / "cache" / key.filename) == b"kernel from the one compile " * 1000


def test_concurrent_writers_never_expose_a_partial_entry(tmp_path):
    procs = _start_racers(tmp_path, "write", 2)
    key = CacheKey(kernel="race", config="c", options="", arch="sm_90a", dsl="d", packages=())
    path, reads = tmp_path / "cache" / key.filename, 0
    while any(p.poll() is None for p in procs):
        payload = DiskCache.read_payload(path)  # raises CorruptEntry on a torn or partial file
        if payload is not None:
            assert payload == payload[:1] * len(payload)
            reads += 1
    _finish(procs)
    assert reads > 0 and DiskCache.read_payload(path) is not None
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


# --------------------------------------------------------------------------------------------------
# end to end with a real planner kernel (compile, export, load; no GPU)
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty on-disk cache and an empty in-process layer (as in a new process)."""
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLEXATTN_CACHE", "1")
    monkeypatch.setattr(compile_cache, "_MEMORY", {})
    return tmp_path / "kernels"


def test_planner_kernel_round_trips_through_the_disk_cache(fresh_cache, monkeypatch, caplog, stats):
    with caplog.at_level(logging.INFO, logger="flexattn"):
        compiled = compile_k2q_count(K2QCountConfig())
    # a first call's compile says what it compiles before the wait, and how long it took after
    said = [r.getMessage() for r in caplog.records if r.name == "flexattn"]
    assert [m.split()[0] for m in said] == ["compiling", "compiled"] and "k2q_count" in said[0], said
    caplog.clear()
    assert compile_k2q_count(K2QCountConfig()) is compiled  # in-process layer
    assert stats() == {"compile": 1, "write": 1, "memory_hit": 1}
    (entry,) = fresh_cache.glob("k2q_count-*.o")
    monkeypatch.setattr(compile_cache, "_MEMORY", {})  # a "new process"
    with caplog.at_level(logging.INFO, logger="flexattn"):
        loaded = compile_k2q_count(K2QCountConfig())
    assert loaded is not compiled and stats()["disk_hit"] == 1 and stats()["compile"] == 1
    assert any("compile cache hit: k2q_count" in r.getMessage() for r in caplog.records)
    # both are TVM-FFI functions: the launch convention of _cute_args (running them needs a GPU)
    assert isinstance(loaded, tvm_ffi.Function) and "TVMFFI" in type(compiled).__name__
    data = entry.read_bytes()
    entry.write_bytes(data[:5000] + bytes([data[5000] ^ 0x40]) + data[5001:])  # one flipped bit
    monkeypatch.setattr(compile_cache, "_MEMORY", {})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flexattn"):
        rebuilt = compile_k2q_count(K2QCountConfig())
    assert rebuilt is not None and stats()["compile"] == 2 and stats()["corrupt"] == 1
    assert any("corrupt" in r.getMessage() and entry.name in r.getMessage() for r in caplog.records)
    assert DiskCache.read_payload(entry) is not None


def test_disabled_cache_compiles_in_process_only(fresh_cache, monkeypatch, stats):
    monkeypatch.setenv("FLEXATTN_CACHE", "0")
    compiled = compile_k2q_count(K2QCountConfig())
    assert compile_k2q_count(K2QCountConfig()) is compiled
    assert stats() == {"compile": 1, "memory_hit": 1}
    assert not fresh_cache.exists()
