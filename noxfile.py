"""One nox session per layer; each installs only its layer and what that layer declares.

    python3 -m nox -s lint core kernels sm90 sm100 facade integration demo   # CPU: what CI runs
    python3 -m nox -s gpu bench                                              # on a CUDA machine

The packages depend on each other by name (``maskplan-core==0.1.0``), and those names are not on
PyPI: every session installs the local closure of its layer in ONE ``pip install`` with every
local path (``-e packages/...``), so pip resolves the local names among them. The closure is read
from the packages' own ``pyproject.toml`` files, so it follows their declared dependencies.

torch comes from the CPU wheel on this machine's disk: ``torch==2.13.0`` is pinned in every
install so pip never reaches for a multi-GB CUDA build. Set ``FLEXATTN_TORCH`` to another
requirement (e.g. ``torch`` on a CUDA machine with an index) to override it. Venvs are reused
(``.nox/``) and pip's cache is kept; ``nox -N`` recreates them.

On the lent GPU machine (no package index) stage the deps, install the packages with
``pip install --no-deps --no-build-isolation -e ...`` and run ``nox --no-venv --no-install -s gpu``
(or plain ``pytest -m gpu``): see README.md.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nox

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 running nox
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent
PACKAGES = ROOT / "packages"
PYTHON = "3.11"
TORCH = os.environ.get("FLEXATTN_TORCH", "torch==2.13.0")
RUFF = "ruff==0.17.6"
#: the version the GPU parity runs used (session 40); its Python API imports without CUDA
CUDNN_FRONTEND = "nvidia-cudnn-frontend==1.32.0"
#: what examples/transformers_packed.py was written against (not a dependency of ours)
TRANSFORMERS = "transformers==5.25.0"
BUILD_BACKEND = "setuptools>=70.1"

# Installs skip bytecode compilation (--no-compile: half the time of a torch install); Python then
# writes bytecode lazily for the modules actually imported, so let it even where the environment
# says otherwise (these venvs are scratch space under .nox/).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True
# `nox` alone runs what CI runs (every CPU session); gpu and bench are asked for by name.
nox.options.sessions = ["lint", "core", "kernels", "sm90", "sm100", "facade", "integration", "demo"]

# Compile-only CuTe DSL tests need a target architecture; no GPU is needed for them.
# ptxas must read the DSL's PTX there (maskplan_kernels.testing.REQUIRE_PTXAS): the spill and
# WGMMA-serialisation checks fail instead of warning without it.
SM90_COMPILE = {"CUTE_DSL_ARCH": "sm_90a", "FLEXATTN_REQUIRE_PTXAS": "1"}
SM100_COMPILE = {"CUTE_DSL_ARCH": "sm_100a", "FLEXATTN_REQUIRE_PTXAS": "1"}


# --------------------------------------------------------------------------------------------------
# local package graph


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _req_name(requirement: str) -> str:
    return _norm(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1))


def _load_packages() -> dict[str, dict]:
    found = {}
    for pyproject in sorted(PACKAGES.glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        found[_norm(project["name"])] = {
            "path": pyproject.parent,
            "deps": project.get("dependencies", []),
            "extras": project.get("optional-dependencies", {}),
        }
    return found


LOCAL = _load_packages()


def _local_deps(name: str, extras: tuple[str, ...]) -> list[str]:
    pkg = LOCAL[name]
    reqs = list(pkg["deps"])
    for extra in extras:
        if extra not in pkg["extras"]:
            raise ValueError(f"{name} has no extra {extra!r} (has {sorted(pkg['extras'])})")
        reqs += pkg["extras"][extra]
    return [d for d in map(_req_name, reqs) if d in LOCAL]


def local_closure(name: str, extras: tuple[str, ...] = ()) -> list[str]:
    """``name`` and every local package it needs (with ``extras``), dependencies first."""
    order: list[str] = []

    def visit(pkg: str, pkg_extras: tuple[str, ...], stack: tuple[str, ...]) -> None:
        if pkg in stack:
            raise ValueError(f"dependency cycle among local packages: {' -> '.join(stack + (pkg,))}")
        for dep in _local_deps(pkg, pkg_extras):
            visit(dep, (), stack + (pkg,))
        if pkg not in order:
            order.append(pkg)

    visit(_norm(name), extras, ())
    return order


def install_layer(session: nox.Session, name: str, extras: tuple[str, ...] = ("test",)) -> None:
    """One pip command: pinned torch, every local dependency, then the layer with ``extras``.

    ``extras`` apply to the layer itself only (its dependencies' test extras are not installed).
    """
    closure = local_closure(name, tuple(e for e in extras if e != "test"))
    args = []
    for pkg in closure:
        path = os.path.relpath(LOCAL[pkg]["path"], ROOT)
        own = [e for e in extras if e in LOCAL[pkg]["extras"]] if pkg == _norm(name) else []
        args += ["-e", f"{path}[{','.join(own)}]" if own else path]
    _pip_install_local(session, args)


def _pip_install_local(session: nox.Session, args: list[str]) -> None:
    # --no-build-isolation builds with the venv's own setuptools: the venv's bundled 65.x cannot
    # build editable wheels without `wheel`, so bring a setuptools that can (>=70.1) first.
    session.install("--no-compile", BUILD_BACKEND)
    session.install("--no-compile", "--no-build-isolation", TORCH, *args)


def install_all_with_tests(session: nox.Session) -> None:
    """flexattn[all] (every local package), each with its own test extra, in one pip command."""
    args = []
    for pkg in local_closure("flexattn", ("all",)):
        extras = [e for e in ("all", "test") if e in LOCAL[pkg]["extras"]]
        path = os.path.relpath(LOCAL[pkg]["path"], ROOT)
        args += ["-e", f"{path}[{','.join(extras)}]" if extras else path]
    _pip_install_local(session, args)


# --------------------------------------------------------------------------------------------------
# running tests


def _has_tests(path: Path) -> bool:
    return path.is_dir() and (any(path.rglob("test_*.py")) or any(path.rglob("*_test.py")))


#: pytest-xdist workers for the CuTe DSL compile suites: each test compiles on one core (DSL trace,
#: then ptxas), so one worker per core cut the sm100 suite from 384 s to 268 s on CI's 2 cores
COMPILE_WORKERS = ("-n", "auto")


def run_tests(
    session: nox.Session, tests: str, env: dict[str, str] | None = None, workers: tuple[str, ...] = ()
) -> None:
    if not _has_tests(ROOT / tests):
        session.error(f"{tests} has no test files")
    session.run("python", "-m", "pytest", tests, *workers, *session.posargs, env=env or {})


# --------------------------------------------------------------------------------------------------
# CPU sessions (CI)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff over the whole repository (config: ruff.toml)."""
    session.install(RUFF)
    session.run("ruff", "check", ".", *session.posargs)


@nox.session(python=PYTHON)
def core(session: nox.Session) -> None:
    """maskplan-core alone (torch + pydantic): ABI, validation, reference planner, masks."""
    install_layer(session, "maskplan-core")
    run_tests(session, "packages/maskplan-core/tests")


@nox.session(python=PYTHON)
def kernels(session: nox.Session) -> None:
    """maskplan-kernels + core; CuTe DSL compile tests target sm_90a (no GPU needed)."""
    install_layer(session, "maskplan-kernels")
    run_tests(session, "packages/maskplan-kernels/tests", env=SM90_COMPILE, workers=COMPILE_WORKERS)


@nox.session(python=PYTHON)
def sm90(session: nox.Session) -> None:
    """flexattn-sm90 + maskplan-kernels + core; layout maths and sm_90a compile tests."""
    install_layer(session, "flexattn-sm90")
    run_tests(session, "packages/flexattn-sm90/tests", env=SM90_COMPILE, workers=COMPILE_WORKERS)


@nox.session(python=PYTHON)
def sm100(session: nox.Session) -> None:
    """flexattn-sm100 + maskplan-kernels + core; layout maths and sm_100a compile tests."""
    install_layer(session, "flexattn-sm100")
    run_tests(session, "packages/flexattn-sm100/tests", env=SM100_COMPILE, workers=COMPILE_WORKERS)


@nox.session(python=PYTHON)
def facade(session: nox.Session) -> None:
    """flexattn + core (no consumer package): the public API on the CPU reference path."""
    install_layer(session, "flexattn")
    run_tests(session, "packages/flexattn/tests")


#: tests inside a package's suite that need another package too (its own session skips them)
CROSS_PACKAGE_TESTS = (
    "packages/maskplan-core/tests/test_plan_properties.py::test_create_mask_plan_invariants",
    "packages/maskplan-core/tests/test_reference_attention.py",  # its needs_flexattn tests
    "packages/maskplan-kernels/tests/test_builder_emulated.py::test_consumer_layouts_and_tails",
    "packages/maskplan-kernels/tests/test_payload_table.py",  # the consumers' layouts' cases
)


@nox.session(python=PYTHON)
def integration(session: nox.Session) -> None:
    """flexattn[all] (every package): cross-package tests in tests/, and CROSS_PACKAGE_TESTS.
    cuDNN's frontend (a peer, never a dependency of ours) is installed for its API alone:
    tests/test_cudnn_parity.py compares the public names and signatures on the CPU. transformers
    (never a dependency either) runs examples/transformers_packed.py (tests/test_transformers_example.py)."""
    install_layer(session, "flexattn", extras=("all", "test"))
    session.install("--no-deps", CUDNN_FRONTEND)
    session.install("--no-compile", TRANSFORMERS)
    run_tests(session, "tests")
    session.run("python", "-m", "pytest", *CROSS_PACKAGE_TESTS, *session.posargs)


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """examples/demo.py with flexattn + core only (CPU check; on a GPU also the CUDA path), and a
    few steps of examples/train_packed_documents.py (with a window, and with SFT prompts)."""
    install_layer(session, "flexattn", extras=())
    session.run("python", "examples/demo.py", *session.posargs)
    session.run("python", "examples/train_packed_documents.py", "--steps", "5", "--window", "64")
    session.run("python", "examples/train_packed_documents.py", "--steps", "5", "--prompt")


@nox.session(name="bench_cpu", python=PYTHON)
def bench_cpu(session: nox.Session) -> None:
    """The CPU reference planner benchmark (benchmarks/bench_plan_cpu.py)."""
    install_layer(session, "flexattn", extras=())
    session.run("python", "benchmarks/bench_plan_cpu.py", *session.posargs)


# --------------------------------------------------------------------------------------------------
# GPU sessions (need torch with CUDA: set FLEXATTN_TORCH, or use --no-venv --no-install)


def _require_cuda(session: nox.Session) -> None:
    code = "import torch; print('cuda' if torch.cuda.is_available() else 'no-cuda')"
    if (session.run("python", "-c", code, silent=True) or "").strip().splitlines()[-1:] != ["cuda"]:
        session.skip("torch.cuda.is_available() is False here: this session needs a CUDA GPU")


@nox.session(python=PYTHON)
def gpu(session: nox.Session) -> None:
    """Every `gpu`-marked test of every package and tests/, against flexattn[all]."""
    install_all_with_tests(session)
    _require_cuda(session)
    dirs = [os.path.relpath(LOCAL[p]["path"] / "tests", ROOT) for p in LOCAL] + ["tests"]
    for tests in dirs:
        if not _has_tests(ROOT / tests):
            session.log(f"{tests}: no tests yet")
            continue
        # exit code 5: this directory has no gpu-marked test (all deselected), which is fine here.
        session.run("python", "-m", "pytest", tests, "-m", "gpu", *session.posargs, success_codes=[0, 5])


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """GPU benchmarks: every benchmarks/bench_*.py except the CPU-only ones (bench_*cpu*.py), each
    with its defaults; arguments after ``--`` go to bench_fwd_sm90.py only (the scripts' flags differ)."""
    install_layer(session, "flexattn", extras=("all",))
    _require_cuda(session)
    scripts = sorted(p for p in (ROOT / "benchmarks").glob("bench_*.py") if "cpu" not in p.stem)
    if not scripts:
        session.skip("no GPU benchmark scripts in benchmarks/ yet")
    for script in scripts:
        args = session.posargs if script.name == "bench_fwd_sm90.py" else ()
        session.run("python", os.path.relpath(script, ROOT), *args)
