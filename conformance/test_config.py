"""DSV4Config: presets, raw-field parsing, validation errors."""

from __future__ import annotations

import json

import pytest

from dsv4mtp.reference import ConfigError, DSV4Config


def test_flash_preset_matches_spec() -> None:
    c = DSV4Config.flash()
    assert (c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.o_groups, c.o_lora_rank) == (
        4096,
        64,
        1024,
        8,
        1024,
    )
    assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (256, 6, 2048)
    assert (c.routed_scaling_factor, c.swiglu_limit, c.num_hidden_layers) == (1.5, 10.0, 43)
    assert c.compress_ratios is not None and len(c.compress_ratios) == 44
    assert c.compress_ratios[:4] == (0, 0, 4, 128) and c.compress_ratios[-2:] == (4, 0)
    assert (c.hc_dim, c.hc_mix, c.nope_head_dim) == (16384, 24, 448)
    assert list(c.mtp_layer_ids) == [43]
    assert c.expected_expert_format == "mxfp4"


def test_pro_preset_matches_spec() -> None:
    c = DSV4Config.pro()
    assert (c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.o_groups) == (
        7168,
        128,
        1536,
        16,
    )
    assert (c.n_routed_experts, c.moe_intermediate_size, c.routed_scaling_factor) == (
        384,
        3072,
        2.5,
    )
    assert c.compress_ratios is not None and len(c.compress_ratios) == 62
    assert c.compress_ratios[:3] == (128, 128, 4) and c.compress_ratios[-1] == 0


def test_tiny_preset() -> None:
    c = DSV4Config.tiny()
    assert (c.hidden_size, c.hc_mult, c.num_attention_heads, c.head_dim, c.qk_rope_head_dim) == (
        256,
        4,
        4,
        128,
        64,
    )
    assert (c.q_lora_rank, c.o_groups, c.o_lora_rank, c.sliding_window) == (128, 2, 128, 16)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.vocab_size) == (
        8,
        2,
        128,
        512,
    )
    assert (c.num_hidden_layers, c.num_nextn_predict_layers) == (2, 1)


@pytest.mark.parametrize("preset", [DSV4Config.flash, DSV4Config.pro, DSV4Config.tiny])
def test_round_trip_through_json(preset) -> None:
    c = preset()
    assert DSV4Config.from_hf_config(json.loads(json.dumps(c.to_hf_config()))) == c


def test_from_hf_config_ignores_unknown_and_keeps_raw_names() -> None:
    raw = DSV4Config.tiny().to_hf_config() | {"some_future_field": 1, "expert_dtype": None}
    c = DSV4Config.from_hf_config(raw)
    assert c.expert_dtype == "fp4"  # vLLM's default for a missing / null expert_dtype


def test_nvfp4_quant_algo_detected(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(DSV4Config.tiny().to_hf_config()))
    (tmp_path / "hf_quant_config.json").write_text(
        json.dumps({"quantization": {"quant_algo": "FP8", "moe_quant_algo": "NVFP4"}})
    )
    c = DSV4Config.from_dir(tmp_path)
    assert c.moe_quant_algo == "NVFP4" and c.expected_expert_format == "nvfp4"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": 0}, "hidden_size: expected a positive int, got 0"),
        ({"hidden_size": 256.0}, "hidden_size: expected an int"),
        ({"qk_rope_head_dim": 63}, "qk_rope_head_dim: expected an even number"),
        ({"qk_rope_head_dim": 128}, "qk_rope_head_dim: expected < head_dim"),
        ({"o_groups": 3}, "o_groups: expected a divisor of num_attention_heads"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok: expected <= n_routed_experts"),
        ({"scoring_func": "softmax"}, "scoring_func: only 'sqrtsoftplus'"),
        ({"expert_dtype": "int4"}, "expert_dtype: expected 'fp4', 'fp8' or 'bf16'"),
        ({"compress_ratios": [0, 0]}, "compress_ratios: expected 3 entries"),
        ({"compress_ratios": [0, 0, 4]}, "compress_ratios: the MTP entries must be 0"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps: expected > 0"),
        ({"hc_eps": float("nan")}, "hc_eps: expected a finite number"),
        ({"hc_eps": -1e-6}, "hc_eps: expected > 0, got -1e-06"),
        ({"rms_norm_eps": float("inf")}, "rms_norm_eps: expected a finite number"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ],
)
def test_validation_errors_name_the_field(change, message) -> None:
    raw = DSV4Config.tiny().to_hf_config() | change
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DSV4Config.from_hf_config(raw)


def test_missing_required_field_and_bad_dir(tmp_path) -> None:
    raw = DSV4Config.tiny().to_hf_config()
    del raw["hidden_size"]
    with pytest.raises(ConfigError, match=r"missing required field.*hidden_size"):
        DSV4Config.from_hf_config(raw)
    with pytest.raises(ConfigError, match=r"config\.json: not found"):
        DSV4Config.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        DSV4Config.from_dir(tmp_path)


def test_config_error_is_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    ("config_json", "hf_quant_json", "match"),
    [
        ("[1, 2]", None, r"config\.json: expected a JSON object, got list"),
        (None, "{not json", r"hf_quant_config\.json: not valid JSON"),
        (None, "[]", r"hf_quant_config\.json: expected a JSON object, got list"),
        (None, '{"quantization": 3}', r"hf_quant_config\.json: quantization: expected a JSON"),
        (None, b"\xff\xfe\x00", r"hf_quant_config\.json: cannot read it"),
    ],
)
def test_from_dir_names_the_bad_json_file(tmp_path, config_json, hf_quant_json, match) -> None:
    """A malformed config.json or hf_quant_config.json is a ConfigError naming the file, never a
    raw JSONDecodeError / AttributeError from inside the reader."""
    good = json.dumps(DSV4Config.tiny().to_hf_config())
    (tmp_path / "config.json").write_text(config_json or good)
    if isinstance(hf_quant_json, bytes):
        (tmp_path / "hf_quant_config.json").write_bytes(hf_quant_json)
    elif hf_quant_json is not None:
        (tmp_path / "hf_quant_config.json").write_text(hf_quant_json)
    with pytest.raises(ConfigError, match=match):
        DSV4Config.from_dir(tmp_path)
