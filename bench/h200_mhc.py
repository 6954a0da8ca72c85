"""Check and time every variant of the optimized mHC / hc_head / rms_norm ops on one GPU.

One call measures the benchmark tables of bench/results/mhc-h200.md and norm-h200.md and prints
a table last:

* same-run ceilings: device-to-device copy bandwidth (2 GiB bf16, bytes read + written) and the
  cost of an empty Triton kernel, timed exactly like the ops (CUDA-graph replay);
* for T in {1, 8, 64, 512, 4096} and D in {4096, 7168}, n = 4, bf16: every optimized backend,
  the reference eager and the reference under ``torch.compile(dynamic=True)``;
* for each row: GPU time per call, the minimum bytes the op must move (each input read once,
  each output written once), achieved bandwidth as a fraction of the copy bandwidth, time over
  the empty kernel, and the error of that very output against the float64 reference.

Timing: each (op, variant, shape) captures a CUDA graph of C back-to-back calls that walk
through R rotating input sets (all inputs, parameters included) whose total exceeds 2.2x the L2,
so no call reads what the previous ones left in cache, and reports median(replay) / C.

Usage (on the GPU machine):
    python bench/h200_mhc.py --out DIR [--no-compile] [--ops hc_pre,hc_head] [--quick]
writes DIR/mhc-h200.json (committed as bench/results/mhc-h200.json) and DIR/mhc-h200-table.md
(whose sections the results pages carry).
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton

import dsv4mtp.optimized as opt
import dsv4mtp.reference as ref
from dsv4mtp.conformance.inputs import op_inputs
from dsv4mtp.optimized.mhc import PRE_AUTO_BACKEND

TOKENS = (1, 8, 64, 512, 4096)
WIDTHS = (4096, 7168)
N = 4
EPS = 1e-6
BF16 = torch.bfloat16


@triton.jit
def _empty_kernel(ptr):
    pass


# ------------------------------------------------------------------------------------- timing
def _median_event_ms(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_time_us(calls: list[Callable[[], Any]], n_calls: int, reps: int) -> float:
    """Median GPU time per call of a CUDA graph of ``n_calls`` calls cycling through ``calls``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls[: min(len(calls), 3)]:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n_calls):
            calls[i % len(calls)]()
    g.replay()
    torch.cuda.synchronize()
    ms = _median_event_ms(g.replay, reps)
    del g
    return ms * 1e3 / n_calls


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB bf16 device-to-device copy."""
    n = 1 << 30
    src = torch.randn(n, device="cuda", dtype=BF16)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    for _ in range(3):
        copy()
    ms = _median_event_ms(copy, 20)
    del copy  # frees src and dst with the closure
    torch.cuda.empty_cache()
    return 2 * n * 2 / (ms * 1e-3)


def empty_kernel_us() -> float:
    dummy = torch.empty(1, device="cuda")
    return graph_time_us([lambda: _empty_kernel[(1,)](dummy)], 100, 20)


# ------------------------------------------------------------------------------------- inputs
# One call's inputs come from the conformance suite's builder (dsv4mtp.conformance.inputs):
# bf16 activations (T, 4, D), fp32 parameters of V4 magnitudes, the same tensors the GPU tests
# draw at a given seed.


def nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def min_bytes(op: str, T: int, D: int) -> int:
    """Each input read once, each output written once (bf16 activations, fp32 parameters)."""
    act = T * N * D * 2
    if op == "rms_norm":
        return 2 * T * D * 2 + D * 2
    if op == "hc_pre":
        M = (2 + N) * N
        return act + M * N * D * 4 + (3 + M) * 4 + T * D * 2 + T * (N + N * N) * 4
    if op == "hc_head":
        return act + N * N * D * 4 + (1 + N) * 4 + T * D * 2
    return T * D * 2 + act + T * (N + N * N) * 4 + act  # hc_post


# ------------------------------------------------------------------------------------- variants
def variants(op: str, compile_ref: bool) -> dict[str, tuple[Callable[..., Any], bool]]:
    """name -> (callable(*args, out=?, **kw), takes_out)."""
    o = getattr(opt, op)
    r = getattr(ref, op)
    backends = {
        "hc_pre": ["triton", "flashinfer", "flashinfer_prenorm"],
        "hc_head": ["triton_fma", "triton_mma"],
        "hc_post": ["flashinfer", "triton"],
        "rms_norm": ["flashinfer", "triton"],
    }[op]
    v: dict[str, tuple[Callable[..., Any], bool]] = {"opt:auto": (o, True)}
    for b in backends:
        v[f"opt:{b}"] = (lambda *a, _b=b, **k: o(*a, backend=_b, **k), True)
    v["ref:eager"] = (r, False)
    if compile_ref:
        v["ref:compile"] = (torch.compile(r, dynamic=True), False)
    return v


def rel_error(got, oracle) -> float:
    got = got if isinstance(got, (tuple, list)) else (got,)
    oracle = oracle if isinstance(oracle, (tuple, list)) else (oracle,)
    worst = 0.0
    for g_, o_ in zip(got, oracle, strict=True):
        g64 = g_.double()
        if not bool(torch.isfinite(g64).all()):
            return float("inf")
        worst = max(worst, float((g64 - o_).norm() / o_.norm().clamp_min(1e-300)))
    return worst


def bench_op(op: str, args_ns: argparse.Namespace, l2: int, copy_bw: float, empty_us: float):
    rows = []
    tokens = (1, 64, 4096) if args_ns.quick else TOKENS
    var = variants(op, not args_ns.no_compile)
    for D in WIDTHS:
        for T in tokens:
            probe, kw = op_inputs(op, T, D, seed=0)
            set_bytes = nbytes(probe)
            R = max(2, math.ceil(2.2 * l2 / set_bytes))
            sets = [probe] + [op_inputs(op, T, D, seed=i)[0] for i in range(1, R)]
            oracle = getattr(ref, op)(*(a.double() for a in probe), **kw)
            n_calls = max(R, 100) if T <= 64 else max(R, 10)
            reps = 10 if T <= 64 else 5
            for name, (fn, takes_out) in var.items():
                try:
                    if takes_out:
                        first = fn(*probe, **kw)
                        outs = first
                        poison = (
                            tuple(torch.full_like(t, float("nan")) for t in first)
                            if isinstance(first, tuple)
                            else torch.full_like(first, float("nan"))
                        )
                        got = fn(*probe, **kw, out=poison)
                        calls = [lambda s=s, o=outs, f=fn, k=kw: f(*s, **k, out=o) for s in sets]
                    else:
                        got = fn(*probe, **kw)
                        calls = [lambda s=s, f=fn, k=kw: f(*s, **k) for s in sets]
                    err = rel_error(got, oracle)
                    t0 = time.time()
                    us = graph_time_us(calls, n_calls, reps)
                    wall = time.time() - t0
                except Exception as e:  # a failing variant is reported, not fatal
                    print(f"  {op} {name} D={D} T={T}: FAILED {type(e).__name__}: {e}")
                    rows.append(dict(op=op, variant=name, D=D, T=T, error=repr(e)[:300]))
                    continue
                mb = min_bytes(op, T, D)
                frac = mb / (us * 1e-6) / copy_bw
                rows.append(
                    dict(
                        op=op,
                        variant=name,
                        D=D,
                        T=T,
                        time_us=round(us, 3),
                        min_bytes=mb,
                        floor_us=round(mb / copy_bw * 1e6, 3),
                        frac_copy_bw=round(frac, 4),
                        x_empty=round(us / empty_us, 2),
                        rel_err_vs_f64=err,
                        rotating_sets=R,
                        calls_per_graph=n_calls,
                    )
                )
                print(
                    f"  {op:8s} {name:24s} D={D:5d} T={T:5d} {us:10.2f} us  "
                    f"{frac * 100:6.1f}% copy  {us / empty_us:6.2f}x empty  err {err:.2e}  "
                    f"({wall:.1f}s)",
                    flush=True,
                )
            del sets, probe, oracle
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------- report
def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        "# mHC / hc_head / rms_norm on the H200",
        "",
        f"- command: `{meta['command']}`",
        f"- commit: {meta['commit']}",
        f"- GPU: {meta['gpu']} ({meta['sms']} SMs, L2 {meta['l2_mb']:.0f} MB); torch "
        f"{meta['torch']}, triton {meta['triton']}, flashinfer {meta['flashinfer']}",
        f"- same-run copy bandwidth: {meta['copy_bw_tbs']:.3f} TB/s (2 GiB bf16 D2D, read + "
        f"write); empty Triton kernel: {meta['empty_us']:.2f} us per call (graph replay)",
        f"- shapes: n = {N}, bf16 activations, fp32 parameters; hc_pre auto = `{meta['pre_auto']}`",
        "- time = GPU time per call from CUDA-graph replay over rotating input sets "
        "(> 2.2x L2); BW% = minimum bytes / time / copy bandwidth; err = rel. Frobenius error "
        "of that output vs the float64 reference",
        "",
    ]
    ops = sorted({r["op"] for r in rows}, key=["hc_pre", "hc_head", "hc_post", "rms_norm"].index)
    for op in ops:
        names = list(dict.fromkeys(r["variant"] for r in rows if r["op"] == op))
        lines += [f"## {op}", ""]
        head = "| D | T | min bytes | floor us | " + " | ".join(names) + " |"
        lines += [head, "|" + "---|" * (4 + len(names))]
        shapes = sorted({(r["D"], r["T"]) for r in rows if r["op"] == op})
        for D, T in shapes:
            cells = []
            mb = min_bytes(op, T, D)
            for nme in names:
                r = next(
                    (r for r in rows if (r["op"], r["variant"], r["D"], r["T"]) == (op, nme, D, T)),
                    None,
                )
                if r is None or "time_us" not in r:
                    cells.append("fail" if r else "-")
                elif nme.startswith("opt"):
                    cells.append(
                        f"{r['time_us']:.2f} ({r['frac_copy_bw'] * 100:.0f}%, {r['x_empty']:.1f}x)"
                    )
                else:
                    cells.append(f"{r['time_us']:.2f}")
            lines.append(
                f"| {D} | {T} | {mb} | {mb / meta['copy_bw'] * 1e6:.2f} | "
                + " | ".join(cells)
                + " |"
            )
        lines += ["", "Cells: us per call; optimized cells add (BW% of copy, x empty kernel).", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--ops", default="hc_pre,hc_head,hc_post,rms_norm")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--quick", action="store_true", help="T in {1, 64, 4096} only")
    p.add_argument("--commit", default=os.environ.get("DSV4_COMMIT", "unknown"))
    a = p.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's fp32 matmul stays fp32
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 60 * 2**20))
    try:
        import flashinfer

        fi_version = flashinfer.__version__
    except Exception as e:
        fi_version = f"not importable ({type(e).__name__})"
    copy_bw = copy_bandwidth()
    empty_us = empty_kernel_us()
    meta = dict(
        command="python " + " ".join(sys.argv),
        commit=a.commit,
        gpu=props.name,
        sms=props.multi_processor_count,
        l2_mb=l2 / 2**20,
        torch=torch.__version__,
        triton=triton.__version__,
        flashinfer=fi_version,
        python=platform.python_version(),
        copy_bw=copy_bw,
        copy_bw_tbs=copy_bw / 1e12,
        empty_us=empty_us,
        pre_auto=PRE_AUTO_BACKEND,
    )
    print(f"copy {copy_bw / 1e12:.3f} TB/s, empty kernel {empty_us:.2f} us, L2 {l2 / 2**20:.0f} MB")
    rows: list[dict] = []
    a.out.mkdir(parents=True, exist_ok=True)
    for op in a.ops.split(","):
        print(f"== {op}", flush=True)
        rows += bench_op(op, a, l2, copy_bw, empty_us)
        # written after every op, so a run cut short still leaves its finished tables
        (a.out / "mhc-h200.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        (a.out / "mhc-h200-table.md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))


if __name__ == "__main__":
    main()
