"""Hardware counters of the MoE's routed GEMMs at decode sizes, under Nsight Compute (H200).

For MXFP4 V4-Flash experts (E 256, top-6, I 2048, D 4096) and T in ``--tokens``, one ``moe``
call per schedule (the default, then the PTX decode on 16-row blocks), in the order printed,
so the report's gate/up and down kernels line up with the printed labels (on the tiles layout
the default's routed GEMMs are ``moe_mx_gluon_kernel``, gate/up then down, and its
``moe_gate_up_kernel`` / ``moe_down_kernel`` the FP8 shared expert's).  Meant to be run
from the repository root as

    ncu --clock-control none -k regex:'moe_(gate_up|down|mx_gluon)_kernel' --section SpeedOfLight \
        --section Occupancy --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section LaunchStats \
        python3 bench/diag/ncu_moe.py [--tokens 1,64]

ncu replays each kernel with the caches flushed (cold L2, like the benchmark's rotating
weight copies).  The question it answers: at decode sizes, is a routed GEMM limited by DRAM
bandwidth, by instruction issue, or by the loads in flight (warps stalled on long scoreboard
with the issue slots idle)?
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from dsv4mtp.conformance.inputs import moe_inputs
from dsv4mtp.optimized.moe import moe, moe_config, pack_moe


def schedules(T: int, fmt: str) -> list[tuple[str, object]]:
    """The default of the pack's format (MXFP4 at decode sizes: the Gluon GEMMs on the tiles
    layout, the group-scaled dot on the rows) and the PTX decode on the 16-row, 64-column
    tiles the group-scaled dot replaced."""
    d = moe_config(T, batch_invariant=False, fmt=fmt)
    asm = replace(
        d, decode="asm", block_m=16,
        gate_up=replace(d.gate_up, block_n=64, swap_ab=False),
        down=replace(d.down, block_n=64, swap_ab=False),
    )  # fmt: skip
    return [("default", d), ("asm_m16", asm)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,64")
    a = p.parse_args()
    for T in (int(t) for t in a.tokens.split(",")):
        (x, params, cfg), kw = moe_inputs("moe", T, 7, shape="flash", fmt="mxfp4", device="cuda")
        pack = pack_moe(params, "cuda")
        for name, s in schedules(T, pack.kernel_fmt):
            moe(x, pack, cfg, **kw, schedule=s)  # compiles (no kernel launch while compiling)
            torch.cuda.synchronize()
            print(f"T={T} {name}: gate/up then down kernels follow", flush=True)


if __name__ == "__main__":
    main()
