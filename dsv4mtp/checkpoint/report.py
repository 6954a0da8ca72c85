"""Inspect a DeepSeek-V4 checkpoint's MTP layers without loading them (``dsv4-mtp inspect``).

:func:`inspect_checkpoint` reads shard headers, then streams the stored codes of every tensor the
loader would read except packed FP4 weights (memory-mapped, one shard at a time), and collects every
problem as a :class:`Finding` instead of stopping at the first, as the loader does.  The checks are
the loader's own (:mod:`.load`: name plan, format detection, expected dtypes and shapes from the
config; :mod:`.scan`: the value rules) plus the NVFP4 gate/up fold of :mod:`.nvfp4`, per expert.

Severities (exit code non-zero only on errors):

=========================================================================== ========
finding                                                                     severity
=========================================================================== ========
checkpoint path not a directory; config.json missing or invalid             error
no MTP layer / fewer than ``num_nextn_predict_layers``                      error
missing, unknown (the loader refuses them), mis-shaped or wrong-dtype tensor error
shard in the index missing or truncated                                     error
NaN/inf value or e4m3 NaN code; NaN, non-positive or overflowing scale     error
unfoldable NVFP4 gate/up ratio (runs here, blocks FlashInfer's moe_ep pack) warning
experts (or dense linears) in a different format than the config says      warning
embedding / head taken from the target; ``mtp.*`` beyond the configured     info
=========================================================================== ========
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from dsv4mtp.checkpoint.io import ShardedCheckpoint, check_checkpoint_dir
from dsv4mtp.checkpoint.load import (
    check_tensor_info,
    claimed_expert_format,
    detect_expert_format,
    detect_linear_format,
    expected_layer_tensors,
    expected_linear_shapes,
    expert_format_mismatch_message,
    format_agrees_with_claim,
    optional_layer_tensors,
    plan_mtp_tensors,
    read_hf_quant_config,
)
from dsv4mtp.checkpoint.nvfp4 import fold_nvfp4_gate_up_scales
from dsv4mtp.checkpoint.scan import Rule, layer_scan_rules, scan_checkpoint
from dsv4mtp.config import DSV4Config
from dsv4mtp.errors import CheckpointError, DSV4Error, FoldError

__all__ = [
    "CheckpointReport",
    "Finding",
    "FoldSummary",
    "GroupFormat",
    "Severity",
    "inspect_checkpoint",
]

Severity = Literal["error", "warning", "info"]
_NVFP4_NOTE = " (normal for current NVIDIA NVFP4 exports, whose MTP experts stay MXFP4)"


@dataclass(frozen=True)
class Finding:
    """One problem or fact: ``code`` is stable (for scripts), ``message`` names the tensor,
    the expected and the actual value."""

    severity: Severity
    code: str
    message: str


@dataclass(frozen=True)
class GroupFormat:
    """Detected format of one tensor group of MTP layer ``layer`` vs what the config claims."""

    layer: int
    group: str  # a dense linear ("attn.wq_b") or "ffn.experts"
    detected: str  # a format tag of weights.FORMATS, or "undetected"
    claimed: str
    agrees: bool


@dataclass(frozen=True)
class FoldSummary:
    """NVFP4 gate/up fold of one MTP layer's routed experts: expert id -> why it does not fold."""

    layer: int
    num_experts: int
    num_foldable: int
    unfoldable: dict[int, str]


@dataclass
class CheckpointReport:
    """What :func:`inspect_checkpoint` found (plain data; ``to_dict`` is JSON-ready)."""

    path: str
    mtp_layers_configured: int | None = None
    mtp_layers_present: int = 0
    num_tensors: int = 0
    formats: list[GroupFormat] = field(default_factory=list)
    nvfp4_fold: list[FoldSummary] = field(default_factory=list)
    embed_source: str | None = None
    head_sources: dict[int, str | None] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    # Target tensors already scanned (every layer's head may be the same target head.weight).
    _scanned: set[str] = field(default_factory=set, repr=False)

    def add(self, severity: Severity, code: str, message: str) -> None:
        self.findings.append(Finding(severity, code, message))

    def of(self, severity: Severity) -> list[Finding]:
        return [f for f in self.findings if f.severity == severity]

    @property
    def errors(self) -> list[Finding]:
        return self.of("error")

    @property
    def warnings(self) -> list[Finding]:
        return self.of("warning")

    @property
    def exit_code(self) -> int:
        """1 when there is at least one error, else 0 (warnings and infos never fail)."""
        return 1 if self.errors else 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("_scanned")
        d["nvfp4_fold"] = [
            {**asdict(s), "unfoldable": {str(e): why for e, why in s.unfoldable.items()}}
            for s in self.nvfp4_fold
        ]
        d["head_sources"] = {str(i): s for i, s in self.head_sources.items()}
        d["counts"] = {s: len(self.of(s)) for s in ("error", "warning", "info")}
        d["exit_code"] = self.exit_code
        return d


