"""Does warming the L2 ahead of a decode linear shorten it?  (H200; answer: no)

A decode linear reads its 6-34 MB weight once, at 0.9-2.6 TB/s, because of its start (linear-
h200.md).  In the layer the kernels before it are latency-bound.  This probe stands in for them
with a spin kernel of S microseconds (``torch.cuda._sleep``) and times, per V4-Flash linear and
row count, one CUDA graph cycling over enough weight copies (>= 256 MB) that each call's weight
starts cold:

- ``cold``: the linear alone; ``hot``: one copy replayed (its weight in the L2);
- per prefetch variant (mode m, pieces of p bytes): the prefetch alone, the prefetch then the
  linear, and per spin S the linear's share of "spin, linear" against the same with the
  prefetch on a side stream beside the spin (joined before the linear);
- pairs (``wo_a`` then ``wo_b``, as after the attention; ``wq_a+wkv`` then ``wq_b``; ``e_proj``
  then ``h_proj``): both weights prefetched beside one spin, only the first, none, or the
  second beside the first linear ("staged").

The number that matters is the linear's share of the chain: chain - spin, us per call.

    python3 bench/diag/l2_prefetch_probe.py [--tokens 1,8,64]

The prefetch kernel: one program issues ``CHUNK // PIECE`` bulk prefetches
(``cp.async.bulk.prefetch.L2``, sm_90's bulk copy engine, no registers, nothing to wait for).
``MODE`` 0: plain bulk prefetch; 1: the same with an L2 evict-last policy; 2: one
``prefetch.global.L2::evict_last`` per 128-byte line.  Measured (2026-12-01, H200;
bench/results/linear-h200.md, "Three ways to speed the decode linears"): the prefetch takes
2.4-8 us for 6-32 MB, about the bytes at HBM speed, and a linear reading a warm L2 ("hot") is
only 1-1.7 us faster than from HBM, so no placement of the prefetch shortens a decode linear:
its time is its own start and finish.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h200_mhc import copy_bandwidth, graph_time_us
from linear_decode_sweep import cold_weights
from linear_sweep import SHAPES

from dsv4mtp.optimized.kernels.linear import FMT_FP8, linear_schedule, linear_triton

# A bulk prefetch's size must be a multiple of 16 bytes, its address 16-byte aligned (the
# weights' codes are: 128-column rows).
_BULK = tl.constexpr("""{
.reg .pred p;
setp.gt.s32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.b32 $0, 0;
}""")

_BULK_LAST = tl.constexpr("""{
.reg .pred p;
.reg .b64 pol;
setp.gt.s32 p, $2, 0;
createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
mov.b32 $0, 0;
}""")

_LINE_LAST = tl.constexpr("""{
.reg .pred p;
setp.gt.s32 p, $2, 0;
@p prefetch.global.L2::evict_last [$1];
mov.b32 $0, 0;
}""")


@triton.jit
def l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, PIECE: tl.constexpr, MODE: tl.constexpr):
    """Program p prefetches bytes [p * CHUNK, (p + 1) * CHUNK) of ``ptr`` (uint8), clipped to
    ``nbytes`` (a multiple of 16 for the bulk modes)."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * CHUNK + tl.arange(0, CHUNK // PIECE).to(tl.int64) * PIECE
    size = tl.minimum(nbytes - offs, PIECE).to(tl.int32)  # <= 0 past the end: no prefetch
    if MODE == 0:
        tl.inline_asm_elementwise(
            _BULK, "=r,l,r", [ptr + offs, size], dtype=tl.int32, is_pure=False, pack=1
        )
    elif MODE == 1:
        tl.inline_asm_elementwise(
            _BULK_LAST, "=r,l,r", [ptr + offs, size], dtype=tl.int32, is_pure=False, pack=1
        )
    else:
        tl.inline_asm_elementwise(
            _LINE_LAST, "=r,l,r", [ptr + offs, size], dtype=tl.int32, is_pure=False, pack=1
        )


COLD_BYTES = 256 << 20
_SIDE: torch.cuda.Stream
CHUNK = 256 << 10
CYCLES_PER_US = 1980  # the spin's clock (H200 boost); the pairs' table prints the spin's time


