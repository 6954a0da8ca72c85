"""Synthetic checkpoints: layout as the real one, every format, deterministic, fast, fully consumed.

The realism properties (routing coverage, sink effect, output magnitudes) need the model and are
asserted by the model's tests.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from safetensors import safe_open

from dsv4mtp.checkpoint.io import INDEX_FILE
from dsv4mtp.checkpoint.synthetic import EXPERT_FORMATS
from dsv4mtp.reference import (
    ConfigError,
    DSV4Config,
    FoldError,
    fold_nvfp4_experts,
    load_mtp_checkpoint,
    make_synthetic_checkpoint,
)

TINY = DSV4Config.tiny()

# The non-expert mtp.0 tensors of the official V4-Flash checkpoint (39 names), written out
# independently of the parameter table so that the table is checked against it.
OFFICIAL_MTP0 = {
    *(f"{p}.{s}" for p in ("e_proj", "h_proj") for s in ("weight", "scale")),
    "enorm.weight", "hnorm.weight", "norm.weight",
    "hc_head_fn", "hc_head_base", "hc_head_scale",
    *(f"hc_{a}_{b}" for a in ("attn", "ffn") for b in ("fn", "base", "scale")),
    "attn_norm.weight", "ffn_norm.weight",
    *(f"attn.{p}.{s}" for p in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b") for s in ("weight", "scale")),
    "attn.q_norm.weight", "attn.kv_norm.weight", "attn.attn_sink",
    "ffn.gate.weight", "ffn.gate.bias",
    *(f"ffn.shared_experts.{w}.{s}" for w in ("w1", "w2", "w3") for s in ("weight", "scale")),
}  # fmt: skip
EXPERT_SUFFIXES = {
    "mxfp4": {"weight", "scale"},
    "fp8": {"weight", "scale"},
    "bf16": {"weight"},
    "nvfp4": {"weight", "weight_scale", "weight_scale_2", "input_scale"},
}


def _index(path: str) -> dict[str, str]:
    with open(os.path.join(path, INDEX_FILE)) as f:
        return json.load(f)["weight_map"]


def _read_all(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, shard in _index(path).items():
        with safe_open(os.path.join(path, shard), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    return {
        fmt: make_synthetic_checkpoint(tmp_path_factory.mktemp(fmt), TINY, expert_format=fmt)
        for fmt in EXPERT_FORMATS
    }


@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_names_and_layout_match_the_official_checkpoint(ckpts, fmt: str) -> None:
    path = ckpts[fmt]
    names = set(_index(path))
    mtp = {n.removeprefix("mtp.0.") for n in names if n.startswith("mtp.0.")}
    experts = {n for n in mtp if n.startswith("ffn.experts.")}
    assert mtp - experts == OFFICIAL_MTP0
    want = {
        f"ffn.experts.{e}.{w}.{s}"
        for e in range(TINY.n_routed_experts)
        for w in ("w1", "w2", "w3")
        for s in EXPERT_SUFFIXES[fmt]
    }
    assert experts == want
    assert {"embed.weight", "head.weight", "layers.0.attn_norm.weight"} <= names
    assert not any(n.startswith(("mtp.0.emb", "mtp.0.head")) for n in names)
    shards = set(_index(path).values())
    assert len(shards) >= 2
    # mtp.* tensors are spread over more than one shard.
    assert len({s for n, s in _index(path).items() if n.startswith("mtp.")}) >= 2


@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_loads_without_warnings_and_consumes_every_tensor(ckpts, fmt: str) -> None:
    path = ckpts[fmt]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck = load_mtp_checkpoint(path)
    names = set(_index(path))
    mtp = {n for n in names if n.startswith("mtp.")}
    assert set(ck.loaded) == mtp | {"embed.weight", "head.weight"}
    assert ck.skipped == {}
    want = {"mxfp4": "mxfp4", "fp8": "fp8_f32", "bf16": "bf16", "nvfp4": "nvfp4"}[fmt]
    assert ck.expert_formats == (want,)
    dense = "fp8_f32" if fmt == "fp8" else "fp8_e8m0"
    assert {
        ck.layers[0].e_proj.format,
        ck.layers[0].wo_b.format,
        ck.layers[0].down_proj.format,
    } == {dense}


@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_config_json_has_the_real_field_names(ckpts, fmt: str) -> None:
    with open(os.path.join(ckpts[fmt], "config.json")) as f:
        raw = json.load(f)
    for key in ("hidden_size", "num_hidden_layers", "num_nextn_predict_layers", "compress_ratios",
                "qk_rope_head_dim", "o_groups", "hc_mult", "n_routed_experts", "expert_dtype",
                "quantization_config", "model_type"):  # fmt: skip
        assert key in raw, key
    cfg = DSV4Config.from_dir(ckpts[fmt])
    assert cfg.hidden_size == TINY.hidden_size and cfg.compress_ratios == TINY.compress_ratios
    assert cfg.expert_dtype == {"mxfp4": "fp4", "nvfp4": "fp4", "fp8": "fp8", "bf16": "bf16"}[fmt]


def test_nvfp4_modelopt_metadata(ckpts) -> None:
    path = ckpts["nvfp4"]
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["moe_quant_algo"] == "NVFP4" and qc["quant_method"] == "fp8"
    assert qc["quant_algo"] == "MIXED_PRECISION" and "mtp.0.ffn.experts" in qc["quantized_layers"]
    with open(os.path.join(path, "hf_quant_config.json")) as f:
        hfq = json.load(f)
    assert hfq["producer"]["name"] == "modelopt"
    assert hfq["quantization"]["quantized_layers"]["mtp.0.ffn.experts"]["quant_algo"] == "NVFP4"
    assert DSV4Config.from_dir(path).expected_expert_format == "nvfp4"
    t = _read_all(path)
    assert t["mtp.0.ffn.experts.0.w1.weight"].dtype == torch.uint8
    assert t["mtp.0.ffn.experts.0.w1.weight_scale"].dtype == torch.float8_e4m3fn
    assert t["mtp.0.ffn.experts.0.w1.weight_scale_2"].shape == ()


@pytest.mark.parametrize("unfoldable", [False, True])
def test_nvfp4_gate_and_up_global_scales_differ(tmp_path, unfoldable: bool) -> None:
    path = make_synthetic_checkpoint(
        tmp_path, TINY, expert_format="nvfp4", nvfp4_unfoldable=unfoldable
    )
    ex = load_mtp_checkpoint(path).layers[0].experts
    ratio = ex.w13_weight_scale_2[:, 1] / ex.w13_weight_scale_2[:, 0]  # type: ignore[index]
    assert (ratio == (3.0 if unfoldable else 2.0)).all()
    if unfoldable:
        with pytest.raises(FoldError, match="cannot be merged"):
            fold_nvfp4_experts(ex)
    else:
        fold_nvfp4_experts(ex)


def test_dtypes_as_in_real_checkpoints(ckpts) -> None:
    mx = _read_all(ckpts["mxfp4"])
    assert mx["mtp.0.ffn.experts.0.w1.weight"].dtype == torch.int8  # V4-Flash stores I8
    assert mx["mtp.0.ffn.experts.0.w1.scale"].dtype == torch.float8_e8m0fnu
    assert mx["mtp.0.e_proj.weight"].dtype == torch.float8_e4m3fn
    assert mx["mtp.0.e_proj.scale"].dtype == torch.float8_e8m0fnu
    assert mx["mtp.0.enorm.weight"].dtype == torch.bfloat16
    assert mx["mtp.0.ffn.gate.weight"].dtype == torch.bfloat16
    for n in (
        "mtp.0.hc_attn_fn",
        "mtp.0.attn.attn_sink",
        "mtp.0.ffn.gate.bias",
        "mtp.0.hc_head_scale",
    ):
        assert mx[n].dtype == torch.float32, n
    base = _read_all(ckpts["fp8"])  # V4-Flash-Base: float32 scales everywhere
    assert base["mtp.0.e_proj.scale"].dtype == torch.float32
    assert base["mtp.0.ffn.experts.0.w2.weight"].dtype == torch.float8_e4m3fn
    assert base["mtp.0.ffn.experts.0.w2.scale"].dtype == torch.float32


def test_init_statistics(ckpts) -> None:
    """The table's init rules, which the model-level realism tests rely on."""
    ck = load_mtp_checkpoint(ckpts["mxfp4"])
    layer = ck.layers[0]
    D = TINY.hidden_size
    assert torch.equal(layer.hc_attn_base, torch.zeros(TINY.hc_mix))
    assert torch.equal(layer.hc_ffn_scale, torch.ones(3)) and torch.equal(
        layer.hc_head_scale, torch.ones(1)
    )
    assert 0.015 < float(layer.hc_attn_fn.std()) < 0.025
    assert (
        float(layer.attn_sink.abs().max()) > 0.1
        and len(set(layer.attn_sink.tolist())) == TINY.num_attention_heads
    )
    for w in (layer.e_proj, layer.wq_b, layer.down_proj):
        std = float(w.dequantize().std()) * w.shape[1] ** 0.5
        assert 0.8 < std < 1.2, w.name
    w13, w2 = layer.experts.dequantize_expert(0)
    assert 0.8 < float(w13.std()) * D**0.5 < 1.2
    assert 0.8 < float(w2.std()) * TINY.moe_intermediate_size**0.5 < 1.2
    assert 0.8 < float(ck.embed_tokens.float().std()) < 1.2
    assert 0.8 < float(layer.head.float().std()) * D**0.5 < 1.2