# ----------------------------------------------------------------------------- entry point
def inspect_checkpoint(
    path: str | os.PathLike[str], config: DSV4Config | None = None
) -> CheckpointReport:
    """Check the MTP layers of checkpoint directory ``path`` (module docstring); never raises
    for a bad checkpoint: every problem becomes a :class:`Finding` of the report."""
    path = os.fspath(path)
    report = CheckpointReport(path=path)
    if config is None:
        config = _read_config(report)
        if config is None:
            return report
    report.mtp_layers_configured = config.num_nextn_predict_layers
    try:
        ck = ShardedCheckpoint(path)  # every indexed shard present and whole, from headers
    except CheckpointError as e:
        report.add("error", "shard", str(e))
        return report
    try:
        report.num_tensors = len(ck.names)
        _inspect_tensors(report, ck, config, read_hf_quant_config(path))
    finally:
        ck.close()
    return report


def _read_config(report: CheckpointReport) -> DSV4Config | None:
    try:
        check_checkpoint_dir(report.path)
    except CheckpointError as e:
        report.add("error", "path", str(e))
        return None
    if not os.path.exists(os.path.join(report.path, "config.json")):
        report.add("error", "config", f"config.json: not found in {report.path}")
        return None
    try:
        return DSV4Config.from_dir(report.path)
    except (DSV4Error, ValueError, KeyError, TypeError) as e:
        report.add("error", "config", f"config.json: not a DeepSeek-V4 config ({e})")
        return None


def _inspect_tensors(
    report: CheckpointReport, ck: ShardedCheckpoint, config: DSV4Config, hf_quant: dict[str, Any]
) -> None:
    plan = plan_mtp_tensors(ck.names, config)
    for name in sorted(plan.unknown):
        report.add("error", "unknown_tensor", f"{name}: unknown mtp.* tensor name (loader refuses)")
    beyond = [n for n, why in plan.skipped.items() if "outside the configured" in why]
    if beyond:
        report.add(
            "info",
            "extra_mtp_layer",
            f"{len(beyond)} mtp.* tensor(s) beyond num_nextn_predict_layers="
            f"{config.num_nextn_predict_layers} are ignored (e.g. {sorted(beyond)[0]})",
        )
    present = [i for i, names in enumerate(plan.layers) if names]
    report.mtp_layers_present = len(present)
    n_cfg = config.num_nextn_predict_layers
    if not present:
        report.add(
            "error",
            "no_mtp_layer",
            f"no MTP layer: num_nextn_predict_layers={n_cfg} but the checkpoint has no mtp.* "
            f"tensors; it may have been quantized without the MTP layers",
        )
    elif len(present) < n_cfg:
        absent = ", ".join(f"mtp.{i}" for i in range(n_cfg) if i not in present)
        report.add(
            "error",
            "fewer_mtp_layers",
            f"fewer MTP layers than configured: num_nextn_predict_layers={n_cfg}, found "
            f"{len(present)}; no tensors for {absent}",
        )
    for i in present:
        _inspect_layer(report, ck, config, hf_quant, i, plan.layers[i])
    if present:
        _shared_source(report, ck, config, plan.layers[0], "emb.tok_emb.weight", "embed.weight")


