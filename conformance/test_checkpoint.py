"""Checkpoint layer: name remapping (pure), loading, format detection, TP/EP, and every error."""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch

from dsv4mtp.checkpoint.io import INDEX_FILE
from dsv4mtp.checkpoint.names import expert_params_mapping
from dsv4mtp.checkpoint.synthetic import synthetic_checkpoint_tensors
from dsv4mtp.reference import (
    CheckpointError,
    ConfigError,
    DSV4Config,
    ExpertFormatWarning,
    formats,
    load_mtp_checkpoint,
    make_synthetic_checkpoint,
    remap_mtp_weight_name,
    write_sharded_checkpoint,
)

FLASH = DSV4Config.flash()  # N = 43
FLASH_FP8 = FLASH.replace(expert_dtype="fp8")
TWO_MTP = FLASH.replace(num_nextn_predict_layers=2, compress_ratios=None)
L = "model.layers.43."
B = L + "mtp_block."

# ----------------------------------------------------------------------------- remapping
# (checkpoint name, config, expected (param_name, shard_id, expert_id) or None).  Rows follow the
# worked examples of vLLM's load_weights (numbered) plus one per remaining branch.
REMAP_CASES = [
    ("mtp.0.attn.wq_a.weight", FLASH, (B + "attn.fused_wqa_wkv.weight", 0, None)),  # 1
    ("mtp.0.attn.wq_a.scale", FLASH, (B + "attn.fused_wqa_wkv.weight_scale_inv", 0, None)),  # 2
    ("mtp.0.attn.wkv.weight", FLASH, (B + "attn.fused_wqa_wkv.weight", 1, None)),  # 3
    ("mtp.0.attn.wkv.scale", FLASH, (B + "attn.fused_wqa_wkv.weight_scale_inv", 1, None)),  # 3
    ("mtp.0.attn.wq_b.weight", FLASH, (B + "attn.wq_b.weight", None, None)),  # 4
    ("mtp.0.attn.wq_b.scale", FLASH, (B + "attn.wq_b.weight_scale_inv", None, None)),  # 4
    ("mtp.0.attn.wo_a.scale", FLASH, (B + "attn.wo_a.weight_scale_inv", None, None)),  # 5
    ("mtp.0.attn.wo_b.weight", FLASH, (B + "attn.wo_b.weight", None, None)),  # 5
    ("mtp.0.attn.q_norm.weight", FLASH, (B + "attn.q_norm.weight", None, None)),  # 6
    ("mtp.0.attn.kv_norm.weight", FLASH, (B + "attn.kv_norm.weight", None, None)),  # 6
    ("mtp.0.attn.attn_sink", FLASH, (B + "attn.attn_sink", None, None)),  # 7
    ("mtp.0.attn_norm.weight", FLASH, (B + "attn_norm.weight", None, None)),  # 8
    ("mtp.0.ffn_norm.weight", FLASH, (B + "ffn_norm.weight", None, None)),  # 8
    ("mtp.0.hc_attn_fn", FLASH, (B + "hc_attn_fn", None, None)),  # 9
    ("mtp.0.hc_attn_scale", FLASH, (B + "hc_attn_scale", None, None)),  # 9: no dot, no rename
    ("mtp.0.hc_ffn_base", FLASH, (B + "hc_ffn_base", None, None)),  # 9
    ("mtp.0.ffn.gate.weight", FLASH, (B + "ffn.gate.weight", None, None)),  # 10
    ("mtp.0.ffn.gate.bias", FLASH, (B + "ffn.gate.e_score_correction_bias", None, None)),  # 11
    (
        "mtp.0.ffn.shared_experts.w1.weight",
        FLASH,
        (B + "ffn.shared_experts.gate_up_proj.weight", 0, None),
    ),  # 12
    (
        "mtp.0.ffn.shared_experts.w3.scale",
        FLASH,
        (B + "ffn.shared_experts.gate_up_proj.weight_scale_inv", 1, None),
    ),  # 13
    (
        "mtp.0.ffn.shared_experts.w2.weight",
        FLASH,
        (B + "ffn.shared_experts.down_proj.weight", None, None),
    ),  # 14
    (
        "mtp.0.ffn.shared_experts.w2.scale",
        FLASH,
        (B + "ffn.shared_experts.down_proj.weight_scale_inv", None, None),
    ),  # 14
    ("mtp.0.ffn.experts.17.w1.weight", FLASH, (B + "ffn.experts.w13_weight", "w1", 17)),  # 15
    ("mtp.0.ffn.experts.17.w3.weight", FLASH, (B + "ffn.experts.w13_weight", "w3", 17)),  # 16
    ("mtp.0.ffn.experts.17.w2.weight", FLASH, (B + "ffn.experts.w2_weight", "w2", 17)),  # 17
    ("mtp.0.ffn.experts.17.w1.scale", FLASH, (B + "ffn.experts.w13_weight_scale", "w1", 17)),  # 18
    (
        "mtp.0.ffn.experts.17.w1.scale",
        FLASH_FP8,
        (B + "ffn.experts.w13_weight_scale_inv", "w1", 17),
    ),  # 19
    (
        "mtp.0.ffn.experts.17.w1.weight_scale",
        FLASH,
        (B + "ffn.experts.w13_weight_scale", "w1", 17),
    ),  # 20
    (
        "mtp.0.ffn.experts.17.w3.weight_scale_2",
        FLASH,
        (B + "ffn.experts.w13_weight_scale_2", "w3", 17),
    ),  # 21
    (
        "mtp.0.ffn.experts.17.w2.input_scale",
        FLASH,
        (B + "ffn.experts.w2_input_scale", "w2", 17),
    ),  # 22
    (
        "mtp.0.ffn.experts.7.w2.scale",
        FLASH,
        (B + "ffn.experts.w2_weight_scale", "w2", 7),
    ),  # 7 vs 17
    (
        "mtp.0.ffn.experts.255.w3.scale",
        FLASH,
        (B + "ffn.experts.w13_weight_scale", "w3", 255),
    ),  # last expert
    ("mtp.0.e_proj.weight", FLASH, (L + "e_proj.weight", None, None)),  # 23
    ("mtp.0.e_proj.scale", FLASH, (L + "e_proj.weight_scale_inv", None, None)),  # 23
    ("mtp.0.h_proj.scale", FLASH, (L + "h_proj.weight_scale_inv", None, None)),  # 24
    ("mtp.0.enorm.weight", FLASH, (L + "enorm.weight", None, None)),  # 25
    ("mtp.0.hnorm.weight", FLASH, (L + "hnorm.weight", None, None)),  # 25
    ("mtp.0.norm.weight", FLASH, (L + "shared_head.norm.weight", None, None)),  # 26
    ("mtp.0.head.weight", FLASH, (L + "shared_head.head.weight", None, None)),  # 27
    ("mtp.0.emb.tok_emb.weight", FLASH, ("model.embed_tokens.weight", None, None)),  # 28
    ("mtp.0.hc_head_fn", FLASH, (L + "hc_head_fn", None, None)),  # 29
    ("mtp.0.hc_head_base", FLASH, (L + "hc_head_base", None, None)),  # 29
    ("mtp.0.hc_head_scale", FLASH, (L + "hc_head_scale", None, None)),  # 29
    ("layers.5.attn.wq_a.weight", FLASH, None),  # 30: first int 5, no mtp.5. to rename
    ("layers.43.attn.wq_a.weight", FLASH, None),  # a target layer with the MTP's number
    ("embed.weight", FLASH, None),  # 31
    ("head.weight", FLASH, None),  # 31
    ("norm.weight", FLASH, None),  # 31
    ("hc_head_fn", FLASH, None),  # 31
    ("mtp.1.attn.wq_a.weight", FLASH, None),  # 32: MTP index outside num_nextn_predict_layers
    ("mtp.1.emb.tok_emb.weight", TWO_MTP, None),  # 33: shared weight of a later MTP layer
    ("mtp.0.ffn.experts.256.w1.weight", FLASH, None),  # no expert 256 in the mapping table
    (
        "mtp.1.attn.wq_a.weight",
        TWO_MTP,
        ("model.layers.44.mtp_block.attn.fused_wqa_wkv.weight", 0, None),
    ),
    ("mtp.1.head.weight", TWO_MTP, ("model.layers.44.shared_head.head.weight", None, None)),
    (
        "mtp.1.ffn.experts.3.w2.scale",
        TWO_MTP,
        ("model.layers.44.mtp_block.ffn.experts.w2_weight_scale", "w2", 3),
    ),
]


