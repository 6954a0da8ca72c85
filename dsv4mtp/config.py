"""DeepSeek-V4 config, built from the HF ``config.json`` dict with its raw field names.

Field names are the JSON keys (``compress_ratios``, ``qk_rope_head_dim``, ``o_groups``, ...), not
Transformers' rewritten ones: Transformers' ``DeepseekV4Config`` truncates ``compress_ratios`` to
the main layers (dropping the MTP entry) and renames several fields, so we read the plain dict.
What each field means for the MTP layer: ``docs/semantics.md``, "Notation and shapes".
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from dsv4mtp.errors import ConfigError

__all__ = ["DSV4Config"]

_FLASH_QUANT = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
    "scale_fmt": "ue8m0",
    "activation_scheme": "dynamic",
}
_YARN = {
    "type": "yarn",
    "factor": 16,
    "original_max_position_embeddings": 65536,
    "beta_fast": 32,
    "beta_slow": 1,
}

# Fields a config.json must carry: shapes cannot be guessed.
_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "num_attention_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "hc_mult",
)
_INT_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_nextn_predict_layers",
    "vocab_size",
    "hc_mult",
    "hc_sinkhorn_iters",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "sliding_window",
    "max_position_embeddings",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_shared_experts",
    "num_hash_layers",
    "index_topk",
    "index_n_heads",
    "index_head_dim",
)
_FLOAT_FIELDS = (
    "hc_eps",
    "rms_norm_eps",
    "rope_theta",
    "compress_rope_theta",
    "routed_scaling_factor",
    "swiglu_limit",
)


@dataclass(frozen=True)
class DSV4Config:
    """The fields the MTP layer reads, named as in DeepSeek-V4's ``config.json``.

    Defaults are V4-Flash's.  Build from a dict with :meth:`from_hf_config`, from a checkpoint
    directory with :meth:`from_dir`, or use the presets :meth:`flash`, :meth:`pro`, :meth:`tiny`.
    """

    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_nextn_predict_layers: int = 1
    vocab_size: int = 129280
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    rms_norm_eps: float = 1e-6
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] | None = None
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict[str, Any] | None = field(default_factory=lambda: dict(_YARN), hash=False)
    max_position_embeddings: int = 1048576
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    num_hash_layers: int = 3
    hidden_act: str = "silu"
    # Routed-expert checkpoint format: "fp4" (MXFP4, V4-Flash/Pro) or "fp8" (Flash-Base).  vLLM
    # defaults a missing field to "fp4"; so do we.
    expert_dtype: str = "fp4"
    quantization_config: dict[str, Any] | None = field(
        default_factory=lambda: dict(_FLASH_QUANT), hash=False
    )
    index_topk: int = 512
    index_n_heads: int = 64
    index_head_dim: int = 128
    torch_dtype: str = "bfloat16"
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        _validate(self)

    # ------------------------------------------------------------------ derived values
    @property
    def hc_dim(self) -> int:
        """n * D: the width of the flat residual the MTP layer consumes and returns."""
        return self.hc_mult * self.hidden_size

    @property
    def hc_mix(self) -> int:
        """M = (2 + n) * n rows of ``hc_*_fn``: [pre n | post n | comb n*n]."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def mtp_layer_ids(self) -> range:
        """Model-layer indices of the MTP layers: num_hidden_layers + i."""
        return range(self.num_hidden_layers, self.num_hidden_layers + self.num_nextn_predict_layers)

    @property
    def moe_quant_algo(self) -> str | None:
        """ModelOpt's ``moe_quant_algo`` (e.g. "NVFP4") when the quantization config names one."""
        qc = self.quantization_config or {}
        algo = qc.get("moe_quant_algo")
        if algo is None and isinstance(qc.get("quantization"), dict):
            algo = qc["quantization"].get("moe_quant_algo")
        return algo

    @property
    def expected_expert_format(self) -> str:
        """What the config claims for routed experts: "nvfp4", "mxfp4", "fp8" or "bf16"."""
        if (self.moe_quant_algo or "").upper() == "NVFP4":
            return "nvfp4"
        return {"fp4": "mxfp4", "fp8": "fp8", "bf16": "bf16"}[self.expert_dtype]

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> DSV4Config:
        """Build from a parsed DeepSeek-V4 ``config.json``; unknown keys are ignored."""
        if not isinstance(config, dict):
            raise ConfigError(
                f"config: expected a dict parsed from config.json, got {type(config).__name__}"
            )
        missing = [k for k in _REQUIRED if k not in config]
        if missing:
            raise ConfigError(f"config.json: missing required field(s) {', '.join(missing)}")
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in known}
        if kwargs.get("expert_dtype") is None:
            kwargs.pop("expert_dtype", None)
        if kwargs.get("compress_ratios") is not None:
            if not isinstance(kwargs["compress_ratios"], (list, tuple)):
                raise ConfigError(
                    f"compress_ratios: expected a list of ints, got {type(kwargs['compress_ratios']).__name__}"
                )
            kwargs["compress_ratios"] = tuple(kwargs["compress_ratios"])
        return cls(**kwargs)

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> DSV4Config:
        """Read ``config.json`` (and merge ``hf_quant_config.json``'s algo, when present)."""
        try:
            raw = _read_json_object(os.path.join(path, "config.json"))
        except FileNotFoundError as e:
            raise ConfigError(f"config.json: not found in {os.fspath(path)!r}") from e
        hf_quant = os.path.join(path, "hf_quant_config.json")
        if os.path.exists(hf_quant):
            q = _read_json_object(hf_quant)
            inner = q.get("quantization", q)
            qc = raw.get("quantization_config") or {}
            if not isinstance(inner, dict) or not isinstance(qc, dict):
                bad = (
                    "hf_quant_config.json: quantization"
                    if not isinstance(inner, dict)
                    else ("config.json: quantization_config")
                )
                raise ConfigError(f"{bad}: expected a JSON object")
            qc = dict(qc)
            for key in ("moe_quant_algo", "quant_algo", "kv_cache_quant_algo", "group_size"):
                if key in inner and key not in qc:
                    qc[key] = inner[key]
            raw["quantization_config"] = qc
        return cls.from_hf_config(raw)

    def to_hf_config(self) -> dict[str, Any]:
        """The config.json dict (raw names); round-trips through :meth:`from_hf_config`."""
        d = dataclasses.asdict(self)
        if d["compress_ratios"] is not None:
            d["compress_ratios"] = list(d["compress_ratios"])
        d["model_type"] = "deepseek_v4"
        d["architectures"] = ["DeepseekV4ForCausalLM"]
        return d

    def replace(self, **changes: Any) -> DSV4Config:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ presets
    @classmethod
    def flash(cls) -> DSV4Config:
        """DeepSeek-V4-Flash."""
        ratios = [0, 0] + [4 if (i % 2 == 0) else 128 for i in range(41)] + [0]
        return cls(compress_ratios=tuple(ratios))

    @classmethod
    def pro(cls) -> DSV4Config:
        """DeepSeek-V4-Pro."""
        ratios = [128, 128] + [4 if (i % 2 == 0) else 128 for i in range(59)] + [0]
        return cls(
            hidden_size=7168,
            num_hidden_layers=61,
            num_attention_heads=128,
            q_lora_rank=1536,
            o_groups=16,
            o_lora_rank=1024,
            n_routed_experts=384,
            moe_intermediate_size=3072,
            routed_scaling_factor=2.5,
            index_topk=1024,
            compress_ratios=tuple(ratios),
        )

    @classmethod
    def tiny(cls) -> DSV4Config:
        """A CPU-sized config exercising every MTP code path (T > 16 makes the window bind;
        D, the ranks and I are multiples of 128 so every FP8 block is full).

        ``num_hash_layers`` is 0: with 2 main layers Flash's 3 would make the MTP layer id (2) a
        hash layer, which the MTP never is."""
        return cls(
            hidden_size=256,
            num_hidden_layers=2,
            num_nextn_predict_layers=1,
            vocab_size=512,
            num_attention_heads=4,
            head_dim=128,
            qk_rope_head_dim=64,
            q_lora_rank=128,
            o_groups=2,
            o_lora_rank=128,
            sliding_window=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            n_shared_experts=1,
            num_hash_layers=0,
            compress_ratios=(0, 0, 0),
            index_topk=16,
            index_n_heads=4,
            index_head_dim=64,
        )


