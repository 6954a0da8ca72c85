"""The conformance suite's pytest plugin: hypothesis profiles, markers, devices, ``--impl``.

Loaded explicitly, never through an entry point, so that installing the package changes no
other project's pytest.  From a source checkout ``pyproject.toml``'s ``addopts`` loads it; from
an installed package::

    python -m pytest -p dsv4mtp.conformance.plugin --pyargs dsv4mtp.conformance [--impl ...]

(``-p`` because pytest reads a conftest inside a ``--pyargs`` package only after it has parsed
the command line: too late for ``--impl``.)
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    MultiplexedDatabase,
    ReadOnlyDatabase,
)

# Without a GPU our Triton kernels run in Triton's interpreter on CPU tensors.  Triton reads the
# variable when a kernel is decorated, so it must be set before dsv4mtp.optimized is imported;
# nox sets it too, this is for plain `pytest` runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _lighter_interpreter_patching() -> None:
    """Under Triton 3.6's interpreter, skip the language re-patching that finds nothing to do.

    The interpreter swaps ``triton.language``'s builtins for interpreting versions around every
    kernel launch, and again at every call of a ``@triton.jit`` helper inside a kernel
    (``InterpretedFunction.__call__`` -> ``_patch_lang``), where ``_patch_builtin`` lists each
    module's members (``inspect.getmembers``) to find builtins that the launch already
    swapped: a quarter of the CPU tier's MoE time in a profile, for nothing.  Here the builtin
    names are listed once per module, and a module whose builtins are already swapped is left
    as it is, which is what the original does after its scan.  Launches patch exactly as
    before.  Any other Triton version keeps its own code."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_builtin", None)
    if triton.__version__ != "3.6.0" or original is None or hasattr(original, "names"):
        return
    names: dict[object, list[str]] = {}  # module (or class) -> its builtins' names

    def _patch_builtin(pkg, builder, scope):  # type: ignore[no-untyped-def]
        listed = names.get(pkg)
        if listed is None:
            listed = [n for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
            if not listed:  # already swapped (or none): as the original, nothing to do
                return
            names[pkg] = listed
        if not tl.core.is_builtin(getattr(pkg, listed[0], None)):
            return  # inside a launch's patching: every builtin is swapped already
        for name in listed:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    _patch_builtin.names = names  # type: ignore[attr-defined]
    interpreter._patch_builtin = _patch_builtin


_lighter_interpreter_patching()


def _source_root() -> Path | None:
    here = Path(__file__).resolve().parent
    if here.name == "conformance" and (here.parent / "pyproject.toml").is_file():
        return here.parent
    return None


#: The repository when the suite runs from a source checkout (or an editable install of one);
#: None when it runs from an installed wheel, where tests that need the sources are skipped.
SOURCE_ROOT = _source_root()

MARKERS = (
    "gpu: needs a CUDA device (skipped with a reason on CPU)",
    "slow: long-running; excluded from the CPU tier with -m 'not slow'",
)
WARNING_FILTERS = ("ignore::DeprecationWarning:cutlass.*",)

# ---------------------------------------------------------------------------------- hypothesis
# The committed example database (.hypothesis/examples) replays past failures.  No run modifies
# it: every profile reads it read-only and saves new failures (and forgets stale ones) in a local
# database beside it, .hypothesis/local, which git ignores; promoting a failure means copying its
# entries into the committed directory (README).  We register our own profiles because with
# CI=true Hypothesis would otherwise load its built-in "ci" profile (no database, derandomized).
# An installed package has no committed database and must not write into site-packages: it runs
# without one unless DSV4_HYPOTHESIS_DB names a directory (e.g. a checkout's .hypothesis/examples),
# whose sibling "local" then takes the new failures.


def _example_dir() -> Path | None:
    if os.environ.get("DSV4_HYPOTHESIS_DB"):
        return Path(os.environ["DSV4_HYPOTHESIS_DB"])
    if SOURCE_ROOT is not None:
        return SOURCE_ROOT / ".hypothesis" / "examples"
    return None


def _database() -> ExampleDatabase | None:
    committed = _example_dir()
    if committed is None:
        return None
    local = DirectoryBasedExampleDatabase(committed.parent / "local")
    return MultiplexedDatabase(ReadOnlyDatabase(DirectoryBasedExampleDatabase(committed)), local)


_COMMON = settings(
    deadline=None,  # interpreter-run kernels have no stable timing
    print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,  # `device`/`impl_override` are pure lookups
    ],
)
settings.register_profile(
    "dsv4-ci", _COMMON, max_examples=40, database=_database(), derandomize=False
)
settings.register_profile("dsv4-dev", _COMMON, max_examples=40, database=_database())
settings.register_profile("dsv4-gpu", _COMMON, max_examples=40, database=_database())
settings.register_profile("dsv4-thorough", _COMMON, max_examples=500, database=_database())
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


IMPL_KEY = pytest.StashKey[dict[str, str]]()
# The items a run collected and then deselected (``-m "not slow"`` on the CPU tier): generated
# and present, only not run here; test_registry.py counts them as collected.
DESELECTED_KEY = pytest.StashKey[list[pytest.Item]]()


def pytest_deselected(items: list[pytest.Item]) -> None:
    if items:
        items[0].config.stash.setdefault(DESELECTED_KEY, []).extend(items)