@pytest.mark.parametrize(
    ("name", "config", "want"),
    REMAP_CASES,
    ids=[
        c[0] + ("/fp8" if c[1] is FLASH_FP8 else "/2mtp" if c[1] is TWO_MTP else "")
        for c in REMAP_CASES
    ],
)
def test_remap_worked_examples(name: str, config: DSV4Config, want: tuple | None) -> None:
    got = remap_mtp_weight_name(name, config)
    if want is None:
        assert got is None
        return
    assert got is not None
    assert (got.param_name, got.shard_id, got.expert_id) == want


def test_remap_reports_layer_and_kind() -> None:
    got = remap_mtp_weight_name("mtp.1.enorm.weight", TWO_MTP)
    assert got is not None and (got.mtp_index, got.layer_id, got.kind) == (1, 44, "layer")
    got = remap_mtp_weight_name("mtp.0.emb.tok_emb.weight", TWO_MTP)
    assert got is not None and got.kind == "shared"


def test_norm_rename_only_matches_a_literal_dot_norm() -> None:
    # enorm / hnorm / q_norm / attn_norm have no '.' right before 'norm'.
    for n in ("enorm", "hnorm", "attn_norm", "ffn_norm", "attn.q_norm", "attn.kv_norm"):
        got = remap_mtp_weight_name(f"mtp.0.{n}.weight", FLASH)
        assert got is not None and "shared_head" not in got.param_name


def test_mtp_index_is_the_first_integer_field() -> None:
    # mtp.0 precedes the expert index; an expert id never becomes the MTP index.
    got = remap_mtp_weight_name("mtp.0.ffn.experts.1.w1.weight", TWO_MTP)
    assert got is not None and got.layer_id == 43 and got.expert_id == 1


def test_expert_mapping_table_order_and_size() -> None:
    table = expert_params_mapping(4)
    assert len(table) == 12
    assert table[:3] == (
        ("experts.w13_", "experts.0.w1.", 0, "w1"),
        ("experts.w2_", "experts.0.w2.", 0, "w2"),
        ("experts.w13_", "experts.0.w3.", 0, "w3"),
    )


def test_every_synthetic_name_maps_to_a_state_dict_param(tiny_ckpt: str) -> None:
    """The loaded object's vLLM names are exactly the remapped names of the consumed tensors."""
    ck = load_mtp_checkpoint(tiny_ckpt)
    params = set(ck.state_dict())
    for name, param in ck.loaded.items():
        assert param in params, name
        if name.startswith("mtp."):
            assert remap_mtp_weight_name(name, ck.config).param_name == param  # type: ignore[union-attr]


