"""A/B of the persistent streaming collapse (diag/exp_stream.py) against the committed kernel.

    python3 diag/ab_stream.py [--tokens 1,64,512,4096] [--variants a,b] (from bench/)

Per (op, D, T): the committed kernel's graph-replay time per call (inputs rotated through more
than 3x the L2), then for each variant its time, its agreement with the committed kernel
(relative L2 error and max |diff| per output), finiteness, a batch-invariance check (the first
77 tokens alone must give the same bits) and the watchdog (a stuck wait would be counted).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import diag.exp_stream as E
from h200_mhc import copy_bandwidth, empty_kernel_us, graph_time_us, make_inputs, min_bytes

from dsv4mtp.optimized.kernels.mhc_collapse import mhc_collapse

C = E.StreamConfig
_V2 = dict(d_slice=256, a_slice=256, lookahead=8, lookahead_f=2, programs_per_sm=4)
VARIANTS = {
    "v2base": C(**_V2),
    "v2dyn": C(**{**_V2, "dynamic": True}),
    "v2L4": C(**{**_V2, "dynamic": True, "lookahead": 4, "lookahead_f": 1}),
    "v2L16": C(**{**_V2, "dynamic": True, "lookahead": 16, "lookahead_f": 4}),
    "v2d128": C(
        **{
            **_V2,
            "dynamic": True,
            "d_slice": 128,
            "a_slice": 128,
            "lookahead": 12,
            "lookahead_f": 3,
        }
    ),
    "v2s4": C(**{**_V2, "dynamic": True, "num_stages": 4}),
    "v2nreg": C(**{**_V2, "dynamic": True, "maxnreg": 128}),
    "v2tr": C(**{**_V2, "dynamic": True, "trace": True}),
    "v2str": C(**{**_V2, "trace": True}),
    "mix": C(mode=1, trace=True),
    "mixfin": C(mode=2, trace=True),
}
# Last sweep: lookaheads sized from the grid (in tickets), fewer programs per SM with deeper
# pipelines and 64 KB items, so the data between a line's two reads stays well inside the L2
# (programs x item bytes + lookahead blocks x block bytes).
_W = dict(d_slice=128, a_slice=128, tpf=4, programs_per_sm=2, num_stages=5, dynamic=True,
          la_f=1.2, la=1.8)  # fmt: skip
VARIANTS.update({
    "w1": C(**_W),
    "w2": C(**{**_W, "dynamic": False}),
    "w3": C(**{**_W, "programs_per_sm": 3, "num_stages": 4}),
    "w4": C(**{**_W, "d_slice": 256, "a_slice": 256, "tpf": 8}),
    "w5": C(**{**_W, "programs_per_sm": 4, "num_stages": 3}),
    "w6": C(**{**_W, "la_f": 1.6, "la": 2.4}),
    "w1tr": C(**{**_W, "trace": True}),
    "w3tr": C(**{**_W, "programs_per_sm": 3, "num_stages": 4, "trace": True}),
})  # fmt: skip
# Streaming-pattern sweep (mix only): slice width (contiguous run per token and stream), step
# order (stream-major "r" or column-major "c"), programs per SM, 5 stages, 32-token blocks, and
# a plain square sum without the MMA ("q": Triton then does not pipeline the loads).
for _ds in (128, 256, 512, 1024):
    for _rm in (False, True):
        for _p in (3, 5):
            VARIANTS[f"m{_ds}{'r' if _rm else 'c'}p{_p}"] = C(
                mode=1, d_slice=_ds, a_slice=_ds, row_major=_rm, programs_per_sm=_p
            )
    VARIANTS[f"q{_ds}rp4"] = C(
        mode=1, d_slice=_ds, a_slice=_ds, row_major=True, programs_per_sm=4, no_mma=True
    )
    VARIANTS[f"m{_ds}rp4s5"] = C(
        mode=1, d_slice=_ds, a_slice=_ds, row_major=True, programs_per_sm=4, num_stages=5
    )
    VARIANTS[f"m{_ds}rt32"] = C(
        mode=1, d_slice=_ds, a_slice=_ds, row_major=True, block_t=32, programs_per_sm=6
    )


def trace_summary(tr: torch.Tensor, grid: int) -> str:
    t = tr[:grid].double().cpu()
    tot = t[:, 0].sum().item() or 1.0
    f = [t[:, k].sum().item() / tot * 100 for k in (1, 2, 3, 4)]
    return (f"mix {f[0]:4.1f}% fin {f[1]:4.1f}% spin {f[2]:4.1f}% apply {f[3]:4.1f}%"
            f" items/prog {t[:, 5].mean().item():.1f}+{t[:, 6].mean().item():.1f}"
            f" life med {t[:, 0].median().item() / 1.98e3:.1f} max {t[:, 0].max().item() / 1.98e3:.1f}"
            f" us, fin max/prog {t[:, 2].max().item() / 1.98e3:.1f} us")  # fmt: skip


def call_factory(collapse, op, x, params, kw, cfg=None):
    fn, scale, base = params
    T, _, D = x.shape
    out = torch.full((T, D), float("nan"), dtype=x.dtype, device="cuda")
    pc = {}
    if op == "hc_pre":
        pc = dict(post=torch.full((T, 4), float("nan"), device="cuda"),
                  comb=torch.full((T, 4, 4), float("nan"), device="cuda"),
                  post_mult=kw["post_mult"], sinkhorn_iters=kw["sinkhorn_iters"])  # fmt: skip
    extra = {} if cfg is None else dict(cfg=cfg)

    def call() -> None:
        collapse(x, fn, scale, base, out, rms_norm_eps=kw["rms_norm_eps"], hc_eps=kw["hc_eps"],
                 **pc, **extra)  # fmt: skip

    outs = [out] + ([pc["post"], pc["comb"]] if op == "hc_pre" else [])
    return call, outs


def compare(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
    parts = []
    for u, v in zip(a, b, strict=True):
        u, v = u.float(), v.float()
        if not torch.isfinite(v).all():
            parts.append("NONFINITE")
            continue
        rel = ((u - v).norm() / u.norm().clamp_min(1e-30)).item()
        parts.append(f"{rel:.1e}/{(u - v).abs().max().item():.1e}")
    return " ".join(parts)


def timed(collapse, op, xs, params, kw, n_calls: int, cfg=None) -> float:
    """Graph-replay GPU time per call, cycling through the input copies ``xs``."""
    calls = [call_factory(collapse, op, x, params, kw, cfg)[0] for x in xs]
    return graph_time_us(calls, n_calls, 5)


def committed_baseline(op: str, T: int, D: int, l2: int, bw: float, n_calls: int):
    """Inputs of one (op, T, D) case, rotated through > 3x the L2 (``xs``), and the committed
    kernel's outputs on the first set and its time per call (printed as the case's header)."""
    (x0, *params), kw = make_inputs(op, T, D, seed=T + D)
    copies = max(2, min(64, -(-3 * l2 // (x0.numel() * 2))))
    xs = [x0] + [x0.clone() for _ in range(copies - 1)]
    mb = min_bytes(op, T, D)
    ref_call, ref_outs = call_factory(mhc_collapse, op, x0, params, kw)
    ref_call()
    t_ref = timed(mhc_collapse, op, xs, params, kw, n_calls)
    print(f"{op} D={D} T={T}: committed {t_ref:7.1f} us "
          f"({mb / (t_ref * 1e-6) / bw * 100:4.1f} % of copy)", flush=True)  # fmt: skip
    return xs, params, kw, mb, ref_outs, t_ref


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="4096")
    p.add_argument("--widths", default="4096,7168")
    p.add_argument("--ops", default="hc_head,hc_pre")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--n-calls", type=int, default=20)
    a = p.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    bw = copy_bandwidth()
    empty = empty_kernel_us()
    print(f"copy {bw / 1e12:.3f} TB/s, empty kernel {empty:.2f} us, L2 {l2 >> 20} MB", flush=True)
    names = a.variants.split(",")
    for op in a.ops.split(","):
        for D in map(int, a.widths.split(",")):
            for T in map(int, a.tokens.split(",")):
                xs, params, kw, mb, ref_outs, t_ref = committed_baseline(
                    op, T, D, l2, bw, a.n_calls
                )
                x0 = xs[0]
                for name in names:
                    cfg = VARIANTS[name]
                    try:
                        call, outs = call_factory(E.mhc_collapse, op, x0, params, kw, cfg)
                        call()
                        torch.cuda.synchronize()
                        stuck = int(E.LAST_INFO["sync"][-1].item())
                        info = dict(E.LAST_INFO)
                        cmp = compare(ref_outs, outs) if cfg.mode == 0 else "n/a"
                        trs = trace_summary(info["trace"], info["grid"]) if cfg.trace else ""
                        bi = "-"
                        if T >= 77 and cfg.mode == 0:
                            c77, o77 = call_factory(E.mhc_collapse, op, x0[:77].contiguous(),
                                                    params, kw, cfg)  # fmt: skip
                            c77()
                            bi = "ok" if all(torch.equal(u[:77], v) for u, v in
                                             zip(outs, o77, strict=True)) else "DIFF"  # fmt: skip
                        first = [o.clone() for o in outs]
                        call()
                        again = all(torch.equal(u, v) for u, v in zip(first, outs, strict=True))
                        t = timed(E.mhc_collapse, op, xs, params, kw, a.n_calls, cfg)
                        print(f"  {name:6s} {t:7.1f} us ({mb / (t * 1e-6) / bw * 100:4.1f} %)"
                              f" x{t_ref / t:4.2f}  regs {info['regs']} smem {info['smem']}"
                              f" resident/SM {info['per_sm']} grid {info['grid']} look {info['look']}"
                              f" | vs committed {cmp} | batch-inv {bi} rerun {again}"
                              f" stuck {stuck} | {trs}", flush=True)  # fmt: skip
                    except Exception as e:  # keep sweeping
                        print(f"  {name:6s} FAILED: {type(e).__name__}: {e}"[:400], flush=True)


if __name__ == "__main__":
    main()
