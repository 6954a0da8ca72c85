"""Sessions: conformance (CPU tier, what CI runs), conformance_gpu, bench, demo, lint.

CPU sessions pin torch==2.13.0 (a CPU wheel of that exact version is served locally; an open
range would resolve to a multi-GB CUDA build) and triton==3.6.0 (the H200 machine's version), and
use pip (uv ignores the machine's pip configuration and downloads gigabytes); they install the
project editable (`pip install -e .[dev]`), which maps reference/, optimized/ and conformance/
under dsv4mtp.  The GPU session runs in the current interpreter: the H200 machine brings its own
torch 2.11 + CUDA build, and an old setuptools whose editable install cannot map those folders,
so it installs a copy (`pip install --no-deps --no-build-isolation .`) and runs that.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["conformance"]

CPU_PINS = ("torch==2.13.0", "triton==3.6.0")
CPU_ENV = {
    "TRITON_INTERPRET": "1",  # our Triton kernels run in the interpreter on CPU tensors
    "OMP_NUM_THREADS": "2",
    "CUDA_VISIBLE_DEVICES": "",
}


def _install_cpu(session: nox.Session, extras: str = "dev") -> None:
    session.install(*CPU_PINS)
    session.install("-e", f".[{extras}]")


@nox.session
def conformance(session: nox.Session) -> None:
    """CPU tier: reference properties + optimized Triton kernels under TRITON_INTERPRET=1.

    Two pytest-xdist workers (CI has two cores; the interpreter runs a kernel's programs one
    by one in one Python thread), tests handed out as workers free up (``worksteal``: a few
    tests take a minute, most a second).  ``-n 0`` in the posargs runs in one process."""
    _install_cpu(session)
    session.run(
        *("pytest", "conformance", "-m", "not slow", "--durations=15"),
        *("-n", "2", "--dist", "worksteal"),
        *session.posargs,
        env={**CPU_ENV, "OMP_NUM_THREADS": "1"},
    )


@nox.session(venv_backend="none")
def conformance_gpu(session: nox.Session) -> None:
    """Everything, on a CUDA machine, in its Python (torch+CUDA come with the machine).

    Installs this checkout (non-editable) into that Python and runs the installed suite; select
    with -k (e.g. `nox -s conformance_gpu -- -k mhc`).  The committed example database is
    replayed, never modified; new failures go to .hypothesis/local (README).
    """
    shutil.rmtree("build", ignore_errors=True)  # setuptools would pack stale files from it
    session.run("python", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", ".")
    env = {
        "DSV4_HYPOTHESIS_PROFILE": "dsv4-gpu",
        "DSV4_HYPOTHESIS_DB": str(Path(".hypothesis", "examples").resolve()),
    }
    # The installed suite, run as from a wheel, from outside the checkout: there the checkout's
    # own dsv4mtp/ folder would come first on sys.path and hide the installed package.
    with tempfile.TemporaryDirectory() as outside, session.chdir(outside):
        session.run(
            *("python", "-m", "pytest", "-p", "dsv4mtp.conformance.plugin"),
            *("--pyargs", "dsv4mtp.conformance", "-ra"),
            "--durations=15",
            *session.posargs,
            env=env,
        )


@nox.session
def bench(session: nox.Session) -> None:
    """pytest-benchmark suite (the GPU rows need CUDA; CPU rows time the reference)."""
    _install_cpu(session)
    session.run(
        "pytest",
        "bench",
        "--benchmark-only",
        "-p",
        "no:randomly",
        *session.posargs,
        env={"OMP_NUM_THREADS": "2"},
    )


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: synthetic checkpoint -> MTP layer -> k-step draft -> agreement report."""
    _install_cpu(session)
    session.run("dsv4-mtp", "demo", *session.posargs, env={"OMP_NUM_THREADS": "2"})


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint + format check) and mypy on the public modules."""
    _install_cpu(session)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", "reference", "optimized", "dsv4mtp")
