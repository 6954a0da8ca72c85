"""``dsv4-mtp inspect``: every defect of the issue's severity table, planted in a tiny synthetic
checkpoint, is reported with the right severity, code, message and exit code."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from dsv4mtp.checkpoint.io import INDEX_FILE
from dsv4mtp.checkpoint.report import inspect_checkpoint
from dsv4mtp.checkpoint.synthetic import make_synthetic_checkpoint, synthetic_checkpoint_tensors
from dsv4mtp.reference import DSV4Config, write_sharded_checkpoint
from dsv4mtp.tools.cli import main

TINY = DSV4Config.tiny()
Tensors = dict[str, torch.Tensor]
Parts = tuple[Tensors, dict[str, Any], dict[str, Any] | None]


def _parts(expert_format: str = "mxfp4") -> Parts:
    tensors, config, hf_quant = synthetic_checkpoint_tensors(TINY, expert_format=expert_format)
    return dict(tensors), dict(config), hf_quant


def _write(path: str, parts: Parts) -> str:
    tensors, config, hf_quant = parts
    return write_sharded_checkpoint(path, tensors, config, hf_quant_config=hf_quant)


def _run(path: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(main, ["inspect", path, "--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, json.loads(result.stdout)


def _findings(report: dict[str, Any], severity: str) -> list[dict[str, str]]:
    return [f for f in report["findings"] if f["severity"] == severity]


# ----------------------------------------------------------------------------- planted defects
def _drop_mtp(p: Parts) -> Parts:
    return {k: v for k, v in p[0].items() if not k.startswith("mtp.")}, p[1], p[2]


def _two_configured(p: Parts) -> Parts:
    return p[0], {**p[1], "num_nextn_predict_layers": 2, "compress_ratios": [0, 0, 0, 0]}, p[2]


def _delete(name: str) -> Callable[[Parts], Parts]:
    def edit(p: Parts) -> Parts:
        return {k: v for k, v in p[0].items() if k != name}, p[1], p[2]

    return edit


def _replace(name: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Parts], Parts]:
    def edit(p: Parts) -> Parts:
        return {**p[0], name: make(p[0][name])}, p[1], p[2]

    return edit


def _nan_e8m0(t: torch.Tensor) -> torch.Tensor:
    bytes_ = t.view(torch.uint8).clone()
    bytes_[0, 0] = 0xFF  # e8m0 NaN
    return bytes_.view(torch.float8_e8m0fnu)


def _claim_nvfp4(p: Parts) -> Parts:
    """MXFP4 expert tensors under the NVFP4 export's config (and manifest, MTP experts listed)."""
    _, config, hf_quant = synthetic_checkpoint_tensors(TINY, expert_format="nvfp4")
    return p[0], config, hf_quant


def _unknown(p: Parts) -> Parts:
    return {**p[0], "mtp.0.attn.extra.weight": torch.zeros(4)}, p[1], p[2]


EXPERT = "mtp.0.ffn.experts.3"
# (id, expert format, edit, severity, code, message fragment, exit code)
DEFECTS = [
    ("no-mtp-layer", "mxfp4", _drop_mtp, "error", "no_mtp_layer", "no mtp.* tensors", 1),
    (
        "fewer-than-configured",
        "mxfp4",
        _two_configured,
        "error",
        "fewer_mtp_layers",
        "num_nextn_predict_layers=2, found 1; no tensors for mtp.1",
        1,
    ),
    (
        "missing-tensor",
        "mxfp4",
        _delete(f"{EXPERT}.w2.weight"),
        "error",
        "missing_tensor",
        f"{EXPERT}.w2.weight: missing (expected dtype int8 or uint8, shape (256, 64))",
        1,
    ),
    (
        "missing-scale",
        "mxfp4",
        _delete("mtp.0.attn.wq_b.scale"),
        "error",
        "missing_tensor",
        "mtp.0.attn.wq_b.scale: missing; mtp.0.attn.wq_b.weight is float8_e4m3fn",
        1,
    ),
    (
        "mis-shaped",
        "mxfp4",
        _replace("mtp.0.attn_norm.weight", lambda t: torch.ones(257, dtype=t.dtype)),
        "error",
        "wrong_shape",
        "mtp.0.attn_norm.weight: expected shape (256,), got (257,)",
        1,
    ),
    (
        "wrong-dtype",
        "mxfp4",
        _replace("mtp.0.attn.wq_b.weight", lambda t: t.float().to(torch.bfloat16)),
        "error",
        "wrong_dtype",
        "mtp.0.attn.wq_b.weight: expected dtype float8_e4m3fn",
        1,
    ),
    (
        "unknown-tensor",
        "mxfp4",
        _unknown,
        "error",
        "unknown_tensor",
        "mtp.0.attn.extra.weight",
        1,
    ),
    (
        "non-finite-scale",
        "mxfp4",
        _replace("mtp.0.attn.wq_b.scale", _nan_e8m0),
        "error",
        "non_finite_scale",
        "mtp.0.attn.wq_b.scale: expected finite scales, found 1 non-finite",
        1,
    ),
    (
        "non-positive-weight-scale-2",
        "nvfp4",
        _replace(f"{EXPERT}.w3.weight_scale_2", lambda t: torch.zeros_like(t)),
        "error",
        "non_positive_scale",
        f"{EXPERT}.w3.weight_scale_2: expected a positive NVFP4 global scale, got 0.0",
        1,
    ),
    (
        "experts-not-as-config-says",
        "mxfp4",
        _claim_nvfp4,
        "warning",
        "expert_format_mismatch",
        "routed experts are mxfp4 in the checkpoint but the config claims nvfp4",
        0,
    ),
    (
        "embed-head-from-target",
        "mxfp4",
        lambda p: p,
        "info",
        "head_from_target",
        "head: taken from the target's head.weight",
        0,
    ),
]


