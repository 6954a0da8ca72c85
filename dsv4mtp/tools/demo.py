"""``dsv4-mtp demo``: load an MTP layer, draft k tokens for a small batch, report agreement.

Creates a tiny synthetic checkpoint in a temporary directory (or uses ``--checkpoint DIR``, a
synthetic or real DeepSeek-V4 directory), loads the MTP layer once (routed experts stay packed),
builds the bf16 reference and the float64 ``math`` oracle (``docs/semantics.md``, "Presets and
switches") from the same loaded tensors, drafts ``num_tokens`` tokens per sequence and reports:

* formats detected (routed experts per layer, dense linears) and tensors loaded;
* the drafted tokens (bf16 reference, free-running) and the oracle's;
* time per draft step of the bf16 reference;
* agreement with the oracle, teacher-forced on the oracle's tokens so one early disagreement
  does not make every later step incomparable: top-1 agreement and max |logit error|;
* on a CUDA machine, the same for ``dsv4mtp.optimized.MTPLayer`` when that module exposes one.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from dsv4mtp.checkpoint.load import load_mtp_checkpoint
from dsv4mtp.checkpoint.synthetic import make_synthetic_checkpoint
from dsv4mtp.checks import check_device_arg, check_int
from dsv4mtp.errors import CheckpointError, DSV4Error
from dsv4mtp.reference import DSV4Config, MTPLayer
from dsv4mtp.tools.drift import json_safe

__all__ = ["main", "print_report", "run_demo"]


@contextmanager
def _step(progress: Progress | None, text: str) -> Iterator[None]:
    task = progress.add_task(text, total=1) if progress is not None else None
    try:
        yield
    finally:
        if progress is not None and task is not None:
            progress.update(task, completed=1)


def _inputs(config: DSV4Config, batch: int, seed: int, device: torch.device) -> dict[str, Any]:
    """A batch of sequences as the target would hand them over: shifted ids, target positions
    (not starting at 0), the target's flat residual (random N(0, 1) here)."""
    g = torch.Generator().manual_seed(seed)
    hi = max(2, min(config.sliding_window + 8, 24))
    lens = torch.randint(2, hi + 1, (batch,), generator=g)
    T = int(lens.sum())
    starts = torch.randint(1, 200, (batch,), generator=g)
    positions = torch.cat(
        [torch.arange(int(s), int(s) + int(n)) for s, n in zip(starts, lens, strict=True)]
    )
    return {
        "input_ids": torch.randint(0, config.vocab_size, (T,), generator=g).to(device),
        "positions": positions.to(device),
        "prev_hidden": torch.randn(T, config.hc_dim, generator=g, dtype=torch.float64).to(device),
        "seq_lens": lens,
    }


def _teacher_forced(
    layer: Any, inp: dict[str, Any], forced: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, list[float]]:
    """Per-step logits (B, k, V) of ``layer`` fed the oracle's tokens, and seconds per step."""
    lens = inp["seq_lens"]
    B, k = forced.shape
    caches = [[layer.new_kv_cache() for _ in range(B)] for _ in range(len(layer.layers))]
    last = lens.cumsum(0) - 1
    ids, pos, prev = inp["input_ids"], inp["positions"], inp["prev_hidden"].to(dtype)
    step_lens, logits, times = lens, [], []
    for step in range(k):
        t0 = time.perf_counter()
        hidden = layer.forward(
            ids, pos, prev, seq_lens=step_lens, kv_cache=caches[step % len(caches)], spec_step=step
        )
        if step == 0:
            hidden, pos = hidden[last.to(hidden.device)], pos[last.to(pos.device)]
        logits.append(layer.compute_logits(hidden, spec_step=step).double())
        if hidden.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        ids, pos, prev = forced[:, step].to(ids.device), pos + 1, hidden
        step_lens = torch.ones(B, dtype=torch.int64)
    return torch.stack(logits, 1), times


def _agreement(
    logits: torch.Tensor, oracle_logits: torch.Tensor, oracle_tokens: torch.Tensor
) -> dict[str, Any]:
    logits, oracle_logits = logits.double().cpu(), oracle_logits.double().cpu()
    err = (logits - oracle_logits).abs()
    return {
        "top1_agreement": float((logits.argmax(-1) == oracle_tokens.cpu()).double().mean()),
        "max_logit_error": float(err.max()),
        "rel_logit_error": float((logits - oracle_logits).norm() / oracle_logits.norm()),
        "logit_std": float(oracle_logits.std()),
    }


