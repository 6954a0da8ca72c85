"""The ``dsv4-mtp`` command line.  Every command has ``--help``."""

from __future__ import annotations

import click

from dsv4mtp import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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
    from dsv4mtp.demo import main as demo_main

    demo_main(
        checkpoint=checkpoint,
        expert_format=expert_format,
        num_tokens=num_tokens,
        batch=batch,
        seed=seed,
        device=device,
        as_json=as_json,
    )


if __name__ == "__main__":
    main()