@pytest.mark.parametrize(
    ("expert_format", "edit", "severity", "code", "fragment", "exit_code"),
    [d[1:] for d in DEFECTS],
    ids=[d[0] for d in DEFECTS],
)
def test_planted_defect(
    tmp_path: Any,
    expert_format: str,
    edit: Callable[[Parts], Parts],
    severity: str,
    code: str,
    fragment: str,
    exit_code: int,
) -> None:
    path = _write(str(tmp_path / "ck"), edit(_parts(expert_format)))
    got_exit, report = _run(path)
    hits = [f for f in report["findings"] if f["code"] == code]
    assert hits, f"no {code} finding in {report['findings']}"
    assert all(f["severity"] == severity for f in hits)
    assert any(fragment in f["message"] for f in hits), hits
    assert got_exit == exit_code == report["exit_code"]
    if exit_code == 0:
        assert _findings(report, "error") == []


def test_clean_checkpoint_only_infos(tmp_path: Any) -> None:
    path = make_synthetic_checkpoint(str(tmp_path / "ck"), TINY)
    exit_code, report = _run(path)
    assert exit_code == 0
    assert _findings(report, "error") == [] and _findings(report, "warning") == []
    codes = {f["code"] for f in _findings(report, "info")}
    assert codes == {"embedding_from_target", "head_from_target"}
    assert report["mtp_layers_present"] == report["mtp_layers_configured"] == 1
    assert report["embed_source"] == "embed.weight" and report["head_sources"] == {
        "0": "head.weight"
    }
    groups = {g["group"]: g for g in report["formats"]}
    assert groups["ffn.experts"]["detected"] == "mxfp4" and groups["ffn.experts"]["agrees"]
    assert groups["attn.wq_b"]["detected"] == "fp8_e8m0" and groups["attn.wq_b"]["agrees"]


def test_embed_and_head_from_the_mtp_layer(tmp_path: Any) -> None:
    tensors, config, hf = _parts()
    tensors["mtp.0.emb.tok_emb.weight"] = tensors.pop("embed.weight")
    tensors["mtp.0.head.weight"] = tensors.pop("head.weight")
    report = inspect_checkpoint(_write(str(tmp_path / "ck"), (tensors, config, hf)))
    assert report.findings == []
    assert report.embed_source == "mtp.0.emb.tok_emb.weight"
    assert report.head_sources == {0: "mtp.0.head.weight"}


def test_missing_head_everywhere_is_an_error(tmp_path: Any) -> None:
    report = inspect_checkpoint(_write(str(tmp_path / "ck"), _delete("head.weight")(_parts())))
    assert [f.code for f in report.errors] == ["missing_tensor"]
    assert "head.weight: missing" in report.errors[0].message and report.exit_code == 1


@pytest.mark.parametrize("defect", ["missing", "truncated"])
def test_bad_shard_in_index(tmp_path: Any, defect: str) -> None:
    path = make_synthetic_checkpoint(str(tmp_path / "ck"), TINY)
    with open(os.path.join(path, INDEX_FILE)) as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[1]
    shard_path = os.path.join(path, shard)
    if defect == "missing":
        os.remove(shard_path)
    else:
        os.truncate(shard_path, os.path.getsize(shard_path) - 100)
    exit_code, report = _run(path)
    assert exit_code == 1
    (finding,) = report["findings"]
    assert finding["severity"] == "error" and finding["code"] == "shard"
    assert finding["message"].startswith(f"{shard}: ")
    assert ("missing" if defect == "missing" else "truncated") in finding["message"]


