"""Streaming ceilings for the mHC collapse's input on the H200, measured beside copy bandwidth.

    python3 diag/ceilings.py   (from bench/)

At T 4096 and D in {4096, 7168} (x = (T, 4*D) bf16, rotated through > 3x the L2), the GPU time
of:
* ``read``: ``torch.linalg.vector_norm(x, dim=1, dtype=float32)``: reads x once, writes T floats
  (a plain-load reduction: what a read-only pass over x costs with torch's own kernel);
* ``cublas_mix_M``: ``x @ W^T`` with W = [fn_hi; fn_lo] (2M, 4D) bf16, M = 4 (hc_head) and 24
  (hc_pre): the collapse's mix (bf16 hi/lo split of fn) as one cuBLAS GEMM, fp32 output where
  torch offers ``out_dtype``.
Each row gives the time, the bytes of x over the time (read TB/s), and that as a % of the copy
bandwidth (read + write) of the same run.  These bound what the mix phase of any one-pass
collapse can do with the same bytes: the committed kernel's whole-op times are in
bench/results/mhc-h200.md ("Ceilings").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h200_mhc import copy_bandwidth, graph_time_us


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.3f} TB/s (read + write)", flush=True)
    T, n = 4096, 4
    for D in (4096, 7168):
        K = n * D
        per = T * K * 2
        xs = [torch.randn(T, K, device="cuda").to(torch.bfloat16)
              for _ in range(max(2, -(-3 * l2 // per)))]  # fmt: skip
        cases = {"read": lambda x: torch.linalg.vector_norm(x, dim=1, dtype=torch.float32)}
        for M in (4, 24):
            fn = torch.randn(M, K, device="cuda") * 0.02
            hi = fn.to(torch.bfloat16)
            w = torch.cat([hi, (fn - hi.float()).to(torch.bfloat16)]).t()  # (K, 2M)
            try:
                torch.mm(xs[0], w, out_dtype=torch.float32)
                cases[f"cublas_mix_{M}"] = lambda x, w=w: torch.mm(x, w, out_dtype=torch.float32)
            except (TypeError, RuntimeError):
                cases[f"cublas_mix_{M} (bf16 out)"] = lambda x, w=w: torch.mm(x, w)
        for name, f in cases.items():
            us = graph_time_us([lambda x=x, f=f: f(x) for x in xs], 20, 5)
            rate = per / (us * 1e-6)
            print(f"D={D} T={T} {name:24s} {us:7.1f} us  read {rate / 1e12:.2f} TB/s"
                  f"  ({rate / bw * 100:4.1f} % of copy)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
