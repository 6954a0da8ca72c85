"""Does the MXFP4 experts' memory layout cap the decode GEMMs' weight stream?  (H200)

The decode-size MoE GEMMs stream about 1.8-2.1 TB/s of expert weights whatever their
instruction count (bench/results/moe-h200.md, "A Gluon probe").  Their loads follow the
checkpoint's layout: each K step of a 128-row tile reads 64 bytes from each of 128 rows that
lie K/2 bytes apart, so the weight bytes of one step are 128 separate 64-byte pieces and a row's
consecutive pieces are requested a K step (about a microsecond) apart.  This script times the
same stream with the same kernel structure (one ``tl.dot_scaled`` per 32-column scale group, 8
tokens on the MMA's N side, as ``decode="mxdot"``) over two layouts of the same codes:

* ``rows``: the checkpoint's (E, N, K/2) bytes;
* ``tiled``: each (128-row tile, K step) block contiguous, (E, N/128, K/BLOCK_K, 128,
  BLOCK_K/2): a step reads one 8 KiB block, each group a 64-byte-strided slice of it;
* ``groups``: each (128-row tile, 32-column scale group) block contiguous, (E, N/128, K/32,
  128, 16): each group's load is one 2 KiB block.

V4-Flash gate/up matrices (N 4096 rows, K 4096 columns: 8 MiB of codes each), E of them in one
launch (grid: 32 row tiles x E), 8 tokens; scales are left out (1/16 of the bytes).  Time: CUDA
graph replay of one launch, median of 20; GB/s = code bytes / time; same-run copy bandwidth
(``bench/h200_mhc.py``: read + write of a 2 GiB copy); "vs copy" = code bytes per second /
copy bandwidth, the project's floor convention (1.0: the stream at the copy's total rate).  The outputs of the two layouts
are compared bitwise (the same products in the same order), so the addressing is checked too.

Run (GPU machine, repository root, after the README's install):
``python3 bench/diag/moe_layout_probe.py [--experts 160]``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from h200_mhc import copy_bandwidth, graph_time_us

TOKENS = 8
BLOCK_N = 128


@triton.jit
def _codes_ptr(base, pid_n, ks, steps, k0, K, g, rows, kb, TILED: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, WIDTH: tl.constexpr):  # fmt: skip
    """Pointers of the (BLOCK_N, WIDTH) code bytes of group(s) g.. of K step ks."""
    if TILED == 2:  # each 32-column group's (128 rows x 16 bytes) block contiguous
        block = ((pid_n * steps + ks) * (BLOCK_K // 32) + g) * (BLOCK_N * 16)
        return base + block + rows[:, None] * 16 + kb[None, :]
    elif TILED == 1:  # each K step's (128 rows x BLOCK_K / 2 bytes) block contiguous
        block = (pid_n * steps + ks) * (BLOCK_N * (BLOCK_K // 2))
        return base + block + rows[:, None] * (BLOCK_K // 2) + (16 * g + kb)[None, :]
    else:
        r = (pid_n * BLOCK_N + rows).to(tl.int64)
        return base + r[:, None] * (K // 2) + (k0 // 2 + 16 * g + kb)[None, :]


@triton.jit
def stream_kernel(
    w_ptr,
    x_ptr,
    y_ptr,
    N,
    K,
    TILED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MODE: tl.constexpr,
):
    """MODE 0: one load and one ``dot_scaled`` per 32-column group (``decode="mxdot"``'s
    structure); 1: the same dots, the step's codes loaded at once and split into groups;
    2: one ``dot_scaled`` per step with the e8m0 scales in the dot (unit scales here); 3: the
    loads alone (a sum keeps them), no dot."""
    pid_n = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, BLOCK_N)
    kb = tl.arange(0, 16)
    kw = tl.arange(0, BLOCK_K // 2)
    kx = tl.arange(0, 32)
    kxs = tl.arange(0, BLOCK_K)
    t = tl.arange(0, 8)
    base = w_ptr + e * N * (K // 2)
    acc = tl.zeros((BLOCK_N, 8), dtype=tl.float32)
    steps = K // BLOCK_K
    for ks in range(0, steps):
        k0 = ks * BLOCK_K
        if MODE == 0 or MODE == 3:
            for g in tl.static_range(BLOCK_K // 32):
                ptr = _codes_ptr(base, pid_n, ks, steps, k0, K, g, rows, kb, TILED, BLOCK_N,
                                 BLOCK_K, 16)  # fmt: skip
                codes = tl.load(ptr)
                if MODE == 0:
                    x = tl.load(x_ptr + t[:, None] * K + (k0 + 32 * g + kx)[None, :])
                    acc += tl.dot_scaled(codes, None, "e2m1", tl.trans(x), None, "bf16")
                else:
                    acc += tl.sum(codes.to(tl.float32), axis=1)[:, None]
        else:
            ptr = _codes_ptr(base, pid_n, ks, steps, k0, K, 0, rows, kw, 1 if TILED else 0,
                             BLOCK_N, BLOCK_K, BLOCK_K // 2)  # fmt: skip
            codes = tl.load(ptr)  # (BLOCK_N, BLOCK_K / 2)
            if MODE == 2:
                x = tl.load(x_ptr + t[:, None] * K + (k0 + kxs)[None, :])
                sc = tl.full((BLOCK_N, BLOCK_K // 32), 127, tl.uint8)
                acc += tl.dot_scaled(codes, sc, "e2m1", tl.trans(x), None, "bf16")
            else:
                c4 = tl.permute(tl.reshape(codes, (BLOCK_N, 4, 16)), (0, 2, 1))
                c02, c13 = tl.split(tl.reshape(c4, (BLOCK_N, 16, 2, 2)))
                c0, c2 = tl.split(c02)
                c1, c3 = tl.split(c13)
                for g in tl.static_range(4):
                    cg = c0 if g == 0 else c1 if g == 1 else c2 if g == 2 else c3
                    x = tl.load(x_ptr + t[:, None] * K + (k0 + 32 * g + kx)[None, :])
                    acc += tl.dot_scaled(cg, None, "e2m1", tl.trans(x), None, "bf16")
    out = y_ptr + e * N * 8 + (pid_n * BLOCK_N + rows)[:, None] * 8 + t[None, :]
    tl.store(out, acc)


def tiled(codes: torch.Tensor, block_k: int) -> torch.Tensor:
    """(E, N, K/2) -> (E, N/128, K/block_k, 128, block_k/2), contiguous (``block_k`` 32: each
    scale group's block)."""
    E, N, Kh = codes.shape
    bk = block_k // 2
    return codes.view(E, N // BLOCK_N, BLOCK_N, Kh // bk, bk).permute(0, 1, 3, 2, 4).contiguous()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=160)
    args = ap.parse_args(argv)
    E, N, K = args.experts, 4096, 4096
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"same-run copy {bw / 1e12:.3f} TB/s (read + write); E {E} matrices of {N} x {K}")
    codes = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device="cuda")
    x = torch.randn(TOKENS, K, device="cuda").to(torch.bfloat16)
    layouts = {("rows", 128): codes, ("tiled", 128): tiled(codes, 128)}
    layouts[("groups", 128)] = tiled(codes, 32)
    nbytes = codes.numel()
    print("| layout | mode | warps | stages | us | TB/s of codes | vs copy |")
    print("|---|---|---|---|---|---|---|")
    ref: dict[int, torch.Tensor] = {}
    cases = [(m, w, st) for m in (0, 1, 2) for w, st in ((4, 1), (4, 2), (4, 3), (8, 2), (8, 3))]
    cases += [(3, 4, 3)]
    for (name, bk), w in layouts.items():
        for mode, warps, stages in cases:
            if name == "groups" and mode in (1, 2):  # a step's codes are not one block there
                continue
            y = torch.empty(E, N, TOKENS, dtype=torch.float32, device="cuda")

            def run(w=w, y=y, bk=bk, mode=mode, warps=warps, stages=stages, name=name) -> None:
                stream_kernel[(N // BLOCK_N, E)](
                    w, x, y, N, K, TILED=("rows", "tiled", "groups").index(name), BLOCK_N=BLOCK_N,
                    BLOCK_K=bk, MODE=mode, num_warps=warps, num_stages=stages,
                )  # fmt: skip

            try:
                run()
                torch.cuda.synchronize()
                us = graph_time_us([run], 1, 20)
            except Exception as exc:  # a variant that fails to compile is a row, not the end
                print(f"| {name} | {mode} | {warps} | {stages} | fail: {exc!r:.80} | | |")
                continue
            same = ""
            if mode in (0, 1):  # the same products in the same order in every layout
                if 0 in ref:
                    same = "" if torch.equal(ref[0], y) else " (outputs differ!)"
                else:
                    ref[0] = y.clone()
            tbs = nbytes / us / 1e6
            print(f"| {name} | {mode} | {warps} | {stages} | {us:.1f} | {tbs:.2f} | "
                  f"{tbs * 1e12 / bw:.2f}{same} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