def pytest_configure(config: pytest.Config) -> None:
    # Registered here rather than in pyproject.toml so that an installed suite, run from a
    # directory without our configuration file, knows them too.
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    for line in WARNING_FILTERS:
        config.addinivalue_line("filterwarnings", line)
    overrides: dict[str, str] = {}
    # A default: loaded late (from a conftest under --pyargs) the option was never parsed.
    for spec in config.getoption("--impl", default=None) or []:
        op, eq, path = spec.partition("=")
        if not eq:
            path = spec
            op = spec.rpartition(":")[2]
        if ":" not in path:
            raise pytest.UsageError(f"--impl {spec!r}: expected [OP=]module:function")
        _check_impl(spec, op, path, config.invocation_params.dir)
        overrides[op] = path
    config.stash[IMPL_KEY] = overrides


def _check_impl(spec: str, op: str, path: str, invocation_dir: Path) -> None:
    """A mistyped ``--impl`` stops the run before any test: the op must be registered and the
    function importable (from sys.path or the directory pytest runs in, as at test time, where
    pytest has put the test's root folder on sys.path)."""
    import dsv4mtp.conformance.pairs  # noqa: F401  (declares the pairs)
    from dsv4mtp.conformance.registry import REGISTRY

    if op not in REGISTRY:
        raise pytest.UsageError(
            f"--impl {spec!r}: no op named {op!r} is registered; the ops are "
            f"{', '.join(sorted(REGISTRY))} (write OP=module:function to name the op)"
        )
    module, _, attr = path.partition(":")
    added = str(invocation_dir) not in sys.path
    if added:
        sys.path.append(str(invocation_dir))
    try:
        obj: object = importlib.import_module(module)
    except Exception as e:
        raise pytest.UsageError(
            f"--impl {spec!r}: cannot import module {module!r} ({type(e).__name__}: {e}); "
            f"it must be importable from sys.path or from {invocation_dir}"
        ) from e
    finally:
        if added:
            sys.path.remove(str(invocation_dir))
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            found = ".".join([module, *attr.split(".")[:i]])
            raise pytest.UsageError(f"--impl {spec!r}: {found} has no attribute {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise pytest.UsageError(
            f"--impl {spec!r}: {path} is a {type(obj).__name__}, not a function"
        )


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


# Under pytest-xdist the differential tests run in the workers: each sends its SUMMARY back
# with its results (``workeroutput``), and the controller merges them before its summary.
_WORKER_SUMMARIES: list[dict[tuple[str, str, str, str], list[float]]] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)  # set in xdist workers only
    differential = sys.modules.get("dsv4mtp.conformance.differential")
    if workeroutput is not None and differential is not None:
        workeroutput["dsv4_summary"] = [[*k, *v] for k, v in differential.SUMMARY.items()]


@pytest.hookimpl(optionalhook=True)  # an xdist hook (controller side), absent without xdist
def pytest_testnodedown(node: Any, error: object) -> None:
    rows = getattr(node, "workeroutput", {}).get("dsv4_summary", [])
    _WORKER_SUMMARIES.append({tuple(r[:4]): list(r[4:]) for r in rows})


def _merged_summary() -> dict[tuple[str, str, str, str], list[float]]:
    """This process's SUMMARY and the workers': cases and by-own counts add, the worst errors
    are the largest."""
    differential = sys.modules.get("dsv4mtp.conformance.differential")
    merged: dict[tuple[str, str, str, str], list[float]] = {}
    for part in [dict(differential.SUMMARY) if differential else {}, *_WORKER_SUMMARIES]:
        for key, (n, rel, mab, by_own) in part.items():
            m = merged.setdefault(key, [0, 0.0, 0.0, 0])
            m[0], m[1], m[2], m[3] = m[0] + n, max(m[1], rel), max(m[2], mab), m[3] + by_own
    return merged


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # type: ignore[no-untyped-def]
    # Only when differential tests ran: a run of other tests (bench/) need not import the suite.
    summary = _merged_summary()
    if not summary:
        return
    import dsv4mtp.conformance.pairs  # noqa: F401  (declares the pairs, in the xdist controller too)
    from dsv4mtp.conformance.registry import REGISTRY

    tr = terminalreporter
    tr.section("conformance: worst error seen per op, dtype, preset and output (vs float64)")
    w = max(14, 1 + max(len(key[0]) for key in summary))  # the longest op name
    # "by own": cases outside the declared bounds that passed within Tolerance.own_factor times
    # the reference-in-dtype's own error on the same case (registry docstring).
    tr.write_line(
        f"{'op':<{w}}{'dtype':<10}{'preset':<9}{'output':<13}{'cases':>6}{'rel':>11}{'tol':>9}"
        f"{'max_abs':>11}{'tol':>9}{'by own':>8}"
    )
    for (op, dt, preset, out), (n, rel, mab, by_own) in sorted(summary.items()):
        tol = REGISTRY[op].tolerance(getattr(torch, dt), preset)
        own = f"{int(by_own):>8}" if tol.own_factor > 0 else f"{'-':>8}"
        tr.write_line(
            f"{op:<{w}}{dt:<10}{preset:<9}{out:<13}{int(n):>6}{rel:>11.2e}{tol.rel:>9.0e}"
            f"{mab:>11.2e}{tol.max_abs:>9.0e}{own}"
        )
