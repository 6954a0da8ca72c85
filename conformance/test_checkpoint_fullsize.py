"""Real-size random checkpoints (``dsv4mtp.checkpoint.fullsize``, ``dsv4-mtp make-checkpoint``).

On the CPU at the tiny config: the directory loads with the project's loader in every expert
format, its index and shards are consistent and stay inside the directory and within
``shard_mb``, the bytes are a function of the seed, no stored code is a NaN pattern, decoded
weights have the schema's magnitude and the reference layer drafts finite logits from it.  The
V4-Flash plan is checked against the release's tensor count and shapes without writing it; the
gpu test writes and loads it for real.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from dsv4mtp.checkpoint.fullsize import (
    FULLSIZE_FORMATS,
    GENERATOR_FILE,
    SHARD_UNIT,
    make_fullsize_checkpoint,
    plan_fullsize_checkpoint,
)
from dsv4mtp.checkpoint.io import INDEX_FILE, read_safetensors_header
from dsv4mtp.reference import (
    ConfigError,
    DSV4Config,
    MTPLayer,
    fold_nvfp4_experts,
    load_mtp_checkpoint,
    make_synthetic_checkpoint,
)
from dsv4mtp.tools.cli import main as cli

TINY = DSV4Config.tiny()
SHARD_MB = 0.4  # the tiny checkpoint is about 1.7 MB: several shards
DETECTED = {"mxfp4": "mxfp4", "nvfp4": "nvfp4", "fp8": "fp8_f32"}


def _index(path: str) -> dict:
    with open(os.path.join(path, INDEX_FILE)) as f:
        return json.load(f)


def _read_all(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, shard in _index(path)["weight_map"].items():
        with safe_open(os.path.join(path, shard), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _sha(path: str) -> dict[str, str]:
    return {
        f: hashlib.sha256(open(os.path.join(path, f), "rb").read()).hexdigest()
        for f in sorted(os.listdir(path))
    }


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    out = {}
    for fmt in FULLSIZE_FORMATS:
        path = str(tmp_path_factory.mktemp(f"fullsize-{fmt}"))
        make_fullsize_checkpoint(path, "tiny", expert_format=fmt, shard_mb=SHARD_MB, seed=3)
        out[fmt] = path
    return out


@pytest.mark.parametrize("fmt", FULLSIZE_FORMATS)
def test_loads_with_the_project_loader(ckpts, tmp_path, fmt: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the format the config claims is the one present
        ck = load_mtp_checkpoint(ckpts[fmt])  # value scan on: no NaN code, no bad scale
    assert ck.expert_formats == (DETECTED[fmt],)
    assert ck.embed_source == "embed.weight" and ck.layers[0].head_source == "head.weight"
    assert set(ck.loaded) == set(_index(ckpts[fmt])["weight_map"])  # every tensor consumed
    # The same names, dtypes and shapes as the quantizer-made synthetic checkpoint.
    syn = make_synthetic_checkpoint(tmp_path, TINY, expert_format=fmt)
    want = {
        n: (t.dtype, t.shape)
        for n, t in _read_all(syn).items()
        if n.startswith("mtp.") or n in ("embed.weight", "head.weight")
    }
    got = {n: (t.dtype, t.shape) for n, t in _read_all(ckpts[fmt]).items()}
    assert got == want


@pytest.mark.parametrize("fmt", FULLSIZE_FORMATS)
def test_index_shards_and_paths(ckpts, fmt: str) -> None:
    path = ckpts[fmt]
    index = _index(path)
    weight_map = index["weight_map"]
    files = sorted(set(weight_map.values()))
    n = len(files)
    assert n >= 3
    assert files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert sorted(os.listdir(path)) == sorted(
        [
            *files,
            INDEX_FILE,
            "config.json",
            GENERATOR_FILE,
            *(["hf_quant_config.json"] if fmt == "nvfp4" else []),
        ]
    )
    root = os.path.realpath(path)
    total = 0
    for shard in files:
        real = os.path.realpath(os.path.join(path, shard))
        assert os.path.dirname(real) == root and os.path.isfile(real)
        header = read_safetensors_header(real)
        assert set(header) == {k for k, v in weight_map.items() if v == shard}
        data = sum(torch.empty(info.shape, dtype=info.dtype).nbytes for info in header.values())
        assert data <= SHARD_MB * SHARD_UNIT or len(header) == 1
        total += data
    assert index["metadata"]["total_size"] == total


def test_same_seed_same_bytes(ckpts, tmp_path) -> None:
    a, b, c = (str(tmp_path / s) for s in "abc")
    make_fullsize_checkpoint(a, "tiny", expert_format="nvfp4", shard_mb=SHARD_MB, seed=3)
    assert _sha(a) == _sha(ckpts["nvfp4"])  # every file, index and config included
    # Another sharding: other files, the same tensors.
    make_fullsize_checkpoint(b, "tiny", expert_format="nvfp4", shard_mb=100, seed=3)
    ta, tb = _read_all(a), _read_all(b)
    assert (
        len(_index(b)["weight_map"]) == len(ta) and len(set(_index(b)["weight_map"].values())) == 1
    )
    for name, t in ta.items():
        assert torch.equal(_u8(t), _u8(tb[name])), name
    make_fullsize_checkpoint(c, "tiny", expert_format="nvfp4", shard_mb=SHARD_MB, seed=4)
    tc = _read_all(c)
    drawn = [n for n, t in ta.items() if t.numel() > 64]
    assert all(not torch.equal(_u8(ta[n]), _u8(tc[n])) for n in drawn)


@pytest.mark.parametrize("fmt", FULLSIZE_FORMATS)
def test_codes_hold_no_nan_patterns(ckpts, fmt: str) -> None:
    seen_e4m3 = torch.zeros(256, dtype=torch.bool)
    for name, t in _read_all(ckpts[fmt]).items():
        if t.dtype == torch.float8_e4m3fn:
            b = t.view(torch.uint8)
            assert not ((b & 0x7F) == 0x7F).any(), name  # e4m3 NaN: 0x7F, 0xFF
            if name.endswith(".weight_scale"):
                assert not (b & 0x80).any(), name  # NVFP4 block scales are positive
            else:
                seen_e4m3[b.flatten().long()] = True
        elif t.dtype == torch.float8_e8m0fnu:
            assert not (t.view(torch.uint8) == 0xFF).any(), name
        elif t.is_floating_point():
            assert torch.isfinite(t).all(), name
            if name.endswith("scale") or name.endswith(("scale_2", "input_scale")):
                assert (t > 0).all(), name
    # FP8 weights use every non-NaN code (uniform bytes), both signs.
    assert int(seen_e4m3.sum()) == 254


@pytest.mark.parametrize("fmt", FULLSIZE_FORMATS)
def test_decoded_weights_have_the_schema_magnitude(ckpts, fmt: str) -> None:
    """Dense linears and routed experts: std about 1/sqrt(fan_in) (the init rule).

    A tiny linear has a few 128x128 blocks, each with one of three scales: one tensor's std may
    be off by 2.6x; pooled over the dense linears it is within 1.5x."""
    layer = load_mtp_checkpoint(ckpts[fmt]).layers[0]
    ratios = []
    for field in (
        "e_proj",
        "h_proj",
        "wq_a",
        "wkv",
        "wq_b",
        "wo_a",
        "wo_b",
        "shared_w1",
        "shared_w2",
    ):
        w = getattr(layer, field).dequantize()
        ratios.append(float(w.std()) * w.shape[1] ** 0.5)
        assert 0.3 < ratios[-1] < 3.0, (field, ratios[-1])
    pooled = (sum(r * r for r in ratios) / len(ratios)) ** 0.5
    assert 0.67 < pooled < 1.5, pooled
    gate_up, down = [], []
    for e in range(TINY.n_routed_experts):
        w13, w2 = layer.experts.dequantize_expert(e)
        gate_up.append(w13)
        down.append(w2)
    for ws, k in ((gate_up, TINY.hidden_size), (down, TINY.moe_intermediate_size)):
        ratio = float(torch.stack(ws).std()) * k**0.5
        assert 0.5 < ratio < 2.0, ratio


@pytest.mark.parametrize("fmt", FULLSIZE_FORMATS)
def test_reference_layer_drafts_finite_logits(ckpts, fmt: str) -> None:
    layer = MTPLayer.from_checkpoint(ckpts[fmt], dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    T = 12
    ids = torch.randint(0, TINY.vocab_size, (T,), generator=g)
    prev = torch.randn(T, TINY.hc_dim, generator=g)
    drafts, logits = layer.draft(ids, torch.arange(T) + 3, prev, num_tokens=2, return_logits=True)
    assert drafts.shape == (1, 2)
    assert torch.isfinite(logits).all()
    assert float(logits.std()) > 0


def test_nvfp4_gate_up_fold_is_exact(ckpts) -> None:
    experts = load_mtp_checkpoint(ckpts["nvfp4"]).layers[0].experts
    folded = fold_nvfp4_experts(experts)  # raises FoldError when a pair does not fold
    for e in range(TINY.n_routed_experts):
        assert torch.equal(folded.dequantize_expert(e)[0], experts.dequantize_expert(e)[0])


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"expert_format": "bf16"}, "expert_format"),
        ({"shard_mb": 0}, "shard_mb"),
        ({"shard_mb": float("nan")}, "shard_mb"),
        ({"shard_mb": "4000"}, "shard_mb"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"device": "tpu"}, "device"),
        ({"config": "nope"}, "config"),
        ({"config": 3}, "config"),
    ],
)
def test_bad_arguments_name_the_argument(tmp_path, kwargs: dict, fragment: str) -> None:
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=rf"^{fragment}:"):
        make_fullsize_checkpoint(out, **{"config": "tiny", **kwargs})
    assert not out.exists()  # refused before writing anything


def test_cuda_without_cuda_names_the_device(tmp_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: 'cuda' is a valid device")
    with pytest.raises(ConfigError, match=r"^device:.*CUDA is not available"):
        make_fullsize_checkpoint(tmp_path / "out", "tiny", device="cuda")


def test_out_must_be_new_or_empty(ckpts, tmp_path) -> None:
    before = _sha(ckpts["mxfp4"])
    with pytest.raises(ConfigError, match=r"^out: .* is not empty"):
        make_fullsize_checkpoint(ckpts["mxfp4"], "tiny")
    assert _sha(ckpts["mxfp4"]) == before  # nothing overwritten
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"^out: .* is a file"):
        make_fullsize_checkpoint(f, "tiny")
    empty = tmp_path / "empty"
    empty.mkdir()
    make_fullsize_checkpoint(empty, "tiny", shard_mb=SHARD_MB, seed=3)
    assert _sha(str(empty)) == before


def test_config_from_a_json_file(tmp_path) -> None:
    cfg = TINY.replace(n_routed_experts=4).to_hf_config()
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    out = tmp_path / "ck"
    make_fullsize_checkpoint(out, str(p), expert_format="fp8")
    assert load_mtp_checkpoint(out).layers[0].experts.num_experts == 4
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match=r"^config: .*bad.json: not a readable JSON"):
        make_fullsize_checkpoint(tmp_path / "ck2", str(bad))


@pytest.mark.parametrize("fmt", FULLSIZE_FORMATS)
def test_v4_flash_plan_matches_the_release(tmp_path, fmt: str) -> None:
    """At V4-Flash shapes (planned, not written): 1575 mtp.0 tensors (NVFP4: 4 per projection
    instead of 2), the release's expert shapes, 4 GB shards."""
    flash = DSV4Config.flash()
    plan = {t.name: t for t in plan_fullsize_checkpoint(flash, fmt)}
    per_proj = 4 if fmt == "nvfp4" else 2
    assert len([n for n in plan if n.startswith("mtp.0.")]) == 39 + 256 * 3 * per_proj
    assert plan["embed.weight"].shape == plan["head.weight"].shape == (129280, 4096)
    if fmt == "mxfp4":
        w1, s1 = plan["mtp.0.ffn.experts.7.w1.weight"], plan["mtp.0.ffn.experts.7.w1.scale"]
        w2, s2 = plan["mtp.0.ffn.experts.7.w2.weight"], plan["mtp.0.ffn.experts.7.w2.scale"]
        assert (w1.dtype, w1.shape, s1.dtype, s1.shape) == (
            torch.int8, (2048, 2048), torch.float8_e8m0fnu, (2048, 128)
        )  # fmt: skip
        assert (w2.shape, s2.shape) == ((4096, 1024), (4096, 64))
        assert sum(t.nbytes for t in plan.values()) == 5_711_911_276
    report = make_fullsize_checkpoint(tmp_path / "x", flash, expert_format=fmt, dry_run=True)
    assert not (tmp_path / "x").exists()
    assert all(s.data_bytes <= 4000 * SHARD_UNIT for s in report.shards)
    assert report.num_tensors == len(plan)