def test_unfoldable_nvfp4_is_a_warning(tmp_path: Any) -> None:
    path = make_synthetic_checkpoint(
        str(tmp_path / "ck"), TINY, expert_format="nvfp4", nvfp4_unfoldable=True
    )
    exit_code, report = _run(path)
    assert exit_code == 0
    (warning,) = _findings(report, "warning")
    assert warning["code"] == "nvfp4_unfoldable"
    assert "8 of 8 experts cannot fold" in warning["message"]
    assert "blocks FlashInfer's moe_ep pack" in warning["message"]
    (fold,) = report["nvfp4_fold"]
    assert fold["num_foldable"] == 0 and sorted(fold["unfoldable"]) == [str(e) for e in range(8)]
    assert "up/gate = 3.0" in fold["unfoldable"]["5"] and "expert 5" in fold["unfoldable"]["5"]


def test_foldable_nvfp4_counts_every_expert(tmp_path: Any) -> None:
    path = make_synthetic_checkpoint(str(tmp_path / "ck"), TINY, expert_format="nvfp4")
    report = inspect_checkpoint(path)
    assert report.exit_code == 0 and report.warnings == []
    (fold,) = report.nvfp4_fold
    assert (fold.num_foldable, fold.num_experts, fold.unfoldable) == (8, 8, {})


def test_nvfp4_claim_note_for_mxfp4_mtp_experts(tmp_path: Any) -> None:
    report = inspect_checkpoint(_write(str(tmp_path / "ck"), _claim_nvfp4(_parts())))
    (warning,) = report.warnings
    assert "normal for current NVIDIA NVFP4 exports" in warning.message


def test_missing_config_is_an_error(tmp_path: Any) -> None:
    tensors, _, _ = _parts()
    path = write_sharded_checkpoint(str(tmp_path / "ck"), tensors, None)
    report = inspect_checkpoint(path)
    assert [(f.severity, f.code) for f in report.findings] == [("error", "config")]
    assert "config.json: not found" in report.findings[0].message


def test_human_output_and_help(tmp_path: Any) -> None:
    path = _write(str(tmp_path / "ck"), _delete(f"{EXPERT}.w2.weight")(_parts()))
    result = CliRunner().invoke(main, ["inspect", path])
    assert result.exit_code == 1
    assert "missing_tensor" in result.stdout and "FAIL" in result.stdout
    assert "formats per tensor group" in result.stdout
    for command in ("inspect", "compare"):
        help_ = CliRunner().invoke(main, [command, "--help"])
        assert help_.exit_code == 0 and "--json" in help_.stdout


def test_a_file_given_as_the_checkpoint_is_named_as_a_file(tmp_path: Any) -> None:
    path = make_synthetic_checkpoint(str(tmp_path / "ck"), TINY)
    report = inspect_checkpoint(os.path.join(path, "config.json"))
    ((severity, code, message),) = [(f.severity, f.code, f.message) for f in report.findings]
    assert (severity, code) == ("error", "path") and report.exit_code == 1
    assert message.endswith(
        "config.json: is a file, expected the checkpoint directory (the one "
        "holding config.json and the safetensors shards)"
    )


def test_tensor_in_its_shard_but_not_in_the_index(tmp_path: Any) -> None:
    path = make_synthetic_checkpoint(str(tmp_path / "ck"), TINY)
    with open(os.path.join(path, INDEX_FILE)) as f:
        index = json.load(f)
    shard = index["weight_map"].pop(f"{EXPERT}.w2.weight")
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump(index, f)
    (error,) = inspect_checkpoint(path).errors
    assert error.code == "missing_tensor"
    assert error.message.startswith(
        f"{EXPERT}.w2.weight: missing (in {shard}, but {INDEX_FILE} does not list it)"
    )


@pytest.mark.parametrize("unfoldable", [False, True])
def test_human_output_prints_a_fold_table_only_for_unfoldable_experts(
    tmp_path: Any, unfoldable: bool
) -> None:
    path = make_synthetic_checkpoint(
        str(tmp_path / "ck"), TINY, expert_format="nvfp4", nvfp4_unfoldable=unfoldable
    )
    result = CliRunner().invoke(main, ["inspect", path])
    assert result.exit_code == 0
    assert ("why it does not fold" in result.stdout) == unfoldable
    assert ("mtp.0 NVFP4 gate/up fold: all 8 experts fold" in result.stdout) != unfoldable