def test_expert_weights_decode_identically_in_every_format(ckpts) -> None:
    experts = {fmt: load_mtp_checkpoint(path).layers[0].experts for fmt, path in ckpts.items()}
    ref = experts["mxfp4"]
    for fmt, ex in experts.items():
        for e in range(TINY.n_routed_experts):
            for a, b in zip(ref(e, torch.float32), ex(e, torch.float32), strict=True):
                assert torch.equal(a, b), (fmt, e)


def test_deterministic_in_seed(tmp_path) -> None:
    a = _read_all(make_synthetic_checkpoint(tmp_path / "a", TINY, seed=3))
    b = _read_all(make_synthetic_checkpoint(tmp_path / "b", TINY, seed=3))
    c = _read_all(make_synthetic_checkpoint(tmp_path / "c", TINY, seed=4))
    assert a.keys() == b.keys() == c.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    assert not torch.equal(
        a["mtp.0.attn.wq_b.weight"].view(torch.uint8), c["mtp.0.attn.wq_b.weight"].view(torch.uint8)
    )


def test_two_mtp_layers(tmp_path) -> None:
    cfg = TINY.replace(num_nextn_predict_layers=2, compress_ratios=(0, 0, 0, 0))
    ck = load_mtp_checkpoint(make_synthetic_checkpoint(tmp_path, cfg))
    assert [layer.layer_id for layer in ck.layers] == [2, 3]
    assert ck.layer_for_step(3) is ck.layers[1]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"expert_format": "int4"}, "expert_format: expected one of"),
        ({"expert_format": "mxfp4", "nvfp4_unfoldable": True}, "nvfp4_unfoldable: only for"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_synthetic_checkpoint(tmp_path, TINY, **kwargs)
