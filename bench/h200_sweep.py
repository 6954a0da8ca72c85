"""Tile sweep of the one-pass mHC collapse kernel (hc_head and hc_pre) on the GPU.

Times each (BLOCK_T, BLOCK_D, num_warps) at T in {1, 64, 4096}, D in {4096, 7168} with the same
CUDA-graph / rotating-input method as bench/h200_mhc.py, checks each result bitwise against the
two-pass schedule of the same tiles, and prints a table.  Used once to pick CollapseConfig's
defaults; kept so the choice can be re-made on another GPU.

    python bench/h200_sweep.py
"""

from __future__ import annotations

import math

import torch
from h200_mhc import copy_bandwidth, graph_time_us, make_inputs, min_bytes

from dsv4mtp.optimized.kernels.mhc_collapse import mhc_collapse

CONFIGS = {
    "hc_head": [(16, 256, 8), (8, 256, 8), (16, 128, 8), (8, 128, 4), (4, 256, 4), (8, 512, 8)],
    "hc_pre": [(16, 128, 8), (16, 64, 4), (16, 64, 8), (32, 64, 8), (16, 128, 4)],
}


def run(op: str, args, kw, cfg, out, single_pass: bool = True) -> None:
    x, fn, scale, base = args
    bt, bd, nw = cfg
    extra = {}
    if op == "hc_pre":
        extra = dict(post=out[1], comb=out[2], post_mult=2.0, sinkhorn_iters=20)
    mhc_collapse(
        x, fn, scale, base, out[0], rms_norm_eps=kw["rms_norm_eps"], hc_eps=kw["hc_eps"],
        single_pass=single_pass, block_t=bt, block_d=bd, num_warps=nw, **extra,
    )  # fmt: skip


def main() -> None:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    bw = copy_bandwidth()
    print(f"copy {bw / 1e12:.3f} TB/s")
    for op, cfgs in CONFIGS.items():
        for D in (4096, 7168):
            for T in (1, 64, 4096):
                probe, kw = make_inputs(op, T, D, seed=0)
                R = max(2, math.ceil(2.2 * l2 / sum(t.numel() * t.element_size() for t in probe)))
                sets = [probe] + [make_inputs(op, T, D, seed=i)[0] for i in range(1, R)]
                outs = [torch.empty(T, D, dtype=torch.bfloat16, device="cuda")]
                if op == "hc_pre":
                    outs += [torch.empty(T, 4, device="cuda"), torch.empty(T, 4, 4, device="cuda")]
                for cfg in cfgs:
                    try:
                        run(op, probe, kw, cfg, outs)
                        a = [o.clone() for o in outs]
                        run(op, probe, kw, cfg, outs, single_pass=False)
                        same = all(torch.equal(u, v) for u, v in zip(a, outs, strict=True))
                        calls = [
                            lambda s=s, c=cfg, o=op, k=kw, out=outs: run(o, s, k, c, out)
                            for s in sets
                        ]
                        us = graph_time_us(calls, max(R, 100) if T <= 64 else max(R, 10), 5)
                        frac = min_bytes(op, T, D) / (us * 1e-6) / bw
                        print(f"{op} D={D} T={T} cfg={cfg}: {us:9.2f} us {frac * 100:5.1f}% "
                              f"copy  1-pass==2-pass: {same}", flush=True)  # fmt: skip
                    except Exception as e:
                        print(f"{op} D={D} T={T} cfg={cfg}: FAILED {type(e).__name__}: {e}")
                del sets
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
