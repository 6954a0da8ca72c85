"""Real-size checkpoints with random codes and scales drawn directly on a device.

:mod:`.synthetic` draws float weights and quantizes them with the reference quantizers, which is
exact but far too slow for a V4-Flash layer (256 experts x 3 projections, 5.7 GB with the
embedding and head).  This writer skips the quantizers: every stored tensor is drawn in its
stored form with torch's RNG on the chosen device (``cuda`` or ``cpu``), so writing costs about
one pass of RNG plus the device-to-host copy and the file write.  It is for measuring load time
and memory at real size and for running the layer on real shapes, not for numerics: a layer
loaded from it has sane magnitudes and finite outputs, nothing more.

Layout (``docs/semantics.md``, "Checkpoint names and layout"): ``config.json`` with real field
names, ``model.safetensors.index.json``, shards ``model-{k:05d}-of-{n:05d}.safetensors`` filled in
order up to ``shard_mb`` megabytes (10^6 bytes) of tensor data each (one tensor larger than
that gets a shard of its own), holding the target's ``embed.weight`` and ``head.weight`` and
every tensor of every MTP layer that :data:`~.schema.MTP_LAYER_PARAMS` lists, formats as in the
release (dense linears FP8 with e8m0 block scales, or float32 scales for ``expert_format="fp8"``
like V4-Flash-Base; routed experts MXFP4, NVFP4 or FP8; config and ``hf_quant_config.json`` as
:func:`~.synthetic.make_synthetic_checkpoint` writes them), and ``fullsize.json`` with the
arguments that made it.  The index is written last, so an
interrupted run leaves a directory the loader refuses.

What is drawn (bytes uniform over the allowed set unless said otherwise):

* FP8 weights: the 254 e4m3 codes that are not NaN (0x7F and 0xFF never appear);
* packed FP4 weights: all 256 bytes (every e2m1 code is finite);
* e8m0 scales: three consecutive bytes around the exponent that gives the decoded weight the
  standard deviation 1/sqrt(fan_in) of the schema's init rule (never 0xFF; at V4-Flash 2^-12 to
  2^-14 for FP8 weights, 2^-7 or 2^-8 for FP4); float32 scales (Flash-Base): 2^u times the same centre, u uniform in
  [-1, 1];
* NVFP4 block scales: e4m3 bytes 0x68..0x7E (64 to 448, positive, as ModelOpt's amax-based
  scales are); ``weight_scale_2`` set so the decoded std is 1/sqrt(fan_in), equal for the w1/w3
  pair of an expert (one joint amax, as ModelOpt exports it; the gate/up fold is then exact);
  ``input_scale`` 1/2688;
* norms, ``hc_*``, attention sink, router, embedding and head: the schema's :class:`~.schema.Init`
  rule, drawn in float32 on the device and cast.

Determinism: each tensor has its own generator, seeded from ``(seed, tensor name)``, so its bytes
do not depend on the order of writing or on ``shard_mb``.  The bytes do depend on the device:
the CPU and CUDA generators are different algorithms.

Memory: tensors are drawn on the device one at a time and copied to the host; one shard's
tensors are held on the host, written with ``safetensors.save_file`` (which writes from the
tensors' memory without another copy) and freed.  Peak host memory is about one shard plus the
largest tensor's float32 draw on ``cpu``; peak device memory is the largest single draw
(``embed.weight`` / ``head.weight`` as float32 before the cast: 2.1 GB at V4-Flash).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import save_file

from dsv4mtp import formats
from dsv4mtp.checkpoint.io import INDEX_FILE
from dsv4mtp.checkpoint.schema import (
    EMBED,
    EXPERT_WEIGHTS,
    MTP_LAYER_PARAMS,
    Init,
    ParamSpec,
    expert_shape,
    shared_params,
)
from dsv4mtp.checkpoint.synthetic import _checkpoint_config
from dsv4mtp.checkpoint.weights import FP8_BLOCK
from dsv4mtp.checks import check_device_arg
from dsv4mtp.config import DSV4Config
from dsv4mtp.errors import ConfigError

__all__ = [
    "FULLSIZE_FORMATS",
    "GENERATOR_FILE",
    "FullsizeReport",
    "PlannedTensor",
    "ShardReport",
    "make_fullsize_checkpoint",
    "plan_fullsize_checkpoint",
    "resolve_config",
    "shard_plan",
]

FULLSIZE_FORMATS = ("mxfp4", "nvfp4", "fp8")
SHARD_UNIT = 10**6  # shard_mb counts megabytes, like a "4GB" max_shard_size
GENERATOR = "dsv4mtp.checkpoint.fullsize"
GENERATOR_FILE = "fullsize.json"  # the generator's arguments; the loader ignores the file

# RMS of the decoded code when every allowed byte is equally likely: the scales divide it out.
_E4M3_CODES = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
_E4M3_RMS = float(formats.decode_e4m3(_E4M3_CODES).square().mean().sqrt())  # about 101
_E2M1_RMS = math.sqrt(sum(v * v for v in formats.E2M1_VALUES) / 16)  # 2.93
# NVFP4 block scales: positive e4m3 bytes 0x68 (64) .. 0x7E (448).
_NVFP4_BLOCK_BYTES = (0x68, 0x7E)
_NVFP4_BLOCK_RMS = float(
    formats.decode_e4m3(
        torch.arange(_NVFP4_BLOCK_BYTES[0], _NVFP4_BLOCK_BYTES[1] + 1).to(torch.uint8)
    )
    .square()
    .mean()
    .sqrt()
)
# e8m0 bytes are drawn from {k - 1, k, k + 1}: mean of 2^(2d) over d in {-1, 0, 1} is 1.75.
_E8M0_SPREAD_RMS = math.sqrt((0.25 + 1 + 4) / 3)
_NVFP4_INPUT_SCALE = 1.0 / formats.NVFP4_SCALE_2_DIVISOR


@dataclass(frozen=True)
class PlannedTensor:
    """One stored tensor: name, stored dtype and shape, and how its bytes are drawn.

    ``rule``: ``init`` (``mean``, ``std`` as :class:`~.schema.Init`, cast to ``dtype``),
    ``e4m3`` / ``fp4`` (uniform codes), ``e8m0`` (bytes ``center - 1 .. center + 1``),
    ``f32_scale`` (2^(center - 127 + u), u ~ U[-1, 1]), ``nvfp4_block`` (e4m3 bytes 0x68..0x7E),
    ``const`` (every element ``mean``).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    rule: str
    mean: float = 0.0
    std: float = 0.0
    center: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class ShardReport:
    file: str
    tensors: int
    data_bytes: int  # tensor data, what shard_mb bounds
    file_bytes: int  # on disk: + the safetensors header (0 for a dry run)


