"""A/B check of variant collapse modules against the committed kernel: bitwise equal outputs.

    python3 diag/ab_collapse.py diag.my_variant [more modules]   (from bench/)

A variant that only changes scheduling or cache hints must compute the same bits; this is
the gate before its timings mean anything.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diag.ab_common import call_factory

from dsv4mtp.conformance.inputs import op_inputs
from dsv4mtp.optimized.kernels.mhc_collapse import mhc_collapse


def outputs(collapse, op: str, T: int, D: int) -> list[torch.Tensor]:
    (x, *params), kw = op_inputs(op, T, D, seed=T + D)
    call, outs = call_factory(collapse, op, x, params, kw)
    call()
    return outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("modules", nargs="+", help="variant modules, e.g. diag.my_variant")
    a = p.parse_args()
    bad = 0
    for name in a.modules:
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
