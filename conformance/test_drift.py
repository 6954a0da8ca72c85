"""``dsv4-mtp compare``: a checkpoint against itself shows no drift; noise planted in one tensor
group shows drift that grows with the noise, and that group ranks first in the weight errors."""

from __future__ import annotations

import itertools
import json
import math
import os
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from dsv4mtp.checkpoint.synthetic import make_synthetic_checkpoint, synthetic_checkpoint_tensors
from dsv4mtp.reference import (
    CheckpointError,
    DSV4Config,
    DSV4Error,
    InputError,
    formats,
    write_sharded_checkpoint,
)
from dsv4mtp.tools.cli import main
from dsv4mtp.tools.drift import (
    DriftInputs,
    DriftReport,
    GroupError,
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


# ----------------------------------------------------------------------------- hardening
def test_different_expert_counts_are_a_checkpoint_error(baseline: str, tmp_path: Any) -> None:
    other = make_synthetic_checkpoint(str(tmp_path / "e16"), TINY.replace(n_routed_experts=16))
    with pytest.raises(
        CheckpointError, match=r"config: A and B differ \(n_routed_experts 8 vs 16\)"
    ):
        compare_checkpoints(baseline, other, num_steps=1)


def test_inputs_file_that_is_not_safetensors(tmp_path: Any) -> None:
    for content in (b"hello", b"\x10" + b"\x00" * 7 + b'{"a":1}'):
        path = tmp_path / "inputs.safetensors"
        path.write_bytes(content)
        with pytest.raises(InputError, match=rf"{path}: expected a readable safetensors file"):
            load_drift_inputs(path, TINY)
    with pytest.raises(InputError, match=r"expected a readable safetensors file"):
        load_drift_inputs(tmp_path, TINY)


def _save_inputs(path: str, **change: torch.Tensor) -> str:
    inp = synthetic_drift_inputs(TINY, num_sequences=2, seq_len=3, seed=7)
    tensors = {
        "prev_hidden": inp.prev_hidden,
        "input_ids": inp.input_ids,
        "positions": inp.positions,
        "seq_lens": inp.seq_lens,
    }
    save_file(tensors | change, path)
    return path


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_are_refused_before_running(
    baseline: str, tmp_path: Any, bad: float
) -> None:
    prev = synthetic_drift_inputs(TINY, num_sequences=2, seq_len=3, seed=7).prev_hidden
    prev[4, 9] = bad
    path = _save_inputs(str(tmp_path / "nan.safetensors"), prev_hidden=prev)
    pattern = rf"prev_hidden: expected finite values, found {bad} at row 4, column 9"
    with pytest.raises(InputError, match=pattern):
        load_drift_inputs(path, TINY)
    inputs = DriftInputs(
        torch.zeros(6, dtype=torch.int64), torch.arange(6), prev, torch.tensor([6]), "test"
    )
    with pytest.raises(InputError, match=pattern):  # before anything is loaded
        compare_checkpoints(str(tmp_path / "absent"), str(tmp_path / "absent"), inputs=inputs)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (
            {"input_ids": torch.tensor([0, 1, 2, 3, 4, TINY.vocab_size])},
            r"input_ids: expected ids in \[0, vocab_size=512\), got 512",
        ),
        (
            {"positions": torch.tensor([-1, 0, 1, 2, 3, 4])},
            r"positions: expected positions in \[0, max_position_embeddings=",
        ),
        (
            {"seq_lens": torch.tensor([2, 2])},
            r"seq_lens: expected lengths >= 1 summing to T=6, got \[2, 2\]",
        ),
    ],
)
def test_bad_user_input_values_are_refused_at_load(tmp_path: Any, change, pattern) -> None:
    path = _save_inputs(str(tmp_path / "bad.safetensors"), **change)
    with pytest.raises(InputError, match=pattern):
        load_drift_inputs(path, TINY)


class _NaNLayer:
    """A layer with the MTPLayer draft interface whose logits are NaN (a broken checkpoint)."""

    dtype = torch.float32
    device = torch.device("cpu")

    def draft(self, input_ids, positions, prev_hidden, *, seq_lens, num_tokens, **kw):
        B = len(seq_lens)
        logits = torch.full((B, num_tokens, TINY.vocab_size), float("nan"))
        return torch.zeros(B, num_tokens, dtype=torch.int64), logits


def test_non_finite_logits_are_an_error_not_a_nan_metric(baseline: str) -> None:
    with pytest.raises(CheckpointError, match=r"checkpoint A: non-finite logits at draft step 0"):
        compare_checkpoints(baseline, baseline, num_steps=2, build_layer=lambda ck: _NaNLayer())


def test_report_json_is_strict(baseline: str) -> None:
    """An infinite relative error (an all-zero group in A) is spelled "inf"; no bare NaN or
    Infinity reaches the JSON."""
    report = compare_checkpoints(baseline, baseline, num_steps=1, num_sequences=2)
    report.weight_errors[0] = GroupError("g", math.inf, 1.0, "fp8", "fp8")
    d = report.to_dict()
    assert d["weight_errors"][0]["rel_error"] == "inf"
    json.dumps(d, allow_nan=False)


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        (
            {"dtype": "float32"},
            r"dtype: expected a torch.dtype in .*got str 'float32'; pass torch.float32",
        ),
        ({"preset": "nope"}, r"preset: expected one of"),
        ({"num_sequences": 0}, r"num_sequences: expected an int >= 1, got 0"),
        ({"seq_len": 2.0}, r"seq_len: expected an int >= 1, got 2.0"),
        ({"inputs": {"prev_hidden": None}}, r"inputs: expected DriftInputs, got dict"),
    ],
)
def test_compare_checkpoints_names_a_bad_argument(baseline: str, kw, pattern) -> None:
    with pytest.raises(DSV4Error, match=pattern):
        compare_checkpoints(baseline, baseline, num_steps=1, **kw)
