"""The loaded MTP checkpoint: what :func:`load_mtp_checkpoint` returns and both models consume.

Quantized tensors stay packed, next to their scales and an explicit format tag; a model
dequantizes what it needs (the MoE only the routed experts, one at a time), so a real V4-Flash
MTP layer (6.6 B parameters, mostly FP4) fits in a 24 GiB CPU machine.

Format tags (``QuantizedWeight.format`` and ``RoutedExperts.format``), one per linear weight of
logical shape (N, K) = (out, in):

=========== =========================================== =============================================
format      ``data``                                    ``scale`` / ``scale_2``
=========== =========================================== =============================================
``bf16``    (N, K) unquantized (bf16, or any float)     None / None
``fp8_e8m0``(N, K) float8_e4m3fn                        uint8 e8m0 bytes (ceil(N/128), ceil(K/128))
``fp8_f32`` (N, K) float8_e4m3fn                        float32 (ceil(N/128), ceil(K/128))  [Flash-Base]
``mxfp4``   (N, K/2) uint8, two e2m1 per byte, low      uint8 e8m0 bytes (N, K/32)
            nibble = even column
``nvfp4``   (N, K/2) uint8, as mxfp4                    float8_e4m3fn (N, K/16) / float32 global scale
=========== =========================================== =============================================

e8m0 scales are kept as their raw bytes (uint8), as vLLM does: a numeric cast would turn 2^-7
into 0.  Every scale is a *multiplier* (vLLM's ``weight_scale_inv`` is multiplied too).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from dsv4mtp import formats
from dsv4mtp.checkpoint.names import MTPWeightName, classify_mtp_weight_name
from dsv4mtp.checkpoint.schema import MTP_LAYER_PARAMS
from dsv4mtp.config import DSV4Config
from dsv4mtp.errors import CheckpointError

__all__ = [
    "FORMATS",
    "MTPCheckpoint",
    "MTPLayerWeights",
    "QuantFormat",
    "QuantizedWeight",
    "RoutedExperts",
    "stack_rows",
]

QuantFormat = Literal["bf16", "fp8_e8m0", "fp8_f32", "mxfp4", "nvfp4"]
FORMATS: tuple[str, ...] = ("bf16", "fp8_e8m0", "fp8_f32", "mxfp4", "nvfp4")
FP8_BLOCK = 128  # DeepSeek-V4 weight_block_size [128, 128]


@dataclass(frozen=True)
class QuantizedWeight:
    """One linear weight (N, K) = (out, in) as stored, plus how to decode it.

    ==========  ==================================================================================
    field       meaning
    ==========  ==================================================================================
    format      one of ``FORMATS`` (table in the module docstring)
    data        packed / quantized values as stored (shape and dtype per format)
    scale       block scales (None for ``bf16``)
    scale_2     ``nvfp4`` only: float32 global scale, 0-d, or (len(row_splits),) with one value per
                row shard (the fused gate/up weight keeps gate's and up's own scales)
    shape       logical (N, K)
    row_splits  for fused weights the row count of each stacked shard, e.g. ``(q_lora_rank,
                head_dim)`` for ``fused_wqa_wkv``, ``(I, I)`` for ``gate_up_proj``; else None
    name        checkpoint name(s) it came from, for messages
    ==========  ==================================================================================
    """

    format: str
    data: torch.Tensor
    scale: torch.Tensor | None
    shape: tuple[int, int]
    scale_2: torch.Tensor | None = None
    row_splits: tuple[int, ...] | None = None
    name: str = ""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The logical (N, K) weight in ``dtype``, decoded by :mod:`.formats` in
        promote(dtype, float32) (exact for FP4 and e8m0-scaled FP8) and rounded once to ``dtype``."""
        fmt, work = self.format, torch.promote_types(dtype, torch.float32)
        if fmt == "bf16":
            return self.data.to(dtype)
        if self.scale is None:
            raise CheckpointError(f"{self.name}: format {fmt} needs a scale, got None")
        if fmt in ("fp8_e8m0", "fp8_f32"):
            return formats.dequantize_fp8_block(self.data, self.scale, dtype=work).to(dtype)
        if fmt == "mxfp4":
            return formats.dequantize_mxfp4(self.data, self.scale, dtype=work).to(dtype)
        if fmt != "nvfp4":
            raise CheckpointError(f"{self.name}: unknown weight format {fmt!r}")
        if self.scale_2 is None:
            raise CheckpointError(f"{self.name}: nvfp4 needs weight_scale_2, got None")
        if self.scale_2.dim() == 0:
            return formats.dequantize_nvfp4(self.data, self.scale, self.scale_2, dtype=work).to(
                dtype
            )
        # A fused weight keeps one global scale per row shard (gate's and up's own).
        parts = []
        for part in self.split_rows():
            assert part.scale is not None and part.scale_2 is not None
            parts.append(formats.dequantize_nvfp4(part.data, part.scale, part.scale_2, dtype=work))
        return torch.cat(parts, 0).to(dtype)

    def split_rows(self) -> list[QuantizedWeight]:
        """The stacked shards of a fused weight (``row_splits``), still packed."""
        if self.row_splits is None:
            return [self]
        out, row = [], 0
        for i, rows in enumerate(self.row_splits):
            out.append(self.rows(row, rows, shard=i))
            row += rows
        return out

    def rows(self, start: int, count: int, *, shard: int | None = None) -> QuantizedWeight:
        """Rows [start, start + count) as a packed weight (whole FP8 blocks only)."""
        _, k = self.shape
        scale = self.scale
        if self.format in ("fp8_e8m0", "fp8_f32"):
            if start % FP8_BLOCK or (count % FP8_BLOCK and start + count != self.shape[0]):
                raise CheckpointError(
                    f"{self.name}: rows [{start}, {start + count}) do not cover whole "
                    f"{FP8_BLOCK}-row FP8 blocks"
                )
            assert scale is not None
            b0 = start // FP8_BLOCK
            scale = scale[b0 : b0 + -(-count // FP8_BLOCK)]
        elif scale is not None:
            scale = scale[start : start + count]
        scale_2 = self.scale_2
        if scale_2 is not None and scale_2.dim() == 1:
            scale_2 = scale_2[shard] if shard is not None else scale_2
        return QuantizedWeight(
            format=self.format,
            data=self.data[start : start + count],
            scale=scale,
            shape=(count, k),
            scale_2=scale_2,
            row_splits=None,
            name=f"{self.name}[rows {start}:{start + count}]",
        )

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return dataclasses.replace(
            self,
            data=self.data.to(device),
            scale=None if self.scale is None else self.scale.to(device),
            scale_2=None if self.scale_2 is None else self.scale_2.to(device),
        )

    def tensors(
        self, prefix: str, scale_suffix: str = ".weight_scale_inv"
    ) -> dict[str, torch.Tensor]:
        """``{prefix.weight, prefix<scale_suffix>, ...}`` under vLLM's parameter names."""
        out = {f"{prefix}.weight": self.data}
        if self.scale is not None:
            out[f"{prefix}{scale_suffix}"] = self.scale
        if self.scale_2 is not None:
            out[f"{prefix}.weight_scale_2"] = self.scale_2
        return out


@dataclass(frozen=True)
class RoutedExperts:
    """The routed experts of one MTP layer on this EP rank, stacked over local experts, packed.

    Stacking follows vLLM (``DeepseekV4MegaMoEExperts`` / ``...FI``): w13 rows are
    ``[w1 (gate) rows 0..I-1 ; w3 (up) rows I..2I-1]``.

    ===================  ====================================  =====================================
    field                shape                                  meaning
    ===================  ====================================  =====================================
    format               --                                     ``FORMATS`` tag, detected per layer
                                                                from the tensors present
    w13_weight           (E_loc, 2I, H) or (E_loc, 2I, H/2)     bf16 / e4m3, or packed fp4 uint8
    w13_weight_scale     fp8: (E_loc, 2I/128, H/128)            vLLM name ``w13_weight_scale_inv``
                         mxfp4: (E_loc, 2I, H/32) uint8 e8m0    for fp8; None for bf16
                         nvfp4: (E_loc, 2I, H/16) e4m3
    w2_weight            (E_loc, H, I) or (E_loc, H, I/2)
    w2_weight_scale      as w13 with (H, I)
    w13_weight_scale_2   (E_loc, 2) float32                     nvfp4: col 0 gate (w1), col 1 up (w3)
    w2_weight_scale_2    (E_loc,) float32                       nvfp4
    w13_input_scale      (E_loc, 2) float32                     nvfp4; loaded, unused (dynamic acts)
    w2_input_scale       (E_loc,) float32                       nvfp4; loaded, unused
    num_experts          E (global)
    expert_start         first global expert id on this rank
    num_local_experts    E_loc = E // ep_size
    hidden_size          H
    intermediate_size    I
    nvfp4_folded         True once the gate/up global scales were folded (``fold_nvfp4``); then
                         both w13_weight_scale_2 columns hold fc1_alpha and a second fold is refused
    ===================  ====================================  =====================================
    """

    format: str
    w13_weight: torch.Tensor
    w13_weight_scale: torch.Tensor | None
    w2_weight: torch.Tensor
    w2_weight_scale: torch.Tensor | None
    num_experts: int
    expert_start: int
    num_local_experts: int
    hidden_size: int
    intermediate_size: int
    w13_weight_scale_2: torch.Tensor | None = None
    w2_weight_scale_2: torch.Tensor | None = None
    w13_input_scale: torch.Tensor | None = None
    w2_input_scale: torch.Tensor | None = None
    nvfp4_folded: bool = False
    name: str = ""

    # ------------------------------------------------------------------ expert ids
    @property
    def expert_end(self) -> int:
        return self.expert_start + self.num_local_experts

    def is_local(self, global_id: int) -> bool:
        return self.expert_start <= global_id < self.expert_end

    def local_id(self, global_id: int) -> int:
        """vLLM's ``_map_global_expert_id``: local slot, or -1 when not on this rank."""
        return global_id - self.expert_start if self.is_local(global_id) else -1

    def global_to_local(self) -> torch.Tensor:
        """(E,) int64: local slot of every global expert id, -1 where not on this rank."""
        ids = torch.full((self.num_experts,), -1, dtype=torch.int64)
        ids[self.expert_start : self.expert_end] = torch.arange(self.num_local_experts)
        return ids

    # ------------------------------------------------------------------ one expert
    def expert(self, local_id: int) -> tuple[QuantizedWeight, QuantizedWeight]:
        """(w13 (2I, H), w2 (H, I)) of local expert ``local_id``, still packed."""
        if not 0 <= local_id < self.num_local_experts:
            raise IndexError(
                f"{self.name}: local expert id {local_id} outside [0, {self.num_local_experts})"
            )
        h, i = self.hidden_size, self.intermediate_size
        s2_13 = None if self.w13_weight_scale_2 is None else self.w13_weight_scale_2[local_id]
        s2_2 = None if self.w2_weight_scale_2 is None else self.w2_weight_scale_2[local_id]
        gid = self.expert_start + local_id
        w13 = QuantizedWeight(
            format=self.format,
            data=self.w13_weight[local_id],
            scale=None if self.w13_weight_scale is None else self.w13_weight_scale[local_id],
            shape=(2 * i, h),
            scale_2=s2_13,
            row_splits=(i, i),
            name=f"{self.name}.{gid}.w13",
        )
        w2 = QuantizedWeight(
            format=self.format,
            data=self.w2_weight[local_id],
            scale=None if self.w2_weight_scale is None else self.w2_weight_scale[local_id],
            shape=(h, i),
            scale_2=s2_2,
            name=f"{self.name}.{gid}.w2",
        )
        return w13, w2

    def dequantize_expert(
        self, local_id: int, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 (2I, H), w2 (H, I)) of one local expert, decoded on the fly."""
        w13, w2 = self.expert(local_id)
        return w13.dequantize(dtype), w2.dequantize(dtype)

    # ------------------------------------------------------------------ ExpertSource protocol
    @property
    def quantized(self) -> bool:
        """True for FP8 / FP4 experts (the official code quantizes their input activations)."""
        return self.format != "bf16"

    def __call__(
        self, expert: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Global expert id -> ``(w1 (I, H) gate, w3 (I, H) up, w2 (H, I) down)`` in ``dtype``."""
        local = self.local_id(expert)
        if local < 0:
            raise IndexError(
                f"{self.name}: expert {expert} is not on this EP rank (owns "
                f"[{self.expert_start}, {self.expert_end}))"
            )
        w13, w2 = self.dequantize_expert(local, dtype)
        i = self.intermediate_size
        return w13[:i], w13[i:], w2

    def to(self, device: torch.device | str) -> RoutedExperts:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return dataclasses.replace(
            self,
            w13_weight=self.w13_weight.to(device),
            w13_weight_scale=move(self.w13_weight_scale),
            w2_weight=self.w2_weight.to(device),
            w2_weight_scale=move(self.w2_weight_scale),
            w13_weight_scale_2=move(self.w13_weight_scale_2),
            w2_weight_scale_2=move(self.w2_weight_scale_2),
            w13_input_scale=move(self.w13_input_scale),
            w2_input_scale=move(self.w2_input_scale),
        )

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """vLLM's parameters ``{prefix}.w13_weight`` ... (scale suffix by format)."""
        suffix = "_weight_scale_inv" if self.format.startswith("fp8") else "_weight_scale"
        out: dict[str, torch.Tensor] = {
            f"{prefix}.w13_weight": self.w13_weight,
            f"{prefix}.w2_weight": self.w2_weight,
        }
        for w in ("w13", "w2"):
            scale = getattr(self, f"{w}_weight_scale")
            if scale is not None:
                out[f"{prefix}.{w}{suffix}"] = scale
            for extra in ("weight_scale_2", "input_scale"):
                t = getattr(self, f"{w}_{extra}")
                if t is not None:
                    out[f"{prefix}.{w}_{extra}"] = t
        return out


@dataclass(frozen=True)
class MTPLayerWeights:
    """All parameters of MTP layer ``index`` (model layer ``layer_id = num_hidden_layers + index``).

    One field per row of :data:`~dsv4mtp.checkpoint.schema.MTP_LAYER_PARAMS`, in table order
    (the table gives each field's checkpoint name, shape and kind; a test keeps the two in step):
    linears as :class:`QuantizedWeight` as stored, one per checkpoint weight (``wq_a`` and ``wkv``
    apart, the shared expert's ``shared_w1`` / ``shared_w3`` / ``shared_w2`` apart); plain and
    ``hc_*`` tensors in the stored dtype (norms bf16, hc_* / attn_sink / bias float32 in real
    checkpoints); the routed experts stacked as vLLM stacks them (:class:`RoutedExperts`).
    ``head_source`` is the checkpoint name the head came from (``mtp.{i}.head.weight`` or the
    target's ``head.weight``).

    vLLM's fused parameters are views computed on demand: :attr:`fused_wqa_wkv` = rows
    [wq_a; wkv], :attr:`gate_up_proj` = rows [w1; w3], :attr:`down_proj` = ``shared_w2``, and
    :meth:`state_dict` lists everything under vLLM's names.

    Tensor parallelism: only ``attn_sink`` is narrowed to this rank's heads, as vLLM's loader
    does (which also pads it to 64 heads with -inf; we do not); every other attention weight is
    replicated here and left to the multi-GPU code to slice.
    """

    index: int
    layer_id: int
    enorm: torch.Tensor
    hnorm: torch.Tensor
    norm: torch.Tensor
    hc_head_fn: torch.Tensor
    hc_head_base: torch.Tensor
    hc_head_scale: torch.Tensor
    hc_attn_fn: torch.Tensor
    hc_attn_base: torch.Tensor
    hc_attn_scale: torch.Tensor
    hc_ffn_fn: torch.Tensor
    hc_ffn_base: torch.Tensor
    hc_ffn_scale: torch.Tensor
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    e_proj: QuantizedWeight
    h_proj: QuantizedWeight
    wq_a: QuantizedWeight
    wkv: QuantizedWeight
    wq_b: QuantizedWeight
    wo_a: QuantizedWeight
    wo_b: QuantizedWeight
    shared_w1: QuantizedWeight
    shared_w3: QuantizedWeight
    shared_w2: QuantizedWeight
    q_norm: torch.Tensor
    kv_norm: torch.Tensor
    attn_sink: torch.Tensor
    gate_weight: torch.Tensor
    e_score_correction_bias: torch.Tensor
    experts: RoutedExperts
    head: torch.Tensor
    head_source: str

    @property
    def fused_wqa_wkv(self) -> QuantizedWeight:
        """vLLM's ``attn.fused_wqa_wkv``: rows [wq_a (Rq); wkv (Dh)], row_splits (Rq, Dh)."""
        return stack_rows([self.wq_a, self.wkv], f"mtp.{self.index}.attn.fused_wqa_wkv")

    @property
    def gate_up_proj(self) -> QuantizedWeight:
        """vLLM's ``shared_experts.gate_up_proj``: rows [w1 (I); w3 (I)], row_splits (I, I)."""
        return stack_rows(
            [self.shared_w1, self.shared_w3], f"mtp.{self.index}.ffn.shared_experts.gate_up_proj"
        )

    @property
    def down_proj(self) -> QuantizedWeight:
        """vLLM's ``shared_experts.down_proj``: the shared expert's w2 (D, I)."""
        return self.shared_w2

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This layer's parameters under vLLM's names (``model.layers.{layer_id}.*``), each name
        the one :func:`~.names.remap_mtp_weight_name` gives the checkpoint tensor(s) it holds;
        shards vLLM stacks (shard id 0, 1) are stacked here in shard order."""
        out: dict[str, torch.Tensor] = {}
        stacked: dict[str, list[QuantizedWeight]] = {}
        for spec in MTP_LAYER_PARAMS:
            value = getattr(self, spec.field)
            if spec.kind == "experts":
                w13 = self._vllm_name(f"{spec.name}.0.w1.weight").param_name
                out.update(value.tensors(w13.removesuffix(".w13_weight")))
            elif spec.kind != "linear":
                out[self._vllm_name(spec.name).param_name] = value
            else:
                m = self._vllm_name(f"{spec.name}.weight")
                prefix = m.param_name.removesuffix(".weight")
                if m.shard_id is None:
                    out.update(value.tensors(prefix))
                else:
                    stacked.setdefault(prefix, []).append(value)
        for prefix, parts in stacked.items():
            out.update(stack_rows(parts, prefix).tensors(prefix))
        return out

    def _vllm_name(self, rel: str) -> MTPWeightName:
        """:func:`~.names.classify_mtp_weight_name` of ``mtp.{index}.{rel}`` for this layer."""
        config = _names_config(self.layer_id - self.index, self.index)
        out = classify_mtp_weight_name(f"mtp.{self.index}.{rel}", config)
        assert isinstance(out, MTPWeightName), (rel, out)
        return out

    def to(self, device: torch.device | str) -> MTPLayerWeights:
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (torch.Tensor, QuantizedWeight, RoutedExperts)):
                changes[f.name] = v.to(device)
        return dataclasses.replace(self, **changes)


@functools.lru_cache(maxsize=8)
def _names_config(num_hidden_layers: int, index: int) -> DSV4Config:
    """A config with MTP layer ``mtp.{index}``: all that vLLM's names of the non-expert
    parameters depend on (the routed experts name their own tensors, by format)."""
    return DSV4Config(num_hidden_layers=num_hidden_layers, num_nextn_predict_layers=index + 1)


def stack_rows(parts: list[QuantizedWeight], name: str) -> QuantizedWeight:
    """Stack linears along rows as vLLM's merged parameters do (``fused_wqa_wkv``,
    ``gate_up_proj``); ``row_splits`` keeps the shards apart."""
    fmt = parts[0].format
    if any(p.format != fmt for p in parts):
        raise CheckpointError(
            f"{name}: cannot stack shards of different formats {[p.format for p in parts]}"
        )
    if fmt.startswith("fp8") and any(p.shape[0] % FP8_BLOCK for p in parts[:-1]):
        raise CheckpointError(
            f"{name}: cannot stack FP8 shards whose row counts {[p.shape[0] for p in parts]} are "
            f"not whole {FP8_BLOCK}-row blocks"
        )
    data = torch.cat([p.data for p in parts], 0)
    scale = None if parts[0].scale is None else torch.cat([p.scale for p in parts], 0)  # type: ignore[misc]
    rows = tuple(p.shape[0] for p in parts)
    return QuantizedWeight(
        fmt, data, scale, (sum(rows), parts[0].shape[1]), row_splits=rows, name=name
    )


@dataclass(frozen=True)
class MTPCheckpoint:
    """What :func:`load_mtp_checkpoint` returns.

    ==============  ===============================================================================
    field           meaning
    ==============  ===============================================================================
    config          the :class:`DSV4Config` the shapes were checked against
    path            the checkpoint directory
    layers          one :class:`MTPLayerWeights` per MTP layer, ``layers[i]`` for ``mtp.{i}``
    embed_tokens    (V, D) vLLM's ``model.embed_tokens.weight`` (shared by all MTP layers)
    embed_source    checkpoint name it came from: ``mtp.0.emb.tok_emb.weight`` when present (a
                    re-export), else the target's ``embed.weight``
    tp_rank/size    tensor-parallel coordinates used (only ``attn_sink`` is narrowed)
    ep_rank/size    expert-parallel coordinates used (experts outside the rank's range skipped)
    loaded          checkpoint name -> vLLM parameter name, for every tensor consumed
    skipped         checkpoint name -> reason, for ``mtp.*`` tensors deliberately not loaded
                    (non-local experts, MTP index beyond ``num_nextn_predict_layers``, shared
                    weights from a later MTP layer)
    warnings        messages of the :class:`ExpertFormatWarning` s raised while loading
    ==============  ===============================================================================
    """

    config: DSV4Config
    path: str
    layers: tuple[MTPLayerWeights, ...]
    embed_tokens: torch.Tensor
    embed_source: str
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    loaded: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    @property
    def expert_formats(self) -> tuple[str, ...]:
        """The routed-expert format of each MTP layer."""
        return tuple(layer.experts.format for layer in self.layers)

    def layer_for_step(self, step: int) -> MTPLayerWeights:
        """Layer used at speculative step ``step`` (``step % num_nextn_predict_layers``)."""
        return self.layers[step % len(self.layers)]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter under vLLM's names (``model.embed_tokens.weight`` + layers)."""
        out = {"model.embed_tokens.weight": self.embed_tokens}
        for layer in self.layers:
            out.update(layer.state_dict())
        return out

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from self.state_dict().values()

    def to(self, device: torch.device | str) -> MTPCheckpoint:
        return dataclasses.replace(
            self,
            layers=tuple(layer.to(device) for layer in self.layers),
            embed_tokens=self.embed_tokens.to(device),
        )
