"""Time the optimized MoE (route + routed experts + shared expert) against its floor and peers.

For V4-Flash shapes (E 256, top-6, I 2048, D 4096), routed experts in MXFP4, NVFP4 (folded)
and FP8, T in {1, 8, 64, 512, 4096}, uniform routing (fixed seed) and a skewed case (one expert
that every token selects, through the router bias):

* time per call of the whole ``dsv4mtp.optimized.moe`` from CUDA-graph replay: a graph of C
  back-to-back calls cycling through R input sets and W weight copies (each copy its own pack:
  experts, router and shared expert), so no call finds the previous call's weights or inputs in
  the 50 MB L2;
* bytes actually touched by one call: weights and scales of the distinct experts its routing
  selects (averaged over the input sets), the shared expert as its FP8 checkpoint stores it
  (e4m3 + fp32 128x128 scales), router weight and bias, x read and the output written;
* FLOPs: 2 x (T K x 3 I D) routed (-1 slots excluded; none here), 2 x T x 3 I D shared,
  2 x T x E x D router;
* same-run ceilings: device-to-device copy bandwidth (2 GiB bf16, read + write) and bf16 dense
  GEMM peak (torch.mm, 8192^3); floor = max(bytes / copy bandwidth, FLOPs / GEMM peak);
  time / floor;
* same-run peers, each with a time cap (``--cap-s``, default 20 s per call after a warm-up
  call, which includes torch.compile's compilation): the reference
  ``moe`` eager on the GPU and under ``torch.compile`` (both sync on the host to list the
  selected experts, so they are timed eagerly with CUDA events, not in a graph), and
  ``torch._grouped_mm`` on pre-dequantized bf16 weights (torch routing, a device-side
  token sort, two grouped GEMMs, clamped SwiGLU, index_add combine, dense bf16 shared expert;
  graph replay like the optimized op);
* targets (issue): time / floor <= 1.25 at T 8 and 64, <= 1.6 at T 1 and 4096, and faster
  than every peer at every T.

Every optimized output is checked against the float64 reference (T <= 512; rel. Frobenius
error, router near-ties included, so a large value on a skewed case can be a tie).  A variant
that fails prints its error, which lands in the table; the run continues.

Usage (on the GPU machine, in its own Python; nox is not needed):
    python bench/h200_moe.py --out DIR [--formats mxfp4,nvfp4_folded,fp8] [--tokens 1,8,64]
        [--skews uniform,one_expert] [--no-compile] [--no-reference] [--cap-s 20]
writes DIR/moe-h200.json and DIR/moe-h200-table.md (nothing under bench/results unless DIR says
so).  ``--dry-run`` runs the same code on the CPU at the tiny shape (E 8, top-2, I 128, D 256),
wall-clock timed, to check the arithmetic and the peers' code paths without a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from h200_mhc import graph_time_us  # this folder (a script: its folder is on sys.path)

import dsv4mtp.reference as ref
from dsv4mtp.config import DSV4Config
from dsv4mtp.conformance.inputs import MOE_SHAPES, moe_inputs, moe_params
from dsv4mtp.params import MoEParams

TOKENS = (1, 8, 64, 512, 4096)
FORMATS = ("mxfp4", "nvfp4_folded", "fp8")
SKEWS = ("uniform", "one_expert")
TARGETS = {1: 1.6, 8: 1.25, 64: 1.25, 4096: 1.6}  # time / floor, from the issue
BF16 = torch.bfloat16
SEED = 0  # the inputs' seed: routing is the same in every run


# ------------------------------------------------------------------------------------- timing
@dataclass
class Clock:
    """CUDA events and graphs on the GPU; wall clock on the CPU (``--dry-run``)."""

    cuda: bool

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def eager_us(self, fn: Callable[[], Any], reps: int) -> float:
        """Median time of one eager call (host included on the CPU)."""
        times = []
        for _ in range(reps):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    def graph_us(self, calls: list[Callable[[], Any]], n_calls: int, reps: int) -> float:
        """Median time per call of a CUDA graph of ``n_calls`` calls cycling through ``calls``
        (on the CPU: the same sequence run eagerly)."""
        if not self.cuda:
            return self.eager_us(
                lambda: [calls[i % len(calls)]() for i in range(n_calls)], reps
            ) / (n_calls)
        for c in calls:  # every input set once before the capture (h200_mhc warms three)
            c()
        torch.cuda.synchronize()
        return graph_time_us(calls, n_calls, reps)


def copy_bandwidth(clock: Clock, device: torch.device, n: int) -> float:
    """Bytes read + written per second by a device-to-device copy of n bf16 values."""
    src = torch.randn(n, device=device, dtype=BF16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    us = clock.eager_us(lambda: dst.copy_(src), 20)
    return 2 * n * 2 / (us * 1e-6)


def gemm_peak(clock: Clock, device: torch.device, n: int) -> float:
    """bf16 dense GEMM FLOP/s of torch.mm on n x n x n."""
    a = torch.randn(n, n, device=device, dtype=BF16)
    b = torch.randn(n, n, device=device, dtype=BF16)
    for _ in range(3):
        torch.mm(a, b)
    us = clock.eager_us(lambda: torch.mm(a, b), 10)
    return 2 * n**3 / (us * 1e-6)


# ------------------------------------------------------------------------------------- bytes
def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def expert_bytes(params: MoEParams) -> int:
    """Weights + scales of one routed expert as packed (every stacked tensor's share)."""
    ex = params.experts.packed  # type: ignore[attr-defined]
    stacked = (ex.w13_weight, ex.w13_weight_scale, ex.w2_weight, ex.w2_weight_scale)
    extra = (ex.w13_weight_scale_2, ex.w2_weight_scale_2)
    return sum(_nbytes(t) for t in (*stacked, *extra)) // ex.num_local_experts


def call_bytes(cfg: DSV4Config, params: MoEParams, T: int, distinct: float) -> float:
    """Bytes one moe call must touch with ``distinct`` experts selected (see module doc)."""
    I, D = cfg.moe_intermediate_size, cfg.hidden_size
    shared = 3 * I * D + 3 * math.ceil(I / 128) * math.ceil(D / 128) * 4  # FP8 + fp32 scales
    router = _nbytes(params.gate_weight) + _nbytes(params.gate_bias)
    return distinct * expert_bytes(params) + shared + router + 2 * T * D * 2


def call_flops(cfg: DSV4Config, T: int, slots: int) -> float:
    I, D = cfg.moe_intermediate_size, cfg.hidden_size
    return 2 * slots * 3 * I * D + 2 * T * 3 * I * D + 2 * T * cfg.n_routed_experts * D


# ------------------------------------------------------------------------------------- peers
class GroupedMM:
    """Peer: torch._grouped_mm on bf16 weights dequantized once (w13 (E, 2I, D), w2 (E, D, I))."""

    def __init__(self, params: MoEParams, cfg: DSV4Config) -> None:
        E = cfg.n_routed_experts
        w13, w2 = [], []
        for e in range(E):
            a, b, c = params.experts(e, BF16)
            w13.append(torch.cat([a, b], 0))
            w2.append(c)
        self.w13_t = torch.stack(w13).transpose(1, 2)  # (E, D, 2I), D unit stride
        self.w2_t = torch.stack(w2).transpose(1, 2)  # (E, I, D), I unit stride
        self.params, self.cfg = params, cfg

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        cfg, p = self.cfg, self.params
        E, K, I, L = (
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.swiglu_limit,
        )
        logits = x.float() @ p.gate_weight.float().T  # (T, E)
        scores = torch.sqrt(F.softplus(logits))
        ids = torch.topk(scores + p.gate_bias.float(), K, dim=-1).indices  # (T, K)
        w = scores.gather(1, ids)
        w = w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor
        flat = ids.flatten()  # (T K,)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(E, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)  # (E,) cumulative ends
        rows = order // K  # token of each sorted slot
        xs = x[rows]  # (T K, D)
        gu = torch._grouped_mm(xs, self.w13_t, offs=offs).float()  # (T K, 2I)
        g, u = gu[:, :I].clamp(max=L), gu[:, I:].clamp(-L, L)
        h = (F.silu(g) * u * w.flatten()[order, None]).to(BF16)  # (T K, I)
        y = torch._grouped_mm(h, self.w2_t, offs=offs).float()  # (T K, D)
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        acc.index_add_(0, rows, y)
        sg = (x @ p.shared_w1.T).float().clamp(max=L)
        su = (x @ p.shared_w3.T).float().clamp(-L, L)
        acc += ((F.silu(sg) * su).to(BF16) @ p.shared_w2.T).float()
        return out.copy_(acc)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    g = got.double()
    if not bool(torch.isfinite(g).all()):
        return float("inf")
    return float((g - want).norm() / want.norm().clamp_min(1e-300))


# ------------------------------------------------------------------------------------- one cell
def routing_stats(cfg: DSV4Config, params: MoEParams, xs: list[torch.Tensor]) -> tuple[float, int]:
    """(mean distinct experts per call, token-expert slots per call) under the router."""
    distinct = []
    for x in xs:
        _, ids = ref.route(x, params.gate_weight, params.gate_bias, cfg)
        distinct.append(int(torch.unique(ids).numel()))
    return statistics.mean(distinct), xs[0].shape[0] * cfg.num_experts_per_tok


def bench_cell(
    a: argparse.Namespace,
    clock: Clock,
    packs: dict[str, list[Any]],
    weights: list[MoEParams],
    peers: dict[str, Any],
    cfg: DSV4Config,
    fmt: str,
    skew: str,
    T: int,
    l2: int,
    ceilings: dict[str, float],
) -> list[dict[str, Any]]:
    device = weights[0].gate_weight.device
    R = a.input_sets
    xs = [
        moe_inputs("moe", T, SEED + i, shape=a.shape, fmt=fmt, device=device, skew=skew)[0][0]
        for i in range(R)
    ]
    distinct, slots = routing_stats(cfg, weights[0], xs)
    nbytes = call_bytes(cfg, weights[0], T, distinct)
    flops = call_flops(cfg, T, slots)
    floor_us = max(nbytes / ceilings["copy_bw"], flops / ceilings["gemm_flops"]) * 1e6
    base = dict(fmt=fmt, skew=skew, T=T, bytes=nbytes, flops=flops, distinct_experts=distinct)
    base["floor_us"] = floor_us
    base["bound"] = (
        "memory" if nbytes / ceilings["copy_bw"] >= flops / ceilings["gemm_flops"] else "compute"
    )
    oracle = None
    if a.check_max_t >= T:
        oracle = ref.moe(xs[0].double(), weights[0], cfg)
    n_calls = max(len(xs) * len(weights), 20 if T <= 64 else 6)
    rows: list[dict[str, Any]] = []

    def record(variant: str, fn: Callable[[], float], err: Callable[[], float | None]) -> None:
        row = dict(base, variant=variant)
        t0 = time.time()
        try:
            us = fn()
            row.update(time_us=us, x_floor=us / floor_us)
            e = err()
            if e is not None:
                row["rel_err_vs_f64"] = e
        except Exception as exc:  # one failing variant is reported, the run continues
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            if a.verbose:
                traceback.print_exc()
        row["wall_s"] = round(time.time() - t0, 2)
        rows.append(row)
        shown = (
            f"{row['time_us']:10.1f} us  {row['x_floor']:5.2f}x floor"
            if "time_us" in row
            else "FAILED " + row["error"]
        )
        print(
            f"  {fmt:13s} {skew:10s} T={T:5d} {variant:14s} {shown}  ({row['wall_s']}s)", flush=True
        )

    # the optimized op: graph replay over (input set, weight copy) pairs
    if "opt" in packs:
        opt_moe = peers["opt_moe"]
        outs = [torch.empty_like(x) for x in xs]

        def opt_time() -> float:
            calls = [
                (lambda x=x, o=o, pk=pk: opt_moe(x, pk, cfg, out=o))
                for pk in packs["opt"]
                for x, o in zip(xs, outs, strict=True)
            ]
            return clock.graph_us(calls, n_calls, a.reps)

        def opt_err() -> float | None:
            if oracle is None:
                return None
            return rel_error(opt_moe(xs[0], packs["opt"][0], cfg), oracle)

        record("opt", opt_time, opt_err)
    else:
        rows.append(dict(base, variant="opt", error=peers["opt_error"]))

    if "grouped_mm" in peers:
        gmm = peers["grouped_mm"]
        gouts = [torch.empty_like(x) for x in xs]
        record(
            "grouped_mm",
            lambda: clock.graph_us(
                [lambda x=x, o=o: gmm(x, o) for x, o in zip(xs, gouts, strict=True)],
                n_calls,
                a.reps,
            ),
            lambda: (
                None if oracle is None else rel_error(gmm(xs[0], torch.empty_like(xs[0])), oracle)
            ),
        )
    elif "grouped_mm_error" in peers:
        rows.append(dict(base, variant="grouped_mm", error=peers["grouped_mm_error"]))

    for name in ("ref_eager", "ref_compile"):
        if name not in peers:
            continue
        fn = peers[name]

        def capped(fn: Callable[..., Any] = fn) -> float:
            fn(xs[0], weights[0], cfg)  # warm-up: torch.compile compiles here, uncapped
            clock.sync()
            t0 = time.perf_counter()
            fn(xs[1 % len(xs)], weights[0], cfg)  # the cap's probe
            clock.sync()
            probe = time.perf_counter() - t0
            if probe > a.cap_s:
                raise TimeoutError(f"one call took {probe:.1f} s > cap {a.cap_s} s")
            reps = max(1, min(a.reps, int(a.cap_s / max(probe, 1e-6))))
            return clock.eager_us(lambda: fn(xs[1 % len(xs)], weights[0], cfg), reps)

        record(name, capped, lambda: None)
    return rows


# ------------------------------------------------------------------------------------- report
def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# MoE on the H200 (dsv4mtp.optimized.moe: route + routed experts + shared expert)",
        "",
        f"- command: `{meta['command']}`; commit {meta['commit']}",
        f"- device: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}",
        f"- shape: {meta['shape']} (E {meta['E']}, top-{meta['K']}, I {meta['I']}, D {meta['D']}), "
        f"bf16 activations, math preset",
        f"- same-run copy bandwidth {meta['copy_bw'] / 1e12:.3f} TB/s, bf16 GEMM "
        f"{meta['gemm_flops'] / 1e12:.1f} TFLOP/s; floor = max(bytes / copy, FLOPs / GEMM)",
        f"- {meta['weight_copies']} weight copies x {meta['input_sets']} input sets cycled "
        f"(L2 {meta['l2_mb']:.0f} MB); peers capped at {meta['cap_s']} s per cell",
        "",
        "Cells: us per call (time / floor); `fail: ...` is the variant's error.  err = rel. "
        "error of the optimized output vs the float64 reference (T <= check limit).",
        "",
    ]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    head = "| format | skew | T | experts | MB | floor us | bound | " + " | ".join(variants)
    lines += [head + " | target | err |", "|" + "---|" * (9 + len(variants))]
    cells = sorted({(r["fmt"], r["skew"], r["T"]) for r in rows}, key=lambda c: (c[0], c[1], c[2]))
    for fmt, skew, T in cells:
        group = [r for r in rows if (r["fmt"], r["skew"], r["T"]) == (fmt, skew, T)]
        r0 = group[0]
        out = []
        for v in variants:
            r = next((r for r in group if r["variant"] == v), None)
            if r is None:
                out.append("-")
            elif "time_us" in r:
                out.append(f"{r['time_us']:.1f} ({r['x_floor']:.2f}x)")
            else:
                out.append("fail: " + r.get("error", "?").replace("|", "/")[:80])
        opt = next((r for r in group if r["variant"] == "opt" and "time_us" in r), None)
        target = TARGETS.get(T)
        met = "-"
        if opt is not None:
            peers = [r["time_us"] for r in group if r["variant"] != "opt" and "time_us" in r]
            ok = (target is None or opt["x_floor"] <= target) and all(
                opt["time_us"] < p for p in peers
            )
            met = f"{'met' if ok else 'missed'}" + (f" (<= {target})" if target else "")
        err = f"{opt['rel_err_vs_f64']:.1e}" if opt is not None and "rel_err_vs_f64" in opt else "-"
        lines.append(
            f"| {fmt} | {skew} | {T} | {r0['distinct_experts']:.1f} | {r0['bytes'] / 1e6:.1f} | "
            f"{r0['floor_us']:.1f} | {r0['bound']} | " + " | ".join(out) + f" | {met} | {err} |"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory for the JSON and table")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--skews", default=",".join(SKEWS))
    p.add_argument("--weight-copies", type=int, default=3)
    p.add_argument("--input-sets", type=int, default=4)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--cap-s", type=float, default=20.0, help="time cap of one peer cell")
    p.add_argument("--check-max-t", type=int, default=512, help="check vs float64 up to this T")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    p.add_argument("--no-reference", action="store_true", help="skip both reference peers")
    p.add_argument("--no-grouped-mm", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shape, wall clock")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    p.add_argument("--commit", default=os.environ.get("DSV4_COMMIT", "unknown"))
    a = p.parse_args(argv)
    cuda = not a.dry_run
    if cuda and not torch.cuda.is_available():
        p.error("needs a CUDA device (or --dry-run)")
    a.shape = "flash" if cuda else "tiny"
    if a.dry_run:
        a.tokens = ",".join(t for t in a.tokens.split(",") if int(t) <= 64)
        a.weight_copies, a.input_sets, a.reps = min(a.weight_copies, 2), min(a.input_sets, 2), 2
    device = torch.device("cuda" if cuda else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's fp32 matmuls stay fp32
    clock = Clock(cuda)
    cfg = MOE_SHAPES[a.shape]
    if cuda:
        props = torch.cuda.get_device_properties(0)
        l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
        dev_name = f"{props.name} ({props.multi_processor_count} SMs)"
    else:
        l2, dev_name = 0, f"CPU ({platform.processor() or platform.machine()}), dry run"
    ceilings = dict(
        copy_bw=copy_bandwidth(clock, device, (1 << 30) if cuda else (1 << 24)),
        gemm_flops=gemm_peak(clock, device, 8192 if cuda else 512),
    )
    print(
        f"copy {ceilings['copy_bw'] / 1e12:.3f} TB/s, bf16 GEMM "
        f"{ceilings['gemm_flops'] / 1e12:.2f} TFLOP/s, L2 {l2 / 2**20:.0f} MB",
        flush=True,
    )
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    meta: dict[str, Any] = dict(
        command="python " + " ".join(sys.argv),
        commit=a.commit,
        device=dev_name,
        torch=torch.__version__,
        triton=triton_version,
        python=platform.python_version(),
        shape=a.shape,
        E=cfg.n_routed_experts,
        K=cfg.num_experts_per_tok,
        I=cfg.moe_intermediate_size,
        D=cfg.hidden_size,
        l2_mb=l2 / 2**20,
        weight_copies=a.weight_copies,
        input_sets=a.input_sets,
        cap_s=a.cap_s,
        **ceilings,
    )
    rows: list[dict[str, Any]] = []
    a.out.mkdir(parents=True, exist_ok=True)

    def write() -> None:  # after every format, so a run cut short keeps its finished cells
        (a.out / "moe-h200.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        (a.out / "moe-h200-table.md").write_text(markdown(meta, rows))

    for fmt in a.formats.split(","):
        for skew in a.skews.split(","):
            weights = [
                moe_params(a.shape, fmt, device, weight_seed=w, skew=skew)[0]
                for w in range(a.weight_copies)
            ]
            peers: dict[str, Any] = {}
            packs: dict[str, list[Any]] = {}
            try:
                import dsv4mtp.optimized as opt

                peers["opt_moe"] = opt.moe  # type: ignore[attr-defined]
                packs["opt"] = [
                    opt.pack_moe(w, device, max_tokens=max(int(t) for t in a.tokens.split(",")))  # type: ignore[attr-defined]
                    for w in weights
                ]
            except Exception as exc:
                peers["opt_error"] = f"{type(exc).__name__}: {exc}"[:300]
                print(f"  optimized moe unavailable: {peers['opt_error']}", flush=True)
            if not a.no_grouped_mm:
                try:
                    if not hasattr(torch, "_grouped_mm"):
                        raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm")
                    peers["grouped_mm"] = GroupedMM(weights[0], cfg)
                except Exception as exc:
                    peers["grouped_mm_error"] = f"{type(exc).__name__}: {exc}"[:300]
            if not a.no_reference:
                peers["ref_eager"] = ref.moe
                if not a.no_compile:
                    peers["ref_compile"] = torch.compile(ref.moe)
            for T in (int(t) for t in a.tokens.split(",")):
                rows += bench_cell(a, clock, packs, weights, peers, cfg, fmt, skew, T, l2, ceilings)
                write()
            del weights, peers, packs
            if cuda:
                torch.cuda.empty_cache()
    write()
    print(markdown(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
