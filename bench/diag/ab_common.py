"""Shared by the A/B tools (ab_time.py, ab_collapse.py): call the committed collapse or a
variant module's ``mhc_collapse`` on one (op, T, D) case, time it by graph replay, compare its
outputs with the committed kernel's.  Run from bench/ (h200_mhc.py is imported from there).
"""

from __future__ import annotations

import torch
from h200_mhc import graph_time_us, min_bytes

from dsv4mtp.conformance.inputs import op_inputs
from dsv4mtp.optimized.kernels.mhc_collapse import mhc_collapse


def call_factory(collapse, op, x, params, kw, cfg=None):
    """A zero-argument call of ``collapse`` on x (NaN-filled outputs) and its output list
    (``[out]`` for hc_head, ``[out, post, comb]`` for hc_pre)."""
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
    """Per output: relative L2 error / max |diff| of ``b`` against ``a`` (NONFINITE if any)."""
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
    (x0, *params), kw = op_inputs(op, T, D, seed=T + D)
    copies = max(2, min(64, -(-3 * l2 // (x0.numel() * 2))))
    xs = [x0] + [x0.clone() for _ in range(copies - 1)]
    mb = min_bytes(op, T, D)
    ref_call, ref_outs = call_factory(mhc_collapse, op, x0, params, kw)
    ref_call()
    t_ref = timed(mhc_collapse, op, xs, params, kw, n_calls)
    print(f"{op} D={D} T={T}: committed {t_ref:7.1f} us "
          f"({mb / (t_ref * 1e-6) / bw * 100:4.1f} % of copy)", flush=True)  # fmt: skip
    return xs, params, kw, mb, ref_outs, t_ref
