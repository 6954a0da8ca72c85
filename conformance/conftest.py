"""Shared pytest configuration: hypothesis profiles, markers, devices, ``--impl``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase, ReadOnlyDatabase

# Without a GPU our Triton kernels run in Triton's interpreter on CPU tensors.  Triton reads the
# variable when a kernel is decorated, so it must be set before dsv4mtp.optimized is imported;
# nox sets it too, this is for plain `pytest` runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# ---------------------------------------------------------------------------------- hypothesis
# The committed example database replays past failures.  CI reads it but never writes to it;
# local runs add new failures to it (commit them).  We register our own profiles because with
# CI=true Hypothesis would otherwise load its built-in "ci" profile (no database, derandomized).
_DB_DIR = Path(__file__).resolve().parent.parent / ".hypothesis" / "examples"
_COMMON = dict(
    deadline=None,  # interpreter-run kernels have no stable timing
    print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,  # `device`/`impl_override` are pure lookups
    ],
)
settings.register_profile(
    "dsv4-ci",
    max_examples=40,
    database=ReadOnlyDatabase(DirectoryBasedExampleDatabase(_DB_DIR)),
    derandomize=False,
    **_COMMON,
)
settings.register_profile(
    "dsv4-dev", max_examples=40, database=DirectoryBasedExampleDatabase(_DB_DIR), **_COMMON
)
settings.register_profile(
    "dsv4-gpu", max_examples=40, database=DirectoryBasedExampleDatabase(_DB_DIR), **_COMMON
)
settings.register_profile(
    "dsv4-thorough", max_examples=500, database=DirectoryBasedExampleDatabase(_DB_DIR), **_COMMON
)
_default_profile = "dsv4-ci" if os.environ.get("CI") else "dsv4-dev"
settings.load_profile(os.environ.get("DSV4_HYPOTHESIS_PROFILE", _default_profile))


# ---------------------------------------------------------------------------------- options
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--impl",
        action="append",
        default=[],
        metavar="[OP=]module:function",
        help=(
            "Test a third-party implementation instead of dsv4mtp.optimized. "
            "'OP=pkg.mod:fn' replaces op OP; 'pkg.mod:fn' replaces the op named fn. Repeatable."
        ),
    )


def pytest_configure(config: pytest.Config) -> None:
    overrides: dict[str, str] = {}
    for spec in config.getoption("--impl"):
        op, eq, path = spec.partition("=")
        if not eq:
            path = spec
            op = spec.rpartition(":")[2]
        if ":" not in path:
            raise pytest.UsageError(f"--impl {spec!r}: expected [OP=]module:function")
        overrides[op] = path
    config.stash[IMPL_KEY] = overrides


IMPL_KEY = pytest.StashKey[dict[str, str]]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (gpu tier); none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def impl_override(request: pytest.FixtureRequest):
    """Returns ``op_name -> callable or None`` for the ``--impl`` option."""
    from dsv4mtp.conformance.registry import resolve

    overrides = request.config.stash[IMPL_KEY]

    def lookup(op: str):
        return resolve(overrides[op]) if op in overrides else None

    return lookup


@pytest.fixture
def device() -> str:
    """The device the optimized ops run on: CUDA when present, else CPU (Triton interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # type: ignore[no-untyped-def]
    from dsv4mtp.conformance.differential import SUMMARY

    if not SUMMARY:
        return
    from dsv4mtp.conformance.registry import REGISTRY

    tr = terminalreporter
    tr.section("conformance: worst error seen per op, dtype and output (vs float64 oracle)")
    tr.write_line(
        f"{'op':<14}{'dtype':<10}{'output':<13}{'cases':>6}{'rel':>11}{'tol':>9}{'max_abs':>11}{'tol':>9}"
    )
    for (op, dt, out), (n, rel, mab) in sorted(SUMMARY.items()):
        tol = REGISTRY[op].tolerances[getattr(torch, dt)]
        tr.write_line(
            f"{op:<14}{dt:<10}{out:<13}{int(n):>6}{rel:>11.2e}{tol.rel:>9.0e}{mab:>11.2e}{tol.max_abs:>9.0e}"
        )
