"""The one compile cache of the project: every CuTe DSL kernel (planner and attention) goes through
:func:`compile_cached`.

::

    compiled = compile_cached(("k2q_count", config), build)          # build() -> (jit_fn, *placeholders)
    compiled = compile_cached(key, build, options="--gpu-arch sm_90a", packages=SM90_PACKAGES)

Two layers:

1. **In process**: ``(key, options, packages) -> compiled function``. A per-key thread lock makes a
   second caller of a key wait for the first compile instead of repeating it; the same object is
   returned on every later call.
2. **On disk** (:class:`DiskCache`, ``<FLEXATTN_CACHE_DIR>/kernels/<kernel>-<digest>.o``; see
   :mod:`.settings` to move or disable it): the compiled function exported with CuTe DSL's
   ``JitCompiledFunction.dump_to_object`` -- one ELF object holding the host launcher and the
   cubin -- followed by a 40-byte trailer (SHA-256 of the object, then the magic ``FLXCC001``).
   A later process loads it with ``cute.runtime.load_module`` and skips both the Python trace of
   the kernel and the MLIR -> NVVM -> ptxas pipeline.

Why our own artifact and not CuTe DSL's file cache: the DSL (4.8) has one (``CUTE_DSL_CACHE_DIR``,
``CUTE_DSL_DISABLE_FILE_CACHING``), but it is keyed by the hash of the traced IR, so every process
still traces the Python kernel before it can hit, and it stores IR that is lowered again. Measured
on the build machine for the SM90 forward kernel (CPU, ``--gpu-arch sm_90a``): 2.8 s to compile
cold, 1.8 s with the DSL's file cache hit, 3 ms to load the exported object. The DSL's cache is
left as it is (it also serves ``options=`` compiles that bypass ours).

The key (:class:`CacheKey`) holds everything that changes the binary: the kernel's static
configuration (the in-process key, rendered canonically: dataclasses field by field), the compile
options, the target architecture, the CuTe DSL version and the DSL settings that it declares
compile-affecting (``cache_key_str()``: arch, lineinfo, debug, assertions, runtime libraries ...),
the version *and a hash of the source files* of every package the kernel is built from, the host
platform, and this module's format version. Its SHA-256 names the entry.

Concurrency: readers take no lock. An entry only ever appears through ``os.replace`` of a complete,
fsync'ed temporary file in the same directory, and its checksum is verified before it is loaded. A
miss takes an exclusive ``fcntl.flock`` on ``<entry>.lock`` (one per key), looks again (another
process may have just written it), compiles, and writes. A corrupt entry (no trailer, checksum
mismatch, or the loader rejects it) is reported as a WARNING on the ``flexattn`` logger, deleted
under the lock, recompiled and rewritten. The disk layer never makes a compile fail: an unwritable
directory, a lock timeout or a failed export is logged and the freshly compiled function is used.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import fcntl
import hashlib
import importlib
import json
import os
import platform
import re
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from contextlib import contextmanager
from functools import cache, cached_property
from pathlib import Path
from typing import TypeVar

from .settings import logger, settings

T = TypeVar("T")

#: bump when the entry layout or the key fields change
CACHE_FORMAT = 2
MAGIC = b"FLXCC001"
TRAILER_BYTES = 32 + len(MAGIC)
#: packages whose sources every planner kernel is built from
PLANNER_PACKAGES = ("maskplan_kernels", "maskplan_core")

log = logger()
#: counters since process start: memory_hit, disk_hit, compile, corrupt, write (tests, diagnostics)
STATS: Counter[str] = Counter()


# -- the key --------------------------------------------------------------------------------------
def canonical(value) -> str:
    """Deterministic text of a key: plain values, enums, tuples/lists/sets/dicts and dataclasses
    (qualified class name, every field). Anything else (whose ``repr`` may hold an address) is refused."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ",".join(f"{f.name}={canonical(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__module__}.{type(value).__qualname__}({fields})"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(canonical(v) for v in value) + ")"
    if isinstance(value, (set, frozenset)):
        return "{" + ",".join(sorted(canonical(v) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ",".join(sorted(f"{canonical(k)}:{canonical(v)}" for k, v in value.items())) + "}"
    raise TypeError(
        f"compile-cache keys hold plain values, enums, containers and dataclasses; got {type(value).__name__}"
    )


@cache
def package_fingerprint(name: str) -> tuple[str, str, str]:
    """``(import name, version, sha256 of every .py file under the package)``, once per process."""
    module = importlib.import_module(name)
    root = Path(module.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        digest.update(f"{rel}\0{path.stat().st_size}\0".encode())
        digest.update(path.read_bytes())
    return name, str(getattr(module, "__version__", "unknown")), digest.hexdigest()


def _dsl_identity(options: str) -> tuple[str, str]:
    """(target arch, DSL version + the DSL settings it declares compile-affecting)."""
    import cutlass

    try:
        from cutlass.cutlass_dsl import CuTeDSL

        envar = CuTeDSL._get_dsl().envar  # the DSL's own notion of what changes a binary
        arch, settings_text = envar.arch, envar.cache_key_str()
    except (ImportError, AttributeError):  # a DSL without that API: every CUTE_DSL_* variable
        arch = os.environ.get("CUTE_DSL_ARCH", "")
        dsl_vars = sorted((k, v) for k, v in os.environ.items() if k.startswith("CUTE_DSL_"))
        settings_text = ";".join(f"{k}={v}" for k, v in dsl_vars)
    match = re.search(r"--gpu-arch[= ](\S+)", options)
    return (match.group(1) if match else arch), f"nvidia-cutlass-dsl=={cutlass.__version__};{settings_text}"


@dataclasses.dataclass(frozen=True)
class CacheKey:
    """Everything a compiled binary depends on; :attr:`digest` names its cache entry."""

    kernel: str  # readable name, e.g. "k2q_count", "sm90-fwd"
    config: str  # canonical text of the static configuration (the in-process key)
    options: str  # cute.compile options
    arch: str  # target, e.g. "sm_90a"
    dsl: str  # DSL version and its compile-affecting settings
    packages: tuple[tuple[str, str, str], ...]  # (import name, version, source sha256)
    host: str = f"{platform.system()}-{platform.machine()}"
    format: int = CACHE_FORMAT

    @cached_property
    def digest(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def filename(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.kernel)[:48] or "kernel"
        return f"{slug}-{self.digest[:32]}.o"

    @property
    def symbol(self) -> str:
        """Symbol prefix of the exported object (a C identifier, unique per key)."""
        return f"flexattn_{self.digest[:24]}"


def make_key(key: Hashable, *, options: str = "", packages: Sequence[str] = PLANNER_PACKAGES) -> CacheKey:
    kernel = key[0] if isinstance(key, tuple) and key and isinstance(key[0], str) else type(key).__name__
    arch, dsl = _dsl_identity(options)
    return CacheKey(
        kernel=kernel,
        config=canonical(key),
        options=options,
        arch=arch,
        dsl=dsl,
        packages=tuple(package_fingerprint(name) for name in packages),
    )


# -- the on-disk layer ----------------------------------------------------------------------------
class CorruptEntry(Exception):
    """A cache entry that exists but cannot be used (reported, deleted and rebuilt)."""


class DiskCache:
    """Entries under ``root``: ``dump(value)`` bytes + trailer, written atomically, one lock per key.

    ``load(path, payload)`` rebuilds a value from a verified entry (``path`` is the entry file, the
    payload followed by the trailer; ``payload`` its bytes without the trailer); any exception it
    raises marks the entry corrupt.
    """

    def __init__(self, root: Path, lock_timeout_s: float = 300.0):
        self.root = Path(root)
        self.lock_timeout_s = lock_timeout_s

    def path(self, key: CacheKey) -> Path:
        return self.root / key.filename

    def get_or_create(
        self,
        key: CacheKey,
        create: Callable[[], T],
        dump: Callable[[T], bytes],
        load: Callable[[Path, bytes], T],
    ) -> T:
        path = self.path(key)
        try:
            value = self._load(path, load)  # fast path: no lock
            if value is not None:
                return self._hit(key, path, value)
        except CorruptEntry:
            pass  # re-examined and deleted under the lock below
        with self._lock(path) as locked:
            if locked:
                try:
                    value = self._load(path, load)
                    if value is not None:
                        return self._hit(key, path, value)
                except CorruptEntry as err:
                    STATS["corrupt"] += 1
                    log.warning(
                        "compile-cache entry %s is corrupt (%s); deleting it and recompiling %s",
                        path, err, key.kernel,
                    )  # fmt: skip
                    path.unlink(missing_ok=True)
            value = create()
            if locked:
                self._store(path, dump, value)
            return value

    @staticmethod
    def _hit(key: CacheKey, path: Path, value: T) -> T:
        STATS["disk_hit"] += 1
        log.info("compile cache hit: %s (%s)", key.kernel, path)
        return value

    @staticmethod
    def read_payload(path: Path) -> bytes | None:
        """The verified payload of the entry at ``path``; None if there is none (or it cannot be
        read: the miss path then reports the directory); CorruptEntry if it is bad."""
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if len(data) < TRAILER_BYTES or data[-len(MAGIC) :] != MAGIC:
            raise CorruptEntry(f"no trailer ({len(data)} bytes; truncated or not written by flexattn)")
        payload, digest = data[:-TRAILER_BYTES], data[-TRAILER_BYTES : -len(MAGIC)]
        if hashlib.sha256(payload).digest() != digest:
            raise CorruptEntry("checksum mismatch")
        return payload

    def _load(self, path: Path, load: Callable[[Path, bytes], T]) -> T | None:
        payload = self.read_payload(path)
        if payload is None:
            return None
        try:
            return load(path, payload)
        except Exception as err:
            raise CorruptEntry(f"the loader rejected it: {type(err).__name__}: {err}") from err

    def _store(self, path: Path, dump: Callable[[T], bytes], value: T) -> None:
        try:
            payload = dump(value)
        except Exception as err:
            log.warning("cannot export %s for the compile cache (%s: %s)", path.name, type(err).__name__, err)
            return
        data = payload + hashlib.sha256(payload).digest() + MAGIC
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{path.name}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), 0o644)  # mkstemp makes 0600
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
            STATS["write"] += 1
            log.debug("compile cache: wrote %s (%d bytes)", path, len(data))
        except OSError as err:
            log.warning("cannot write compile-cache entry %s (%s)", path, err)
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    @contextmanager
    def _lock(self, path: Path):
        """Exclusive per-key lock; yields False (compile without caching) if it cannot be had."""
        fd = self._open_lock_file(path)
        if fd is None:
            yield False
            return
        try:
            locked = self._acquire(fd, path)
            try:
                yield locked
            finally:
                if locked:
                    fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _open_lock_file(self, path: Path) -> int | None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            return os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            log.warning("compile cache unavailable at %s (%s); compiling without it", self.root, err)
            return None

    def _acquire(self, fd: int, path: Path) -> bool:
        deadline = time.monotonic() + self.lock_timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES):
                    reason = str(err)
                elif time.monotonic() > deadline:
                    reason = f"another process held it for {self.lock_timeout_s:.0f} s"
                else:
                    time.sleep(0.05)
                    continue
            log.warning("compile cache: no lock on %s (%s); compiling without caching", path.name, reason)
            return False


# -- CuTe DSL compile, export and load ------------------------------------------------------------
_MEMORY: dict[Hashable, object] = {}
_KEY_LOCKS: dict[Hashable, threading.Lock] = {}
_GLOBAL_LOCK = threading.Lock()
#: compile options of every kernel of the project: TVM-FFI entry points, so a launch passes plain
#: ints (addresses, sizes, the stream handle) and floats (:mod:`maskplan_kernels._cute_args`)
CALL_OPTIONS = "--enable-tvm-ffi"

#: loaded binary modules, kept alive with the functions looked up in them
_MODULES: list[object] = []


def _cute_compile(key: Hashable, build: Callable[[], tuple], options: str):
    import cutlass.cute as cute

    fn, *args = build()
    log.info("compiling %s (a first call's compile takes seconds; cached afterwards)", canonical(key))
    start = time.perf_counter()
    compiled = cute.compile(fn, *args, options=options)
    STATS["compile"] += 1
    log.info("compiled %s in %.2f s", canonical(key), time.perf_counter() - start)
    return compiled


def _object_bytes(compiled, symbol: str) -> bytes:
    """The relocatable object of a TVM-FFI compiled function (host entry + cubin), exporting
    ``__tvm_ffi_<symbol>``."""
    with tempfile.TemporaryDirectory(prefix="flexattn-export-") as tmp:
        path = Path(tmp) / f"{symbol}.o"
        compiled.export_to_c(str(path), function_name=symbol)
        return path.read_bytes()


def _cute_loader(symbol: str):
    def load(path: Path, payload: bytes):
        import cutlass.cute as cute

        module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
        compiled = getattr(module, symbol)
        _MODULES.append(module)
        return compiled

    return load


def compile_cached(
    key: Hashable,
    build: Callable[[], tuple],
    *,
    options: str = "",
    packages: Sequence[str] = PLANNER_PACKAGES,
):
    """The compiled function for ``key``; on a miss ``cute.compile(*build(), options=options)``.

    Every kernel is compiled with :data:`CALL_OPTIONS` (TVM-FFI: a
    launch passes ints and floats, see :mod:`maskplan_kernels._cute_args`), and loads as such.

    ``key`` identifies the kernel and its static configuration (a tuple of plain values and frozen
    dataclasses, by convention ``(kernel name, config, ...)``); ``build`` returns
    ``(jit_callable, *placeholder_args)``; ``packages`` are the import names whose sources the
    kernel is built from (their source hash and version join the on-disk key). Thread-safe: one
    compile per key and process; the on-disk cache makes it one compile per key and machine.
    """
    packages = tuple(packages)
    options = f"{options} {CALL_OPTIONS}".strip()
    memory_key = (key, options, packages)
    compiled = _MEMORY.get(memory_key)
    if compiled is not None:
        STATS["memory_hit"] += 1
        return compiled
    with _GLOBAL_LOCK:
        lock = _KEY_LOCKS.setdefault(memory_key, threading.Lock())
    with lock:
        compiled = _MEMORY.get(memory_key)
        if compiled is None:
            compiled = _compile_or_load(key, build, options, packages)
            _MEMORY[memory_key] = compiled
        return compiled


def _compile_or_load(key: Hashable, build: Callable[[], tuple], options: str, packages: tuple[str, ...]):
    s = settings()
    if not s.cache_enabled:
        return _cute_compile(key, build, options)
    cache_key = make_key(key, options=options, packages=packages)
    disk = DiskCache(s.cache_dir / "kernels", s.lock_timeout_s)
    return disk.get_or_create(
        cache_key,
        create=lambda: _cute_compile(key, build, options),
        dump=lambda compiled: _object_bytes(compiled, cache_key.symbol),
        load=_cute_loader(cache_key.symbol),
    )


def cached_keys() -> list[Hashable]:
    """The keys compiled or loaded so far in this process (for tests and diagnostics)."""
    return [memory_key[0] for memory_key in _MEMORY]


__all__ = [
    "CACHE_FORMAT",
    "CALL_OPTIONS",
    "PLANNER_PACKAGES",
    "STATS",
    "CacheKey",
    "CorruptEntry",
    "DiskCache",
    "cached_keys",
    "canonical",
    "compile_cached",
    "make_key",
    "package_fingerprint",
]
