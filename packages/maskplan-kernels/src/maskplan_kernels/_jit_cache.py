"""The in-process compile cache of the planner kernels: one compiled function per (kernel, static config).

Sizes are runtime arguments of every planner kernel, so the key is only the kernel class and its
frozen config dataclass (hashable). Compiling uses placeholder pointers (``_cute_args``): it needs no
GPU and allocates nothing. A per-key lock lets two threads compile different kernels concurrently
while a second caller of the same key waits for the first compile instead of repeating it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

import cutlass.cute as cute

_COMPILED: dict[Hashable, object] = {}
_KEY_LOCKS: dict[Hashable, threading.Lock] = {}
_GLOBAL_LOCK = threading.Lock()


def compile_cached(key: Hashable, build: Callable[[], tuple], options: str | None = None) -> object:
    """Return the compiled function for ``key``; on a miss ``cute.compile(*build())``.

    ``build`` returns ``(jit_callable, *placeholder_args)``. ``options`` (e.g. ``"--keep-ptx"`` for
    ``compiled.__ptx__``) compiles a fresh, uncached function.
    """
    if options is not None:
        fn, *args = build()
        return cute.compile(fn, *args, options=options)
    compiled = _COMPILED.get(key)
    if compiled is not None:
        return compiled
    with _GLOBAL_LOCK:
        lock = _KEY_LOCKS.setdefault(key, threading.Lock())
    with lock:
        compiled = _COMPILED.get(key)
        if compiled is None:
            fn, *args = build()
            compiled = cute.compile(fn, *args)
            _COMPILED[key] = compiled
        return compiled


def cached_keys() -> list[Hashable]:
    """The keys compiled so far in this process (for tests and diagnostics)."""
    return list(_COMPILED)
