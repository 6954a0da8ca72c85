"""The path of someone new to the project: the README's set-up commands, its library snippet,
installing outside nox, a test run leaving the checkout clean, and ``--impl`` mistakes reported
before any test runs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dsv4mtp.conformance.plugin import SOURCE_ROOT
from dsv4mtp.conformance.test_packaging import _third_party_paths

needs_source = pytest.mark.skipif(
    SOURCE_ROOT is None, reason="reads the source checkout; this run uses an installed copy"
)

#: The README's set-up: each line installs nox and runs one session, so it works when pasted
#: alone into a fresh shell.
TWO_COMMANDS = (
    "python3 -m pip install nox && python3 -m nox -s demo",
    "python3 -m pip install nox && python3 -m nox -s conformance",
)


def _readme() -> str:
    assert SOURCE_ROOT is not None
    return (SOURCE_ROOT / "README.md").read_text()


def _first_block(section: str, lang: str) -> str:
    """The first fenced ``lang`` block under the README heading ``section``."""
    text = _readme()
    heading = re.search(rf"^#+ {re.escape(section)}\s*$", text, flags=re.M)
    assert heading, f"README.md has no heading {section!r}"
    block = re.search(rf"^```{lang}\n(.*?)^```", text[heading.end() :], flags=re.M | re.S)
    assert block, f"README.md: no ```{lang} block under {section!r}"
    return block.group(1)


@needs_source
def test_readme_two_commands_are_the_whole_set_up() -> None:
    lines = [line for line in _first_block("The two commands", "bash").splitlines() if line]
    assert tuple(lines) == TWO_COMMANDS, lines
    assert SOURCE_ROOT is not None
    ci = (SOURCE_ROOT / ".ci" / "run").read_text().splitlines()
    assert TWO_COMMANDS[1] in ci, f".ci/run does not run the README's test command: {ci}"


@needs_source
def test_readme_reference_snippet_runs_as_written(tmp_path: Path) -> None:
    # In a fresh interpreter, from an empty directory: the snippet must define everything it uses.
    snippet = _first_block("Using the reference", "python")
    (tmp_path / "snippet.py").write_text(snippet)
    out = subprocess.run(
        [sys.executable, "snippet.py"],
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # mkdtemp() writes the checkpoint here
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "torch.Size([1, 3])", out.stdout


# Not copied into the scratch checkout: VCS data, environments, build outputs, caches and the
# local (uncommitted) Hypothesis data; .hypothesis/examples is copied on its own.
_NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".nox", ".venv", ".whl", ".site", ".hypothesis", ".benchmarks", "build", "dist",
    "*.egg-info", "__pycache__", "*.pyc", ".*_cache",
)  # fmt: skip


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=test", "-c", "user.email=test@localhost", *args],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def _scratch_checkout(tmp: Path) -> tuple[Path, Path]:
    """A git repository holding a copy of this checkout's sources and committed examples, and a
    directory that imports ``dsv4mtp`` from it with the install's package mapping (symbolic
    links, so the plugin finds the copy as its source root)."""
    assert SOURCE_ROOT is not None
    repo = tmp / "checkout"
    shutil.copytree(SOURCE_ROOT, repo, ignore=_NOT_SOURCES)
    examples = SOURCE_ROOT / ".hypothesis" / "examples"
    if examples.is_dir():
        shutil.copytree(examples, repo / ".hypothesis" / "examples")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "scratch")
    site_dir = tmp / "site"
    package = site_dir / "dsv4mtp"
    package.mkdir(parents=True)
    for entry in (repo / "dsv4mtp").iterdir():
        (package / entry.name).symlink_to(entry)
    mapping = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    for name, folder in mapping["package-dir"].items():
        if name.count(".") == 1:  # dsv4mtp.reference -> reference/ (deeper ones come along)
            (package / name.partition(".")[2]).symlink_to(repo / folder)
    return repo, site_dir


# A property test of its own (so no committed example can exist for it yet): fails until
# DSV4_SCRATCH_FIXED is set.
_PLANTED = """
import os

from hypothesis import given, strategies as st


@given(st.integers())
def test_planted(n):
    assert os.environ.get("DSV4_SCRATCH_FIXED") or n < 10