def _shared_source(
    report: CheckpointReport,
    ck: ShardedCheckpoint,
    config: DSV4Config,
    names: dict[str, str],
    own: str,
    target: str,
) -> str | None:
    """Where the embedding / head comes from: the MTP layer's own copy, else the target's."""
    if own in names:
        source = names[own]
    elif target in ck:
        source = target
        kind = "embedding" if target.startswith("embed") else "head"
        report.add(
            "info",
            f"{kind}_from_target",
            f"{kind}: taken from the target's {target} (no {_names_prefix(names)}{own})",
        )
        dtypes, shape = optional_layer_tensors(config)[own]
        if _check_header(report, ck, target, dtypes, shape) and target not in report._scanned:
            report._scanned.add(target)  # the head of every layer is the same target tensor
            _scan(report, ck, {target: "finite"})
    else:
        report.add(
            "error",
            "missing_tensor",
            f"{target}: missing{ck.why_missing(target)}, and the MTP layer has no "
            f"{_names_prefix(names)}{own} either",
        )
        source = None
    if own == "emb.tok_emb.weight":
        report.embed_source = source
    return source


def _names_prefix(names: dict[str, str]) -> str:
    """``mtp.{i}.`` of a layer's name map (rel -> full)."""
    rel, full = next(iter(names.items()))
    return full[: len(full) - len(rel)]


def _check_header(
    report: CheckpointReport, ck: ShardedCheckpoint, name: str, dtypes: Any, shape: Any
) -> bool:
    info = ck.info(name)
    try:
        check_tensor_info(info, dtypes, shape)
    except CheckpointError as e:
        code = "wrong_dtype" if info.dtype not in dtypes else "wrong_shape"
        report.add("error", code, str(e))
        return False
    return True


# ----------------------------------------------------------------------------- one layer
def _dense_claim(config: DSV4Config) -> str:
    """What ``quantization_config`` claims for the dense linears (``fp8`` accepts both scales)."""
    qc = config.quantization_config or {}
    if qc.get("quant_method") != "fp8":
        return "bf16"
    return "fp8_e8m0" if qc.get("scale_fmt") == "ue8m0" else "fp8"


def _detect_code(e: CheckpointError) -> str:
    """Finding code of a format-detection error: a missing scale or no experts, else a dtype."""
    message = str(e)
    return "missing_tensor" if ": missing" in message or "no routed" in message else "wrong_dtype"