def _optimized_layer(checkpoint: Any, device: torch.device) -> tuple[Any, str | None]:
    if device.type != "cuda":
        return None, "skipped: no CUDA device"
    # The optimized path is optional: a missing dependency or MTPLayer, or a checkpoint it
    # refuses (a DSV4Error), is reported; any other exception is a bug and surfaces.
    try:
        import dsv4mtp.optimized as optimized
    except ImportError as e:
        return None, f"skipped: dsv4mtp.optimized failed to import ({e})"
    cls = getattr(optimized, "MTPLayer", None)
    if cls is None:
        return None, "skipped: dsv4mtp.optimized does not expose MTPLayer yet"
    try:
        if hasattr(cls, "from_loaded"):
            return cls.from_loaded(checkpoint, dtype=torch.bfloat16, device=device), None
        return cls.from_checkpoint(checkpoint.path, dtype=torch.bfloat16, device=device), None
    except DSV4Error as e:
        return None, f"failed to load: {type(e).__name__}: {e}"


def run_demo(
    checkpoint: str | None,
    *,
    expert_format: str = "mxfp4",
    num_tokens: int = 3,
    batch: int = 4,
    seed: int = 0,
    device: str | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the demo and return the report as plain data (see the module docstring).

    ``console``: where the loading progress is drawn (None: no progress display).
    """
    check_int("num_tokens", num_tokens, 1)
    check_int("batch", batch, 1)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = check_device_arg("device", device)
    report: dict[str, Any] = {
        "device": str(dev),
        "num_tokens": num_tokens,
        "batch": batch,
        "seed": seed,
    }
    timings: dict[str, float] = {}
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
        disable=console is None,
    )
    with tempfile.TemporaryDirectory(prefix="dsv4mtp-demo-") as tmp, progress:
        t0 = time.perf_counter()
        if checkpoint is None:
            with _step(progress, f"writing a tiny synthetic checkpoint ({expert_format} experts)"):
                checkpoint_dir = make_synthetic_checkpoint(
                    tmp, DSV4Config.tiny(), expert_format=expert_format, seed=seed
                )
            report["synthetic"] = True
        else:
            checkpoint_dir = checkpoint
            report["synthetic"] = False
        report["checkpoint"] = (
            checkpoint_dir if checkpoint is not None else f"(temporary) {checkpoint_dir}"
        )
        with _step(progress, "reading mtp.* tensors (memory-mapped safetensors)"):
            loaded = load_mtp_checkpoint(checkpoint_dir)
        with _step(progress, "dequantizing dense weights to bf16 (experts stay packed)"):
            reference = MTPLayer.from_loaded(loaded, dtype=torch.bfloat16, device=dev)
        with _step(progress, "building the float64 math oracle"):
            oracle = MTPLayer.from_loaded(loaded, dtype=torch.float64, device=dev)
        timings["load_s"] = time.perf_counter() - t0
        optimized, optimized_note = _optimized_layer(loaded, dev)

    cfg = loaded.config
    report["config"] = {
        k: getattr(cfg, k)
        for k in (
            "hidden_size",
            "hc_mult",
            "num_attention_heads",
            "head_dim",
            "n_routed_experts",
            "num_experts_per_tok",
            "vocab_size",
            "sliding_window",
            "num_nextn_predict_layers",
        )
    }
    report["formats"] = {
        "routed_experts": list(loaded.expert_formats),
        "dense": reference.info["dense_formats"],
    }
    report["tensors_loaded"] = len(loaded.loaded)
    report["tensors_skipped"] = len(loaded.skipped)
    report["embed_source"], report["head_source"] = (
        loaded.embed_source,
        reference.info["head_source"],
    )
    report["warnings"] = list(loaded.warnings)

    inp = _inputs(cfg, batch, seed, dev)
    report["seq_lens"] = inp["seq_lens"].tolist()
    prev16 = inp["prev_hidden"].to(torch.bfloat16)
    args = (inp["input_ids"], inp["positions"])

    t0 = time.perf_counter()
    tokens16 = reference.draft(*args, prev16, seq_lens=inp["seq_lens"], num_tokens=num_tokens)
    timings["draft_s"] = time.perf_counter() - t0
    tokens64, logits64 = oracle.draft(
        *args, prev16.double(), seq_lens=inp["seq_lens"], num_tokens=num_tokens, return_logits=True
    )
    if not bool(torch.isfinite(logits64).all()):
        raise CheckpointError(
            f"{report['checkpoint']}: the float64 oracle's logits are not finite, so every "
            "agreement metric would be NaN (run dsv4-mtp inspect on it)"
        )
    forced16, step_times = _teacher_forced(
        reference, {**inp, "prev_hidden": prev16}, tokens64, torch.bfloat16
    )
    timings["step_ms"] = [1e3 * t for t in step_times]  # type: ignore[assignment]
    report["draft_tokens"] = {
        "reference_bf16": tokens16.tolist(),
        "oracle_float64": tokens64.tolist(),
    }
    report["agreement"] = {"reference_bf16": _agreement(forced16, logits64, tokens64)}
    report["free_running_token_agreement"] = float(
        (tokens16.cpu() == tokens64.cpu()).double().mean()
    )

    if optimized is not None:
        try:
            opt_tokens = optimized.draft(
                *args, prev16, seq_lens=inp["seq_lens"], num_tokens=num_tokens
            )
            forced_opt, opt_times = _teacher_forced(
                optimized, {**inp, "prev_hidden": prev16}, tokens64, torch.bfloat16
            )
            report["draft_tokens"]["optimized_bf16"] = opt_tokens.tolist()
            report["agreement"]["optimized_bf16"] = _agreement(forced_opt, logits64, tokens64)
            timings["optimized_step_ms"] = [1e3 * t for t in opt_times]  # type: ignore[assignment]
        except DSV4Error as e:
            optimized_note = f"failed: {type(e).__name__}: {e}"
    report["optimized"] = optimized_note or "ran"
    report["timings"] = timings
    return report


def print_report(report: dict[str, Any], console: Console | None = None) -> None:
    """The report as rich tables."""
    console = console or Console()
    head = Table(title="DeepSeek-V4 MTP draft layer: demo", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    head.add_row("checkpoint", str(report["checkpoint"]))
    head.add_row("device", report["device"])
    head.add_row("routed experts", ", ".join(report["formats"]["routed_experts"]))
    head.add_row("dense linears", ", ".join(report["formats"]["dense"]))
    head.add_row(
        "tensors loaded", f"{report['tensors_loaded']} (skipped {report['tensors_skipped']})"
    )
    head.add_row("embed / head from", f"{report['embed_source']} / {report['head_source']}")
    cfg = report["config"]
    head.add_row(
        "shape",
        f"D={cfg['hidden_size']} n={cfg['hc_mult']} heads={cfg['num_attention_heads']}x"
        f"{cfg['head_dim']} experts={cfg['n_routed_experts']} top-{cfg['num_experts_per_tok']} "
        f"vocab={cfg['vocab_size']} window={cfg['sliding_window']}",
    )
    head.add_row(
        "batch",
        f"{report['batch']} sequences, lengths {report['seq_lens']}, k={report['num_tokens']}",
    )
    t = report["timings"]
    head.add_row("load", f"{t['load_s']:.2f} s")
    head.add_row(
        "bf16 step time", ", ".join(f"{ms:.1f}" for ms in t["step_ms"]) + " ms (step 0 = all rows)"
    )
    if "optimized_step_ms" in t:
        head.add_row(
            "optimized step time", ", ".join(f"{ms:.2f}" for ms in t["optimized_step_ms"]) + " ms"
        )
    head.add_row("optimized path", report["optimized"])
    for w in report["warnings"]:
        head.add_row("[yellow]warning", w)
    console.print(head)

    tokens = Table(title="draft tokens per sequence", title_justify="left")
    tokens.add_column("seq")
    names = list(report["draft_tokens"])
    for name in names:
        tokens.add_column(name)
    for b in range(report["batch"]):
        tokens.add_row(str(b), *(" ".join(map(str, report["draft_tokens"][n][b])) for n in names))
    console.print(tokens)

    agree = Table(
        title="agreement with the float64 math oracle (teacher-forced)", title_justify="left"
    )
    for col in (
        "implementation",
        "top-1 agreement",
        "max |logit error|",
        "relative logit error",
        "logit std",
    ):
        agree.add_column(col)
    for name, a in report["agreement"].items():
        agree.add_row(
            name,
            f"{100 * a['top1_agreement']:.1f} %",
            f"{a['max_logit_error']:.3g}",
            f"{a['rel_logit_error']:.3g}",
            f"{a['logit_std']:.3g}",
        )
    console.print(agree)
    console.print(
        f"free-running draft tokens equal to the oracle's: "
        f"{100 * report['free_running_token_agreement']:.1f} %"
    )


def main(
    *,
    checkpoint: str | None,
    expert_format: str,
    num_tokens: int,
    batch: int,
    seed: int,
    device: str | None,
    as_json: bool = False,
    printer: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """What ``dsv4-mtp demo`` runs: progress on stderr, the report on stdout."""
    progress_console = Console(stderr=True)
    report = run_demo(
        checkpoint,
        expert_format=expert_format,
        num_tokens=num_tokens,
        batch=batch,
        seed=seed,
        device=device,
        console=progress_console,
    )
    if as_json:
        (printer or print)(json.dumps(json_safe(report), indent=2, allow_nan=False))
    else:
        print_report(report)
    return report
