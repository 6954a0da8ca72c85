"""Time variant collapse modules against the committed kernel on the GPU (same process).

    python3 diag/ab_time.py diag.my_variant [more modules] [--uncapped] [--tokens 1,64,4096]
    (from bench/; a variant module is a copy of optimized/kernels/mhc_collapse.py with
    absolute imports, saved under bench/diag/)

Per (op, D, T): graph-replay GPU time per call of the committed ``mhc_collapse`` (inputs rotated
through > 3x the L2, diag/ab_common.py), of each variant module's ``mhc_collapse`` and, with
``--uncapped``, of the committed kernel without the register cap of its default schedule (only
where ``collapse_config`` sets ``max_registers``); each with its relative and max-abs difference
from the committed kernel's outputs (NONFINITE if any output is).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diag.ab_common import call_factory, committed_baseline, compare, timed
from h200_mhc import copy_bandwidth

from dsv4mtp.optimized.kernels.mhc_collapse import collapse_config, mhc_collapse


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("modules", nargs="*", help="variant modules, e.g. diag.my_variant")
    p.add_argument("--uncapped", action="store_true")
    p.add_argument("--tokens", default="1,64,512,4096")
    p.add_argument("--widths", default="4096,7168")
    p.add_argument("--ops", default="hc_pre,hc_head")
    p.add_argument("--n-calls", type=int, default=20)
    a = p.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    bw = copy_bandwidth()
    print(f"copy {bw / 1e12:.3f} TB/s", flush=True)
    variants = {m: (importlib.import_module(m).mhc_collapse, None) for m in a.modules}
    for op in a.ops.split(","):
        for D in map(int, a.widths.split(",")):
            cfg = collapse_config(4, D, with_post_comb=op == "hc_pre")
            runs = dict(variants)
            if a.uncapped and cfg.max_registers is not None:
                runs["uncapped"] = (mhc_collapse, dataclasses.replace(cfg, max_registers=None))
            for T in map(int, a.tokens.split(",")):
                xs, params, kw, mb, ref_outs, t_ref = committed_baseline(
                    op, T, D, l2, bw, a.n_calls
                )
                x0 = xs[0]
                for name, (collapse, vcfg) in runs.items():
                    call, outs = call_factory(collapse, op, x0, params, kw, vcfg)
                    call()
                    t = timed(collapse, op, xs, params, kw, a.n_calls, vcfg)
                    print(f"  {name:28s} {t:7.1f} us ({mb / (t * 1e-6) / bw * 100:4.1f} %)"
                          f" committed x{t / t_ref:4.2f} | vs committed "
                          f"{compare(ref_outs, outs)}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
