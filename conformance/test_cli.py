"""The ``dsv4-mtp`` CLI's single error path: a DSV4Error is one ``Error: <message>`` line on
stderr and exit code 1; usage errors exit 2; JSON output is strict (no bare NaN / Infinity)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from dsv4mtp.checkpoint.synthetic import make_synthetic_checkpoint
from dsv4mtp.reference import DSV4Config
from dsv4mtp.tools.cli import main
from dsv4mtp.tools.drift import synthetic_drift_inputs

TINY = DSV4Config.tiny()
NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def ck(tmp_path_factory: Any) -> str:
    return make_synthetic_checkpoint(str(tmp_path_factory.mktemp("a") / "ck"), TINY)


def _nan_inputs(path: str) -> str:
    inp = synthetic_drift_inputs(TINY, num_sequences=2, seq_len=3, seed=7)
    prev = inp.prev_hidden.clone()
    prev[1, 2] = float("nan")
    save_file({"prev_hidden": prev, "input_ids": inp.input_ids, "positions": inp.positions}, path)
    return path


def _one_error(result: Any, exit_code: int, *fragments: str) -> str:
    assert result.exit_code == exit_code, (result.exit_code, result.output, result.exception)
    assert not isinstance(result.exception, Exception) or isinstance(
        result.exception, SystemExit
    ), repr(result.exception)
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def test_compare_with_nan_inputs_is_one_error_line(ck: str, tmp_path: Any) -> None:
    path = _nan_inputs(str(tmp_path / "nan.safetensors"))
    for extra in ([], ["--json"]):
        result = CliRunner().invoke(main, ["compare", ck, ck, "--inputs", path, *extra])
        _one_error(result, 1, "prev_hidden: expected finite values, found nan at row 1, column 2")
        assert result.stdout == ""


def test_compare_inputs_not_safetensors(ck: str, tmp_path: Any) -> None:
    path = tmp_path / "inputs.safetensors"
    path.write_bytes(b"not a safetensors file")
    result = CliRunner().invoke(main, ["compare", ck, ck, "--inputs", str(path)])
    _one_error(result, 1, f"{path}: expected a readable safetensors file")


def test_compare_different_expert_counts(ck: str, tmp_path: Any) -> None:
    other = make_synthetic_checkpoint(str(tmp_path / "e16"), TINY.replace(n_routed_experts=16))
    result = CliRunner().invoke(main, ["compare", ck, other, "--steps", "1"])
    _one_error(result, 1, "config: A and B differ (n_routed_experts 8 vs 16)")


@pytest.mark.skipif(not NO_CUDA, reason="checks the behaviour without CUDA")
@pytest.mark.parametrize(
    ("device", "fragment"),
    [
        ("cuda", "device: 'cuda' requested but CUDA is not available"),
        ("cuda:0", "device: 'cuda:0' requested but CUDA is not available"),
        ("junk", "device: expected 'cpu', 'cuda' or 'cuda:N', got 'junk'"),
    ],
)
def test_demo_bad_device(device: str, fragment: str) -> None:
    result = CliRunner().invoke(main, ["demo", "--device", device, "-k", "1", "-b", "1"])
    _one_error(result, 1, fragment)


def test_inspect_an_empty_directory_exits_1_without_a_traceback(tmp_path: Any) -> None:
    result = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert result.exit_code == 1 and "Traceback" not in result.stderr, result.output


def test_usage_errors_exit_2(ck: str) -> None:
    for args in (
        ["compare", ck],
        ["demo", "--batch", "0"],
        ["nope"],
        ["compare", ck, ck, "--dtype", "int8"],
    ):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, (args, result.output)
        assert sum(ln.startswith("Error:") for ln in result.stderr.splitlines()) == 1


def test_bugs_keep_their_traceback(ck: str, monkeypatch: Any) -> None:
    """Only DSV4Errors become Error: lines; anything else propagates (CliRunner records it)."""
    import dsv4mtp.tools.drift as drift

    def boom(*a: Any, **k: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(drift, "compare_checkpoints", boom)
    result = CliRunner().invoke(main, ["compare", ck, ck])
    assert isinstance(result.exception, RuntimeError) and result.exit_code == 1


def test_compare_json_is_strict(ck: str) -> None:
    result = CliRunner().invoke(
        main, ["compare", ck, ck, "--steps", "1", "--sequences", "2", "--json"]
    )
    assert result.exit_code == 0, result.output
    json.loads(result.stdout, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))


def test_optimized_probe_does_not_swallow_bugs(monkeypatch: Any) -> None:
    """The probe for dsv4mtp.optimized.MTPLayer falls back on ImportError only."""
    import builtins

    from dsv4mtp.tools import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_import = builtins.__import__

    def fake_import(name: str, *a: Any, **k: Any) -> Any:
        if name == "dsv4mtp.optimized":
            raise exc
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    exc: Exception = ImportError("no triton")
    assert cli._optimized_builder() == (None, "reference (CPU)")
    exc = RuntimeError("a bug in the optimized package")
    with pytest.raises(RuntimeError, match="a bug"):
        cli._optimized_builder()


# ------------------------------------------------------------------ subprocess smoke tests
def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    return subprocess.run(
        [sys.executable, "-m", "dsv4mtp.tools.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_subprocess_compare_nan_inputs(ck: str, tmp_path: Any) -> None:
    path = _nan_inputs(str(tmp_path / "nan.safetensors"))
    p = _run("compare", ck, ck, "--inputs", path, "--json")
    assert p.returncode == 1, p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("Error:")]
    assert errors == [
        "Error: prev_hidden: expected finite values, found nan at row 1, column 2 "
        "(1 non-finite of 6144)"
    ], p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""


@pytest.mark.skipif(not NO_CUDA, reason="checks the behaviour without CUDA")
def test_subprocess_demo_cuda_without_cuda() -> None:
    p = _run("demo", "--device", "cuda")
    assert p.returncode == 1, p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "CUDA is not available" in errors[0], p.stderr
    assert "Traceback" not in p.stderr
