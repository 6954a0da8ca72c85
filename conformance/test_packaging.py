"""The distribution: a built wheel maps reference/, optimized/ and conformance/ under dsv4mtp,
declares the ``test`` extra, and the conformance suite runs from it with the documented command;
the CLI."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from dsv4mtp.conformance.plugin import SOURCE_ROOT

needs_source = pytest.mark.skipif(
    SOURCE_ROOT is None,
    reason="builds a wheel from the source checkout; this run uses an installed copy of the suite",
)

# Not copied into the build: VCS data, environments, caches and earlier build outputs (a stale
# build/lib would put deleted modules back into the wheel).
_NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".nox", ".venv", ".whl", ".site", ".hypothesis", ".benchmarks", "build", "dist",
    "*.egg-info", "__pycache__", "*.pyc", ".*_cache",
)  # fmt: skip
PIP = (sys.executable, "-m", "pip")
# How the README runs the suite from an installed wheel.
INSTALLED_SUITE = "python -m pytest -p dsv4mtp.conformance.plugin --pyargs dsv4mtp.conformance"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built as the docs build it, from a clean copy of the checkout."""
    assert SOURCE_ROOT is not None
    src = tmp_path_factory.mktemp("src") / "dsv4-mtp"
    shutil.copytree(SOURCE_ROOT, src, ignore=_NOT_SOURCES)
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [*PIP, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)],
        check=True,
        capture_output=True,
        text=True,
    )
    (whl,) = dist.glob("dsv4_mtp-*.whl")
    return whl


@needs_source
def test_wheel_contents_and_metadata(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA")).rpartition("/")[0]
        metadata = Parser().parsestr(z.read(f"{info}/METADATA").decode())
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    for module in (
        "dsv4mtp/__init__.py",
        "dsv4mtp/__main__.py",
        "dsv4mtp/tools/cli.py",
        "dsv4mtp/checkpoint/load.py",
        "dsv4mtp/reference/mhc.py",
        "dsv4mtp/optimized/__init__.py",
        "dsv4mtp/optimized/kernels/__init__.py",
        "dsv4mtp/conformance/__init__.py",
        "dsv4mtp/conformance/plugin.py",
        "dsv4mtp/docs/semantics.md",  # the installed suite checks the presets table in it
        "dsv4mtp/conformance/test_norm.py",
        "dsv4mtp/conformance/test_contract.py",
    ):
        assert module in names, f"{module} missing from {wheel.name}"
    top = {n.split("/")[0] for n in names}
    assert top == {"dsv4mtp", info}, f"unexpected top-level entries in {wheel.name}: {top}"

    assert "test" in metadata.get_all("Provides-Extra", [])
    test_reqs = [
        r.partition(";")[0].strip()
        for r in metadata.get_all("Requires-Dist", [])
        if r.replace("'", '"').endswith('extra == "test"')
    ]
    for req in ("hypothesis>=6.100", "pytest>=8", "ml_dtypes>=0.5"):
        assert req in test_reqs, f"the test extra lacks {req}: {test_reqs}"
    # The command is installed; nothing is registered into other projects' pytest.
    assert "dsv4-mtp = dsv4mtp.tools.cli:main" in entry_points
    assert "pytest11" not in entry_points


def _third_party_paths() -> list[str]:
    """Where this interpreter finds torch, pytest and the rest, without its .pth files (one of
    them is the editable install's finder, which would map dsv4mtp to the checkout)."""
    extra = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    paths = [*site.getsitepackages(), *extra]
    root = str(SOURCE_ROOT)
    return [p for p in paths if p and os.path.abspath(p) != root]


# A third-party implementation, as the README's "Testing your own implementation" describes:
# delegates to the installed reference and records which dsv4mtp it ran.
_MY_IMPL = """
from pathlib import Path

import dsv4mtp.reference as reference


def rms_norm(x, weight, eps, *, order="official"):
    Path(__file__).with_name("impl-called").write_text(reference.__file__)
    return reference.rms_norm(x, weight, eps, order=order)
"""


@needs_source
def test_suite_runs_from_the_installed_wheel(wheel: Path, tmp_path: Path) -> None:
    site_dir = tmp_path / "site"
    subprocess.run(
        [*PIP, "install", "--no-deps", "--no-compile", "-q", "--target", str(site_dir), str(wheel)],
        check=True,
        capture_output=True,
        text=True,
    )
    (tmp_path / "my_kernels.py").write_text(_MY_IMPL)
    # -S: no .pth files, so neither the checkout (editable finder) nor its conformance/ is
    # importable; the working directory (tmp_path, which holds my_kernels) comes first as usual.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site_dir), *_third_party_paths()])}
    subset = ["-k", "rms_norm-impl-float32-math or test_norm and rejects"]
    impl = ["--impl", "rms_norm=my_kernels:rms_norm"]
    out = subprocess.run(
        [sys.executable, "-S", *INSTALLED_SUITE.split()[1:], *subset, *impl, "-v"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    log = out.stdout[-4000:] + out.stderr[-2000:]
    assert out.returncode == 0, log
    # Node ids are relative to the working directory: site/dsv4mtp/conformance/test_*.py::...
    passed = [line for line in out.stdout.splitlines() if " PASSED" in line]
    assert passed, log
    here = (
        "site/dsv4mtp/conformance/test_norm.py::",
        "site/dsv4mtp/conformance/test_contract.py::",
    )
    assert all(line.startswith(here) for line in passed), log
    assert any("test_differential[rms_norm-impl-float32-math]" in line for line in passed), log
    ran = (tmp_path / "impl-called").read_text()
    assert Path(ran).is_relative_to(site_dir), f"--impl ran against {ran}, not the wheel"


def test_console_script_help(tmp_path: Path) -> None:
    # Outside the checkout: a non-editable install must not be shadowed by its dsv4mtp/ folder.
    for module in ("dsv4mtp.tools.cli", "dsv4mtp"):
        out = subprocess.run(
            [sys.executable, "-m", module, "--help"],
            check=True,
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert "Usage" in out.stdout and "demo" in out.stdout, module


def test_every_command_has_help() -> None:
    from click.testing import CliRunner

    from dsv4mtp.tools.cli import main

    runner = CliRunner()
    assert main.commands, "the CLI has no commands"
    for name in main.commands:
        result = runner.invoke(main, [name, "--help"])
        assert result.exit_code == 0, f"dsv4-mtp {name} --help: {result.output}"
        assert f"Usage: main {name}" in result.output or "Usage:" in result.output