def prefetch(w: torch.Tensor, mode: int, piece: int) -> None:
    n = w.numel() * w.element_size()
    grid = (math.ceil(n / CHUNK),)
    # one thread per piece at most: a tensor smaller than the program's threads is replicated
    # over them, and each copy of a side-effecting asm would issue its prefetch again
    warps = max(1, min(4, CHUNK // piece // 32))
    l2_prefetch_kernel[grid](
        w.view(-1).view(torch.uint8), n, CHUNK=CHUNK, PIECE=piece, MODE=mode, num_warps=warps
    )


class Lin:
    """One linear shape at ``rows`` rows, with enough copies to be cold."""

    def __init__(self, name: str, N: int, K: int, G: int, rows: int, copies: int) -> None:
        self.name, self.rows = name, rows
        self.ws = cold_weights(N, K, G, copies)
        self.x = torch.randn(rows, G, K, device="cuda").to(torch.bfloat16)
        self.ys = [torch.empty(rows, G, N, device="cuda", dtype=torch.bfloat16) for _ in self.ws]
        self.sched = linear_schedule(rows, N, K, G, False)

    def call(self, i: int) -> None:
        w, s = self.ws[i]
        linear_triton(self.x, w, s, self.ys[i], fmt=FMT_FP8, sched=self.sched)


def spin(us: float) -> None:
    if us > 0:
        torch.cuda._sleep(int(us * CYCLES_PER_US))


def t(steps: list, n: int) -> float:
    calls = [lambda i=i: [f(i) for f in steps] for i in range(n)]
    return graph_time_us(calls, 2 * n, 10)


def side(fn) -> None:
    """Run ``fn`` on a side stream forked from and joined into the current one later."""
    cur = torch.cuda.current_stream()
    _SIDE.wait_stream(cur)
    with torch.cuda.stream(_SIDE):
        fn()


def join() -> None:
    torch.cuda.current_stream().wait_stream(_SIDE)


def single(name: str, N: int, K: int, G: int, rows: int, variants: list[tuple[int, int]]) -> None:
    copies = max(2, math.ceil(COLD_BYTES / (G * N * K)))
    L = Lin(name, N, K, G, rows, copies)
    L.call(0)
    ref = L.ys[0].clone()
    lin = t([L.call], copies)
    hot = t([lambda i: L.call(0)], copies)
    row = [f"| {name} | {rows} | {lin:.1f} | {hot:.1f}"]
    for mode, piece in variants:
        alone = t([lambda i, m=mode, p=piece: prefetch(L.ws[i][0], m, p)], copies)
        serial = t([lambda i, m=mode, p=piece: prefetch(L.ws[i][0], m, p), L.call], copies)
        cells = [f"{alone:.1f}", f"{serial:.1f}"]
        for S in (5, 10, 20):
            sp = t([lambda i, S=S: spin(S)], copies)
            chain = t([lambda i, S=S: spin(S), L.call], copies)
            pf = t([lambda i, m=mode, p=piece: side(lambda: prefetch(L.ws[i][0], m, p)),
                    lambda i, S=S: spin(S), lambda i: join(), L.call], copies)  # fmt: skip
            cells.append(f"S{S}: {chain - sp:.1f} -> {pf - sp:.1f}")
        row.append(f"{mode}:{piece} " + " / ".join(cells))
    L.call(0)
    torch.cuda.synchronize()
    assert torch.equal(L.ys[0], ref)
    print(" | ".join(row) + " |", flush=True)


def pair(a: tuple, b: tuple, rows: tuple[int, int], S: float, mode: int, piece: int) -> None:
    nb = a[1] * a[2] * a[3] + b[1] * b[2] * b[3]
    copies = max(2, math.ceil(COLD_BYTES / nb))
    A = Lin(a[0], *a[1:4], rows[0], copies)
    B = Lin(b[0], *b[1:4], rows[1], copies)
    sp = t([lambda i: spin(S)], copies)
    none = t([lambda i: spin(S), A.call, B.call], copies)
    first = t([lambda i: side(lambda: prefetch(A.ws[i][0], mode, piece)), lambda i: spin(S),
               lambda i: join(), A.call, B.call], copies)  # fmt: skip
    both = t([lambda i: side(lambda: (prefetch(A.ws[i][0], mode, piece),
                                      prefetch(B.ws[i][0], mode, piece))),
              lambda i: spin(S), lambda i: join(), A.call, B.call], copies)  # fmt: skip
    # the second weight's prefetch beside the first linear (joined before the second)
    staged = t([lambda i: side(lambda: prefetch(A.ws[i][0], mode, piece)), lambda i: spin(S),
                lambda i: join(), lambda i: side(lambda: prefetch(B.ws[i][0], mode, piece)),
                A.call, lambda i: join(), B.call], copies)  # fmt: skip
    print(
        f"| {a[0]} + {b[0]} | {rows[0]} | S {S} (spin {sp:.1f}) | none {none - sp:.1f} | "
        f"first {first - sp:.1f} | both {both - sp:.1f} | staged {staged - sp:.1f} |",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--modes", default="0:4096,2:128")
    args = ap.parse_args()
    variants = [(int(m), int(p)) for m, p in (v.split(":") for v in args.modes.split(","))]
    global _SIDE
    _SIDE = torch.cuda.Stream()
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, L2 {props.L2_cache_size / 2**20:.0f} MiB, copy "
          f"{copy_bandwidth() / 1e12:.3f} TB/s; variants (mode:piece) {variants}")  # fmt: skip
    print(
        "| linear | rows | cold | hot | per variant: prefetch alone / prefetch then linear / "
        "per spin S: chain - spin -> with the prefetch on a side stream - spin |"
    )
    print("|---|---|---|---|---|---|")
    shapes = {s[0]: s for s in SHAPES}
    for T in (int(v) for v in args.tokens.split(",")):
        for name, N, K, G, per in SHAPES:
            if T * per <= 64:
                single(name, N, K, G, T * per, variants)
    print("\n| pair | rows | spin | none | first | both | staged |\n|---|---|---|---|---|---|---|")
    best = variants[0]
    for T in (int(v) for v in args.tokens.split(",")):
        torch.cuda.empty_cache()
        pair(shapes["wo_a (G 8)"], shapes["wo_b"], (T, T), 15, *best)
        pair(shapes["wq_a+wkv"], shapes["wq_b"], (T, T), 8, *best)
        pair(shapes["e_proj"], shapes["h_proj"], (T, 4 * T), 6, *best)


if __name__ == "__main__":
    main()
