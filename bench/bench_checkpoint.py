"""CPU benchmarks of the reference checkpoint path and one MTP draft step (tiny config).

These time the readable reference, not the kernels: they say how long the demo and the CPU tier
spend writing, loading and drafting, and catch accidental slowdowns (run with ``nox -s bench``).
"""

from __future__ import annotations

import pytest
import torch

from dsv4mtp.reference import DSV4Config, MTPLayer, load_mtp_checkpoint, make_synthetic_checkpoint

TINY = DSV4Config.tiny()


@pytest.mark.parametrize("expert_format", ["mxfp4", "nvfp4", "fp8"])
def test_make_synthetic_checkpoint(benchmark, tmp_path_factory, expert_format: str) -> None:
    benchmark(
        lambda: make_synthetic_checkpoint(
            tmp_path_factory.mktemp(expert_format), TINY, expert_format=expert_format
        )
    )


@pytest.mark.parametrize("expert_format", ["mxfp4", "nvfp4"])
def test_load_mtp_checkpoint(benchmark, tmp_path, expert_format: str) -> None:
    path = make_synthetic_checkpoint(tmp_path, TINY, expert_format=expert_format)
    benchmark(load_mtp_checkpoint, path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=["bf16", "f64"])
def test_reference_draft_step(benchmark, tmp_path, dtype: torch.dtype) -> None:
    """One k=3 draft for 4 sequences of 8 rows on the tiny config."""
    layer = MTPLayer.from_checkpoint(make_synthetic_checkpoint(tmp_path, TINY), dtype=dtype)
    g = torch.Generator().manual_seed(0)
    T = 32
    ids = torch.randint(0, TINY.vocab_size, (T,), generator=g)
    pos = torch.arange(T) % 8 + 5
    prev = torch.randn(T, TINY.hc_dim, generator=g).to(dtype)
    seq_lens = torch.tensor([8, 8, 8, 8])
    benchmark(layer.draft, ids, pos, prev, seq_lens=seq_lens, num_tokens=3)