def _inspect_layer(
    report: CheckpointReport,
    ck: ShardedCheckpoint,
    config: DSV4Config,
    hf_quant: dict[str, Any],
    index: int,
    names: dict[str, str],
) -> None:
    prefix = f"mtp.{index}."
    undetected: list[str] = []  # groups whose tensors are not checked further
    linear_formats = {}
    dense_claim = _dense_claim(config)
    for base in expected_linear_shapes(config):
        try:
            fmt = detect_linear_format(ck, prefix + base)
        except CheckpointError as e:
            report.add("error", _detect_code(e), str(e))
            fmt = "undetected"
            undetected.append(base + ".")
        linear_formats[base] = fmt if fmt != "undetected" else "fp8_e8m0"
        agrees = fmt == "undetected" or format_agrees_with_claim(fmt, dense_claim)
        report.formats.append(GroupFormat(index, base, fmt, dense_claim, agrees))
        if not agrees:
            report.add(
                "warning",
                "dense_format_mismatch",
                f"{prefix}{base}: stored as {fmt} but quantization_config claims {dense_claim}",
            )

    claim = claimed_expert_format(config, hf_quant, index)
    try:
        expert_format = detect_expert_format(ck, names, f"mtp.{index}")
    except CheckpointError as e:
        report.add("error", _detect_code(e), str(e))
        expert_format = "undetected"
        undetected.append("ffn.experts.")
    agrees = expert_format == "undetected" or format_agrees_with_claim(expert_format, claim)
    report.formats.append(GroupFormat(index, "ffn.experts", expert_format, claim, agrees))
    if not agrees:
        note = _NVFP4_NOTE if (claim, expert_format) == ("nvfp4", "mxfp4") else ""
        msg = expert_format_mismatch_message(config, index, expert_format, claim)
        report.add("warning", "expert_format_mismatch", msg + note)

    expected = expected_layer_tensors(
        config,
        linear_formats,
        expert_format if expert_format != "undetected" else "bf16",
        has_input_scale=any(rel.endswith(".input_scale") for rel in names),
    )
    optional = optional_layer_tensors(config)

    def skipped(rel: str) -> bool:
        return rel.startswith(tuple(undetected))

    for rel in sorted(names):
        if rel not in expected and rel not in optional and not skipped(rel):
            report.add(
                "error",
                "unknown_tensor",
                f"{prefix}{rel}: unexpected tensor for MTP layer mtp.{index} (experts detected "
                f"as {expert_format})",
            )
    ok = []
    for rel, (dtypes, shape) in expected.items():
        if skipped(rel):
            continue
        if rel not in names:
            want = "() or (1,)" if shape == "scalar" else str(tuple(shape))
            dtype_names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            report.add(
                "error",
                "missing_tensor",
                f"{prefix}{rel}: missing{ck.why_missing(prefix + rel)} (expected dtype "
                f"{dtype_names}, shape {want})",
            )
        elif _check_header(report, ck, names[rel], dtypes, shape):
            ok.append(rel)
    for rel in optional:
        if rel in names and _check_header(report, ck, names[rel], *optional[rel]):
            ok.append(rel)

    rules = layer_scan_rules(prefix, ok, linear_formats, expert_format)
    bad = _scan(report, ck, rules)
    bad_scale_2 = {rel for rel in ok if rel.endswith(".weight_scale_2") and prefix + rel in bad}
    if expert_format == "nvfp4":
        report.nvfp4_fold.append(_fold_summary(ck, config, index, names, set(ok), bad_scale_2))
        summary = report.nvfp4_fold[-1]
        if summary.unfoldable:
            first, why = next(iter(summary.unfoldable.items()))
            report.add(
                "warning",
                "nvfp4_unfoldable",
                f"mtp.{index}.ffn.experts: {len(summary.unfoldable)} of {summary.num_experts} "
                f"experts cannot fold NVFP4 gate/up weight_scale_2 into one fc1_alpha (runs in "
                f"the reference, blocks FlashInfer's moe_ep pack); e.g. expert {first}: {why}",
            )
    report.head_sources[index] = _shared_source(
        report, ck, config, names, "head.weight", "head.weight"
    )


def _scan(report: CheckpointReport, ck: ShardedCheckpoint, rules: dict[str, Rule]) -> set[str]:
    """Scan the stored codes (the loader's rules, :mod:`.scan`); every bad tensor becomes an
    error.  Returns the names of the bad tensors."""
    bad = set()
    try:
        for finding in scan_checkpoint(ck, rules):
            report.add("error", finding.code, finding.message)
            bad.add(finding.name)
    except CheckpointError as e:  # a tensor the headers describe but safetensors cannot read
        report.add("error", "shard", str(e))
        bad.update(rules)
    return bad


def _fold_summary(
    ck: ShardedCheckpoint,
    config: DSV4Config,
    index: int,
    names: dict[str, str],
    ok: set[str],
    bad: set[str],
) -> FoldSummary:
    """Try :func:`fold_nvfp4_gate_up_scales` on each expert alone (its gate/up pair)."""
    E, I = config.n_routed_experts, config.moe_intermediate_size
    unfoldable: dict[int, str] = {}
    for e in range(E):
        p = f"ffn.experts.{e}."
        needed = [p + s for s in ("w1.weight_scale", "w3.weight_scale")]
        scalars = [p + f"{w}.weight_scale_2" for w in ("w1", "w3", "w2")]
        if any(r not in ok for r in needed + scalars) or any(r in bad for r in scalars):
            unfoldable[e] = "scale tensors missing or invalid (see the errors)"
            continue
        block = torch.cat([ck.get(names[r]) for r in needed], 0)[None]  # (1, 2I, H/16)
        s2 = [ck.get(names[r]).float().reshape(1) for r in scalars]
        try:
            fold_nvfp4_gate_up_scales(block, torch.stack(s2[:2], 1), s2[2], intermediate_size=I)
        except FoldError as err:
            unfoldable[e] = str(err).replace("local expert 0", f"expert {e}")
    return FoldSummary(index, E, E - len(unfoldable), unfoldable)