# ----------------------------------------------------------------------------- loading
@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_synthetic_checkpoint(tmp_path_factory.mktemp("mx"), DSV4Config.tiny())


def _tensors(fmt: str = "mxfp4", config: DSV4Config | None = None):
    return synthetic_checkpoint_tensors(config or DSV4Config.tiny(), expert_format=fmt)


def _write(path, tensors, cfg, hf_quant=None, num_shards: int = 2) -> str:
    return write_sharded_checkpoint(
        path, tensors, cfg, num_shards=num_shards, hf_quant_config=hf_quant
    )


def test_load_consumes_every_mtp_tensor_and_ignores_the_target(tiny_ckpt: str) -> None:
    with open(os.path.join(tiny_ckpt, INDEX_FILE)) as f:
        names = set(json.load(f)["weight_map"])
    ck = load_mtp_checkpoint(tiny_ckpt)
    mtp = {n for n in names if n.startswith("mtp.")}
    assert mtp <= set(ck.loaded)
    assert set(ck.loaded) - mtp == {"embed.weight", "head.weight"}
    assert ck.skipped == {}
    assert "layers.0.attn_norm.weight" not in ck.loaded
    assert ck.embed_source == "embed.weight" and ck.layers[0].head_source == "head.weight"


def test_loaded_values_match_the_checkpoint_tensors() -> None:
    tensors, _, _ = _tensors()
    c = DSV4Config.tiny()
    layer_ck = None
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        layer_ck = load_mtp_checkpoint(make_synthetic_checkpoint(d, c))
    layer = layer_ck.layers[0]
    # Fused attention weight: rows [wq_a; wkv], shard by shard, decoded bit-exactly.
    wq_a = formats.dequantize_fp8_block(
        tensors["mtp.0.attn.wq_a.weight"], tensors["mtp.0.attn.wq_a.scale"]
    )
    wkv = formats.dequantize_fp8_block(
        tensors["mtp.0.attn.wkv.weight"], tensors["mtp.0.attn.wkv.scale"]
    )
    assert torch.equal(layer.fused_wqa_wkv.dequantize(), torch.cat([wq_a, wkv]))
    assert layer.fused_wqa_wkv.row_splits == (c.q_lora_rank, c.head_dim)
    assert torch.equal(layer.wkv.dequantize(), wkv)
    # e8m0 scales are kept as raw bytes.
    assert layer.e_proj.scale.dtype == torch.uint8  # type: ignore[union-attr]
    assert torch.equal(layer.e_proj.scale, tensors["mtp.0.e_proj.scale"].view(torch.uint8))  # type: ignore[arg-type]
    # Routed expert 5: w13 = [w1; w3], packed bytes and scales bit-preserved.
    ex = layer.experts
    w1 = tensors["mtp.0.ffn.experts.5.w1.weight"].view(torch.uint8)
    w3 = tensors["mtp.0.ffn.experts.5.w3.weight"].view(torch.uint8)
    assert torch.equal(ex.w13_weight[5], torch.cat([w1, w3]))
    gate, up, down = ex(5, torch.float32)
    assert torch.equal(gate, formats.dequantize_mxfp4(w1, tensors["mtp.0.ffn.experts.5.w1.scale"]))
    assert torch.equal(
        down,
        formats.dequantize_mxfp4(
            tensors["mtp.0.ffn.experts.5.w2.weight"], tensors["mtp.0.ffn.experts.5.w2.scale"]
        ),
    )
    assert up.shape == (c.moe_intermediate_size, c.hidden_size)
    assert torch.equal(layer.e_score_correction_bias, tensors["mtp.0.ffn.gate.bias"])
    assert torch.equal(layer.attn_sink, tensors["mtp.0.attn.attn_sink"])


def test_reexported_mtp_embedding_and_head_win(tmp_path) -> None:
    tensors, cfg, _ = _tensors()
    emb = torch.randn_like(tensors["embed.weight"], dtype=torch.float32).to(torch.bfloat16)
    head = torch.randn_like(tensors["head.weight"], dtype=torch.float32).to(torch.bfloat16)
    tensors["mtp.0.emb.tok_emb.weight"] = emb
    tensors["mtp.0.head.weight"] = head
    ck = load_mtp_checkpoint(_write(tmp_path, tensors, cfg))
    assert ck.embed_source == "mtp.0.emb.tok_emb.weight"
    assert ck.layers[0].head_source == "mtp.0.head.weight"
    assert torch.equal(ck.embed_tokens, emb) and torch.equal(ck.layers[0].head, head)
    assert "embed.weight" not in ck.loaded and "head.weight" not in ck.loaded


@pytest.mark.parametrize(("tp_size", "tp_rank"), [(2, 1), (4, 2), (1, 0)])
def test_attn_sink_is_narrowed_to_the_tp_rank_heads(
    tiny_ckpt: str, tp_size: int, tp_rank: int
) -> None:
    full = load_mtp_checkpoint(tiny_ckpt).layers[0].attn_sink
    ck = load_mtp_checkpoint(tiny_ckpt, tp_rank=tp_rank, tp_size=tp_size)
    n = full.numel() // tp_size
    assert torch.equal(ck.layers[0].attn_sink, full[n * tp_rank : n * (tp_rank + 1)])
    # Everything else stays replicated.
    assert ck.layers[0].wq_b.shape == load_mtp_checkpoint(tiny_ckpt).layers[0].wq_b.shape


