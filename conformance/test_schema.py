"""The parameter table agrees with every consumer: the synthetic writer, the loader, the loaded
object's fields, the dense parameter containers, and vLLM's names (``remap_mtp_weight_name``)."""

from __future__ import annotations

import dataclasses

import pytest

from dsv4mtp.checkpoint.load import expected_layer_tensors, expected_linear_shapes
from dsv4mtp.checkpoint.schema import EMBED, EXPERT_WEIGHTS, MTP_LAYER_PARAMS, expert_shape
from dsv4mtp.checkpoint.synthetic import EXPERT_FORMATS, synthetic_checkpoint_tensors
from dsv4mtp.params import AttentionParams, MoEParams, MTPLayerParams
from dsv4mtp.reference import (
    DSV4Config,
    MTPLayerWeights,
    load_mtp_checkpoint,
    make_synthetic_checkpoint,
    remap_mtp_weight_name,
)

TINY = DSV4Config.tiny()
FLASH = DSV4Config.flash()
LOADED_FORMAT = {"mxfp4": "mxfp4", "nvfp4": "nvfp4", "fp8": "fp8_f32", "bf16": "bf16"}
LINEAR_SUFFIXES = (".weight", ".scale")


def _row_of(rel: str) -> str:
    """The table name a checkpoint name (relative to ``mtp.{i}.``) belongs to."""
    if rel.startswith("ffn.experts."):
        return "ffn.experts"
    for suffix in LINEAR_SUFFIXES:
        base = rel.removesuffix(suffix)
        if base != rel and base in expected_linear_shapes(TINY):
            return base
    return rel


@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_table_covers_the_writer_and_the_loader(fmt: str) -> None:
    tensors, _, _ = synthetic_checkpoint_tensors(TINY, expert_format=fmt)
    written = {n.removeprefix("mtp.0."): t for n, t in tensors.items() if n.startswith("mtp.0.")}
    rows = {_row_of(rel) for rel in written}
    layer_rows = {s.name for s in MTP_LAYER_PARAMS if s.kind != "shared"}
    assert rows == layer_rows  # every written tensor has a row; every own row is written
    linear_formats = dict.fromkeys(
        expected_linear_shapes(TINY), "fp8_f32" if fmt == "fp8" else "fp8_e8m0"
    )
    expected = expected_layer_tensors(
        TINY, linear_formats, LOADED_FORMAT[fmt], has_input_scale=fmt == "nvfp4"
    )
    assert set(expected) == set(written)
    for rel, t in written.items():
        spec = next(s for s in MTP_LAYER_PARAMS if s.name == _row_of(rel))
        if spec.kind in ("plain", "mhc"):
            assert tuple(t.shape) == spec.shape(TINY), rel
    assert {EMBED.target, "head.weight"} <= set(tensors)


def test_every_layer_field_appears_once() -> None:
    fields = [f.name for f in dataclasses.fields(MTPLayerWeights)]
    table = [s.field for s in MTP_LAYER_PARAMS]
    assert len(set(table)) == len(table)
    assert [f for f in fields if f not in ("index", "layer_id", "head_source")] == table


def test_every_dense_param_appears_once() -> None:
    def tensors(cls: type, skip: tuple[str, ...] = ()) -> set[str]:
        return {f.name for f in dataclasses.fields(cls) if f.name not in skip}

    want = {
        *(tensors(MTPLayerParams, ("attn", "ffn", "dense_quantized"))),
        *(f"attn.{n}" for n in tensors(AttentionParams)),
        # shared_fp8: the same checkpoint tensors as shared_w*, kept packed (not a table row).
        *(f"ffn.{n}" for n in tensors(MoEParams, ("shared_quantized", "shared_fp8"))),
    }
    params = [s.param for s in MTP_LAYER_PARAMS]
    assert len(set(params)) == len(params) and set(params) == want


# Logical shapes of the official V4-Flash mtp.0 tensors (config.json sizes: D 4096, n 4, H 64,
# Dh 512, Rq 1024, G 8, Ro 1024, E 256, I 2048, V 129280).
FLASH_SHAPES = {
    "enorm.weight": (4096,),
    "hc_head_fn": (4, 16384),
    "hc_head_scale": (1,),
    "hc_attn_fn": (24, 16384),
    "hc_ffn_base": (24,),
    "hc_ffn_scale": (3,),
    "e_proj": (4096, 4096),
    "attn.wq_a": (1024, 4096),
    "attn.wkv": (512, 4096),
    "attn.wq_b": (32768, 1024),
    "attn.wo_a": (8192, 4096),
    "attn.wo_b": (4096, 8192),
    "ffn.shared_experts.w1": (2048, 4096),
    "ffn.shared_experts.w2": (4096, 2048),
    "attn.q_norm.weight": (1024,),
    "attn.kv_norm.weight": (512,),
    "attn.attn_sink": (64,),
    "ffn.gate.weight": (256, 4096),
    "ffn.gate.bias": (256,),
    "ffn.experts": (256,),
    "head.weight": (129280, 4096),
}


def test_shapes_agree_with_flash_and_the_loaded_tiny_layer(tmp_path) -> None:
    by_name = {s.name: s for s in MTP_LAYER_PARAMS}
    for name, shape in FLASH_SHAPES.items():
        assert by_name[name].shape(FLASH) == shape, name
    assert [expert_shape(FLASH, w) for w in EXPERT_WEIGHTS] == [
        (2048, 4096),
        (4096, 2048),
        (2048, 4096),
    ]
    layer = load_mtp_checkpoint(make_synthetic_checkpoint(tmp_path, TINY)).layers[0]
    for spec in MTP_LAYER_PARAMS:
        value = getattr(layer, spec.field)
        shape = (value.num_experts,) if spec.kind == "experts" else tuple(value.shape)
        assert shape == spec.shape(TINY), spec.name


def test_vllm_names_of_the_table_match_the_state_dict(tmp_path) -> None:
    """Names only for Flash (no tensors): every table name remaps, and the remapped names are the
    loaded layer's state_dict keys (tiny, shifted to Flash's layer id)."""
    mapped = set()
    for spec in MTP_LAYER_PARAMS:
        if spec.kind == "linear":
            rels = [spec.name + s for s in LINEAR_SUFFIXES]
        elif spec.kind == "experts":
            rels = [
                f"ffn.experts.{e}.{w}.{s}"
                for e in range(FLASH.n_routed_experts)
                for w in EXPERT_WEIGHTS
                for s in ("weight", "scale")
            ]
        else:
            rels = [spec.name]
        for rel in rels:
            got = remap_mtp_weight_name(f"mtp.0.{rel}", FLASH)
            assert got is not None, rel
            mapped.add(got.param_name)
    layer = load_mtp_checkpoint(make_synthetic_checkpoint(tmp_path, TINY)).layers[0]
    shift = f"model.layers.{FLASH.num_hidden_layers}."
    keys = {k.replace(f"model.layers.{layer.layer_id}.", shift) for k in layer.state_dict()}
    assert mapped == keys
