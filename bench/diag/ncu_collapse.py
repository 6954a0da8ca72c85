"""Hardware counters of the mHC collapse and its parts, under Nsight Compute (H200).

Launches each case once (inputs built first; Triton compiles on the first launch, which is the
profiled one: compilation is not a kernel), in the order printed, so the ncu report's kernels
line up with the printed labels.  Meant to be run as

    ncu --clock-control none -k regex:'mhc_' --section SpeedOfLight --section Occupancy \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
        python3 diag/ncu_collapse.py [--module PATH ...]

ncu replays each kernel with caches flushed (--cache-control all, its default), so every case
starts with a cold L2, like the benchmark's rotating buffers.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import torch

from dsv4mtp.conformance.inputs import op_inputs
from dsv4mtp.optimized.kernels import mhc_collapse as default_collapse
from dsv4mtp.optimized.kernels.mhc_collapse import CollapseConfig, collapse_config
from dsv4mtp.optimized.kernels.mhc_mix import mhc_mix_splitk, mix_config


def load_module(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def run_collapse(mod, op: str, T: int, D: int, cfg: CollapseConfig) -> None:
    (x, fn, scale, base), kw = op_inputs(op, T, D, seed=0)
    out = torch.empty(T, D, dtype=x.dtype, device="cuda")
    pc = {}
    if op == "hc_pre":
        pc = dict(post=torch.empty(T, 4, device="cuda"), comb=torch.empty(T, 4, 4, device="cuda"),
                  post_mult=kw["post_mult"], sinkhorn_iters=kw["sinkhorn_iters"])  # fmt: skip
    torch.cuda.synchronize()
    mod.mhc_collapse(x, fn, scale, base, out, rms_norm_eps=kw["rms_norm_eps"], hc_eps=kw["hc_eps"],
                     cfg=cfg, **pc)  # fmt: skip
    torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--module", action="append", default=[], help="variant collapse module file")
    p.add_argument("--tokens", default="4096")
    p.add_argument("--small", action="store_true", help="also T = 1 (latency case)")
    p.add_argument("--collapse", default=None,
                   help="JSON list of CollapseConfig 7-tuples: only these, for every --module "
                   "(and the default kernel), both ops, D 4096 and 7168")  # fmt: skip
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    variants = [(Path(m).stem, load_module(m)) for m in args.module]  # each compiled once
    cases = []
    if args.collapse:
        for c in json.loads(args.collapse):
            for label, mod in [("default", default_collapse), *variants]:
                for op in ("hc_head", "hc_pre"):
                    for D in (4096, 7168):
                        for T in tokens:
                            cases.append((label, mod, op, T, D, CollapseConfig(*c)))
    else:
        cfg = collapse_config(4, 4096)
        for T in tokens:
            for op, D in (("hc_head", 4096), ("hc_pre", 4096), ("hc_head", 7168)):
                op_cfg = collapse_config(4, D, op == "hc_pre")
                cases.append(("default", default_collapse, op, T, D, op_cfg))
            three = dataclasses.replace(cfg, fused=False)
            cases.append(("three-launch (3 kernels)", default_collapse, "hc_head", T, 4096, three))
            for label, mod in variants:
                cases.append((label, mod, "hc_head", T, 4096, cfg))
        if args.small:
            cases.append(("default", default_collapse, "hc_head", 1, 4096, cfg))
    for i, (label, mod, op, T, D, c) in enumerate(cases):
        print(f"CASE {i}: {label} {op} T={T} D={D} {tuple(vars(c).values())}", flush=True)
        run_collapse(mod, op, T, D, c)
    if args.collapse:
        return
    # The split-K mix producer alone (reads x once, like the collapse's mix phase).
    for i, T in enumerate(tokens, start=len(cases)):
        (x, fn, _, _), _ = op_inputs("hc_pre", T, 4096, seed=0)
        print(f"CASE {i}: mix producer M=24 T={T} D=4096", flush=True)
        mhc_mix_splitk(x.view(T, -1), fn, mix_config(24, 4 * 4096))
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