def test_expert_parallel_rank_owns_a_contiguous_range(tiny_ckpt: str) -> None:
    full = load_mtp_checkpoint(tiny_ckpt).layers[0].experts
    ck = load_mtp_checkpoint(tiny_ckpt, ep_rank=1, ep_size=2)
    ex = ck.layers[0].experts
    assert (ex.expert_start, ex.num_local_experts, ex.num_experts) == (4, 4, 8)
    assert torch.equal(ex.w13_weight, full.w13_weight[4:8])
    assert torch.equal(ex.w2_weight_scale, full.w2_weight_scale[4:8])  # type: ignore[index]
    assert ex.local_id(5) == 1 and ex.local_id(3) == -1
    assert ex.global_to_local().tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]
    # Non-local experts are skipped, with the reason, and not counted as loaded.
    skipped = {n for n in ck.skipped if ".experts." in n}
    assert skipped == {
        f"mtp.0.ffn.experts.{e}.{w}.{s}"
        for e in range(4)
        for w in ("w1", "w2", "w3")
        for s in ("weight", "scale")
    }
    assert "not on EP rank 1 of 2" in ck.skipped["mtp.0.ffn.experts.0.w1.weight"]
    assert not any(".experts.0." in n for n in ck.loaded)
    with pytest.raises(IndexError, match="not on this EP rank"):
        ex(0, torch.float32)


def test_nvfp4_scalars_go_to_their_shard_column_with_ep(tmp_path) -> None:
    tensors, cfg, hfq = _tensors("nvfp4")
    ck = load_mtp_checkpoint(_write(tmp_path, tensors, cfg, hfq), ep_rank=1, ep_size=4)
    ex = ck.layers[0].experts
    assert ex.format == "nvfp4" and ex.expert_start == 2
    for local, e in enumerate((2, 3)):
        p = f"mtp.0.ffn.experts.{e}."
        assert float(ex.w13_weight_scale_2[local, 0]) == float(tensors[p + "w1.weight_scale_2"])  # type: ignore[index]
        assert float(ex.w13_weight_scale_2[local, 1]) == float(tensors[p + "w3.weight_scale_2"])  # type: ignore[index]
        assert float(ex.w2_weight_scale_2[local]) == float(tensors[p + "w2.weight_scale_2"])  # type: ignore[index]
        assert float(ex.w13_input_scale[local, 1]) == float(tensors[p + "w3.input_scale"])  # type: ignore[index]
    assert ex.w13_weight_scale_2.shape == (2, 2) and ex.w2_input_scale.shape == (2,)  # type: ignore[union-attr]


def test_state_dict_uses_the_seed_names(tiny_ckpt: str) -> None:
    sd = load_mtp_checkpoint(tiny_ckpt).state_dict()
    for name in (
        "model.embed_tokens.weight",
        B.replace("43", "2") + "attn.fused_wqa_wkv.weight_scale_inv",
        B.replace("43", "2") + "ffn.shared_experts.gate_up_proj.weight",
        B.replace("43", "2") + "ffn.experts.w13_weight_scale",
        B.replace("43", "2") + "ffn.gate.e_score_correction_bias",
        "model.layers.2.shared_head.head.weight",
    ):
        assert name in sd, name


# ----------------------------------------------------------------------------- format detection
def test_expert_format_comes_from_the_tensors_and_disagreement_warns(tmp_path) -> None:
    tensors, cfg, _ = _tensors("nvfp4")
    cfg = {**cfg, "quantization_config": {"quant_method": "fp8"}}  # config no longer says NVFP4
    path = _write(tmp_path, tensors, cfg)
    with pytest.warns(
        ExpertFormatWarning,
        match="routed experts are nvfp4 in the checkpoint but the config claims mxfp4",
    ):
        ck = load_mtp_checkpoint(path)
    assert ck.expert_formats == ("nvfp4",) and len(ck.warnings) == 1


