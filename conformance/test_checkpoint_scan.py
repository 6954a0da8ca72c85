"""The value scan of the stored codes: every poisoned tensor kind is refused by the loader and
reported by ``inspect`` with the same message (one rule set), boundaries of the overflow rules,
chunked streaming, and the loader's ``scan=False`` switch."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from dsv4mtp import formats
from dsv4mtp.checkpoint.report import inspect_checkpoint
from dsv4mtp.checkpoint.synthetic import synthetic_checkpoint_tensors
from dsv4mtp.reference import (
    CheckpointError,
    DSV4Config,
    load_mtp_checkpoint,
    write_sharded_checkpoint,
)

TINY = DSV4Config.tiny()
EXPERT = "mtp.0.ffn.experts.5"
BF16_MAX = torch.finfo(torch.bfloat16).max


def _set_byte(byte: int, at: tuple[int, ...] = (1, 2)) -> Callable[[torch.Tensor], torch.Tensor]:
    """Overwrite one stored byte of an 8-bit tensor (e4m3 / e8m0 / uint8), keeping its dtype."""

    def edit(t: torch.Tensor) -> torch.Tensor:
        b = t.view(torch.uint8).clone()
        b[at] = byte
        return b.view(t.dtype)

    return edit


def _set_value(
    value: float, at: tuple[int, ...] = (1, 2)
) -> Callable[[torch.Tensor], torch.Tensor]:
    def edit(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        if t.dim() == 0:
            return torch.tensor(value, dtype=t.dtype)
        t[at[: t.dim()]] = value
        return t

    return edit


# (id, expert format, tensor, edit, finding code, message)
POISONS: list[tuple[str, str, str, Callable[[torch.Tensor], torch.Tensor], str, str]] = [
    (
        "e4m3-weight-nan-0x7f",
        "mxfp4",
        "mtp.0.attn.wq_b.weight",
        _set_byte(0x7F, (3, 5)),
        "non_finite_weight",
        "mtp.0.attn.wq_b.weight: expected finite float8_e4m3fn codes, found 1 NaN code(s) "
        "(0x7F/0xFF) of 65536 (first at index (3, 5): e4m3 byte 0x7F (nan))",
    ),
    (
        "e4m3-expert-weight-nan-0xff",
        "fp8",
        f"{EXPERT}.w2.weight",
        _set_byte(0xFF, (7, 0)),
        "non_finite_weight",
        f"{EXPERT}.w2.weight: expected finite float8_e4m3fn codes, found 1 NaN code(s) "
        "(0x7F/0xFF) of 32768 (first at index (7, 0): e4m3 byte 0xFF (nan))",
    ),
    (
        "bf16-expert-weight-inf",
        "bf16",
        f"{EXPERT}.w1.weight",
        _set_value(float("inf")),
        "non_finite_tensor",
        f"{EXPERT}.w1.weight: expected finite values, found 1 non-finite of 32768 (first at "
        "index (1, 2): inf)",
    ),
    (
        "target-head-nan",
        "mxfp4",
        "head.weight",
        _set_value(float("nan"), (9, 1)),
        "non_finite_tensor",
        "head.weight: expected finite values, found 1 non-finite of 131072 (first at index "
        "(9, 1): nan)",
    ),
    (
        "target-embedding-inf",
        "mxfp4",
        "embed.weight",
        _set_value(float("-inf"), (0, 0)),
        "non_finite_tensor",
        "embed.weight: expected finite values, found 1 non-finite of 131072 (first at index "
        "(0, 0): -inf)",
    ),
    (
        "fp8-e8m0-scale-nan",
        "mxfp4",
        "mtp.0.attn.wo_b.scale",
        _set_byte(0xFF, (1, 0)),
        "non_finite_scale",
        "mtp.0.attn.wo_b.scale: expected finite scales, found 1 non-finite of 4 (first at index "
        "(1, 0): e8m0 byte 0xFF (NaN))",
    ),
    (
        "fp8-e8m0-scale-overflow",
        "mxfp4",
        "mtp.0.attn.wo_b.scale",
        _set_byte(247, (0, 1)),
        "scale_overflow",
        "mtp.0.attn.wo_b.scale: expected FP8 block scales whose product with the largest e4m3 "
        "value (448) stays finite in bfloat16 and float32 (<= 3.39e+38), found 1 of 4 that "
        "overflow (first at index (0, 1): e8m0 byte 0xF7 (2^120))",
    ),
    (
        "fp8-f32-scale-zero",
        "fp8",
        "mtp.0.attn.wo_a.scale",
        _set_value(0.0, (0, 0)),
        "non_positive_scale",
        "mtp.0.attn.wo_a.scale: expected positive FP8 block scales, found 1 <= 0 of 4 (first "
        "at index (0, 0): 0.0)",
    ),
    (
        "fp8-f32-expert-scale-negative",
        "fp8",
        f"{EXPERT}.w3.scale",
        _set_value(-0.5, (0, 1)),
        "non_positive_scale",
        f"{EXPERT}.w3.scale: expected positive FP8 block scales, found 1 <= 0 of 2 (first at "
        "index (0, 1): -0.5)",
    ),
    (
        "fp8-f32-scale-overflow",
        "fp8",
        "mtp.0.e_proj.scale",
        _set_value(1e36, (1, 1)),
        "scale_overflow",
        "mtp.0.e_proj.scale: expected FP8 block scales whose product with the largest e4m3 "
        "value (448) stays finite in bfloat16 and float32 (<= 3.39e+38), found 1 of 4 that "
        "overflow (first at index (1, 1): 1e+36)",
    ),
    (
        "mxfp4-scale-nan",
        "mxfp4",
        f"{EXPERT}.w1.scale",
        _set_byte(0xFF, (4, 3)),
        "non_finite_scale",
        f"{EXPERT}.w1.scale: expected finite scales, found 1 non-finite of 1024 (first at "
        "index (4, 3): e8m0 byte 0xFF (NaN))",
    ),
    (
        "mxfp4-scale-overflow",
        "mxfp4",
        f"{EXPERT}.w1.scale",
        _set_byte(253, (4, 3)),
        "scale_overflow",
        f"{EXPERT}.w1.scale: expected MXFP4 scales whose product with the largest e2m1 value "
        "(6) stays finite in bfloat16 and float32 (<= 3.39e+38), found 1 of 1024 that overflow "
        "(first at index (4, 3): e8m0 byte 0xFD (2^126))",
    ),
    (
        "nvfp4-block-scale-nan",
        "nvfp4",
        f"{EXPERT}.w2.weight_scale",
        _set_byte(0x7F, (2, 2)),
        "non_finite_scale",
        f"{EXPERT}.w2.weight_scale: expected finite scales, found 1 non-finite of 2048 (first "
        "at index (2, 2): e4m3 byte 0x7F (nan))",
    ),
    (
        "nvfp4-block-scale-negative",
        "nvfp4",
        f"{EXPERT}.w1.weight_scale",
        _set_byte(0xB8, (0, 3)),
        "non_positive_scale",
        f"{EXPERT}.w1.weight_scale: expected non-negative NVFP4 block scales, found 1 negative "
        "of 2048 (first at index (0, 3): e4m3 byte 0xB8 (-1))",
    ),
    (
        "nvfp4-global-scale-zero",
        "nvfp4",
        f"{EXPERT}.w3.weight_scale_2",
        _set_value(0.0),
        "non_positive_scale",
        f"{EXPERT}.w3.weight_scale_2: expected a positive NVFP4 global scale, got 0.0",
    ),
    (
        "nvfp4-global-scale-negative",
        "nvfp4",
        f"{EXPERT}.w2.weight_scale_2",
        _set_value(-1.0),
        "non_positive_scale",
        f"{EXPERT}.w2.weight_scale_2: expected a positive NVFP4 global scale, got -1.0",
    ),
    (
        "nvfp4-global-scale-overflow",
        "nvfp4",
        f"{EXPERT}.w1.weight_scale_2",
        _set_value(2.0**118),
        "scale_overflow",
        f"{EXPERT}.w1.weight_scale_2: expected NVFP4 global scale whose product with the "
        "largest e4m3 x e2m1 value (2688) stays finite in bfloat16 and float32 (<= 3.39e+38), "
        "found 1 of 1 that overflow (first at the scalar: 3.32307e+35)",
    ),
    (
        "nvfp4-input-scale-zero",
        "nvfp4",
        f"{EXPERT}.w1.input_scale",
        _set_value(0.0),
        "non_positive_scale",
        f"{EXPERT}.w1.input_scale: expected a positive NVFP4 input scale, got 0.0",
    ),
    (
        "nvfp4-input-scale-inf",
        "nvfp4",
        f"{EXPERT}.w2.input_scale",
        _set_value(float("inf")),
        "non_finite_scale",
        f"{EXPERT}.w2.input_scale: expected finite scales, found 1 non-finite of 1 (first at "
        "the scalar: inf)",
    ),
]


def _poisoned(tmp_path: Any, fmt: str, name: str, edit: Callable) -> str:
    tensors, config, hf_quant = synthetic_checkpoint_tensors(TINY, expert_format=fmt)
    tensors = dict(tensors)
    tensors[name] = edit(tensors[name])
    return write_sharded_checkpoint(str(tmp_path / "ck"), tensors, config, hf_quant_config=hf_quant)


@pytest.mark.parametrize(
    ("fmt", "name", "edit", "code", "message"),
    [p[1:] for p in POISONS],
    ids=[p[0] for p in POISONS],
)
def test_loader_and_inspect_refuse_the_same_way(
    tmp_path: Any, fmt: str, name: str, edit: Callable, code: str, message: str
) -> None:
    path = _poisoned(tmp_path, fmt, name, edit)
    with pytest.raises(CheckpointError) as e:
        load_mtp_checkpoint(path)
    assert str(e.value) == message
    report = inspect_checkpoint(path)
    assert [(f.code, f.message) for f in report.errors] == [(code, message)]
    assert report.exit_code == 1


@pytest.mark.parametrize(
    ("fmt", "name", "edit"),
    [
        ("mxfp4", f"{EXPERT}.w1.scale", _set_byte(252)),  # 6 x 2^125 = 2.6e38: fits
        ("mxfp4", "mtp.0.attn.wo_b.scale", _set_byte(246, (0, 0))),  # 448 x 2^119 = 3.0e38
        ("nvfp4", f"{EXPERT}.w1.weight_scale", _set_byte(0x80)),  # -0: a zero block
        ("fp8", "mtp.0.e_proj.scale", _set_value(BF16_MAX / 448 / 1.01, (0, 0))),
    ],
    ids=["mxfp4-e8m0-252", "fp8-e8m0-246", "nvfp4-minus-zero", "fp8-f32-just-below"],
)
def test_scales_at_the_limit_load(tmp_path: Any, fmt: str, name: str, edit: Callable) -> None:
    path = _poisoned(tmp_path, fmt, name, edit)
    load_mtp_checkpoint(path)
    assert [f for f in inspect_checkpoint(path).errors if f.code != "nvfp4_unfoldable"] == []


@pytest.mark.parametrize("rule", ["mxfp4_scale", "fp8_scale"])
def test_e8m0_overflow_threshold_is_where_the_decode_overflows(rule: str) -> None:
    from dsv4mtp.checkpoint.scan import scan_tensor

    emax = formats.E2M1_MAX if rule == "mxfp4_scale" else formats.E4M3_MAX
    codes = torch.arange(255, dtype=torch.uint8)  # every finite e8m0 byte
    scales = formats.decode_e8m0(codes, dtype=torch.float64)
    for dtype in (torch.bfloat16, torch.float32):
        decoded = (emax * scales).to(dtype)  # the largest element's decode in that dtype
        overflows = ~torch.isfinite(decoded)
        first = int(overflows.nonzero()[0, 0])
        assert overflows[first:].all()
        (finding,) = scan_tensor("s", rule, [(0, codes.view(torch.float8_e8m0fnu))])  # type: ignore[arg-type]
        assert finding.code == "scale_overflow"
        assert f"found {255 - first} of 255 that overflow" in finding.message
        assert f"(first at index {first}: e8m0 byte 0x{first:02X}" in finding.message


def test_chunks_count_every_bad_code_and_locate_the_first(tmp_path: Any) -> None:
    from dsv4mtp.checkpoint.io import ShardedCheckpoint
    from dsv4mtp.checkpoint.scan import scan_checkpoint

    w = torch.zeros(100, 48, dtype=torch.uint8)
    w[37, 5] = w[80, 0] = w[99, 47] = 0xFF
    path = write_sharded_checkpoint(
        str(tmp_path / "ck"), {"w": w.view(torch.float8_e4m3fn), "x": torch.ones(3)}, None
    )
    ck = ShardedCheckpoint(path)
    for chunk_bytes in (1, 48, 100, 1 << 20):
        (finding,) = scan_checkpoint(
            ck, {"w": "e4m3_weight", "x": "finite"}, chunk_bytes=chunk_bytes
        )
        assert "found 3 NaN code(s) (0x7F/0xFF) of 4800 (first at index (37, 5)" in finding.message


def test_scan_false_skips_the_scan(tmp_path: Any) -> None:
    path = _poisoned(tmp_path, "nvfp4", f"{EXPERT}.w3.weight_scale_2", _set_value(0.0))
    with pytest.raises(CheckpointError, match="expected a positive NVFP4 global scale"):
        load_mtp_checkpoint(path)
    ck = load_mtp_checkpoint(path, scan=False)
    assert float(ck.layers[0].experts.w13_weight_scale_2[5, 1]) == 0.0


def test_expert_parallel_scans_only_the_rank_experts(tmp_path: Any) -> None:
    path = _poisoned(tmp_path, "mxfp4", f"{EXPERT}.w1.scale", _set_byte(0xFF))
    load_mtp_checkpoint(path, ep_rank=0, ep_size=2)  # experts 0-3: expert 5 is not read
    with pytest.raises(CheckpointError, match=rf"{EXPERT}\.w1\.scale: expected finite scales"):
        load_mtp_checkpoint(path, ep_rank=1, ep_size=2)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8", "bf16"])
def test_clean_synthetic_checkpoints_pass_the_scan(tmp_path: Any, fmt: str) -> None:
    tensors, config, hf_quant = synthetic_checkpoint_tensors(TINY, expert_format=fmt)
    path = write_sharded_checkpoint(str(tmp_path / "ck"), tensors, config, hf_quant_config=hf_quant)
    load_mtp_checkpoint(path)
    assert inspect_checkpoint(path).errors == []
    assert math.isfinite(BF16_MAX)


@pytest.mark.parametrize("poison", ["fp8-f32-scale-zero", "nvfp4-block-scale-negative"])
def test_inspect_command_exits_1_on_a_bad_scale(tmp_path: Any, poison: str) -> None:
    from click.testing import CliRunner

    from dsv4mtp.tools.cli import main

    _, fmt, name, edit, _code, message = next(p for p in POISONS if p[0] == poison)
    result = CliRunner().invoke(main, ["inspect", _poisoned(tmp_path, fmt, name, edit), "--json"])
    assert result.exit_code == 1, result.output
    assert f'"message": "{message}"' in result.stdout
