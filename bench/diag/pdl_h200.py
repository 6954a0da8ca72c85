"""Does programmatic dependent launch (PDL) shorten a CUDA graph of small dependent kernels?

A chain of N launches, each reading the previous one's output, captured in one CUDA graph,
replayed; per-launch time with and without ``launch_pdl=True`` (each kernel calls
``gdc_wait()`` before it reads its input, and, with ``early``, ``gdc_launch_dependents()`` at
its start).  Two kernels: a one-program add over 4096 elements (pure latency), and a GEMV that
streams a (N, K) bf16 weight over 132 programs (weights may be prefetched before the wait).

    python3 bench/diag/pdl_h200.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def add_kernel(x, y, n, PDL: tl.constexpr, EARLY: tl.constexpr, BLOCK: tl.constexpr):
    if EARLY:
        gdc_launch_dependents()
    offs = tl.arange(0, BLOCK)
    if PDL:
        gdc_wait()
    v = tl.load(x + offs, mask=offs < n)
    tl.store(y + offs, v + 1.0, mask=offs < n)


@triton.jit
def gemv_kernel(
    x,
    w,
    y,
    N,
    K,
    PDL: tl.constexpr,
    EARLY: tl.constexpr,
    PREFETCH: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    if EARLY:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BN,), tl.float32)
    if PREFETCH:
        # the first weight tile before the wait (weights never depend on the previous kernel)
        w0 = tl.load(w + rn[:, None] * K + rk[None, :])
    if PDL:
        gdc_wait()
    if PREFETCH:
        acc += tl.sum(w0.to(tl.float32) * tl.load(x + rk).to(tl.float32)[None, :], axis=1)
    for k in range(BK if PREFETCH else 0, K, BK):
        wt = tl.load(w + rn[:, None] * K + (k + rk)[None, :])
        xv = tl.load(x + k + rk).to(tl.float32)
        acc += tl.sum(wt.to(tl.float32) * xv[None, :], axis=1)
    tl.store(y + rn, acc.to(tl.bfloat16))


def graph_us(fn, reps=50) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return min(times)


def main() -> None:
    n_chain = 40
    bufs = [torch.zeros(4096, device="cuda") for _ in range(n_chain + 1)]
    print(torch.cuda.get_device_name(), "triton", triton.__version__)
    print("| kernel | mode | us per launch in the graph | check |")
    print("|---|---|---|---|")
    for pdl, early in ((False, False), (True, False), (True, True)):

        def chain(pdl=pdl, early=early):
            for i in range(n_chain):
                add_kernel[(1,)](
                    bufs[i], bufs[i + 1], 4096, PDL=pdl, EARLY=early, BLOCK=4096, launch_pdl=pdl
                )

        bufs[0].zero_()
        us = graph_us(chain)
        ok = bool((bufs[-1] == n_chain).all())
        print(f"| add 4096 | pdl={pdl} early={early} | {us / n_chain:.2f} | {ok} |")
    N, K, chain_n = 4096, 2048, 20  # 16 MiB of bf16 weights each, distinct per link
    ws = [torch.randn(N, K, device="cuda").to(torch.bfloat16) / 64 for _ in range(chain_n)]
    xs = [torch.randn(N, device="cuda").to(torch.bfloat16) for _ in range(chain_n + 1)]
    ref = None
    for pdl, early, pre in (
        (False, False, False),
        (True, False, False),
        (True, True, False),
        (True, True, True),
    ):

        def chain(pdl=pdl, early=early, pre=pre):
            for i in range(chain_n):
                gemv_kernel[(N // 32,)](
                    xs[i],
                    ws[i],
                    xs[i + 1],
                    N,
                    K,
                    PDL=pdl,
                    EARLY=early,
                    PREFETCH=pre,
                    BN=32,
                    BK=128,
                    launch_pdl=pdl,
                )

        us = graph_us(chain, reps=20)
        out = xs[-1].clone()
        ref = out if ref is None else ref
        mb = N * K * 2 / 1e6
        print(
            f"| gemv {N}x{K} bf16 | pdl={pdl} early={early} prefetch={pre} | {us / chain_n:.2f}"
            f" ({mb / (us / chain_n):.2f} TB/s) | {bool(torch.equal(out, ref))} |"
        )


if __name__ == "__main__":
    main()
