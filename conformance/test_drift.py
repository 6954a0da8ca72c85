"""``dsv4-mtp compare``: a checkpoint against itself shows no drift; noise planted in one tensor
group shows drift that grows with the noise, and that group ranks first in the weight errors."""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from dsv4mtp.checkpoint.synthetic import make_synthetic_checkpoint, synthetic_checkpoint_tensors
from dsv4mtp.reference import DSV4Config, InputError, formats, write_sharded_checkpoint
from dsv4mtp.tools.cli import main
from dsv4mtp.tools.drift import (
    DriftReport,
    compare_checkpoints,
    load_drift_inputs,
    synthetic_drift_inputs,
)

TINY = DSV4Config.tiny()
NOISY_GROUP = "attn.wq_b"
# Relative noise levels (||noise|| / ||W||).  Measured KL(p_A || p_B) means on the tiny config
# (32 sequences x 3 steps): about 0.005, 0.014, 0.046 nats (ratios ~2.8 and ~3.3; not
# quadratic because top-k expert routing flips discretely), so KL_GROWTH = 1.5 leaves margin.
NOISE_LEVELS = (0.05, 0.2, 0.8)
KL_GROWTH = 1.5
# Self-comparison: the same computation twice on CPU is bit-identical; 1e-6 is the bound.
SELF_KL = 1e-6


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: Any) -> str:
    return make_synthetic_checkpoint(str(tmp_path_factory.mktemp("a") / "ck"), TINY)


def _requantized_with_noise(path: str, level: float) -> str:
    """The baseline's tensors with ``NOISY_GROUP`` dequantized, + ``level`` relative Gaussian
    noise (the same direction for every level), and re-quantized to FP8 with e8m0 scales."""
    tensors, config, hf_quant = synthetic_checkpoint_tensors(TINY)
    name = f"mtp.0.{NOISY_GROUP}"
    w = formats.dequantize_fp8_block(tensors[f"{name}.weight"], tensors[f"{name}.scale"])
    noise = torch.randn(w.shape, generator=torch.Generator().manual_seed(1234))
    w = w + level * w.norm() / noise.norm() * noise
    tensors[f"{name}.weight"], tensors[f"{name}.scale"] = formats.quantize_fp8_block(
        w, scale_fmt="e8m0"
    )
    return write_sharded_checkpoint(path, tensors, config, hf_quant_config=hf_quant)


@pytest.fixture(scope="module")
def noisy(baseline: str, tmp_path_factory: Any) -> list[DriftReport]:
    root = tmp_path_factory.mktemp("b")
    return [
        compare_checkpoints(baseline, _requantized_with_noise(str(root / f"b{i}"), level))
        for i, level in enumerate(NOISE_LEVELS)
    ]


def test_self_compare_has_no_drift(baseline: str) -> None:
    report = compare_checkpoints(baseline, baseline, num_steps=3)
    assert [s.step for s in report.steps] == [0, 1, 2]
    for s in report.steps:
        assert s.top1_agreement == 1.0
        assert 0.0 <= s.kl_mean < SELF_KL and s.kl_max < SELF_KL
    assert all(g.rel_error == 0.0 and g.max_abs_error == 0.0 for g in report.weight_errors)
    assert len(report.draft_tokens) == 32 and all(len(t) == 3 for t in report.draft_tokens)


def test_noise_in_one_group_drifts(noisy: list[DriftReport]) -> None:
    kls = []
    for level, report in zip(NOISE_LEVELS, noisy, strict=True):
        assert all(s.kl_mean > 0.0 for s in report.steps), report.steps
        kls.append(sum(s.kl_mean for s in report.steps) / len(report.steps))
        first, second = report.weight_errors[:2]
        assert first.group == f"mtp.0.{NOISY_GROUP}"
        # FP8 re-quantization adds a little error of its own: the relative error is near level.
        assert level * 0.8 < first.rel_error < level * 1.2
        assert second.rel_error == 0.0
    agreement = [min(s.top1_agreement for s in r.steps) for r in noisy]
    assert agreement[-1] < 1.0
    for lo, hi in itertools.pairwise(kls):
        assert hi > KL_GROWTH * lo, kls


def test_compare_cli_json(baseline: str, tmp_path: Any) -> None:
    noisy_path = _requantized_with_noise(str(tmp_path / "b"), NOISE_LEVELS[-1])
    result = CliRunner().invoke(
        main, ["compare", baseline, noisy_path, "--steps", "2", "--sequences", "8", "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [s["step"] for s in report["steps"]] == [0, 1]
    assert report["implementation"] == "reference (CPU)"
    assert report["weight_errors"][0]["group"] == f"mtp.0.{NOISY_GROUP}"
    assert report["steps"][0]["kl_mean"] > 0.0
    human = CliRunner().invoke(main, ["compare", baseline, baseline, "--steps", "1"])
    assert human.exit_code == 0, human.output
    assert "100.0 %" in human.stdout and "worst first" in human.stdout


def test_user_supplied_inputs(baseline: str, tmp_path: Any) -> None:
    inp = synthetic_drift_inputs(TINY, num_sequences=3, seq_len=5, seed=7)
    path = str(tmp_path / "inputs.safetensors")
    save_file(
        {
            "prev_hidden": inp.prev_hidden.to(torch.bfloat16),
            "input_ids": inp.input_ids.to(torch.int32),
            "positions": inp.positions,
            "seq_lens": inp.seq_lens,
        },
        path,
    )
    loaded = load_drift_inputs(path, TINY)
    assert torch.equal(loaded.prev_hidden, inp.prev_hidden.to(torch.bfloat16).float())
    assert torch.equal(loaded.input_ids, inp.input_ids) and loaded.input_ids.dtype == torch.int64
    result = CliRunner().invoke(
        main, ["compare", baseline, baseline, "--inputs", path, "--steps", "2", "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert len(report["draft_tokens"]) == 3 and path in report["inputs"]
    assert all(s["top1_agreement"] == 1.0 for s in report["steps"])


def test_bad_user_inputs_name_the_tensor(tmp_path: Any) -> None:
    path = str(tmp_path / "bad.safetensors")
    save_file(
        {"prev_hidden": torch.zeros(4, 7), "input_ids": torch.zeros(4, dtype=torch.int64)}, path
    )
    with pytest.raises(InputError, match=r"missing tensor.*positions"):
        load_drift_inputs(path, TINY)
    save_file(
        {
            "prev_hidden": torch.zeros(4, 7),
            "input_ids": torch.zeros(4, dtype=torch.int64),
            "positions": torch.zeros(4, dtype=torch.int64),
        },
        path,
    )
    with pytest.raises(InputError, match=rf"prev_hidden: expected .*\(T, {TINY.hc_dim}\)"):
        load_drift_inputs(path, TINY)


def test_compare_cli_reports_a_bad_checkpoint(baseline: str, tmp_path: Any) -> None:
    tensors, config, _ = synthetic_checkpoint_tensors(TINY)
    broken = write_sharded_checkpoint(
        str(tmp_path / "b"), {k: v for k, v in tensors.items() if not k.startswith("mtp.")}, config
    )
    result = CliRunner().invoke(main, ["compare", baseline, broken])
    assert result.exit_code == 1
    assert "no weights in the checkpoint" in result.output
    assert os.path.isdir(broken)