def test_nvfp4_config_with_mxfp4_mtp_experts(tmp_path) -> None:
    """NVIDIA's current exports exclude mtp.* from NVFP4: MXFP4 MTP experts then load silently;
    a config that claims NVFP4 for the MTP layer too gets a warning, never a silent guess."""
    mx, _, _ = _tensors("mxfp4")
    _, nv_cfg, nv_hfq = _tensors("nvfp4")
    excluded = {**nv_hfq["quantization"], "exclude_modules": ["*.attn.*", "head", "mtp.*"]}
    qc = {**nv_cfg["quantization_config"], **excluded}
    path = _write(
        tmp_path / "a", mx, {**nv_cfg, "quantization_config": qc}, {"quantization": excluded}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_mtp_checkpoint(path).expert_formats == ("mxfp4",)
    path = _write(tmp_path / "b", mx, nv_cfg, nv_hfq)  # manifest lists mtp.0.ffn.experts
    with pytest.warns(
        ExpertFormatWarning, match="mxfp4 in the checkpoint but the config claims nvfp4"
    ):
        assert load_mtp_checkpoint(path).expert_formats == ("mxfp4",)


@pytest.mark.parametrize(("fmt", "claim"), [("fp8", "fp4"), ("mxfp4", "fp8"), ("bf16", "fp4")])
def test_expert_dtype_disagreement_warns(tmp_path, fmt: str, claim: str) -> None:
    tensors, cfg, _ = _tensors(fmt)
    with pytest.warns(ExpertFormatWarning):
        load_mtp_checkpoint(_write(tmp_path, tensors, {**cfg, "expert_dtype": claim}))


# ----------------------------------------------------------------------------- errors
def _expect_error(tmp_path, tensors, cfg, match: str, hfq=None, config=None) -> None:
    path = _write(tmp_path, tensors, cfg, hfq)
    with pytest.raises(CheckpointError, match=match):
        load_mtp_checkpoint(path, config)


def test_error_mtp_layer_without_weights(tmp_path) -> None:
    tensors, cfg, _ = _tensors()
    target_only = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    _expect_error(
        tmp_path,
        target_only,
        cfg,
        r"MTP layer mtp\.0 \(model layer 2\): no weights in the checkpoint \(no mtp\.0\.\* "
        r"tensors\)\. .* quantized without the MTP "
        r"layers",
    )


def test_error_second_mtp_layer_missing(tmp_path) -> None:
    tensors, cfg, _ = _tensors()
    cfg = {**cfg, "num_nextn_predict_layers": 2, "compress_ratios": [0, 0, 0, 0]}
    _expect_error(
        tmp_path,
        tensors,
        cfg,
        r"MTP layer mtp\.1 \(model layer 3\): no weights in the checkpoint \(no mtp\.1\.\*",
    )


@pytest.mark.parametrize(
    "extra",
    [
        "mtp.0.attn.foo.weight",
        "mtp.0.ffn.experts.99.w1.weight",
        "mtp.0.ffn.experts.1.w1.input_scale",
        "mtp.0.wat",
    ],
)
def test_error_unknown_mtp_name(tmp_path, extra: str) -> None:
    tensors, cfg, _ = _tensors()
    tensors[extra] = torch.zeros(1)
    _expect_error(tmp_path, tensors, cfg, f"unknown mtp.* tensor name.*{extra}")


def test_error_missing_tensor(tmp_path) -> None:
    tensors, cfg, _ = _tensors()
    del tensors["mtp.0.attn.q_norm.weight"]
    del tensors["mtp.0.ffn.experts.3.w2.scale"]
    _expect_error(
        tmp_path,
        tensors,
        cfg,
        r"missing tensor\(s\) .*mtp\.0\.attn\.q_norm\.weight, mtp\.0\.ffn\.experts\.3\.w2\.scale",
    )


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        (
            "mtp.0.attn.wq_b.weight",
            torch.zeros(8, 8, dtype=torch.float8_e4m3fn),
            r"mtp\.0\.attn\.wq_b\.weight: expected shape \(512, 128\), got \(8, 8\)",
        ),
        (
            "mtp.0.ffn.experts.2.w2.scale",
            torch.zeros(256, 8, dtype=torch.uint8),
            r"mtp\.0\.ffn\.experts\.2\.w2\.scale: expected shape \(256, 4\), got \(256, 8\)",
        ),
        (
            "mtp.0.hc_attn_fn",
            torch.zeros(24, 1024, dtype=torch.int32),
            r"mtp\.0\.hc_attn_fn: expected dtype float32 or bfloat16 .*got int32",
        ),
        (
            "mtp.0.e_proj.weight",
            torch.zeros(256, 256, dtype=torch.bfloat16),
            r"mtp\.0\.e_proj\.weight: expected dtype float8_e4m3fn \(FP8 weight: it has a \.scale\), got bfloat16",
        ),
        (
            "mtp.0.e_proj.scale",
            torch.zeros(2, 2, dtype=torch.float16),
            r"mtp\.0\.e_proj\.scale: expected dtype .* for an FP8 block scale, got float16",
        ),
        (
            "mtp.0.ffn.experts.1.w1.weight",
            torch.zeros(128, 128, dtype=torch.float32),
            r"mtp\.0\.ffn\.experts\.1\.w1\.weight: expected dtype int8 or uint8",
        ),
        (
            "mtp.0.hc_head_scale",
            torch.ones(3),
            r"mtp\.0\.hc_head_scale: expected shape \(1,\), got \(3,\)",
        ),
    ],
)
def test_error_shape_or_dtype_mismatch_names_the_tensor(tmp_path, name, value, match) -> None:
    tensors, cfg, _ = _tensors()
    tensors[name] = value
    _expect_error(tmp_path, tensors, cfg, match)


def test_error_shape_mismatch_against_a_passed_config(tmp_path) -> None:
    tensors, cfg, _ = _tensors()
    path = _write(tmp_path, tensors, cfg)
    bigger = DSV4Config.from_dir(path).replace(vocab_size=1024)
    with pytest.raises(CheckpointError, match=r"expected shape \(1024, 256\), got \(512, 256\)"):
        load_mtp_checkpoint(path, bigger)


def _nan_e4m3(shape) -> torch.Tensor:
    return torch.full(shape, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("fmt", "name", "poison"),
    [
        (
            "mxfp4",
            "mtp.0.e_proj.scale",
            lambda t: t.view(torch.uint8).clone().fill_(0xFF).view(torch.float8_e8m0fnu),
        ),
        (
            "mxfp4",
            "mtp.0.ffn.experts.6.w3.scale",
            lambda t: (
                t.view(torch.uint8)
                .clone()
                .index_fill_(0, torch.tensor([3]), 0xFF)
                .view(torch.float8_e8m0fnu)
            ),
        ),
        ("fp8", "mtp.0.attn.wo_a.scale", lambda t: t.clone().fill_(float("inf"))),
        ("fp8", "mtp.0.ffn.experts.0.w2.scale", lambda t: t.clone().fill_(float("nan"))),
        ("nvfp4", "mtp.0.ffn.experts.4.w1.weight_scale", lambda t: _nan_e4m3(t.shape)),
        ("nvfp4", "mtp.0.ffn.experts.4.w3.weight_scale_2", lambda t: torch.tensor(float("nan"))),
    ],
)
def test_error_non_finite_scales(tmp_path, fmt, name, poison) -> None:
    tensors, cfg, hfq = _tensors(fmt)
    tensors[name] = poison(tensors[name])
    _expect_error(tmp_path, tensors, cfg, f"{name}: expected finite scales, found", hfq)


