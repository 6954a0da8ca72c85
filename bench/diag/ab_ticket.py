"""The ticketed one-launch mHC kernels against the kernels they replaced and their split forms.

GPU time per call by CUDA-graph replay (``diag/ab_common.timed``: inputs rotated through > 3x the
L2), same process, for hc_pre and hc_head (tensor-core collapse) at T in {1, 8, 64, 512, 4096}
and hc_head's FMA kernel at T <= 512, D 4096 and 7168; checks that the one-launch and split forms
agree bitwise and prints the old kernels' difference from the new.

The old kernels are 18d4311's, whose programs waited on the other programs of their token block
(co-residency assumed); extract them next to this script first (from bench/):

    git show 18d4311:optimized/kernels/mhc_collapse.py | sed 's/^from \\._launch/from dsv4mtp.optimized.kernels._launch/; s/^from \\.mhc_mix/from dsv4mtp.optimized.kernels.mhc_mix/' > diag/old_collapse.py
    git show 18d4311:optimized/kernels/mhc_head.py | sed 's/^from \\._launch/from dsv4mtp.optimized.kernels._launch/' > diag/old_head.py
    python3 diag/ab_ticket.py

bench/results/mhc-h200.md, "In-kernel waits", has a run.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diag import old_collapse, old_head  # type: ignore[attr-defined]
from diag.ab_common import call_factory, compare, timed
from h200_mhc import copy_bandwidth

from dsv4mtp.conformance.inputs import op_inputs
from dsv4mtp.optimized.kernels.mhc_collapse import collapse_config, mhc_collapse
from dsv4mtp.optimized.kernels.mhc_head import mhc_head_fma


def main() -> None:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"copy {copy_bandwidth() / 1e12:.3f} TB/s", flush=True)
    for op in ("hc_pre", "hc_head", "hc_head_fma"):
        base_op = "hc_head" if op.startswith("hc_head") else op
        for D in (4096, 7168):
            for T in (1, 8, 64, 512, 4096):
                if op == "hc_head_fma" and T > 512:
                    continue
                (x0, *params), kw = op_inputs(base_op, T, D, seed=T + D)
                copies = max(2, min(64, -(-3 * l2 // (x0.numel() * 2))))
                xs = [x0] + [x0.clone() for _ in range(copies - 1)]
                if op == "hc_head_fma":
                    variants = {
                        "old": (old_head.mhc_head_fma, None),
                        "new": (functools.partial(mhc_head_fma, one_launch=True), None),
                        "split": (functools.partial(mhc_head_fma, one_launch=False), None),
                    }
                else:
                    pc = op == "hc_pre"
                    cfg = collapse_config(4, D, with_post_comb=pc)
                    variants = {
                        "old": (old_collapse.mhc_collapse,
                                old_collapse.collapse_config(4, D, with_post_comb=pc)),
                        "new": (mhc_collapse, cfg),
                        "split": (mhc_collapse, dataclasses.replace(cfg, fused=False)),
                    }  # fmt: skip
                res, outs = {}, {}
                for name, (fn, c) in variants.items():
                    call, o = call_factory(fn, base_op, x0, params, kw, c)
                    call()
                    torch.cuda.synchronize()
                    outs[name] = o
                    res[name] = timed(fn, base_op, xs, params, kw, 20, c)
                same = all(
                    torch.equal(a, b) for a, b in zip(outs["new"], outs["split"], strict=True)
                )
                print(f"{op:12s} D={D:5d} T={T:5d} old {res['old']:7.1f} new {res['new']:7.1f} "
                      f"split {res['split']:7.1f} us  new/old {res['new'] / res['old']:.3f} "
                      f"new==split {same} old-vs-new {compare(outs['old'], outs['new'])}",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
