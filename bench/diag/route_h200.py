"""Time and check the optimized router (``route``) on the H200: default, batch-invariant and
alternative :class:`RouteSchedule`s at V4-Flash shapes.

V4-Flash router: E 256 experts, D 4096, top-6, bf16 x and bf16 gate (2 MiB), fp32 bias.  For T
in {1, 8, 64, 512, 4096}, each schedule is

* checked against a float64 top-k computed with torch from the same inputs: the selected sets
  equal on every row whose K-th and (K+1)-th biased scores are more than 2e-5 apart (the pairs'
  near-tie rule, conformance/pairs.py), the weights within the route tolerance (2e-5 relative);
* timed from CUDA-graph replay of back-to-back calls (bench/h200_mhc.py ``graph_time_us``)
  cycling through input sets (x, gate, bias) whose total exceeds 2.2x the L2, so each call reads
  its gate from HBM, as in the model where the layers between two routers evict it.

``default`` and ``batch_invariant`` run the public ``route`` (its op, the launcher and both
kernels); the alternatives run ``route_triton`` with that schedule (the same kernels).  The
floor column is the bytes every schedule must move (gate + x + outputs) at the copy bandwidth
measured in the same run.  Prints one markdown table.

Plain command on the GPU machine (repository root, ~40 s):
    python bench/diag/route_h200.py [--tokens 1,8,64,512,4096] [--schedules default,...]
``--dry-run``: the same code paths on the CPU under TRITON_INTERPRET=1 (set by the script) at
E 64, D 256, T 1, 5 and 37, wall-clock timed.
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h200_moe import Clock, copy_bandwidth

from dsv4mtp.config import DSV4Config
from dsv4mtp.optimized.kernels.moe_route import RouteSchedule, route_config, route_triton
from dsv4mtp.optimized.moe import route

TOKENS = (1, 8, 64, 512, 4096)
L2_BYTES = 60 << 20
NEAR_TIE = 2e-5  # conformance/pairs.py ROUTE_SCORE_TOL
WEIGHT_RTOL = 2e-5  # conformance/pairs.py, route weights

# Plausible alternatives to the defaults (optimized/kernels/moe_route.py, "Schedule"):
ALTERNATIVES = {
    # decode tile of 16 rows (mma.sync) instead of 64 (wgmma), same gate spread
    "t16_e32_s16": RouteSchedule(16, 32, 128, split=16),
    # the decode schedule at every T: a batch-invariant candidate that reads the gate once
    # at T <= 64
    "t64_e32_s16": RouteSchedule(64, 32, 128, split=16),
    # many tokens: no split (no partial traffic), 128 x 128 tiles, 8 warps
    "t128_e128_s1": RouteSchedule(128, 128, 64, split=1, num_warps=8, topk_rows=4),
    # many tokens: all experts per program (x read once), two D slices
    "t64_e256_s2": RouteSchedule(64, 256, 64, split=2, num_warps=8, topk_rows=4),
}


def _inputs(
    T: int, E: int, D: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, D, generator=g, device=device).to(torch.bfloat16)  # (T, D)
    w = (torch.randn(E, D, generator=g, device=device) / D**0.5).to(torch.bfloat16)  # (E, D)
    b = torch.randn(E, generator=g, device=device) * 0.1  # (E,) fp32
    return x, w, b


def _oracle(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, k: int, rho: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64: (weights by id (T, K), ids sorted (T, K), near-tie (T,))."""
    scores = torch.sqrt(F.softplus(x.double() @ w.double().T))  # (T, E)
    top = (scores + b.double()).topk(k + 1, dim=-1)
    ids = top.indices[:, :k]
    near = (top.values[:, k - 1] - top.values[:, k]) <= NEAR_TIE
    sel = scores.gather(1, ids)
    wts = sel / sel.sum(-1, keepdim=True) * rho
    order = ids.argsort(-1)
    return wts.gather(1, order), ids.gather(1, order), near