"""


@needs_source
def test_a_test_run_leaves_the_checkout_clean(tmp_path: Path) -> None:
    """Neither a failing run (Hypothesis saves the failure) nor, once that failure is promoted
    into the committed database as the README says, a passing run (Hypothesis would forget the
    stale example) changes a tracked file or leaves an untracked one."""
    repo, site_dir = _scratch_checkout(tmp_path)
    (repo / "conformance" / "test_planted.py").write_text(_PLANTED)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "planted")
    env = {
        **os.environ,
        # -S below: no .pth files, so the editable install cannot map dsv4mtp to this checkout;
        # -P: nor the working directory first (the copy, whose bare dsv4mtp/ lacks the mapping).
        "PYTHONPATH": os.pathsep.join([str(site_dir), *_third_party_paths()]),
        "DSV4_HYPOTHESIS_PROFILE": "dsv4-dev",  # a profile that saves failures
    }
    env.pop("DSV4_HYPOTHESIS_DB", None)
    # The suite's own differential test against a deliberately wrong implementation, and the
    # planted test.
    wrong = "rms_norm=dsv4mtp.conformance.test_registry:wrong_rms_norm"
    tests = ["conformance/test_planted.py", "conformance/test_contract.py::test_differential"]

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-S", "-P", "-m", "pytest", *tests, *args],
            cwd=repo,
            env={**env, **extra},
            capture_output=True,
            text=True,
            check=False,
        )

    out = run("-k", "planted or rms_norm-impl-float32-math", "--impl", wrong)
    log = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == 1 and "2 failed" in out.stdout, log
    assert _git(repo, "status", "--porcelain", "--untracked-files=all") == "", log
    local = repo / ".hypothesis" / "local"
    assert local.is_dir() and any(local.iterdir()), f"no failure was saved in {local}"

    # Promote the failures, then fix the planted test: its committed example is now stale.
    shutil.copytree(local, repo / ".hypothesis" / "examples", dirs_exist_ok=True)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "promote")
    out = run("-k", "planted", DSV4_SCRATCH_FIXED="1")
    log = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == 0, log
    assert _git(repo, "status", "--porcelain", "--untracked-files=all") == "", log


# A machine without the `gpu` extra: importing triton or flashinfer fails as when they are not
# installed.  The public names import; every op called on CPU tensors, with or without the
# interpreter flag, and a kernel entry point raise an InputError that says what to install.
_WITHOUT_TRITON = """
import importlib.abc
import sys


class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("triton", "flashinfer"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())

import torch

import dsv4mtp.optimized as optimized
from dsv4mtp.errors import InputError
from dsv4mtp.optimized import CollapseSchedule, hc_head, hc_post, hc_pre, rms_norm
from dsv4mtp.optimized.kernels._launch import triton_kernel

CollapseSchedule()
T, n, D = 2, 4, 8
x = torch.randn(T, n, D)
calls = {
    "rms_norm": lambda: rms_norm(torch.randn(T, D), None, 1e-6),
    "hc_pre": lambda: hc_pre(
        x, torch.randn((2 + n) * n, n * D), torch.ones(3), torch.zeros((2 + n) * n),
        rms_norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=3,
    ),
    "hc_post": lambda: hc_post(torch.randn(T, D), x, torch.rand(T, n), torch.rand(T, n, n)),
    "hc_head": lambda: hc_head(
        x, torch.randn(n, n * D), torch.ones(1), torch.zeros(n), rms_norm_eps=1e-6, hc_eps=1e-6
    ),
    # What a CUDA tensor reaches past the device check.
    "kernel": lambda: triton_kernel("rms_norm", "rms_norm_triton")(),
}
for name, call in calls.items():
    try:
        call()
    except InputError as e:
        print(f"{name}: {e}")
    else:
        raise SystemExit(f"{name}: ran without triton")
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in ("triton", "flashinfer"))
assert not loaded, loaded
print("exports:", ", ".join(optimized.__all__))
"""


@pytest.mark.parametrize("interpret", ["1", "0"])
def test_optimized_imports_without_triton(interpret: str, tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": interpret, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TRITON],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for op in ("rms_norm", "hc_pre", "hc_post", "hc_head", "kernel"):
        (line,) = [line for line in lines if line.startswith(f"{op}: ")]
        assert "triton is not installed" in line, line
        assert "pip install 'dsv4-mtp[gpu]'" in line and "dsv4mtp.reference" in line, line


@needs_source
def test_triton_is_optional_and_the_cpu_install_documented() -> None:
    assert SOURCE_ROOT is not None
    cpu_torch = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert cpu_torch in _first_block("Installing", "bash"), "README: no CPU install of torch"
    project = tomllib.loads((SOURCE_ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        return {re.split(r"[ <>=!~;\[]", r, maxsplit=1)[0].lower() for r in reqs}

    assert "triton" not in names(project["dependencies"]), project["dependencies"]
    gpu = project["optional-dependencies"]["gpu"]
    assert {"triton", "flashinfer-python"} <= names(gpu), gpu
