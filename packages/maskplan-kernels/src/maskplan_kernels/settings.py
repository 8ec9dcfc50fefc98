"""Every environment knob of flexattn but one (below), read in one place (call :func:`settings`;
nothing is cached, so a test or a launcher may change the environment between calls).

=========================  ==========================================================================
variable                   meaning
=========================  ==========================================================================
``FLEXATTN_CACHE_DIR``     root of the on-disk compile cache (default ``$XDG_CACHE_HOME/flexattn``,
                           i.e. ``~/.cache/flexattn``); compiled kernels live in ``<root>/kernels``
``FLEXATTN_CACHE``         ``0``/``false``/``off``/``no`` disables the on-disk cache (kernels are then
                           compiled once per process); ``1``/``true``/``on``/``yes`` (the default,
                           see ``CACHE_DEFAULT``) enables it
=========================  ==========================================================================

One knob is read elsewhere: ``FLEXATTN_SM100_UNVERIFIED=1`` (run the SM100 kernels, which have never
run on hardware) is read by ``flexattn_sm100.consumer``, which the consumer registry imports without
CuTe DSL, and importing this package imports CuTe DSL.

CuTe DSL's own variables (``CUTE_DSL_ARCH``, ``CUTE_DSL_LINEINFO``, ...) keep their meaning; the
ones that change generated code are part of every compile-cache key (see :mod:`.compile_cache`).

Logging goes to the ``flexattn`` logger, which has a ``NullHandler`` and so is silent unless the
application configures logging (``logging.basicConfig(level=logging.INFO)`` shows compiles and
cache hits; warnings such as a corrupt cache entry are logged at WARNING).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

LOGGER_NAME = "flexattn"
ENV_CACHE_DIR = "FLEXATTN_CACHE_DIR"
ENV_CACHE = "FLEXATTN_CACHE"
_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")
#: how long a process waits for another one compiling the same kernel before compiling it itself
LOCK_TIMEOUT_S = 300.0
#: On: on an H200 a second process loaded every forward and planner kernel from disk and its
#: forward output was bit-identical to the first process's (tests/test_gpu_compile.py).
CACHE_DEFAULT = True


@dataclass(frozen=True)
class Settings:
    cache_enabled: bool
    cache_dir: Path  # root; kernels are stored under cache_dir / "kernels"
    lock_timeout_s: float = LOCK_TIMEOUT_S


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name} must be one of {'/'.join(_TRUE + _FALSE)}, got {os.environ[name]!r}")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flexattn"


def settings() -> Settings:
    """The current settings, read from the environment now."""
    raw_dir = os.environ.get(ENV_CACHE_DIR, "").strip()
    cache_dir = Path(raw_dir).expanduser() if raw_dir else default_cache_dir()
    return Settings(cache_enabled=_flag(ENV_CACHE, CACHE_DEFAULT), cache_dir=cache_dir)


def logger() -> logging.Logger:
    """The ``flexattn`` logger (with a ``NullHandler``: silent unless the application configures logging)."""
    log = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, logging.NullHandler) for h in log.handlers):
        log.addHandler(logging.NullHandler())
    return log