@dataclass
class FullsizeReport:
    """What :func:`make_fullsize_checkpoint` wrote and how long it took (seconds)."""

    path: str
    config: str
    expert_format: str
    device: str
    seed: int
    shard_mb: float
    shards: list[ShardReport] = field(default_factory=list)
    draw_s: float = 0.0  # RNG on the device + copy to the host
    write_s: float = 0.0  # save_file
    wall_s: float = 0.0
    dry_run: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(s.file_bytes if not self.dry_run else s.data_bytes for s in self.shards)

    @property
    def num_tensors(self) -> int:
        return sum(s.tensors for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "config": self.config,
            "expert_format": self.expert_format,
            "device": self.device,
            "seed": self.seed,
            "shard_mb": self.shard_mb,
            "dry_run": self.dry_run,
            "num_tensors": self.num_tensors,
            "total_bytes": self.total_bytes,
            "draw_s": self.draw_s,
            "write_s": self.write_s,
            "wall_s": self.wall_s,
            "shards": [vars(s) for s in self.shards],
        }


# ----------------------------------------------------------------------------- arguments
def resolve_config(config: str | DSV4Config) -> DSV4Config:
    """``flash``, ``pro``, ``tiny``, a ``config.json`` path or a directory holding one."""
    if isinstance(config, DSV4Config):
        return config
    if not isinstance(config, str):
        raise ConfigError(
            f"config: expected 'flash', 'pro', 'tiny' or a config.json path, got "
            f"{type(config).__name__}"
        )
    presets: dict[str, Callable[[], DSV4Config]] = {
        "flash": DSV4Config.flash,
        "pro": DSV4Config.pro,
        "tiny": DSV4Config.tiny,
    }
    if config in presets:
        return presets[config]()
    if os.path.isdir(config):
        return DSV4Config.from_dir(config)
    if os.path.isfile(config):
        try:
            with open(config, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"config: {config}: not a readable JSON file ({e})") from e
        return DSV4Config.from_hf_config(raw)
    raise ConfigError(
        f"config: expected 'flash', 'pro', 'tiny' or a config.json path, got {config!r} "
        f"(no such file)"
    )


