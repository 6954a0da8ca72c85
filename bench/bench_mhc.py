"""pytest-benchmark rows for ``nox -s bench``: optimized vs reference mHC / hc_head / rms_norm.

On a CUDA machine: T in {1, 8, 64, 512, 4096}, D in {4096, 7168}, n = 4, bf16; each round runs
one call and synchronizes, so these are host-visible latencies (launch overhead included).  The
H200 numbers (GPU time from CUDA-graph replay, rotating inputs, bandwidth fractions, same-run
baselines) come from ``bench/h200_mhc.py``; see bench/results/.  Without CUDA only small
reference rows run (the optimized kernels need a GPU outside the Triton interpreter).
"""

from __future__ import annotations

import pytest
import torch

import dsv4mtp.optimized as opt
import dsv4mtp.reference as ref
from dsv4mtp.conformance.inputs import op_inputs

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
SHAPES = (
    [(T, D) for D in (4096, 7168) for T in (1, 8, 64, 512, 4096)] if CUDA else [(1, 256), (64, 256)]
)
OPS = ["hc_pre", "hc_head", "hc_post", "rms_norm"]


@pytest.mark.parametrize(("T", "D"), SHAPES, ids=[f"T{T}-D{D}" for T, D in SHAPES])
@pytest.mark.parametrize("impl", ["optimized", "reference"])
@pytest.mark.parametrize("op", OPS)
def test_bench(benchmark, op: str, impl: str, T: int, D: int) -> None:
    if impl == "optimized" and not CUDA:
        pytest.skip("optimized kernels need CUDA (on CPU they run only in the Triton interpreter)")
    args, kw = op_inputs(op, T, D, seed=0, device=DEVICE)
    fn = getattr(opt if impl == "optimized" else ref, op)
    benchmark.group = f"{op} T={T} D={D}"
    fn(*args, **kw)  # JIT / warm-up outside the timed rounds
    if CUDA:
        torch.cuda.synchronize()

        def run() -> None:
            fn(*args, **kw)
            torch.cuda.synchronize()

        benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    else:
        benchmark.pedantic(fn, args=args, kwargs=kw, rounds=5, warmup_rounds=1)
