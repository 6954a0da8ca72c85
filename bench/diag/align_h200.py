"""Time the MoE token -> expert sort (optimized/kernels/moe_align.py) alone on the H200.

V4-Flash routing (E 256 local experts, no expert map, top-6), T in {1, 8, 64, 512, 4096},
BLOCK_M 16 and 64, two id distributions (fixed seed): ``uniform`` (each slot's expert uniform
at random, 10% padding slots -1) and ``one_expert`` (every slot on expert 17).  Each row is one
path and chunk: ``single`` (one program, S <= min(chunk, 128)) and ``chunked`` (count / scan /
place launches) at chunks 64, 128 and 256 wherever S allows them.  Each output is first checked
bit for bit against the plain torch contract (conformance/test_moe_align.py, align_contract);
the time is the median over replays of a CUDA graph of 20 back-to-back calls, per call, next to
an empty Triton kernel timed the same way (the launch floor).  Prints a markdown table (~30 s).

    python bench/diag/align_h200.py [--tokens 1,8,64,512,4096] [--single-warps 4,8,16]

``--single-warps``: the one-program rows once per warp count instead of at the default
(``moe_align._small_warps``), the column "warps" saying which.
``--dry-run``: the same on the CPU under TRITON_INTERPRET=1 (set by the script) at E 16,
top-2, T in {1, 8, 64}, wall clock (the interpreter's time, not the kernel's).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h200_mhc import empty_kernel_us
from h200_moe import Clock

from dsv4mtp.conformance.test_moe_align import align_contract
from dsv4mtp.optimized.kernels import moe_align
from dsv4mtp.optimized.kernels.moe_align import moe_align_triton

SEED = 0
CHUNKS = (64, 128, 256)


def route_ids(kind: str, T: int, K: int, E: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED)
    if kind == "one_expert":
        return torch.full((T, K), 17 % E, dtype=torch.int64, device=device)
    ids = torch.randint(0, E, (T, K), generator=g)
    return torch.where(torch.rand((T, K), generator=g) < 0.1, -1, ids).to(device)


def variants(S: int) -> list[tuple[str, int]]:
    """(path, chunk) rows for S slots: the single program where it applies, every chunk that
    splits S into more than one chunk."""
    single = [("single", 128)] if S <= 128 else []
    return single + [("chunked", c) for c in CHUNKS if min(c, 128) < S]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default=None, help="comma-separated T (default 1,8,64,512,4096)")
    p.add_argument("--reps", type=int, default=30, help="graph replays per row")
    p.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes")
    p.add_argument("--single-warps", default="", help="one-program warps to time, e.g. 4,8,16")
    a = p.parse_args()
    default_warps = moe_align._small_warps
    single_warps = [int(w) for w in a.single_warps.split(",") if w]
    cuda = not a.dry_run
    if cuda and not torch.cuda.is_available():
        p.error("needs a CUDA device (or --dry-run)")
    E, K = (16, 2) if a.dry_run else (256, 6)
    tokens = a.tokens or ("1,8,64" if a.dry_run else "1,8,64,512,4096")
    n_calls, reps = (2, 2) if a.dry_run else (20, a.reps)
    dev = "cuda" if cuda else "cpu"
    clock = Clock(cuda=cuda)
    print(f"E {E}, top-{K}, {'CUDA graph replay' if cuda else 'CPU interpreter, wall clock'}")
    if cuda:
        print(f"empty Triton kernel: {empty_kernel_us():.2f} us per call\n")
    print("| T | S | BLOCK_M | ids | path | chunk | warps | launches | us / call |")
    print("|---:|---:|---:|---|---|---:|---:|---:|---:|")
    for T in (int(t) for t in tokens.split(",")):
        S = T * K
        for bm in (16, 64):
            for kind in ("uniform", "one_expert"):
                ids = route_ids(kind, T, K, E, dev)
                want = align_contract(ids, None, E, bm)
                for path, chunk, warps in _with_warps(variants(S), single_warps):
                    moe_align._small_warps = default_warps if warps is None else (
                        lambda sb, w=warps: w
                    )  # fmt: skip
                    srt, blk = moe_align_triton(ids, None, E, bm, chunk=chunk)
                    if not (torch.equal(srt, want[0]) and torch.equal(blk, want[1])):
                        raise SystemExit(f"mismatch: T {T}, BLOCK_M {bm}, {kind}, {path} {chunk}")
                    us = clock.graph_us(
                        [lambda i=ids, b=bm, c=chunk: moe_align_triton(i, None, E, b, chunk=c)],
                        n_calls,
                        reps,
                    )
                    launches = 1 if path == "single" else 3
                    sb = moe_align.small_align(S, E, bm, 128)
                    shown = "-" if sb is None else (warps or f"{default_warps(sb[1])}*")
                    print(f"| {T} | {S} | {bm} | {kind} | {path} | {chunk} | {shown} | "
                          f"{launches} | {us:.1f} |")  # fmt: skip
    moe_align._small_warps = default_warps


def _with_warps(rows: list[tuple[str, int]], warps: list[int]) -> list[tuple[str, int, int | None]]:
    """Each one-program row once per warp count of ``warps`` (None: the default, marked *)."""
    out: list[tuple[str, int, int | None]] = []
    for path, chunk in rows:
        for w in warps if path == "single" and warps else [None]:
            out.append((path, chunk, w))
    return out


if __name__ == "__main__":
    main()
