"""Where the time of the fused mHC collapse goes: per-program phase timestamps on the GPU.

Runs ``mhc_collapse`` with ``trace=`` (kernels/mhc_collapse.py: clock64 stamps at the phase
boundaries, global-timer stamps at program start and end) on cold-L2 inputs and prints, per
(op, D, T, schedule):

* span: first program start to last program end (global timer), next to the event-timed call;
* programs, waves (programs / mean concurrency) and mean concurrency (programs resident at once);
* per phase, the median and 90th percentile over programs, in microseconds:
  mix (stream the piece, store partials), bar1 (wait for the block's partials), reduce (own
  tokens' gates), bar2 (wait for the block's gates), apply (re-read, weighted sum, store).

    python bench/h200_trace.py [--collapse JSON] [--ops hc_head,hc_pre] [--tokens 1,512,4096]
"""

from __future__ import annotations

import argparse
import importlib
import json

import torch

from dsv4mtp.conformance.inputs import op_inputs
from dsv4mtp.optimized.kernels.mhc_collapse import (
    TRACE_WIDTH,
    CollapseConfig,
    collapse_config,
    collapse_grid,
    mhc_collapse,
)

PHASES = ("mix", "bar1", "reduce", "bar2", "apply")


def _flush_l2(buf: torch.Tensor) -> None:
    buf.add_(1)  # touches 2.5x the L2: nothing of the inputs stays cached


def trace_once(
    op: str, T: int, D: int, cfg: CollapseConfig, flush: torch.Tensor, collapse=mhc_collapse
) -> dict:
    (x, fn, scale, base), kw = op_inputs(op, T, D, seed=0)
    out = torch.empty(T, D, dtype=x.dtype, device="cuda")
    pc = {}
    if op == "hc_pre":
        pc = dict(
            post=torch.empty(T, 4, device="cuda"),
            comb=torch.empty(T, 4, 4, device="cuda"),
            post_mult=kw["post_mult"],
            sinkhorn_iters=kw["sinkhorn_iters"],
        )
    trace = torch.zeros(collapse_grid(T, D, cfg), TRACE_WIDTH, dtype=torch.int64, device="cuda")

    def call(tr: torch.Tensor | None) -> None:
        collapse(x, fn, scale, base, out, rms_norm_eps=kw["rms_norm_eps"],
                     hc_eps=kw["hc_eps"], cfg=cfg, trace=tr, **pc)  # fmt: skip

    call(trace)  # compile
    times = []
    for _ in range(3):
        _flush_l2(flush)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call(trace)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    tr = trace.cpu().double()
    clk, g0, g1 = tr[:, :6], tr[:, 7], tr[:, 8]
    wall_ns = g1 - g0
    cycles = clk[:, 5] - clk[:, 0]
    long = wall_ns > wall_ns.median()  # clock rate from the longer programs (timer granularity)
    ghz = float((cycles[long].sum() / wall_ns[long].sum()).item()) if long.any() else 1.98
    span_us = float((g1.max() - g0.min()).item()) / 1e3
    life_us = float(wall_ns.sum().item()) / 1e3
    res = dict(
        op=op, D=D, T=T, cfg=list(vars(cfg).values()), event_us=min(times), span_us=span_us,
        programs=tr.shape[0], concurrency=life_us / span_us if span_us > 0 else 0.0, ghz=ghz,
    )  # fmt: skip
    for i, name in enumerate(PHASES):
        d_us = (clk[:, i + 1] - clk[:, i]) / (ghz * 1e3)
        res[name] = (float(d_us.median()), float(d_us.quantile(0.9)))
    d_us = cycles / (ghz * 1e3)
    res["total"] = (float(d_us.median()), float(d_us.quantile(0.9)))
    return res


def line(r: dict) -> str:
    ph = "  ".join(f"{k} {r[k][0]:6.2f}/{r[k][1]:6.2f}" for k in (*PHASES, "total"))
    return (
        f"{r['op']:7s} D={r['D']} T={r['T']:5d} {tuple(r['cfg'])}: call {r['event_us']:7.1f} us"
        f"  span {r['span_us']:7.1f}  progs {r['programs']:5d}  conc {r['concurrency']:5.1f}"
        f"  | p50/p90 us: {ph}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--collapse", default=None, help="JSON list of CollapseConfig 7-tuples")
    p.add_argument("--ops", default="hc_head,hc_pre")
    p.add_argument("--tokens", default="1,512,4096")
    p.add_argument("--widths", default="4096,7168")
    p.add_argument("--json", default=None, help="write all rows to this file")
    p.add_argument("--module", default=None, help="an alternative collapse module (A/B runs)")
    a = p.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    flush = torch.empty(int(2.5 * l2) // 4, device="cuda")
    collapse = mhc_collapse
    if a.module:
        collapse = importlib.import_module(a.module).mhc_collapse
    rows = []
    for op in a.ops.split(","):
        for D in map(int, a.widths.split(",")):
            cfgs = (
                [CollapseConfig(*c) for c in json.loads(a.collapse)]
                if a.collapse
                else [collapse_config(4, D, with_post_comb=op == "hc_pre")]
            )
            for T in map(int, a.tokens.split(",")):
                for cfg in cfgs:
                    r = trace_once(op, T, D, cfg, flush, collapse)
                    print(line(r), flush=True)
                    rows.append(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
