"""The distribution maps reference/ and optimized/ under dsv4mtp, in a built wheel too."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_built_wheel_contains_and_imports_both_implementations(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    (wheel,) = dist.glob("dsv4_mtp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for module in (
        "dsv4mtp/__init__.py",
        "dsv4mtp/tools/cli.py",
        "dsv4mtp/checkpoint/load.py",
        "dsv4mtp/reference/mhc.py",
        "dsv4mtp/optimized/__init__.py",
    ):
        assert module in names, f"{module} missing from {wheel.name}"
    assert not any(n.startswith(("conformance/", "bench/")) for n in names), (
        "tests leaked into the wheel"
    )
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    # Import from the unpacked wheel only, from a directory that does not contain the repo.
    code = (
        "import dsv4mtp, dsv4mtp.reference as r, dsv4mtp.optimized as o; "
        f"assert r.__file__.startswith({str(site)!r}), r.__file__; "
        "print(r.DSV4Config.tiny().hc_dim)"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {code}"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip() == "1024"


def test_console_script_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dsv4mtp.tools.cli", "--help"],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert "Usage" in out.stdout and "demo" in out.stdout


def test_every_command_has_help() -> None:
    from click.testing import CliRunner

    from dsv4mtp.tools.cli import main

    runner = CliRunner()
    assert main.commands, "the CLI has no commands"
    for name in main.commands:
        result = runner.invoke(main, [name, "--help"])
        assert result.exit_code == 0, f"dsv4-mtp {name} --help: {result.output}"
        assert f"Usage: main {name}" in result.output or "Usage:" in result.output
