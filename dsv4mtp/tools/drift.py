"""Draft drift between two checkpoints' MTP layers (``dsv4-mtp compare``).

Checkpoint A is the baseline.  Both MTP layers run on the same deterministic inputs (synthetic
target residuals and token ids from a seed, or a user's safetensors file); A drafts greedily and
B is teacher-forced on A's tokens, so one early disagreement does not make every later step
incomparable.  Per draft step: top-1 agreement (B's argmax == A's token) and KL(p_A || p_B) of
the softmax distributions, in float64.  Per tensor group: the relative error
||W_B - W_A|| / ||W_A|| of the dequantized weights, ranked, so a user sees which tensors caused
the drift.

Which implementation runs is the caller's choice (``build_layer``); the default is the reference
:class:`dsv4mtp.reference.MTPLayer` on CPU.  This module never imports the optimized package.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from dsv4mtp.checkpoint.load import load_mtp_checkpoint
from dsv4mtp.checkpoint.schema import MTP_LAYER_PARAMS
from dsv4mtp.checkpoint.weights import (
    MTPCheckpoint,
    MTPLayerWeights,
    QuantizedWeight,
    RoutedExperts,
)
from dsv4mtp.checks import FLOAT_DTYPES, check_dtype_arg, check_finite_at
from dsv4mtp.config import DSV4Config
from dsv4mtp.errors import CheckpointError, InputError

__all__ = [
    "DriftInputs",
    "DriftReport",
    "GroupError",
    "StepDrift",
    "check_drift_inputs",
    "compare_checkpoints",
    "draft_drift",
    "json_safe",
    "load_drift_inputs",
    "synthetic_drift_inputs",
    "teacher_forced_logits",
    "weight_group_errors",
]


# ----------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class DriftInputs:
    """input_ids (T,) int64 (already shifted), positions (T,) int64, prev_hidden (T, hc_mult*D)
    float32 (the target's flat residual), seq_lens (B,) int64 summing to T."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    prev_hidden: torch.Tensor
    seq_lens: torch.Tensor
    source: str


def synthetic_drift_inputs(
    config: DSV4Config, *, num_sequences: int = 32, seq_len: int = 4, seed: int = 0
) -> DriftInputs:
    """``num_sequences`` sequences of ``seq_len`` rows: random ids, positions starting at a random
    offset (not 0), residuals N(0, 1).  Deterministic in ``seed``."""
    for name, v in (("num_sequences", num_sequences), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{name}: expected an int >= 1, got {v!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InputError(f"seed: expected an int, got {seed!r}")
    g = torch.Generator().manual_seed(seed)
    T = num_sequences * seq_len
    starts = torch.randint(1, 1000, (num_sequences,), generator=g)
    positions = (starts[:, None] + torch.arange(seq_len)[None, :]).reshape(T)
    return DriftInputs(
        input_ids=torch.randint(0, config.vocab_size, (T,), generator=g),
        positions=positions,
        prev_hidden=torch.randn(T, config.hc_dim, generator=g),
        seq_lens=torch.full((num_sequences,), seq_len, dtype=torch.int64),
        source=f"synthetic (seed {seed}, {num_sequences} x {seq_len} rows)",
    )


def load_drift_inputs(path: str | os.PathLike[str], config: DSV4Config) -> DriftInputs:
    """A safetensors file with ``prev_hidden`` (T, hc_mult*D) float, ``input_ids`` (T,) and
    ``positions`` (T,) integer, optional ``seq_lens`` (B,) (default: one sequence)."""
    path = os.fspath(path)
    try:
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
            missing = {"prev_hidden", "input_ids", "positions"} - keys
            if missing:
                raise InputError(
                    f"{path}: missing tensor(s) {sorted(missing)}; have {sorted(keys)}"
                )
            wanted = keys & {"prev_hidden", "input_ids", "positions", "seq_lens"}
            t = {k: f.get_tensor(k) for k in wanted}
    except (SafetensorError, OSError) as e:
        raise InputError(f"{path}: expected a readable safetensors file, got: {e}") from e
    prev = t["prev_hidden"]
    if not prev.is_floating_point() or prev.dim() != 2 or prev.shape[1] != config.hc_dim:
        raise InputError(
            f"prev_hidden: expected a float (T, {config.hc_dim}) = (T, hc_mult*hidden_size) "
            f"tensor, got {prev.dtype} {tuple(prev.shape)}"
        )
    T = prev.shape[0]
    for name in ("input_ids", "positions", "seq_lens"):
        if name in t and (t[name].is_floating_point() or t[name].dim() != 1):
            raise InputError(f"{name}: expected a 1-D integer tensor, got {t[name].dtype}")
    for name in ("input_ids", "positions"):
        if t[name].shape[0] != T:
            raise InputError(f"{name}: expected shape ({T},) like prev_hidden, got {t[name].shape}")
    seq_lens = t.get("seq_lens", torch.tensor([T]))
    inputs = DriftInputs(
        input_ids=t["input_ids"].long(),
        positions=t["positions"].long(),
        prev_hidden=prev.float(),
        seq_lens=seq_lens.long(),
        source=f"{path} ({len(seq_lens)} sequence(s), {T} rows)",
    )
    check_drift_inputs(inputs, config)
    return inputs


def check_drift_inputs(inputs: DriftInputs, config: DSV4Config) -> None:
    """Refuse, before any layer runs, what would fail mid-run or turn the metrics into NaN:
    non-finite residuals, ids outside the vocab, negative or too large positions, and
    sequence lengths that do not split the rows."""
    if not isinstance(inputs, DriftInputs):
        raise InputError(f"inputs: expected DriftInputs, got {type(inputs).__name__}")
    check_finite_at("prev_hidden", inputs.prev_hidden)
    ids, pos, lens = inputs.input_ids, inputs.positions, inputs.seq_lens
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size):
        bad = ids[(ids < 0) | (ids >= config.vocab_size)][0]
        raise InputError(
            f"input_ids: expected ids in [0, vocab_size={config.vocab_size}), got {int(bad)}"
        )
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= config.max_position_embeddings):
        raise InputError(
            f"positions: expected positions in [0, max_position_embeddings="
            f"{config.max_position_embeddings}), got {int(pos.min())} .. {int(pos.max())}"
        )
    if lens.dim() != 1 or any(n < 1 for n in lens.tolist()) or int(lens.sum()) != ids.shape[0]:
        raise InputError(
            f"seq_lens: expected lengths >= 1 summing to T={ids.shape[0]}, got {lens.tolist()}"
        )


# ----------------------------------------------------------------------------- weight errors
@dataclass(frozen=True)
class GroupError:
    """||W_B - W_A|| / ||W_A|| and max |W_B - W_A| over one tensor group (dequantized)."""

    group: str
    rel_error: float
    max_abs_error: float
    format_a: str
    format_b: str


def _layer_groups(
    w: MTPLayerWeights,
) -> Iterator[tuple[str, str, Callable[[], list[torch.Tensor]]]]:
    """(group name, format, thunk -> dequantized tensors) of one MTP layer, one per ``group`` of
    the schema, in table order.  Thunks keep only one group in float64 memory at a time."""
    groups: dict[str, list[Any]] = {}
    for spec in MTP_LAYER_PARAMS:
        groups.setdefault(spec.group, []).append(getattr(w, spec.field))
    for name, values in groups.items():
        first = values[0]
        if isinstance(first, RoutedExperts):
            yield name, first.format, functools.partial(_experts_f64, first)
        elif isinstance(first, QuantizedWeight):
            yield name, first.format, functools.partial(_linears_f64, values)
        else:
            fmt = str(first.dtype).removeprefix("torch.")
            yield name, fmt, functools.partial(_plain_f64, values)


def _experts_f64(ex: RoutedExperts) -> list[torch.Tensor]:
    return [t for e in range(ex.num_local_experts) for t in ex.dequantize_expert(e, torch.float64)]


def _linears_f64(qs: list[QuantizedWeight]) -> list[torch.Tensor]:
    return [q.dequantize(torch.float64) for q in qs]


def _plain_f64(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.double() for t in ts]


def _group_error(name: str, a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    diff2 = ref2 = max_abs = 0.0
    if len(a) != len(b):
        raise CheckpointError(
            f"{name}: checkpoints differ in tensor count, A {len(a)} vs B {len(b)}"
        )
    for ta, tb in zip(a, b, strict=True):
        if ta.shape != tb.shape:
            raise CheckpointError(
                f"{name}: checkpoints differ in shape, A {tuple(ta.shape)} vs B {tuple(tb.shape)}"
            )
        d = tb - ta
        diff2 += float((d * d).sum())
        ref2 += float((ta * ta).sum())
        max_abs = max(max_abs, float(d.abs().max()) if d.numel() else 0.0)
    for label, ts in (("A", a), ("B", b)):
        if not all(bool(torch.isfinite(t).all()) for t in ts):
            raise CheckpointError(
                f"{name}: checkpoint {label}'s dequantized weights are not finite"
            )
    if ref2 == 0.0:
        return (0.0 if diff2 == 0.0 else math.inf), max_abs
    return math.sqrt(diff2 / ref2), max_abs


def weight_group_errors(a: MTPCheckpoint, b: MTPCheckpoint) -> list[GroupError]:
    """Per tensor group of every MTP layer (+ the shared embedding), ranked worst first."""
    if len(a.layers) != len(b.layers):
        raise CheckpointError(
            f"num_nextn_predict_layers: A has {len(a.layers)} MTP layers, B {len(b.layers)}"
        )
    out = []
    for la, lb in zip(a.layers, b.layers, strict=True):
        for (name, fa, ga), (_, fb, gb) in zip(_layer_groups(la), _layer_groups(lb), strict=True):
            full = f"mtp.{la.index}.{name}"
            rel, max_abs = _group_error(full, ga(), gb())
            out.append(GroupError(full, rel, max_abs, fa, fb))
    rel, max_abs = _group_error("embed", [a.embed_tokens.double()], [b.embed_tokens.double()])
    fmt = str(a.embed_tokens.dtype).removeprefix("torch.")
    out.append(
        GroupError("embed", rel, max_abs, fmt, str(b.embed_tokens.dtype).removeprefix("torch."))
    )
    return sorted(out, key=lambda g: -g.rel_error)


# ----------------------------------------------------------------------------- draft drift
@dataclass(frozen=True)
class StepDrift:
    """One draft step over B sequences: fraction whose B-argmax equals A's token; KL(p_A || p_B)
    mean and max over sequences (nats)."""

    step: int
    top1_agreement: float
    kl_mean: float
    kl_max: float


def _on(layer: Any, t: torch.Tensor) -> torch.Tensor:
    return t.to(layer.device)


@torch.no_grad()
def teacher_forced_logits(layer: Any, inputs: DriftInputs, tokens: torch.Tensor) -> torch.Tensor:
    """Logits (B, k, V) float64 of ``layer`` drafting k steps but fed ``tokens`` (B, k) instead of
    its own picks (:meth:`MTPLayer.draft` with ``forced_tokens``)."""
    _, logits = layer.draft(
        _on(layer, inputs.input_ids),
        _on(layer, inputs.positions),
        _on(layer, inputs.prev_hidden).to(layer.dtype),
        seq_lens=inputs.seq_lens,
        num_tokens=tokens.shape[1],
        return_logits=True,
        forced_tokens=tokens,
    )
    return logits.double().cpu()


@torch.no_grad()
def draft_drift(
    layer_a: Any, layer_b: Any, inputs: DriftInputs, num_steps: int
) -> tuple[list[StepDrift], torch.Tensor]:
    """A drafts ``num_steps`` greedy tokens; B is teacher-forced on them.  Returns the per-step
    drift and A's tokens (B, k)."""
    tokens, logits_a = layer_a.draft(
        _on(layer_a, inputs.input_ids),
        _on(layer_a, inputs.positions),
        _on(layer_a, inputs.prev_hidden).to(layer_a.dtype),
        seq_lens=inputs.seq_lens,
        num_tokens=num_steps,
        return_logits=True,
    )
    tokens, logits_a = tokens.cpu(), logits_a.double().cpu()
    logits_b = teacher_forced_logits(layer_b, inputs, tokens)
    for label, logits in (("A", logits_a), ("B", logits_b)):
        bad = ~torch.isfinite(logits).all(-1).all(0)  # (k,) steps with a non-finite logit
        if bool(bad.any()):
            step = int(bad.nonzero()[0])
            raise CheckpointError(
                f"checkpoint {label}: non-finite logits at draft step {step}; the metrics "
                "would be NaN (run dsv4-mtp inspect on it)"
            )
    log_pa = torch.log_softmax(logits_a, dim=-1)  # (B, k, V)
    log_pb = torch.log_softmax(logits_b, dim=-1)
    kl = (log_pa.exp() * (log_pa - log_pb)).sum(-1)  # (B, k)
    agree = (logits_b.argmax(-1) == tokens).double()  # (B, k)
    steps = [
        StepDrift(s, float(agree[:, s].mean()), float(kl[:, s].mean()), float(kl[:, s].max()))
        for s in range(num_steps)
    ]
    return steps, tokens


# ----------------------------------------------------------------------------- entry point
@dataclass
class DriftReport:
    """What :func:`compare_checkpoints` measured (plain data; ``to_dict`` is JSON-ready)."""

    path_a: str
    path_b: str
    implementation: str
    dtype: str
    inputs: str
    steps: list[StepDrift] = field(default_factory=list)
    weight_errors: list[GroupError] = field(default_factory=list)
    draft_tokens: list[list[int]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for strict JSON: a non-finite metric (a relative error against an all-zero
        group is inf) is spelled as a string, never written as a bare NaN / Infinity."""
        return json_safe(asdict(self))


def json_safe(v: Any) -> Any:
    """``v`` with every non-finite float spelled as a string ("inf", "nan"), recursively, so
    ``json.dumps(..., allow_nan=False)`` accepts it."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


# The config fields that fix the shape of some MTP tensor: compare pairs tensors group by group.
_SHAPE_FIELDS = (
    "num_nextn_predict_layers",
    "vocab_size",
    "hidden_size",
    "hc_mult",
    "num_attention_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "n_routed_experts",
    "moe_intermediate_size",
)


def _load(path: str, label: str, notes: list[str]) -> MTPCheckpoint:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck = load_mtp_checkpoint(path)
    notes.extend(f"{label}: {w.message}" for w in caught)
    return ck


def compare_checkpoints(
    path_a: str | os.PathLike[str],
    path_b: str | os.PathLike[str],
    *,
    num_steps: int = 3,
    inputs: DriftInputs | None = None,
    seed: int = 0,
    num_sequences: int = 32,
    seq_len: int = 4,
    dtype: torch.dtype = torch.float32,
    preset: str = "math",
    build_layer: Callable[[MTPCheckpoint], Any] | None = None,
    implementation: str = "reference (CPU)",
    progress: Callable[[str], None] | None = None,
) -> DriftReport:
    """Compare the MTP layers of checkpoint directories A (baseline) and B (module docstring).

    ``inputs``: default :func:`synthetic_drift_inputs` (``seed``, ``num_sequences``,
    ``seq_len``).  ``build_layer``: loaded checkpoint -> a layer with the :class:`MTPLayer`
    interface (default: the reference in ``dtype`` with ``preset`` on CPU).  ``progress`` is
    called with a short text before each stage.
    """
    say = progress or (lambda _text: None)
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise InputError(f"num_steps: expected an int >= 1, got {num_steps!r}")
    if build_layer is None:
        from dsv4mtp.semantics import resolve_semantics

        resolve_semantics(preset)
        check_dtype_arg("dtype", dtype, FLOAT_DTYPES)
    if inputs is not None:
        if not isinstance(inputs, DriftInputs):
            raise InputError(f"inputs: expected DriftInputs, got {type(inputs).__name__}")
        check_finite_at("prev_hidden", inputs.prev_hidden)
    notes: list[str] = []
    say("loading checkpoint A")
    a = _load(os.fspath(path_a), "A", notes)
    say("loading checkpoint B")
    b = _load(os.fspath(path_b), "B", notes)
    differ = [
        f"{k} {getattr(a.config, k)} vs {getattr(b.config, k)}"
        for k in _SHAPE_FIELDS
        if getattr(a.config, k) != getattr(b.config, k)
    ]
    if differ:
        raise CheckpointError(
            f"config: A and B differ ({', '.join(differ)}); compare needs MTP layers of the "
            "same shapes"
        )
    if inputs is None:
        inputs = synthetic_drift_inputs(
            a.config, num_sequences=num_sequences, seq_len=seq_len, seed=seed
        )
    check_drift_inputs(inputs, a.config)
    say("dequantized-weight error per tensor group")
    errors = weight_group_errors(a, b)

    def reference(ck: MTPCheckpoint) -> Any:
        from dsv4mtp.reference import MTPLayer  # the default layer; imported when used

        return MTPLayer.from_loaded(ck, preset=preset, dtype=dtype, device="cpu")

    build = build_layer or reference
    say("building layer A")
    layer_a = build(a)
    say("building layer B")
    layer_b = build(b)
    say(f"drafting {num_steps} step(s) with A, teacher-forcing B")
    steps, tokens = draft_drift(layer_a, layer_b, inputs, num_steps)
    return DriftReport(
        path_a=os.fspath(path_a),
        path_b=os.fspath(path_b),
        implementation=implementation,
        dtype=str(getattr(layer_a, "dtype", dtype)).removeprefix("torch."),
        inputs=inputs.source,
        steps=steps,
        weight_errors=errors,
        draft_tokens=tokens.tolist(),
        warnings=notes,
    )
