"""Would e_proj and h_proj in one grouped launch shorten the decode step?  Times both forms.

The layer's input projection is ``x = linear(h, h_proj) + linear(e, e_proj)[:, None, :]``: h
(T, n, D) the hc_mult streams of the previous hidden state, e (T, D) the normalized embedding,
two FP8 (D, D) weights of 16 MiB each at V4-Flash (docs/semantics.md, "`forward` (one MTP
pass)").  At
decode each call is a GEMV whose time is mostly its fixed start (linear-h200.md, "Decode
schedules"), so one launch over both weights might save one start.  Forms:

* ``separate``: the two ``linear`` calls and the broadcast add (what the layer runs);
* ``grouped``: e repeated over the n streams and stacked with h into (T*n, 2, D), one
  ``grouped_linear`` over the stacked (2, D, D) pack, then the sum of the two groups.  The
  stack and the sum are two elementwise launches, timed with it.

Weights are cold as in the step: one CUDA graph of back-to-back calls cycles over enough copies
of the weights (>= 192 MB) that none is in the 60 MB L2 (``linear_decode_sweep.py``'s method),
us per call from ``bench/h200_mhc.py``'s graph timer.  Both forms' outputs are compared (rel.
Frobenius difference; they sum in other orders, so bits may differ).

    python3 bench/diag/eh_proj_grouped.py [--tokens 1,8,64]
``--dry-run``: the same code on the CPU under TRITON_INTERPRET=1 at D 256, wall clock.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4mtp.conformance.inputs import linear_weight
from dsv4mtp.optimized import grouped_linear, linear, pack_linear

COLD_BYTES = 192 << 20


def packs(D: int, copies: int, device: str) -> list[tuple[Any, Any, Any]]:
    """``copies`` of (e_proj pack, h_proj pack, their stacked (2, D, D) pack), FP8 with e8m0
    scales; the stacked pack holds exactly the two weights (codes and scales concatenated)."""
    from dsv4mtp.checkpoint.weights import QuantizedWeight

    out = []
    for c in range(copies):
        e = linear_weight(1, D, D, "fp8_e8m0", 2 * c, device)
        h = linear_weight(1, D, D, "fp8_e8m0", 2 * c + 1, device)
        both = QuantizedWeight(
            "fp8_e8m0",
            torch.cat([e.data, h.data]),
            torch.cat([e.scale, h.scale]),
            (2 * D, D),
            name="e_proj|h_proj",
        )
        out.append((pack_linear(e, device), pack_linear(h, device), pack_linear(both, groups=2)))
    return out


def forms(T: int, n: int, D: int, device: str) -> dict[str, Callable[[Any], torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(T)
    e = torch.randn(T, D, device=device, generator=g).to(torch.bfloat16)
    h = torch.randn(T, n, D, device=device, generator=g).to(torch.bfloat16)

    def separate(p: Any) -> torch.Tensor:
        return linear(h, p[1]) + linear(e, p[0])[:, None, :]

    def grouped(p: Any) -> torch.Tensor:
        x = torch.stack([e[:, None, :].expand(T, n, D), h], dim=2).view(T * n, 2, D)
        y = grouped_linear(x, p[2])  # (T*n, 2, D)
        return (y[:, 0] + y[:, 1]).view(T, n, D)

    return {"separate": separate, "grouped": grouped}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--dry-run", action="store_true", help="CPU, D 256, wall clock")
    args = ap.parse_args()
    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    D, n = (256, 4) if dry else (4096, 4)
    copies = 1 if dry else max(2, -(-COLD_BYTES // (2 * D * D)))  # FP8: one byte per weight
    ps = packs(D, copies, device)
    print(f"D {D}, hc_mult {n}, {copies} weight copies, device {device}")
    print("| T | separate (us) | grouped (us) | rel. difference |")
    print("|---|---|---|---|")
    for T in map(int, args.tokens.split(",")):
        fs = forms(T, n, D, device)
        a, b = fs["separate"](ps[0]), fs["grouped"](ps[0])
        diff = float((a.float() - b.float()).norm() / a.float().norm())
        times = []
        for f in fs.values():
            calls = [lambda p=p, f=f: f(p) for p in ps]
            if dry:
                t0 = time.perf_counter()
                for c in calls:
                    c()
                times.append((time.perf_counter() - t0) / len(calls) * 1e6)
            else:
                from h200_mhc import graph_time_us

                times.append(graph_time_us(calls, 2 * len(calls), 10))
        print(f"| {T} | {times[0]:.1f} | {times[1]:.1f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