def test_error_non_finite_plain_parameter(tmp_path) -> None:
    tensors, cfg, _ = _tensors()
    tensors["mtp.0.hc_ffn_fn"] = tensors["mtp.0.hc_ffn_fn"].clone()
    tensors["mtp.0.hc_ffn_fn"][0, 0] = float("nan")
    _expect_error(
        tmp_path, tensors, cfg, r"mtp\.0\.hc_ffn_fn: expected finite values, found 1 non-finite"
    )


def test_error_shard_missing(tmp_path) -> None:
    tensors, cfg, _ = _tensors()
    path = _write(tmp_path, tensors, cfg, num_shards=3)
    os.remove(os.path.join(path, "model-00002-of-00003.safetensors"))
    with pytest.raises(
        CheckpointError,
        match=r"model-00002-of-00003\.safetensors: listed in model\.safetensors\.index\.json .* but missing",
    ):
        load_mtp_checkpoint(path)


@pytest.mark.parametrize("keep", [4, 100, -1000])
def test_error_shard_truncated(tmp_path, keep: int) -> None:
    tensors, cfg, _ = _tensors()
    path = _write(tmp_path, tensors, cfg)
    shard = os.path.join(path, "model-00001-of-00002.safetensors")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(keep if keep > 0 else size + keep)
    with pytest.raises(
        CheckpointError,
        match=r"model-00001-of-00002\.safetensors: truncated safetensors file: .*file has",
    ):
        load_mtp_checkpoint(path)


def test_error_index_names_a_tensor_its_shard_lacks(tmp_path) -> None:
    tensors, cfg, _ = _tensors()
    path = _write(tmp_path, tensors, cfg)
    with open(os.path.join(path, INDEX_FILE)) as f:
        index = json.load(f)
    index["weight_map"]["mtp.0.ghost"] = "model-00001-of-00002.safetensors"
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump(index, f)
    with pytest.raises(
        CheckpointError, match=r"mtp\.0\.ghost: model\.safetensors\.index\.json says it is in"
    ):
        load_mtp_checkpoint(path)


def test_error_missing_config_json(tmp_path) -> None:
    tensors, _, _ = _tensors()
    path = _write(tmp_path, tensors, None)
    with pytest.raises(CheckpointError, match=r"config\.json: not found in .*pass config="):
        load_mtp_checkpoint(path)
    assert load_mtp_checkpoint(path, DSV4Config.tiny()).expert_formats == ("mxfp4",)


def test_error_not_a_checkpoint_directory(tmp_path) -> None:
    with pytest.raises(
        CheckpointError, match=r"no model\.safetensors\.index\.json or model\.safetensors"
    ):
        load_mtp_checkpoint(tmp_path, DSV4Config.tiny())


@pytest.mark.parametrize("shared", ["embed.weight", "head.weight"])
def test_error_missing_shared_embedding_or_head(tmp_path, shared: str) -> None:
    tensors, cfg, _ = _tensors()
    del tensors[shared]
    _expect_error(tmp_path, tensors, cfg, rf"{shared}: missing; .* shared with the target")


def test_error_fp8_stacking_needs_whole_blocks(tmp_path) -> None:
    c = DSV4Config.tiny().replace(q_lora_rank=64)  # wq_a: 64 rows, half an FP8 block
    tensors, cfg, _ = _tensors(config=c)
    _expect_error(tmp_path, tensors, cfg, r"fused_wqa_wkv: cannot stack FP8 shards .*\[64, 128\]")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp_size": 3}, "tp_size: expected a divisor of num_attention_heads"),
        ({"tp_size": 2, "tp_rank": 2}, "tp_rank"),
        ({"ep_size": 3}, "ep_size: expected a divisor of n_routed_experts"),
        ({"ep_size": 2, "ep_rank": -1}, "ep_rank"),
    ],
)
def test_error_bad_parallel_arguments(tiny_ckpt: str, kwargs, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_mtp_checkpoint(tiny_ckpt, **kwargs)


def test_single_file_checkpoint_loads(tmp_path) -> None:
    from safetensors.torch import save_file

    tensors, cfg, _ = _tensors()
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert load_mtp_checkpoint(tmp_path).expert_formats == ("mxfp4",)


def test_error_fused_shards_of_different_formats(tmp_path) -> None:
    tensors, cfg, _ = _tensors()
    del tensors["mtp.0.attn.wkv.scale"]  # wkv becomes an unquantized weight, wq_a stays FP8
    tensors["mtp.0.attn.wkv.weight"] = torch.zeros(128, 256, dtype=torch.bfloat16)
    _expect_error(
        tmp_path,
        tensors,
        cfg,
        r"fused_wqa_wkv: cannot stack shards of different formats \['fp8_e8m0', 'bf16'\]",
    )


def test_error_no_routed_expert_tensors(tmp_path) -> None:
    tensors, cfg, _ = _tensors()
    tensors = {k: v for k, v in tensors.items() if ".experts." not in k}
    _expect_error(
        tmp_path, tensors, cfg, r"mtp\.0: no routed-expert tensors \(ffn\.experts\.\*\) found"
    )


def test_error_expert_scale_with_an_unquantized_weight(tmp_path) -> None:
    tensors, cfg, _ = _tensors()
    tensors["mtp.0.ffn.experts.0.w1.weight"] = torch.zeros(128, 256, dtype=torch.bfloat16)
    _expect_error(
        tmp_path,
        tensors,
        cfg,
        r"routed experts have \.scale tensors but mtp\.0\.ffn\.experts\.0\.w1\.scale's weight is bfloat16",
    )


def test_error_fp8_experts_need_whole_blocks(tmp_path) -> None:
    tensors, cfg, _ = _tensors("fp8", DSV4Config.tiny().replace(moe_intermediate_size=64))
    for w in ("w1", "w2", "w3"):  # unquantized shared expert: only the routed ones must fail
        p = f"mtp.0.ffn.shared_experts.{w}."
        scale = tensors.pop(p + "scale")
        tensors[p + "weight"] = formats.dequantize_fp8_block(
            tensors[p + "weight"], scale
        ).bfloat16()
    _expect_error(
        tmp_path, tensors, cfg, "cannot stack FP8 w1/w3 block scales: moe_intermediate_size 64"
    )


def test_error_corrupt_header_and_index(tmp_path) -> None:
    tensors, cfg, _ = _tensors()
    path = _write(tmp_path / "a", tensors, cfg)
    shard = os.path.join(path, "model-00002-of-00002.safetensors")
    with open(shard, "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xfe{{{")
    with pytest.raises(
        CheckpointError, match=r"model-00002-of-00002\.safetensors: corrupt safetensors header"
    ):
        load_mtp_checkpoint(path)
    path = _write(tmp_path / "b", tensors, cfg)
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        f.write('{"metadata": {}}')
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors\.index\.json: not a valid safetensors index"
    ):
        load_mtp_checkpoint(path)


