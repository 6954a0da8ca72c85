"""A/B check of variant collapse modules against the committed kernel: bitwise equal outputs.

    python3 diag/ab_collapse.py diag.exp_prefetch [more modules]   (from bench/)

A variant that only changes scheduling or cache hints must compute the same bits; this is
the gate before its timings mean anything.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h200_mhc import make_inputs

from dsv4mtp.optimized.kernels.mhc_collapse import mhc_collapse


def outputs(collapse, op: str, T: int, D: int) -> list[torch.Tensor]:
    (x, fn, scale, base), kw = make_inputs(op, T, D, seed=T + D)
    out = torch.full((T, D), float("nan"), dtype=x.dtype, device="cuda")
    pc = {}
    if op == "hc_pre":
        pc = dict(post=torch.full((T, 4), float("nan"), device="cuda"),
                  comb=torch.full((T, 4, 4), float("nan"), device="cuda"),
                  post_mult=kw["post_mult"], sinkhorn_iters=kw["sinkhorn_iters"])  # fmt: skip
    collapse(x, fn, scale, base, out, rms_norm_eps=kw["rms_norm_eps"], hc_eps=kw["hc_eps"], **pc)
    return [out, *pc.values()][: 3 if op == "hc_pre" else 1]


def main() -> None:
    bad = 0
    for name in sys.argv[1:]:
        variant = importlib.import_module(name).mhc_collapse
        for op in ("hc_head", "hc_pre"):
            for D in (4096, 7168):
                for T in (1, 77, 4096):
                    a, b = outputs(mhc_collapse, op, T, D), outputs(variant, op, T, D)
                    same = all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
                    finite = all(torch.isfinite(v).all().item() for v in b)
                    bad += not (same and finite)
                    print(f"{name} {op} D={D} T={T}: bitwise {'equal' if same else 'DIFFERENT'}"
                          f"{'' if finite else ', NON-FINITE'}", flush=True)  # fmt: skip
    print("A/B:", "all equal" if bad == 0 else f"{bad} cases differ")


if __name__ == "__main__":
    main()
