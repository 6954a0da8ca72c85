"""Bounded fuzzing of the checkpoint reader: corruptions of a tiny synthetic checkpoint (header
bytes and fields, index structure, shard names, shapes, dtypes, scale values, missing and extra
tensors) must end in a :class:`DSV4Error` from ``load_mtp_checkpoint`` and a clean result from
``dsv4-mtp inspect`` (a JSON report with exit 0/1, or exit 1 with one ``Error:`` line), never in
another exception or a traceback.

A fixed budget of derandomized examples (the same corruptions every run, a few seconds on two
cores), plus a few subprocess runs of the installed command."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4mtp.checkpoint.io import INDEX_FILE
from dsv4mtp.checkpoint.synthetic import synthetic_checkpoint_tensors
from dsv4mtp.errors import DSV4Error
from dsv4mtp.reference import DSV4Config, load_mtp_checkpoint, write_sharded_checkpoint
from dsv4mtp.tools.cli import main

TINY = DSV4Config.tiny()
FORMATS = ("mxfp4", "nvfp4", "fp8")
EXAMPLES = 500

_PARTS: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any], Any]] = {}


def _parts(fmt: str) -> tuple[dict[str, torch.Tensor], dict[str, Any], Any]:
    if fmt not in _PARTS:
        _PARTS[fmt] = synthetic_checkpoint_tensors(TINY, expert_format=fmt)
    tensors, config, hf_quant = _PARTS[fmt]
    return dict(tensors), dict(config), hf_quant


# ----------------------------------------------------------------------------- tensor edits
_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e8m0fnu,
)
_SPECIAL = (0.0, -0.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e38, 2.0**-140, 3.0)
_EXTRA_NAMES = (
    "mtp.0.attn.foo.weight",
    "mtp.0.ffn.experts.99.w1.weight",
    "mtp.0.ffn.experts.1.w1.input_scale",
    "mtp.0.ffn.experts.1.w1.weight_scale_2",
    "mtp.0.ffn.experts.1.w1.scale",
    "mtp.0.attn.wq_b.scale",
    "mtp.0.head.weight",
    "mtp.0.emb.tok_emb.weight",
    "mtp.1.enorm.weight",
    "mtp.0",
    "mtp.0.wat",
    "mtp.x.enorm.weight",
)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype.itemsize == dtype.itemsize:
        return t.view(dtype) if t.dim() else t.reshape(1).view(dtype).reshape(())
    return torch.zeros(t.shape, dtype=dtype)


def _edit_tensors(data: st.DataObject, tensors: dict[str, torch.Tensor]) -> None:
    names = sorted(tensors)
    for _ in range(data.draw(st.integers(1, 3), label="tensor edits")):
        kind = data.draw(st.sampled_from(["shape", "dtype", "value", "missing", "extra"]))
        name = data.draw(st.sampled_from(names), label="tensor")
        if name not in tensors:
            continue
        t = tensors[name]
        if kind == "shape":
            shape = data.draw(st.lists(st.integers(0, 300), min_size=0, max_size=3))
            tensors[name] = torch.zeros(shape, dtype=t.dtype)
        elif kind == "dtype":
            tensors[name] = _cast(t, data.draw(st.sampled_from(_DTYPES)))
        elif kind == "value":
            flat = t.reshape(-1).clone() if t.numel() else t.clone()
            if flat.numel():
                i = data.draw(st.integers(0, flat.numel() - 1), label="index")
                if t.dtype.itemsize == 1:
                    b = flat.view(torch.uint8)
                    b[i] = data.draw(st.integers(0, 255), label="byte")
                else:
                    flat[i] = data.draw(st.sampled_from(_SPECIAL))
            tensors[name] = flat.reshape(t.shape)
        elif kind == "missing":
            del tensors[name]
        else:
            extra = data.draw(st.sampled_from(_EXTRA_NAMES))
            tensors[extra] = torch.zeros(data.draw(st.sampled_from([(1,), (4, 4), ()])))


# ----------------------------------------------------------------------------- file edits
def _shards(path: str) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def _index(path: str) -> dict[str, Any]:
    with open(os.path.join(path, INDEX_FILE)) as f:
        return json.load(f)


def _put_index(path: str, index: Any) -> None:
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump(index, f)


def _header(shard_path: str) -> tuple[dict[str, Any], bytes]:
    with open(shard_path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        return header, f.read()


def _put_header(shard_path: str, header: Any, data: bytes) -> None:
    blob = json.dumps(header).encode()
    with open(shard_path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + data)


_FIELD_VALUES = (
    None,
    [],
    [1],
    [-1, 2],
    [0, 10**12],
    "x",
    3,
    {"a": 1},
    [2.5],
    True,
    "BF16",
    "F8_E4M3",
)
_SHARD_NAMES = (
    "../outside.safetensors",
    "/etc/hostname",
    "missing.safetensors",
    ".",
    "",
    "sub/../../outside.safetensors",
    "a\u00e9.safetensors",
    INDEX_FILE,
    "config.json",
)


def _edit_files(data: st.DataObject, path: str) -> None:
    kind = data.draw(
        st.sampled_from(
            ["none", "header_bytes", "header_field", "truncate", "index", "shard_name", "symlink"]
        ),
        label="file edit",
    )
    shard = os.path.join(path, data.draw(st.sampled_from(_shards(path)), label="shard"))
    if kind == "header_bytes":
        size = os.path.getsize(shard)
        with open(shard, "r+b") as f:
            for _ in range(data.draw(st.integers(1, 4))):
                f.seek(data.draw(st.integers(0, min(size - 1, 400)), label="offset"))
                f.write(bytes([data.draw(st.integers(0, 255), label="byte")]))
    elif kind == "header_field":
        header, rest = _header(shard)
        name = data.draw(st.sampled_from(sorted(header)), label="entry")
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "*"]))
        value = data.draw(st.sampled_from(_FIELD_VALUES), label="value")
        if field == "*":
            header[name] = value
        elif isinstance(header[name], dict):
            if data.draw(st.booleans(), label="delete"):
                header[name].pop(field, None)
            else:
                header[name][field] = value
        _put_header(shard, header, rest)
    elif kind == "truncate":
        os.truncate(shard, data.draw(st.integers(0, os.path.getsize(shard) - 1)))
    elif kind == "index":
        index = _index(path)
        how = data.draw(st.sampled_from(["weight_map", "entry", "drop_entry", "top", "bytes"]))
        if how == "weight_map":
            index["weight_map"] = data.draw(st.sampled_from(_FIELD_VALUES))
        elif how == "entry":
            name = data.draw(st.sampled_from(sorted(index["weight_map"])))
            index["weight_map"][name] = data.draw(st.sampled_from(_FIELD_VALUES))
        elif how == "drop_entry":
            index["weight_map"].pop(data.draw(st.sampled_from(sorted(index["weight_map"]))))
        elif how == "top":
            index = data.draw(st.sampled_from(_FIELD_VALUES))
        if how == "bytes":
            with open(os.path.join(path, INDEX_FILE), "wb") as f:
                f.write(data.draw(st.binary(max_size=40)))
        else:
            _put_index(path, index)
    elif kind == "shard_name":
        index = _index(path)
        old = os.path.basename(shard)
        new = data.draw(st.sampled_from(_SHARD_NAMES))
        for name, s in index["weight_map"].items():
            if s == old:
                index["weight_map"][name] = new
        _put_index(path, index)
    elif kind == "symlink":
        target = data.draw(st.sampled_from(["/etc/hostname", "..", path, "nowhere"]))
        os.remove(shard)
        os.symlink(target, shard)


# ----------------------------------------------------------------------------- oracle
def _check_clean(path: str) -> None:
    """The loader ends in a DSV4Error or a result; ``inspect`` in a report (without errors when
    the loader accepted the checkpoint) or one Error line."""
    loaded = False
    with warnings.catch_warnings(), contextlib.suppress(DSV4Error):
        warnings.simplefilter("ignore")
        load_mtp_checkpoint(path)
        loaded = True
    result = CliRunner().invoke(main, ["inspect", path, "--json"])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code in (0, 1), result.output
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
        assert result.exit_code == 1 and len(errors) == 1, result.output
    else:
        assert report["exit_code"] == result.exit_code
        # One rule set: what the loader accepts, inspect does not call an error.
        assert not loaded or result.exit_code == 0, report["findings"]


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fuzz-bases")
    out = {}
    for fmt in FORMATS:
        tensors, config, hf_quant = _parts(fmt)
        out[fmt] = write_sharded_checkpoint(
            str(root / fmt), tensors, config, num_shards=3, hf_quant_config=hf_quant
        )
    return out


@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_corrupted_checkpoints_fail_cleanly(
    data: st.DataObject, bases: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    fmt = data.draw(st.sampled_from(FORMATS), label="format")
    path = str(tmp_path_factory.mktemp("fuzz") / "ck")
    if data.draw(st.booleans(), label="edit tensors"):
        tensors, config, hf_quant = _parts(fmt)
        _edit_tensors(data, tensors)
        write_sharded_checkpoint(path, tensors, config, num_shards=3, hf_quant_config=hf_quant)
    else:
        shutil.copytree(bases[fmt], path)
    _edit_files(data, path)
    try:
        _check_clean(path)
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


# ----------------------------------------------------------------------------- the command
def _subprocess_inspect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dsv4mtp.tools.cli", "inspect", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )


def _break_index(path: str) -> None:
    _put_index(path, {"weight_map": [1, 2]})


def _break_header(path: str) -> None:
    shard = os.path.join(path, _shards(path)[0])
    header, rest = _header(shard)
    for meta in header.values():
        if isinstance(meta, dict) and "shape" in meta:
            del meta["shape"]
    _put_header(shard, header, rest)


def _escape_shard(path: str) -> None:
    index = _index(path)
    index["weight_map"] = {n: "../" + s for n, s in index["weight_map"].items()}
    _put_index(path, index)


@pytest.mark.parametrize(
    ("edit", "exit_code", "fragment"),
    [
        (_break_index, 1, "weight_map: expected an object"),
        (_break_header, 1, "header entry 'shape'"),
        (_escape_shard, 1, "the shard path leads outside the checkpoint directory"),
        (None, 2, "Error: Invalid value for 'CHECKPOINT'"),
    ],
    ids=["index", "header", "shard-path", "file-argument"],
)
def test_inspect_command_never_prints_a_traceback(
    bases: dict[str, str],
    tmp_path: Any,
    edit: Callable[[str], None] | None,
    exit_code: int,
    fragment: str,
) -> None:
    path = str(tmp_path / "ck")
    shutil.copytree(bases["mxfp4"], path)
    if edit is None:
        path = os.path.join(path, "config.json")  # a file where a directory is expected
    else:
        edit(path)
    proc = _subprocess_inspect(path, "--json")
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode == exit_code, proc.stderr
    assert fragment in proc.stdout + proc.stderr