def _check_args(expert_format: Any, shard_mb: Any, seed: Any) -> None:
    if expert_format not in FULLSIZE_FORMATS:
        raise ConfigError(
            f"expert_format: expected one of {FULLSIZE_FORMATS}, got {expert_format!r}"
        )
    if isinstance(shard_mb, bool) or not isinstance(shard_mb, (int, float)):
        raise ConfigError(f"shard_mb: expected a number of megabytes > 0, got {shard_mb!r}")
    if not (math.isfinite(shard_mb) and shard_mb > 0):
        raise ConfigError(f"shard_mb: expected a number of megabytes > 0, got {shard_mb!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ConfigError(f"seed: expected an int in [0, 2^63), got {seed!r}")


# ----------------------------------------------------------------------------- the plan
def _e8m0_center(target_std: float, code_rms: float) -> int:
    """The e8m0 byte whose scale, spread over three bytes, gives codes of RMS ``code_rms`` the
    RMS ``target_std``."""
    return formats.E8M0_BIAS + round(math.log2(target_std / (code_rms * _E8M0_SPREAD_RMS)))


def _fp8_linear(name: str, n: int, k: int, float32_scales: bool) -> list[PlannedTensor]:
    """``name.weight`` e4m3 (n, k) + ``name.scale`` (ceil(n/128), ceil(k/128))."""
    center = _e8m0_center(k**-0.5, _E4M3_RMS)
    blocks = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
    scale = (
        PlannedTensor(f"{name}.scale", torch.float32, blocks, "f32_scale", center=center)
        if float32_scales
        else PlannedTensor(f"{name}.scale", torch.float8_e8m0fnu, blocks, "e8m0", center=center)
    )
    return [PlannedTensor(f"{name}.weight", torch.float8_e4m3fn, (n, k), "e4m3"), scale]


def _expert(name: str, n: int, k: int, expert_format: str) -> list[PlannedTensor]:
    """One routed-expert projection ``name`` of logical shape (n, k) in ``expert_format``."""
    if expert_format == "fp8":
        return _fp8_linear(name, n, k, float32_scales=True)
    if expert_format == "mxfp4":
        center = _e8m0_center(k**-0.5, _E2M1_RMS)
        return [
            PlannedTensor(f"{name}.weight", torch.int8, (n, k // 2), "fp4"),  # the release's I8
            PlannedTensor(
                f"{name}.scale",
                torch.float8_e8m0fnu,
                (n, k // formats.MXFP4_BLOCK),
                "e8m0",
                center=center,
            ),
        ]
    scale_2 = k**-0.5 / (_E2M1_RMS * _NVFP4_BLOCK_RMS)
    return [
        PlannedTensor(f"{name}.weight", torch.uint8, (n, k // 2), "fp4"),  # ModelOpt's U8
        PlannedTensor(
            f"{name}.weight_scale",
            torch.float8_e4m3fn,
            (n, k // formats.NVFP4_BLOCK),
            "nvfp4_block",
        ),
        PlannedTensor(f"{name}.weight_scale_2", torch.float32, (), "const", mean=scale_2),
        PlannedTensor(f"{name}.input_scale", torch.float32, (), "const", mean=_NVFP4_INPUT_SCALE),
    ]


def _init(name: str, spec: ParamSpec, config: DSV4Config) -> PlannedTensor:
    shape = spec.shape(config)
    init: Init = spec.init
    std = shape[-1] ** -0.5 if init.std is None else init.std
    return PlannedTensor(name, init.dtype, shape, "init", mean=init.mean, std=std)


def plan_fullsize_checkpoint(config: DSV4Config, expert_format: str) -> list[PlannedTensor]:
    """Every tensor the checkpoint holds, in writing order: ``embed.weight``, ``head.weight``,
    then each MTP layer's in table order (experts by id, then w1, w2, w3)."""
    _check_args(expert_format, 1, 0)
    out = [_init(spec.target, spec, config) for spec in shared_params()]
    float32_scales = expert_format == "fp8"  # V4-Flash-Base: every dense scale float32
    for i in range(config.num_nextn_predict_layers):
        p = f"mtp.{i}."
        for spec in MTP_LAYER_PARAMS:
            if spec.kind == "linear":
                n, k = spec.shape(config)
                out += _fp8_linear(p + spec.name, n, k, float32_scales)
            elif spec.kind == "experts":
                for e in range(config.n_routed_experts):
                    for w in EXPERT_WEIGHTS:
                        n, k = expert_shape(config, w)
                        out += _expert(f"{p}{spec.name}.{e}.{w}", n, k, expert_format)
            elif spec.kind != "shared":  # the layer shares the target's head: no copy
                out.append(_init(p + spec.name, spec, config))
    assert out[0].name == EMBED.target
    return out


def shard_plan(tensors: list[PlannedTensor], shard_mb: float) -> list[list[PlannedTensor]]:
    """Consecutive runs of ``tensors`` of at most ``shard_mb`` megabytes of data each (a tensor
    larger than that alone)."""
    limit = shard_mb * SHARD_UNIT
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def shard_file(k: int, n: int) -> str:
    """The release's shard name, 0-based ``k`` of ``n``."""
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


# ----------------------------------------------------------------------------- drawing
def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """One generator per tensor, seeded from (seed, name): bytes independent of order."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)


def _bytes(
    shape: tuple[int, ...], lo: int, hi: int, g: torch.Generator, device: torch.device
) -> torch.Tensor:
    """uint8 uniform in [lo, hi] (inclusive)."""
    return torch.randint(lo, hi + 1, shape, dtype=torch.uint8, generator=g, device=device)


def draw(t: PlannedTensor, seed: int, device: torch.device) -> torch.Tensor:
    """The tensor ``t`` on ``device`` (rules: :class:`PlannedTensor`)."""
    g = _generator(seed, t.name, device)
    if t.rule == "init":
        if t.std == 0.0:
            return torch.full(t.shape, t.mean, dtype=t.dtype, device=device)
        x = torch.randn(t.shape, generator=g, device=device, dtype=torch.float32)
        return x.mul_(t.std).add_(t.mean).to(t.dtype)
    if t.rule == "const":
        return torch.full(t.shape, t.mean, dtype=t.dtype, device=device)
    if t.rule == "e4m3":
        b = _bytes(t.shape, 0, 253, g, device)  # 254 codes; skip 0x7F (0xFF is out of range)
        return b.add_(b >= 0x7F).view(torch.float8_e4m3fn)
    if t.rule == "fp4":
        return _bytes(t.shape, 0, 255, g, device).view(t.dtype)
    if t.rule == "e8m0":
        return _bytes(t.shape, t.center - 1, t.center + 1, g, device).view(torch.float8_e8m0fnu)
    if t.rule == "nvfp4_block":
        return _bytes(t.shape, *_NVFP4_BLOCK_BYTES, g, device).view(torch.float8_e4m3fn)
    if t.rule == "f32_scale":
        u = torch.rand(t.shape, generator=g, device=device, dtype=torch.float32)
        return torch.exp2(u.mul_(2).add_(t.center - formats.E8M0_BIAS - 1))
    raise AssertionError(f"unknown rule {t.rule}")


# ----------------------------------------------------------------------------- writing
def _check_out_dir(path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"out: {path} is a file, expected a new or empty directory")
    if os.path.isdir(path) and os.listdir(path):
        raise ConfigError(
            f"out: {path} is not empty; expected a new or empty directory (nothing is overwritten)"
        )


def make_fullsize_checkpoint(
    path: str | os.PathLike[str],
    config: str | DSV4Config = "flash",
    *,
    expert_format: str = "mxfp4",
    device: str | torch.device = "cpu",
    shard_mb: float = 4000,
    seed: int = 0,
    dry_run: bool = False,
    progress: Callable[[str], None] | None = None,
) -> FullsizeReport:
    """Write the checkpoint of the module docstring into ``path`` (new or empty directory).

    ``config``: ``"flash"``, ``"pro"``, ``"tiny"``, a config.json path or a
    :class:`DSV4Config` (its ``expert_dtype`` and ``quantization_config`` are replaced to match
    ``expert_format``).  ``dry_run``: plan the shards and report their sizes, write nothing.
    Raises :class:`ConfigError` naming the bad argument.  ``progress`` gets one line per shard.
    """
    t_start = time.perf_counter()
    _check_args(expert_format, shard_mb, seed)
    dev = check_device_arg("device", device, ConfigError)
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"out: expected a directory path, got {type(path).__name__}")
    path = os.fspath(path)
    config_name = config if isinstance(config, str) else "DSV4Config"
    cfg, hf_quant = _checkpoint_config(resolve_config(config), expert_format)
    shards = shard_plan(plan_fullsize_checkpoint(cfg, expert_format), shard_mb)
    report = FullsizeReport(
        path, config_name, expert_format, str(dev), seed, float(shard_mb), dry_run=dry_run
    )
    files = [shard_file(k, len(shards)) for k in range(len(shards))]
    if dry_run:
        for file, shard in zip(files, shards, strict=True):
            report.shards.append(ShardReport(file, len(shard), sum(t.nbytes for t in shard), 0))
        report.wall_s = time.perf_counter() - t_start
        return report
    _check_out_dir(path)
    os.makedirs(path, exist_ok=True)
    # Shard metadata holds one key: safetensors writes a map's keys in a random order, which
    # would make two runs' bytes differ.  What made the checkpoint goes to GENERATOR_FILE.
    metadata = {"format": "pt"}
    weight_map: dict[str, str] = {}
    for file, shard in zip(files, shards, strict=True):
        t0 = time.perf_counter()
        host = {t.name: draw(t, seed, dev).cpu() for t in shard}  # one tensor on the device
        t1 = time.perf_counter()
        save_file(host, os.path.join(path, file), metadata=metadata)
        t2 = time.perf_counter()
        del host
        report.draw_s += t1 - t0
        report.write_s += t2 - t1
        data = sum(t.nbytes for t in shard)
        report.shards.append(
            ShardReport(file, len(shard), data, os.path.getsize(os.path.join(path, file)))
        )
        weight_map.update(dict.fromkeys((t.name for t in shard), file))
        if progress is not None:
            progress(f"{file}: {len(shard)} tensors, {data / 1e9:.3f} GB, {t2 - t0:.1f} s")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_config(), f, indent=2)
    if hf_quant is not None:
        with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
            json.dump(hf_quant, f, indent=2)
    with open(os.path.join(path, GENERATOR_FILE), "w") as f:
        json.dump(
            {
                "generator": GENERATOR,
                "config": config_name,
                "expert_format": expert_format,
                "seed": seed,
                "device": dev.type,
                "shard_mb": float(shard_mb),
            },
            f,
            indent=2,
        )
    total = sum(t.nbytes for shard in shards for t in shard)
    with open(os.path.join(path, INDEX_FILE), "w") as f:  # last: marks the directory complete
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    report.wall_s = time.perf_counter() - t_start
    return report
