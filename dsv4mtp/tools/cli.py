"""The ``dsv4-mtp`` command line.  Every command has ``--help``.

One error path: a :class:`DSV4Error` raised by any command (bad argument, file, tensor or
checkpoint) is printed as one ``Error: <message>`` line on stderr with exit code 1; click's usage
errors exit 2.  Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from dsv4mtp import __version__
from dsv4mtp.errors import DSV4Error


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DSV4Error as e:
            # click prints a ClickException as "Error: <message>" and exits 1; one line.
            raise click.ClickException(" ".join(str(e).split("\n"))) from e


def _dumps(data: Any) -> str:
    """Strict JSON: a non-finite metric is spelled as a string, never a bare NaN / Infinity."""
    import json

    from dsv4mtp.tools.drift import json_safe

    return json.dumps(json_safe(data), indent=2, allow_nan=False)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dsv4-mtp")
def main() -> None:
    """DeepSeek-V4 MTP draft layer: reference, optimized kernels, checkpoint tools."""


@main.command()
@click.option(
    "--checkpoint",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="A DeepSeek-V4 checkpoint directory (real or synthetic). Default: make a tiny synthetic one.",
)
@click.option(
    "--expert-format",
    type=click.Choice(["mxfp4", "nvfp4", "fp8", "bf16"]),
    default="mxfp4",
    show_default=True,
    help="Routed-expert format of the synthetic checkpoint.",
)
@click.option(
    "--num-tokens",
    "-k",
    type=click.IntRange(1, 64),
    default=3,
    show_default=True,
    help="Draft tokens per sequence.",
)
@click.option(
    "--batch", "-b", type=click.IntRange(1, 64), default=4, show_default=True, help="Sequences."
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def demo(
    checkpoint: str | None,
    expert_format: str,
    num_tokens: int,
    batch: int,
    seed: int,
    device: str | None,
    as_json: bool,
) -> None:
    """Load an MTP layer, draft k tokens for a batch, and report agreement with the oracle."""
    from dsv4mtp.tools.demo import main as demo_main

    demo_main(
        checkpoint=checkpoint,
        expert_format=expert_format,
        num_tokens=num_tokens,
        batch=batch,
        seed=seed,
        device=device,
        as_json=as_json,
    )


# ----------------------------------------------------------------------------- inspect
_SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def _print_inspect(report: Any) -> None:
    """The :class:`CheckpointReport` as rich tables (stdout)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    head = Table(title="DeepSeek-V4 MTP checkpoint", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    head.add_row("checkpoint", report.path)
    head.add_row(
        "MTP layers",
        f"{report.mtp_layers_present} present / {report.mtp_layers_configured} configured "
        f"(num_nextn_predict_layers)",
    )
    head.add_row("tensors", str(report.num_tensors))
    head.add_row("embedding from", str(report.embed_source))
    for i, src in report.head_sources.items():
        head.add_row(f"mtp.{i} head from", str(src))
    console.print(head)
    if report.formats:
        fmt = Table(title="formats per tensor group", title_justify="left")
        for col in ("layer", "group", "detected", "config claims", "agrees"):
            fmt.add_column(col)
        for g in report.formats:
            ok = "[green]yes" if g.agrees else "[yellow]no"
            fmt.add_row(f"mtp.{g.layer}", g.group, g.detected, g.claimed, ok)
        console.print(fmt)
    for s in report.nvfp4_fold:
        if not s.unfoldable:  # a table with no rows says nothing: one line instead
            console.print(
                f"mtp.{s.layer} NVFP4 gate/up fold: all {s.num_experts} experts fold", style="green"
            )
            continue
        fold = Table(
            title=f"mtp.{s.layer} NVFP4 gate/up fold: {s.num_foldable} of {s.num_experts} "
            f"experts fold",
            title_justify="left",
        )
        fold.add_column("expert")
        fold.add_column("why it does not fold")
        for e, why in s.unfoldable.items():
            fold.add_row(str(e), why)
        console.print(fold)
    findings = Table(title="findings", title_justify="left")
    for col in ("severity", "code", "message"):
        findings.add_column(col)
    for f in report.findings:
        style = _SEVERITY_STYLE[f.severity]
        findings.add_row(f"[{style}]{f.severity}", f.code, f.message)
    console.print(findings)
    n_err, n_warn = len(report.errors), len(report.warnings)
    verdict = "[bold red]FAIL" if n_err else "[green]OK"
    console.print(f"{verdict}[/]: {n_err} error(s), {n_warn} warning(s)")


@main.command()
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def inspect(checkpoint: str, as_json: bool) -> None:
    """Check CHECKPOINT's MTP layers from headers and stored codes (no full load).

    Reports MTP layers present vs configured, the format of every tensor group vs config.json /
    quantization_config / hf_quant_config.json, missing, unexpected, mis-shaped and wrong-dtype
    tensors, NaN/inf values and e4m3 NaN codes, NaN, non-positive or overflowing scales (the
    loader's rules), NVFP4 gate/up foldability per expert, and where the embedding and head
    come from.  Exit code 1 when there is any error, else 0.
    """
    from dsv4mtp.checkpoint.report import inspect_checkpoint

    report = inspect_checkpoint(checkpoint)  # a DSV4Error here becomes one Error: line (_Group)
    if as_json:
        click.echo(_dumps(report.to_dict()))
    else:
        _print_inspect(report)
    sys.exit(report.exit_code)


# ----------------------------------------------------------------------------- compare
def _optimized_builder() -> tuple[Any, str]:
    """``dsv4mtp.optimized.MTPLayer`` on CUDA when both exist, else None (use the reference).

    Only a missing optional dependency (ImportError) or a missing ``MTPLayer`` falls back; any
    other failure while importing the optimized package is a bug and surfaces."""
    import torch

    if not torch.cuda.is_available():
        return None, "reference (CPU)"
    try:
        import dsv4mtp.optimized as optimized
    except ImportError:
        return None, "reference (CPU)"
    cls = getattr(optimized, "MTPLayer", None)
    if cls is None or not hasattr(cls, "from_loaded"):
        return None, "reference (CPU)"
    return (
        lambda ck: cls.from_loaded(ck, dtype=torch.bfloat16, device="cuda"),
        "optimized (CUDA)",
    )


def _print_compare(report: Any) -> None:
    """The :class:`DriftReport` as rich tables (stdout)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    head = Table(title="MTP draft drift: B vs baseline A", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    head.add_row("A (baseline)", report.path_a)
    head.add_row("B", report.path_b)
    head.add_row("implementation", f"{report.implementation}, {report.dtype}")
    head.add_row("inputs", report.inputs)
    for w in report.warnings:
        head.add_row("[yellow]warning", w)
    console.print(head)
    steps = Table(title="per draft step (B teacher-forced on A's tokens)", title_justify="left")
    for col in ("step", "top-1 agreement", "KL(p_A || p_B) mean", "KL max"):
        steps.add_column(col)
    for s in report.steps:
        steps.add_row(
            str(s.step), f"{100 * s.top1_agreement:.1f} %", f"{s.kl_mean:.3g}", f"{s.kl_max:.3g}"
        )
    console.print(steps)
    errs = Table(title="dequantized-weight relative error, worst first", title_justify="left")
    errs.add_column("tensor group", no_wrap=True)
    for col in ("||B - A|| / ||A||", "max |B - A|", "format A", "format B"):
        errs.add_column(col)
    for g in report.weight_errors:
        style = "bold" if g.rel_error > 0 else "dim"
        errs.add_row(
            f"[{style}]{g.group}",
            f"{g.rel_error:.3g}",
            f"{g.max_abs_error:.3g}",
            g.format_a,
            g.format_b,
        )
    console.print(errs)


@main.command()
@click.argument("dir_a", type=click.Path(exists=True, file_okay=False))
@click.argument("dir_b", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--steps", "-k", type=click.IntRange(1, 64), default=3, show_default=True, help="Draft steps."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Synthetic input seed.")
@click.option(
    "--sequences",
    type=click.IntRange(1),
    default=32,
    show_default=True,
    help="Synthetic sequences.",
)
@click.option(
    "--seq-len", type=click.IntRange(1), default=4, show_default=True, help="Rows per sequence."
)
@click.option(
    "--inputs",
    "inputs_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="safetensors file with prev_hidden (T, hc_mult*D), input_ids, positions [, seq_lens].",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float64"]),
    default="float32",
    show_default=True,
    help="Reference activation dtype.",
)
@click.option(
    "--preset",
    type=click.Choice(["math", "official", "vllm"]),
    default="math",
    show_default=True,
    help="Reference semantics preset.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def compare(
    dir_a: str,
    dir_b: str,
    steps: int,
    seed: int,
    sequences: int,
    seq_len: int,
    inputs_path: str | None,
    dtype: str,
    preset: str,
    as_json: bool,
) -> None:
    """Measure draft drift of DIR_B's MTP layers against DIR_A's (the baseline).

    Both run on the same deterministic inputs; per draft step: top-1 agreement and
    KL(p_A || p_B); per tensor group: the relative error of the dequantized weights, worst
    first.  Runs the reference on CPU (the optimized layer on CUDA when available).  Presets:
    docs/semantics.md, "Presets and switches".
    """
    import torch
    from rich.console import Console

    from dsv4mtp.reference import DSV4Config
    from dsv4mtp.tools.drift import compare_checkpoints, load_drift_inputs

    build, implementation = _optimized_builder()
    status = Console(stderr=True).status("comparing")
    with status:
        # The inputs are checked before either checkpoint is loaded.
        inputs = load_drift_inputs(inputs_path, DSV4Config.from_dir(dir_a)) if inputs_path else None
        report = compare_checkpoints(
            dir_a,
            dir_b,
            num_steps=steps,
            inputs=inputs,
            seed=seed,
            num_sequences=sequences,
            seq_len=seq_len,
            dtype=getattr(torch, dtype),
            preset=preset,
            build_layer=build,
            implementation=implementation,
            progress=status.update,
        )
    if as_json:
        click.echo(_dumps(report.to_dict()))
    else:
        _print_compare(report)


# ----------------------------------------------------------------------------- make-checkpoint
@main.command("make-checkpoint")
@click.option(
    "--config",
    "config_name",
    required=True,
    help="flash, pro, tiny, or a DeepSeek-V4 config.json (or a directory holding one).",
)
@click.option(
    "--expert-format",
    type=click.Choice(["mxfp4", "nvfp4", "fp8"]),
    default="mxfp4",
    show_default=True,
    help="Routed experts: MXFP4 (V4-Flash), NVFP4 (ModelOpt), FP8 (V4-Flash-Base).",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False),
    help="New or empty directory to write into.",
)
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option(
    "--shard-mb",
    type=float,
    default=4000,
    show_default=True,
    help="Tensor data per shard, in megabytes (10^6 bytes).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--dry-run", is_flag=True, help="Plan the shards and print their sizes; write nothing."
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def make_checkpoint(
    config_name: str,
    expert_format: str,
    out: str,
    device: str | None,
    shard_mb: float,
    seed: int,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Write a real-size checkpoint (MTP layers + embed + head) with random codes and scales.

    Codes and scales are drawn in their stored form with torch's RNG on DEVICE, one tensor at a
    time, and written shard by shard (config.json, model.safetensors.index.json,
    model-XXXXX-of-NNNNN.safetensors), so host memory holds one shard.  Deterministic for a seed
    and a device type.  For load-time and memory measurements at real size
    (bench/load_fullsize.py); a V4-Flash MXFP4 checkpoint is 5.7 GB.
    """
    import torch

    from dsv4mtp.checkpoint.fullsize import make_fullsize_checkpoint

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    progress = None if as_json else (lambda line: click.echo(line, err=True))
    report = make_fullsize_checkpoint(
        out,
        config_name,
        expert_format=expert_format,
        device=device,
        shard_mb=shard_mb,
        seed=seed,
        dry_run=dry_run,
        progress=progress,
    )
    if as_json:
        click.echo(_dumps(report.to_dict()))
        return
    size = "data bytes (planned)" if dry_run else "file bytes"
    click.echo(f"| shard | tensors | {size} |")
    click.echo("|---|---|---|")
    for s in report.shards:
        click.echo(f"| {s.file} | {s.tensors} | {s.data_bytes if dry_run else s.file_bytes} |")
    click.echo(
        f"\n{'planned' if dry_run else 'wrote'} {report.num_tensors} tensors, "
        f"{report.total_bytes} bytes ({report.total_bytes / 1e9:.3f} GB) in "
        f"{len(report.shards)} shard(s) under {report.path}: config {report.config}, experts "
        f"{report.expert_format}, device {report.device}, seed {report.seed}; "
        f"draw {report.draw_s:.2f} s, write {report.write_s:.2f} s, wall {report.wall_s:.2f} s"
    )


if __name__ == "__main__":
    main()