def test_cli_make_checkpoint(tmp_path) -> None:
    runner = CliRunner()
    out = tmp_path / "ck"
    args = ["make-checkpoint", "--config", "tiny", "--out", str(out), "--device", "cpu"]
    res = runner.invoke(cli, [*args, "--expert-format", "nvfp4", "--shard-mb", "0.4", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["num_tensors"] == len(_index(str(out))["weight_map"])
    assert report["total_bytes"] == sum(os.path.getsize(out / s["file"]) for s in report["shards"])
    load_mtp_checkpoint(out)
    res = runner.invoke(cli, args)  # not empty now
    assert res.exit_code == 1
    assert re.fullmatch(r"Error: out: .* is not empty.*\n", res.output)
    res = runner.invoke(cli, [*args[:-4], "--out", str(tmp_path / "y"), "--shard-mb", "-1"])
    assert res.exit_code == 1 and res.output.startswith("Error: shard_mb:")
    assert not (tmp_path / "y").exists()


@pytest.mark.gpu
@pytest.mark.slow
def test_v4_flash_written_on_the_gpu_loads_and_drafts(tmp_path) -> None:
    """5.7 GB written with the CUDA generator, loaded by the reference on the GPU, one draft."""
    if shutil.disk_usage(tmp_path).free < 12e9:
        pytest.skip("needs 12 GB free in the temp dir for a V4-Flash checkpoint")
    report = make_fullsize_checkpoint(tmp_path / "ck", "flash", device="cuda", seed=1)
    assert report.total_bytes > 5.7e9 and len(report.shards) == 2
    layer = MTPLayer.from_checkpoint(tmp_path / "ck", dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(0)
    T = 8
    ids = torch.randint(0, 129280, (T,), generator=g).cuda()
    prev = torch.randn(T, 4 * 4096, generator=g).to("cuda", torch.bfloat16)
    _, logits = layer.draft(ids, torch.arange(T).cuda(), prev, num_tokens=2, return_logits=True)
    assert torch.isfinite(logits).all()
