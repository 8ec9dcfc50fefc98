"""The planner kernels' entry to the project's compile cache (:mod:`.compile_cache`).

Sizes are runtime arguments of every planner kernel, so the key is only the kernel name and its
frozen config dataclass; the planner packages' sources and versions, the DSL and the target join it
on disk. Compiling uses placeholder pointers (``_cute_args``): it needs no GPU and allocates nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import cutlass.cute as cute
from cutlass import Int32

from . import compile_cache
from ._cute_args import fake_stream, placeholder_ptr


def compile_cached(key: Hashable, build: Callable[[], tuple], options: str | None = None) -> object:
    """Return the compiled function for ``key``; on a miss ``cute.compile(*build())``.

    ``build`` returns ``(jit_callable, *placeholder_args)``. ``options`` (e.g. ``"--keep-ptx"`` for
    ``compiled.__ptx__``) compiles a fresh, uncached function.
    """
    if options is not None:
        fn, *args = build()
        return cute.compile(fn, *args, options=options)
    return compile_cache.compile_cached(key, build, packages=compile_cache.PLANNER_PACKAGES)


def compile_stage(
    name: str, kernel: Callable[[Hashable], object], config: Hashable, *, pointers: int, ints: int,
    options: str | None = None,
) -> object:  # fmt: skip
    """Compile (cached, under ``(name, config)``) a planner stage: the host entry of ``kernel(config)``
    against its signature's placeholders, ``pointers`` pointers, then ``ints`` int32 sizes and the
    stream; no GPU needed. ``options`` (e.g. ``"--keep-ptx"``) compiles a fresh, uncached function."""

    def build():
        ptr = placeholder_ptr()
        return (kernel(config), *(ptr,) * pointers, *(Int32(1),) * ints, fake_stream())

    return compile_cached((name, config), build, options)
