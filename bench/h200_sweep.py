"""Schedule sweep of the mHC collapse (hc_head, hc_pre) and of rms_norm on the GPU.

Picks the defaults of ``collapse_config`` / ``mix_config`` and rms_norm's warps; kept so the
choice can be re-made on another GPU.  Same timing method as bench/h200_mhc.py (CUDA-graph
replay over rotating input sets > 2.2x L2).  Every end-to-end row is checked against the
float64 reference (rel. Frobenius error printed).

    python bench/h200_sweep.py [--out DIR] [--parts a,b,c] [--quick]

Parts: A) the split-K mix producer alone (FlashInfer's feed), per (M, D, T) and config: time
and bandwidth on its own bytes (x + fn + partials); B) hc_head / hc_pre end to end per
one-pass collapse schedule (and hc_pre through FlashInfer); C) rms_norm's Triton kernel per
num_warps.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from h200_mhc import copy_bandwidth, empty_kernel_us, graph_time_us, min_bytes

import dsv4mtp.optimized as opt
import dsv4mtp.reference as ref
from dsv4mtp.conformance.inputs import op_inputs
from dsv4mtp.optimized.kernels.mhc_collapse import CollapseConfig
from dsv4mtp.optimized.kernels.mhc_mix import MixConfig, mhc_mix_splitk
from dsv4mtp.optimized.kernels.rms_norm import rms_norm_triton

N = 4

# (block_t, block_k, num_splits, num_warps, num_stages)
MIX_CANDIDATES = [
    (64, 128, 16, 4, 3),
    (64, 64, 16, 4, 4),
    (128, 64, 16, 8, 4),
    (128, 64, 16, 4, 4),
    (64, 128, 8, 4, 3),
    (64, 128, 64, 4, 3),
]
# (block_t, d_slice, block_k, apply_d, num_warps, num_stages, fused)
COLLAPSE_CANDIDATES = [
    (64, 256, 64, 64, 4, 3, True),
    (64, 256, 64, 16, 4, 3, True),
    (64, 256, 64, 32, 4, 3, True),
    (64, 256, 32, 16, 4, 3, True),
    (64, 256, 128, 64, 4, 3, True),
    (64, 512, 64, 64, 4, 3, True),
    (64, 128, 64, 64, 4, 3, True),
    (32, 256, 64, 64, 4, 3, True),
    (64, 256, 64, 64, 4, 3, False),
]


def rotating_sets(op: str, T: int, D: int, l2: int):
    probe, kw = op_inputs(op, T, D, seed=0)
    size = sum(t.numel() * t.element_size() for t in probe)
    R = max(2, math.ceil(2.2 * l2 / size))
    return [probe] + [op_inputs(op, T, D, seed=i)[0] for i in range(1, R)], kw, R


def timed(calls, T: int, R: int) -> float:
    return graph_time_us(calls, max(R, 100) if T <= 64 else max(R, 10), 10 if T <= 64 else 5)


def part_a(l2: int, bw: float, tokens, log) -> dict:
    """Producer alone; returns {(M, D): [(us at the largest T, cfg), ...]} sorted."""
    ranking: dict = {}
    for op, M in (("hc_pre", (2 + N) * N),):
        for D in (4096, 7168):
            K = N * D
            for T in tokens:
                sets, _, R = rotating_sets(op, T, D, l2)
                for c in MIX_CANDIDATES:
                    cfg = MixConfig(*c)
                    try:
                        ws = [
                            torch.empty(cfg.num_splits * T * M, device="cuda"),
                            torch.empty(cfg.num_splits * T, device="cuda"),
                        ]
                        mix = ws[0].view(cfg.num_splits, T, M)
                        sq = ws[1].view(cfg.num_splits, T)
                        calls = [
                            lambda s=s, cfg=cfg, mix=mix, sq=sq, T=T, K=K: mhc_mix_splitk(
                                s[0].view(T, K), s[1], cfg, mix, sq
                            )
                            for s in sets
                        ]
                        # correctness of this config against a float64 matmul
                        calls[0]()
                        x64 = sets[0][0].view(T, K).double()
                        want = x64 @ sets[0][1].double().T
                        err = float((mix.double().sum(0) - want).norm() / want.norm())
                        us = timed(calls, T, R)
                    except Exception as e:
                        log(f"A {op} D={D} T={T} mix={c}: FAILED {type(e).__name__}: {e}")
                        continue
                    nbytes = T * K * 2 + M * K * 4 + cfg.num_splits * T * (M + 1) * 4
                    log(
                        f"A {op:7s} D={D} T={T:5d} mix={c}: {us:9.2f} us "
                        f"{nbytes / (us * 1e-6) / bw * 100:5.1f}% copy  err {err:.1e}"
                    )
                    if max(tokens) == T:
                        ranking.setdefault((M, D), []).append((us, c))
                del sets
                torch.cuda.empty_cache()
    return {k: sorted(v) for k, v in ranking.items()}


def part_b(l2: int, bw: float, empty: float, tokens, log, rows: list, ops, candidates) -> None:
    for op in ops:
        for D in (4096, 7168):
            for T in tokens:
                sets, kw, R = rotating_sets(op, T, D, l2)
                oracle = getattr(ref, op)(*(a.double() for a in sets[0]), **kw)
                oracle = oracle if isinstance(oracle, tuple) else (oracle,)
                variants: list[tuple[str, dict]] = [
                    (f"collapse={c}", dict(schedule=opt.CollapseSchedule(CollapseConfig(*c))))
                    for c in candidates
                ]
                # a schedule drives the collapse backend; the other backend is the baseline
                if op == "hc_pre":
                    for v in variants:
                        v[1]["backend"] = "triton"
                    variants.append(("flashinfer default mix", dict(backend="flashinfer")))
                else:
                    for v in variants:
                        v[1]["backend"] = "triton_mma"
                    variants.append(("triton_fma", dict(backend="triton_fma")))
                for name, extra in variants:
                    f = getattr(opt, op)
                    try:
                        got = f(*sets[0], **kw, **extra)
                        got = got if isinstance(got, tuple) else (got,)
                        err = max(
                            float((g.double() - o).norm() / o.norm())
                            for g, o in zip(got, oracle, strict=True)
                        )
                        outs = got if len(got) > 1 else got[0]
                        calls = [
                            lambda s=s, e=extra, o=outs, f=f, kw=kw: f(*s, **kw, **e, out=o)
                            for s in sets
                        ]
                        us = timed(calls, T, R)
                    except Exception as e:
                        log(f"B {op} D={D} T={T} {name}: FAILED {type(e).__name__}: {e}")
                        continue
                    frac = min_bytes(op, T, D) / (us * 1e-6) / bw
                    log(
                        f"B {op:7s} D={D} T={T:5d} {name}: {us:9.2f} us {frac * 100:5.1f}% "
                        f"{us / empty:6.1f}x empty  err {err:.1e}"
                    )
                    rows.append(dict(op=op, D=D, T=T, variant=name, us=us, frac=frac, err=err))
                del sets
                torch.cuda.empty_cache()


def part_c(l2: int, bw: float, empty: float, tokens, log) -> None:
    for D in (4096, 7168):
        for T in tokens:
            sets, kw, R = rotating_sets("rms_norm", T, D, l2)
            out = torch.empty(T, D, dtype=torch.bfloat16, device="cuda")
            for nw in (4, 8, 16):
                calls = [
                    lambda s=s, nw=nw, kw=kw, out=out: rms_norm_triton(
                        s[0], s[1], kw["eps"], out, False, nw
                    )
                    for s in sets
                ]
                us = timed(calls, T, R)
                frac = min_bytes("rms_norm", T, D) / (us * 1e-6) / bw
                log(f"C rms_norm D={D} T={T:5d} warps={nw:2d}: {us:8.2f} us {frac * 100:5.1f}% "
                    f"{us / empty:5.1f}x empty")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--parts", default="b")
    p.add_argument("--ops", default="hc_head,hc_pre", help="part B ops")
    p.add_argument(
        "--collapse",
        default=None,
        help="part B schedules as a JSON list of 7-tuples (CollapseConfig fields)",
    )
    a = p.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    bw = copy_bandwidth()
    empty = empty_kernel_us()
    lines: list[str] = []

    def log(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    log(f"copy {bw / 1e12:.3f} TB/s, empty kernel {empty:.2f} us, L2 {l2 / 2**20:.0f} MB")
    tokens = (1, 64, 4096) if a.quick else (1, 64, 512, 4096)
    if "a" in a.parts:
        ranking = part_a(l2, bw, (1, 64, 4096), log)
        log("A ranking at T=4096: " + json.dumps({str(k): v[:4] for k, v in ranking.items()}))
    rows: list[dict] = []
    if "b" in a.parts:
        cands = json.loads(a.collapse) if a.collapse else COLLAPSE_CANDIDATES
        part_b(l2, bw, empty, tokens, log, rows, a.ops.split(","), [tuple(c) for c in cands])
    if "c" in a.parts:
        part_c(l2, bw, empty, (1, 64, 4096), log)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "sweep.log").write_text("\n".join(lines) + "\n")
        (a.out / "sweep.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