def _read_json_object(path: str) -> dict[str, Any]:
    """A JSON file holding one object; anything else is a :class:`ConfigError` naming the file.
    A missing file raises FileNotFoundError for the caller to word."""
    name = os.path.basename(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{name}: cannot read it ({e})") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{name}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{name}: expected a JSON object, got {type(data).__name__}")
    return data


def _validate(c: DSV4Config) -> None:
    for name in _INT_FIELDS:
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{name}: expected an int, got {v!r}")
        if v < 0 or (v == 0 and name not in ("num_hash_layers", "n_shared_experts")):
            raise ConfigError(f"{name}: expected a positive int, got {v}")
    for name in _FLOAT_FIELDS:
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"{name}: expected a finite number, got {v!r}")
    for name in ("hc_eps", "rms_norm_eps", "rope_theta", "routed_scaling_factor"):
        if getattr(c, name) <= 0:
            raise ConfigError(f"{name}: expected > 0, got {getattr(c, name)}")
    if c.qk_rope_head_dim % 2:
        raise ConfigError(
            f"qk_rope_head_dim: expected an even number (RoPE pairs), got {c.qk_rope_head_dim}"
        )
    if c.qk_rope_head_dim >= c.head_dim:
        raise ConfigError(
            f"qk_rope_head_dim: expected < head_dim ({c.head_dim}), got {c.qk_rope_head_dim}"
        )
    if c.num_attention_heads % c.o_groups:
        raise ConfigError(
            f"o_groups: expected a divisor of num_attention_heads ({c.num_attention_heads}), got {c.o_groups}"
        )
    if c.num_key_value_heads != 1:
        raise ConfigError(
            f"num_key_value_heads: V4 attention has one shared latent, expected 1, got {c.num_key_value_heads}"
        )
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ConfigError(
            f"num_experts_per_tok: expected <= n_routed_experts ({c.n_routed_experts}), got {c.num_experts_per_tok}"
        )
    if c.n_shared_experts != 1:
        raise ConfigError(
            f"n_shared_experts: V4 has exactly one shared expert, got {c.n_shared_experts}"
        )
    if c.scoring_func != "sqrtsoftplus":
        raise ConfigError(
            f"scoring_func: only 'sqrtsoftplus' (V4) is implemented, got {c.scoring_func!r}"
        )
    if c.hidden_act != "silu":
        raise ConfigError(f"hidden_act: only 'silu' (SwiGLU) is implemented, got {c.hidden_act!r}")
    if c.expert_dtype not in ("fp4", "fp8", "bf16"):
        raise ConfigError(f"expert_dtype: expected 'fp4', 'fp8' or 'bf16', got {c.expert_dtype!r}")
    if c.compress_ratios is not None:
        want = c.num_hidden_layers + c.num_nextn_predict_layers
        if len(c.compress_ratios) != want:
            raise ConfigError(
                f"compress_ratios: expected {want} entries (num_hidden_layers + "
                f"num_nextn_predict_layers), got {len(c.compress_ratios)}"
            )
        mtp = c.compress_ratios[c.num_hidden_layers :]
        if any(r != 0 for r in mtp):
            raise ConfigError(
                f"compress_ratios: the MTP entries must be 0 (pure sliding-window attention), got {list(mtp)}"
            )
    if c.rope_scaling is not None and not isinstance(c.rope_scaling, dict):
        raise ConfigError(
            f"rope_scaling: expected a dict or null, got {type(c.rope_scaling).__name__}"
        )
    if c.quantization_config is not None and not isinstance(c.quantization_config, dict):
        raise ConfigError(
            f"quantization_config: expected a dict or null, got {type(c.quantization_config).__name__}"
        )