def _check(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, ...]) -> str:
    ww, wi, near = want
    order = got[1].long().argsort(-1)
    gw, gi = got[0].double().gather(1, order), got[1].long().gather(1, order)
    keep = ~near
    bad = int((~(gi == wi).all(-1) & keep).sum())
    if not bool(torch.isfinite(got[0]).all()):
        return "FAIL (non-finite)"
    same = keep & (gi == wi).all(-1)
    rel = float(((gw - ww).abs() / ww.abs()).amax(-1)[same].max()) if bool(same.any()) else 0.0
    status = "ok" if bad == 0 and rel <= WEIGHT_RTOL else "FAIL"
    return f"{status} (sets differ {bad}, near-ties {int(near.sum())}, w rel {rel:.1e})"


def _caller(
    name: str, cfg: DSV4Config, inp: tuple[torch.Tensor, ...], out: tuple[torch.Tensor, ...]
) -> Callable[[], Any]:
    x, w, b = inp
    k, rho = cfg.num_experts_per_tok, float(cfg.routed_scaling_factor)
    if name in ("default", "batch_invariant"):
        bi = name == "batch_invariant"
        return lambda: route(x, w, b, cfg, batch_invariant=bi, out=(out[0], out[1]))
    s = ALTERNATIVES[name]
    return lambda: route_triton(x, w, b, k, rho, out[0], out[1], schedule=s)


def _schedule_text(name: str, T: int, D: int, E: int) -> str:
    if name in ("default", "batch_invariant"):
        s = route_config(T, D, E, batch_invariant=name == "batch_invariant")
    else:
        s = ALTERNATIVES[name]
    return (
        f"t{s.block_t} e{s.block_e} k{s.block_k} s{s.split} w{s.num_warps} st{s.num_stages} "
        f"r{s.topk_rows}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--schedules", default=",".join(["default", "batch_invariant", *ALTERNATIVES]))
    p.add_argument("--calls", type=int, default=32, help="calls per captured graph (min)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes")
    a = p.parse_args()
    cuda = not a.dry_run
    if cuda and not torch.cuda.is_available():
        p.error("needs a CUDA device (or --dry-run)")
    dev = torch.device("cuda" if cuda else "cpu")
    clock = Clock(cuda)
    names = a.schedules.split(",")
    for n in names:
        if n not in ("default", "batch_invariant", *ALTERNATIVES):
            p.error(f"unknown schedule {n!r}")
    if cuda:
        cfg = DSV4Config.flash()
        tokens = [int(t) for t in a.tokens.split(",")]
        bw = copy_bandwidth(clock, dev, 1 << 30)
    else:
        cfg = DSV4Config.tiny().replace(hidden_size=256, n_routed_experts=64, num_experts_per_tok=6)
        tokens, a.calls, a.reps, bw = [1, 5, 37], 2, 1, float("nan")
    E, D, K = cfg.n_routed_experts, cfg.hidden_size, cfg.num_experts_per_tok
    print(f"router E {E}, D {D}, top-{K}, bf16 x / gate; copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    t_start = time.perf_counter()
    for T in tokens:
        set_bytes = (E * D + T * D) * 2 + E * 4
        n_sets = max(1, min(64, -(-int(2.2 * L2_BYTES) // set_bytes))) if cuda else 1
        sets = [_inputs(T, E, D, 1000 * T + i, dev) for i in range(n_sets)]
        outs = [
            (torch.empty(T, K, device=dev), torch.empty(T, K, dtype=torch.int32, device=dev))
            for _ in range(n_sets)
        ]
        want = _oracle(*sets[0], K, float(cfg.routed_scaling_factor))
        floor_us = ((E * D + T * D) * 2 + T * K * 8) / bw * 1e6
        for name in names:
            calls = [_caller(name, cfg, s, o) for s, o in zip(sets, outs, strict=True)]
            calls[0]()
            clock.sync()
            check = _check(outs[0], want)
            us = clock.graph_us(calls, max(a.calls, n_sets), a.reps)
            rows.append((T, name, _schedule_text(name, T, D, E), us, floor_us, check))
            print(f"  T {T:5d} {name:16s} {us:9.2f} us  {check}", flush=True)
    print(f"\n({time.perf_counter() - t_start:.0f} s)\n")
    print("| T | schedule | tiles | us | floor us | check |")
    print("|---:|---|---|---:|---:|---|")
    for T, name, text, us, floor_us, check in rows:
        print(f"| {T} | {name} | {text} | {us:.2f} | {floor_us:.2f} | {check} |")


if __name__ == "__main__":
    main()