def test_fp8_row_slices_must_cover_whole_blocks(tiny_ckpt: str) -> None:
    fused = load_mtp_checkpoint(tiny_ckpt).layers[0].fused_wqa_wkv
    assert fused.rows(128, 128).shape == (128, 256)
    with pytest.raises(
        CheckpointError, match=r"rows \[64, 128\) do not cover whole 128-row FP8 blocks"
    ):
        fused.rows(64, 64)


@pytest.mark.parametrize("with_config", [False, True])
def test_error_checkpoint_path_is_a_file(tiny_ckpt: str, with_config: bool) -> None:
    config_json = os.path.join(tiny_ckpt, "config.json")
    config = DSV4Config.tiny() if with_config else None
    with pytest.raises(
        CheckpointError, match=r"config\.json: is a file, expected the checkpoint directory"
    ):
        load_mtp_checkpoint(config_json, config)
    with pytest.raises(CheckpointError, match=r"nowhere: no such directory"):
        load_mtp_checkpoint(os.path.join(tiny_ckpt, "nowhere"), config)


@pytest.mark.parametrize(
    ("fmt", "drop", "match"),
    [
        (
            "mxfp4",
            lambda n: n == "mtp.0.attn.wq_b.scale",
            r"mtp\.0\.attn\.wq_b\.scale: missing; mtp\.0\.attn\.wq_b\.weight is float8_e4m3fn "
            r"\(an FP8 weight\), which needs its 128x128 block scales",
        ),
        (
            "mxfp4",
            lambda n: ".experts." in n and n.endswith(".scale"),
            r"mtp\.0\.ffn\.experts\.0\.w1\.scale: missing, as for every routed expert of mtp\.0: "
            r"mtp\.0\.ffn\.experts\.0\.w1\.weight is int8 \(quantized\)",
        ),
        (
            "fp8",
            lambda n: ".experts." in n and n.endswith(".scale"),
            r"experts\.0\.w1\.scale: missing, as .*w1\.weight is float8_e4m3fn \(quantized\)",
        ),
        (
            "nvfp4",
            lambda n: n.endswith(".weight_scale_2"),
            r"mtp\.0\.ffn\.experts\.0\.w1\.weight_scale_2: missing, as for every routed expert",
        ),
    ],
    ids=["dense-fp8", "mxfp4-experts", "fp8-experts", "nvfp4-experts"],
)
def test_error_missing_scale_is_named_as_missing(tmp_path, fmt: str, drop, match: str) -> None:
    tensors, cfg, hfq = _tensors(fmt)
    tensors = {k: v for k, v in tensors.items() if not drop(k)}
    _expect_error(tmp_path, tensors, cfg, match, hfq)


@pytest.mark.parametrize("name", ["mtp.0.attn.q_norm.weight", "head.weight"])
def test_error_tensor_in_its_shard_but_not_in_the_index(tmp_path, name: str) -> None:
    tensors, cfg, _ = _tensors()
    path = _write(tmp_path, tensors, cfg)
    with open(os.path.join(path, INDEX_FILE)) as f:
        index = json.load(f)
    shard = index["weight_map"].pop(name)
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump(index, f)
    where = rf"\(in {shard}, but model\.safetensors\.index\.json does not list it\)"
    match = rf"{name}: missing {where}; MTP layer mtp\.0 has no mtp\.0\.{name} either"
    if name.startswith("mtp."):
        match = rf"missing tensor\(s\) for MTP layer mtp\.0 .*: {name} {where}"
    with pytest.raises(CheckpointError, match=match):
        load_mtp_checkpoint(path)


# ----------------------------------------------------------------------------- malformed files
def _rewrite_index(path: str, edit) -> None:
    with open(os.path.join(path, INDEX_FILE)) as f:
        index = json.load(f)
    edit(index)
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump(index, f)


def _first_entry(index: dict) -> str:
    return next(iter(index["weight_map"]))


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda ix: ix.update(weight_map=list(ix["weight_map"])),
            r"index\.json: weight_map: expected an object mapping tensor names to shard file "
            r"names, got list",
        ),
        (
            lambda ix: ix["weight_map"].update({"mtp.0.enorm.weight": None}),
            r"index\.json: weight_map\['mtp\.0\.enorm\.weight'\]: expected a shard file name, "
            r"got None",
        ),
        (
            lambda ix: ix.pop("weight_map"),
            r"index\.json: not a valid safetensors index: expected an object with a "
            r"'weight_map', got no weight_map key",
        ),
    ],
    ids=["weight-map-list", "null-entry", "no-weight-map"],
)
def test_error_malformed_index(tmp_path, edit, match: str) -> None:
    tensors, cfg, _ = _tensors()
    path = _write(tmp_path, tensors, cfg)
    _rewrite_index(path, edit)
    with pytest.raises(CheckpointError, match=match):
        load_mtp_checkpoint(path)


def _write_raw_shard(path: str, header: object, data: bytes) -> None:
    """A safetensors file with a hand-written header (defects safetensors' writer cannot make)."""
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob + data)


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (
            {"mtp.0.enorm.weight": {"dtype": "BF16", "data_offsets": [0, 512]}},
            r"tensor mtp\.0\.enorm\.weight: header entry 'shape': expected a list of "
            r"non-negative ints, got None",
        ),
        (
            {"mtp.0.enorm.weight": {"dtype": "BF16", "shape": [256], "data_offsets": [0]}},
            r"header entry 'data_offsets': expected \[begin, end\] with 0 <= begin <= end, "
            r"got \[0\]",
        ),
        (
            {"mtp.0.enorm.weight": {"dtype": "BF16", "shape": [300], "data_offsets": [0, 512]}},
            r"header says shape \(300,\) of bfloat16 \(600 bytes\) but data_offsets \[0, 512\] "
            r"span 512 bytes",
        ),
        (
            {"mtp.0.enorm.weight": [256]},
            r"header entry must be an object with dtype, shape and data_offsets, got list",
        ),
        (["mtp.0.enorm.weight"], r"corrupt safetensors header: expected a JSON object, got list"),
        (
            {
                "mtp.0.enorm.weight": {"dtype": "BF16", "shape": [256], "data_offsets": [0, 512]},
                "mtp.0.hnorm.weight": {"dtype": "BF16", "shape": [256], "data_offsets": [0, 512]},
            },
            r"model-00003-of-00003\.safetensors: (tensor mtp\.0\.[eh]norm\.weight: )?cannot "
            r"(open|read) it \(.*invalid offset",
        ),
    ],
    ids=["no-shape", "short-offsets", "size-mismatch", "entry-not-object", "not-object", "overlap"],
)
def test_error_malformed_shard_header(tmp_path, header, match: str) -> None:
    tensors, cfg, _ = _tensors()
    for name in ("mtp.0.enorm.weight", "mtp.0.hnorm.weight"):
        tensors.pop(name)
    path = _write(tmp_path, tensors, cfg)
    shard = "model-00003-of-00003.safetensors"
    _write_raw_shard(os.path.join(path, shard), header, bytes(512))
    _rewrite_index(
        path,
        lambda ix: ix["weight_map"].update(dict.fromkeys(["mtp.0.enorm.weight"], shard)),
    )
    if isinstance(header, dict) and "mtp.0.hnorm.weight" in header:
        _rewrite_index(path, lambda ix: ix["weight_map"].update({"mtp.0.hnorm.weight": shard}))
    with pytest.raises(CheckpointError, match=match):
        load_mtp_checkpoint(path)


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "symlink"])
def test_error_shard_path_outside_the_checkpoint(tmp_path, kind: str) -> None:
    tensors, cfg, _ = _tensors()
    path = _write(tmp_path / "ck", tensors, cfg)
    shard = "model-00002-of-00002.safetensors"
    outside = tmp_path / "outside.safetensors"
    os.replace(os.path.join(path, shard), outside)  # a valid shard, but outside the directory
    entry = {"absolute": str(outside), "dotdot": "../outside.safetensors", "symlink": shard}[kind]
    if kind == "symlink":
        os.symlink(outside, os.path.join(path, shard))
    else:
        _rewrite_index(
            path,
            lambda ix: ix["weight_map"].update(
                {n: entry for n, s in ix["weight_map"].items() if s == shard}
            ),
        )
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors\.index\.json: weight_map\['[^']+'\] = '"
        + re.escape(entry)
        + r"': the shard path leads outside the checkpoint directory",
    ):
        load_mtp_checkpoint(path)


def test_a_symlinked_shard_inside_the_checkpoint_loads(tmp_path) -> None:
    tensors, cfg, _ = _tensors()
    path = _write(tmp_path / "ck", tensors, cfg)
    shard = "model-00002-of-00002.safetensors"
    os.makedirs(os.path.join(path, "blobs"))
    os.replace(os.path.join(path, shard), os.path.join(path, "blobs", "x"))
    os.symlink(os.path.join(path, "blobs", "x"), os.path.join(path, shard))  # as HF caches do
    assert load_mtp_checkpoint(path).expert_formats == ("mxfp4",)


def test_error_bad_hf_quant_config_and_writer_arguments(tmp_path) -> None:
    tensors, cfg, _ = _tensors()
    path = _write(tmp_path / "ck", tensors, cfg)
    with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match=r"hf_quant_config\.json: not valid JSON"):
        load_mtp_checkpoint(path, DSV4Config.tiny())
    with pytest.raises(ConfigError, match=r"num_shards: expected >= 1, got 0"):
        write_sharded_checkpoint(tmp_path / "w", tensors, cfg, num_shards=0)
