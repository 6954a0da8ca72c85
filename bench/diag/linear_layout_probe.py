"""Does the FP8 dense linears' row layout cap their decode weight stream?  (H200)

The decode GEMVs of the dense linears (``optimized/kernels/linear.py``, ``linear_kernel``) read
the checkpoint's e4m3 codes, row-major (N, K) bytes: each 128-column K step of a BLOCK_N-row tile
reads 128 bytes from each of BLOCK_N rows that lie K bytes apart.  For the MoE's MXFP4 weights
the same kind of row-strided pieces (64 bytes there) capped the stream at about 2.3 TB/s against
4.0 TB/s for the same bytes stored as contiguous tiles (bench/results/moe-h200.md, "The weight
stream and the layout").  FP8 pieces are twice as long, so the answer may differ; this script
times one split-K-free GEMV kernel over two layouts of the same codes:

* ``rows``: the checkpoint's (E, N, K) bytes;
* ``tiles``: (E, N/BLOCK_N, K/128, BLOCK_N, 128) contiguous: each (BLOCK_N-row, 128-column)
  block one run of BLOCK_N * 128 bytes, a K step one load of it.

Modes.  0, ``linear_kernel``'s FP8 step: per 128-column step a program (n tile, copy) loads the
(BLOCK_N, 128) codes, decodes them to bf16 exactly (``_e4m3_bf16``, the linear kernel's PTX
decode), does one ``tl.dot`` with the step's x (the tokens padded to 16 rows, the rest masked to
zero) and adds the fp32 partial times the (128-row, 128-column) block's fp32 scale (all ones);
the dot makes Triton pipeline the code and x loads into cp.async copies.  1: the code loads
alone (a sum keeps them; no decode, x or dot), pipelined into cp.async copies like mode 0's (a
loop without a dot is pipelined only when it asks: ``tl.range(..., num_stages)``).  2: the same
loads as plain loads, not pipelined (the MoE probe's "loads alone").  Modes 1 and 2 do not
depend on the tokens, so they run once per variant (tokens "any"), mode 2 at one stage count
("-").  Variants: BLOCK_N 32 / 64 / 128, 4 warps, 3 / 4 stages, tokens 1 and 8 (bf16 x).

Shapes: V4-Flash's e_proj 4096 x 4096, wq_b 32768 x 1024, wo_b 4096 x 8192 and the fused wq_a +
wkv 1536 x 4096 (N rows x K columns).  One launch reads E copies of the weight (grid: N/BLOCK_N
tiles x E copies), E * N * K >= 256 MiB, so no launch finds its codes in the 60 MB L2.  Time:
median replay of a CUDA graph of 5 back-to-back launches over 10 replays (bench/h200_mhc.py's
``graph_time_us``), per launch.  TB/s = code bytes / time (scales, 1/4096 of them, and x left
out); "vs copy" = that over the same-run copy bandwidth (read + write of a 2 GiB copy,
``copy_bandwidth``), the project's floor convention (1.0: the stream at the copy's total rate).

Checks: both layouts feed the same codes to the same lanes, so their outputs must be bitwise
equal at each (BLOCK_N, stages, tokens, mode); a tiles row that is not says "(outputs differ!)".
Every mode-0 output is compared on copies 0 and E-1 with their fp64 product (rel. Frobenius
error <= 1e-4, else "(wrong!)").  A variant that fails to compile is a row with its error.
After the table, a summary: the best rows and tiles time of each (linear, tokens, mode).

Reading it: tiles at a clearly higher TB/s than rows in modes 1 and 2 means the row-strided
128-byte pieces cap the stream, as the MXFP4 pieces did; equal rates there mean they do not,
and a gap that appears only in mode 0 comes from the decode + dot, not the layout.  "vs copy"
near 0.9-0.95 is a full stream (the MoE's tiles reached 0.94-0.96).

Run (GPU machine, repository root, after the README's install), about a minute on an H200:
``python3 bench/diag/linear_layout_probe.py``.  ``--dry-run``: the same code paths on the CPU
under TRITON_INTERPRET=1 (set by the script) at tiny shapes, wall-clock timed.  ``--ttgir``: no
GPU needed; compiles each (layout, mode, BLOCK_N, stages) for sm_90 and prints how many of its
loads became ``cp.async`` copies (``ttg.async_copy_global_to_local`` in the TTGIR) and its
shared memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from h200_mhc import copy_bandwidth, graph_time_us

from dsv4mtp.optimized.kernels._launch import INTERPRET
from dsv4mtp.optimized.kernels.decode import _e4m3_bf16
from dsv4mtp.optimized.kernels.linear import _dot
from dsv4mtp.optimized.kernels.moe_common import jit_loop_bounds

# V4-Flash dense linears: (N rows, K columns) of the FP8 weight.
LINEARS = {
    "e_proj": (4096, 4096),
    "wq_b": (32768, 1024),
    "wo_b": (4096, 8192),
    "wqa_wkv": (1536, 4096),
}
TOKENS = (1, 8)
BLOCK_NS = (32, 64, 128)
STAGES = (3, 4)
WARPS = 4
LAYOUTS = ("rows", "tiles")
COLD_BYTES = 256 << 20  # codes per launch, > 4x the 60 MB L2
GRAPH_CALLS, REPS = 5, 10


@triton.jit
def _step(acc, kb, w_rows, step, cols, x_rows, tm, s_row, MODE: tl.constexpr,
          INTERP: tl.constexpr):  # fmt: skip
    """One 128-column K step of a program: acc (16, BLOCK_N) fp32 updated."""
    codes = tl.load(w_rows + (kb * step + cols)[None, :])  # (BLOCK_N, 128) uint8
    if MODE == 0:
        x = tl.load(x_rows + (kb * 128 + cols)[None, :], mask=tm[:, None], other=0.0)
        w = _e4m3_bf16(codes, INTERP)  # exact; integer ops under the interpreter
        part = _dot(x, tl.trans(w), False, INTERP)  # an fp32 broadcast sum when interpreted
        acc += part * tl.load(s_row + kb)
    else:
        acc += tl.sum(codes.to(tl.float32), axis=1)[None, :]  # exact: sums stay < 2**24
    return acc


def _jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit``, T not specialized (one compile serves 1 and 8 tokens); under the
    interpreter the loop bound KB (= K / 128) constexpr, as its ``range`` needs a Python int."""
    return jit_loop_bounds("KB")(fn) if INTERPRET else triton.jit(fn, do_not_specialize=["T"])


@_jit
def gemv_kernel(
    w_ptr,
    s_ptr,
    x_ptr,
    y_ptr,
    T,
    N,
    K,
    KB,
    TILED: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    INTERP: tl.constexpr,
):
    """y (E, N, T) fp32 = x (T, K) @ W_e^T per copy e (grid: N/BLOCK_N tiles x E copies), W_e's
    codes in layout TILED (0 rows, 1 tiles).  MODE 0: decode + dot + block scale per K step;
    1: the code loads alone, pipelined into cp.async copies over STAGES stages (the launch's
    num_stages); 2: the code loads alone as plain loads."""
    pid_n = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, 128)
    t = tl.arange(0, 16)
    tm = t < T
    base = w_ptr + e * N * K  # offsets within one copy fit int32 (N * K < 2**31)
    # The row part is loop-invariant and the step a scalar added to it, so the pipeliner sees
    # one affine pointer per load and can turn it into cp.async copies.
    if TILED:
        w_rows = base + pid_n * BLOCK_N * K + rows[:, None] * 128  # the tile's first block
        step = BLOCK_N * 128  # the tile's next block
    else:
        w_rows = base + (pid_n * BLOCK_N + rows)[:, None] * K
        step = 128
    s_row = s_ptr + (e * (N // 128) + (pid_n * BLOCK_N) // 128) * KB
    x_rows = x_ptr + t[:, None] * K
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    if MODE == 1:
        # Without a dot in the loop Triton pipelines its loads only when the loop asks for it.
        for kb in tl.range(0, KB, num_stages=STAGES):
            acc = _step(acc, kb, w_rows, step, cols, x_rows, tm, s_row, MODE, INTERP)
    else:
        # linear_kernel's plain loop: its dot makes mode 0 pipelined at the launch's num_stages;
        # mode 2 has no dot, so its loads stay plain loads.
        for kb in range(0, KB):
            acc = _step(acc, kb, w_rows, step, cols, x_rows, tm, s_row, MODE, INTERP)
    out = y_ptr + e * N * T + (pid_n * BLOCK_N + rows)[None, :] * T + t[:, None]
    tl.store(out, acc, mask=tm[:, None])


def tiles(codes: torch.Tensor, block_n: int) -> torch.Tensor:
    """(E, N, K) -> (E, N/block_n, K/128, block_n, 128), contiguous."""
    E, N, K = codes.shape
    return codes.view(E, N // block_n, block_n, K // 128, 128).permute(0, 1, 3, 2, 4).contiguous()


def random_codes(E: int, N: int, K: int, device: str) -> torch.Tensor:
    """Uniform e4m3 bytes without the NaN codes 0x7F / 0xFF (no pack lets those through; the
    fp64 reference could not read them)."""
    c = torch.randint(0, 256, (E, N, K), dtype=torch.uint8, device=device)
    return torch.where((c & 0x7F) == 0x7F, c - 1, c)


def reference(codes: torch.Tensor, x: torch.Tensor, e: int) -> torch.Tensor:
    """Copy e's (N, T) output x @ W_e^T in fp64 (all block scales are one)."""
    return codes[e].view(torch.float8_e4m3fn).to(torch.float64) @ x.to(torch.float64).T


def wall_time_us(call: Callable[[], Any], reps: int = 2) -> float:
    """Median wall-clock time of ``call`` (the dry run's stand-in for CUDA-graph timing)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def cpu_copy_bandwidth() -> float:
    """Bytes read + written per second by a 64 MiB CPU copy (the dry run's copy ceiling)."""
    src = torch.empty(1 << 26, dtype=torch.uint8)
    dst = torch.empty_like(src)
    us = wall_time_us(lambda: dst.copy_(src), 5)
    return 2 * src.numel() / (us * 1e-6)


def cases(tokens: tuple[int, ...], stages: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(mode, tokens, stages) of each BLOCK_N: the loads-alone modes once (x unused), mode 2
    at one stage count (it is not pipelined)."""
    out = [(0, T, st) for T in tokens for st in stages]
    return out + [(1, tokens[-1], st) for st in stages] + [(2, tokens[-1], stages[0])]


def ttgir_report(block_ns: tuple[int, ...], stages: tuple[int, ...]) -> int:
    """Compile each variant for sm_90 offline (no GPU) and print its cp.async copies."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(w_ptr="*u8", s_ptr="*fp32", x_ptr="*bf16", y_ptr="*fp32", T="i32", N="i32",
               K="i32", KB="i32")  # fmt: skip
    # What the JIT specializes on the GPU: 16-byte-aligned pointers, N, K and KB % 16 == 0 (KB
    # is 8 for wq_b, which then compiles without that mark).
    attrs = {
        (gemv_kernel.arg_names.index(n),): [["tt.divisibility", 16]]
        for n in ("w_ptr", "s_ptr", "x_ptr", "y_ptr", "N", "K", "KB")
    }
    print("TTGIR ``ttg.async_copy_global_to_local`` ops (prologue and loop; codes: the uint8 ones)")
    print()
    print("| layout | mode | BLOCK_N | stages | async copies of codes | all | smem B |")
    print("|---|---|---|---|---|---|---|")
    for layout in LAYOUTS:
        for bn in block_ns:
            for mode, _, st in cases((1,), stages):
                consts = dict(TILED=LAYOUTS.index(layout), MODE=mode, BLOCK_N=bn, STAGES=st,
                              INTERP=False)  # fmt: skip
                sig_c = {**sig, **{c: "constexpr" for c in consts}}
                src = ASTSource(fn=gemv_kernel, signature=sig_c, constexprs=consts, attrs=attrs)
                row = f"| {layout} | {mode} | {bn} | {st} |"
                try:
                    k = triton.compile(
                        src,
                        target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": WARPS, "num_stages": st},
                    )
                except Exception as exc:  # a failing variant is a row, not the end
                    print(f"{row} fail: {exc!r:.80} | | |")
                    continue
                ops = [
                    ln for ln in k.asm["ttgir"].splitlines() if "async_copy_global_to_local" in ln
                ]
                n_codes = sum("ptr<i8>" in ln for ln in ops)
                print(f"{row} {n_codes} | {len(ops)} | {k.metadata.shared} |")
    return 0


Best = dict[tuple[str, str, int, str], tuple[float, int, str]]


def probe_linear(name: str, N: int, K: int, E: int, setup: dict[str, Any], best: Best) -> None:
    """Time every variant of one linear over E copies of its weight; print a row each."""
    device, dry, bw = setup["device"], setup["dry"], setup["bw"]
    codes = random_codes(E, N, K, device)
    scales = torch.ones(E, N // 128, K // 128, dtype=torch.float32, device=device)
    xs = {T: torch.randn(T, K, device=device).to(torch.bfloat16) for T in TOKENS}
    refs = {T: [reference(codes, xs[T], e) for e in (0, E - 1)] for T in TOKENS}
    for bn in setup["block_ns"]:
        weights = {"rows": codes, "tiles": tiles(codes, bn)}
        for mode, T, st in cases(TOKENS, setup["stages"]):
            tok, st_s = str(T) if mode == 0 else "any", "-" if mode == 2 else str(st)
            first: torch.Tensor | None = None  # the rows output of this variant
            for layout in LAYOUTS:
                y = torch.zeros(E, N, T, dtype=torch.float32, device=device)
                args = (weights[layout], scales, xs[T], y, T, N, K, K // 128)
                consts = dict(TILED=LAYOUTS.index(layout), MODE=mode, BLOCK_N=bn, STAGES=st,
                              INTERP=INTERPRET, num_warps=WARPS, num_stages=st)  # fmt: skip

                def run(args=args, consts=consts, grid=(N // bn, E)) -> None:
                    gemv_kernel[grid](*args, **consts)

                row = f"| {name} | {tok} | {layout} | {mode} | {bn} | {st_s} |"
                try:
                    run()
                    if dry:
                        us = wall_time_us(run)
                    else:
                        torch.cuda.synchronize()
                        us = graph_time_us([run], GRAPH_CALLS, REPS)
                except Exception as exc:  # a failing variant is a row, not the end
                    print(f"{row} fail: {exc!r:.100} | | |")
                    continue
                mark = ""
                if first is None:
                    first = y
                elif not torch.equal(first, y):
                    mark += " (outputs differ!)"
                if mode == 0:
                    for e, r in zip((0, E - 1), refs[T], strict=True):
                        err = float((y[e].to(torch.float64) - r).norm() / r.norm())
                        if not err <= 1e-4:
                            mark += f" (wrong! copy {e} rel. err {err:.1e})"
                tbs = codes.numel() / us / 1e6
                print(f"{row} {us:.1f} | {tbs:.3f} | {tbs * 1e12 / bw:.3f}{mark} |")
                key = (name, tok, mode, layout)
                if key not in best or us < best[key][0]:
                    best[key] = (us, bn, st_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes")
    ap.add_argument("--ttgir", action="store_true", help="offline sm_90 compile, no GPU")
    args = ap.parse_args(argv)
    if args.ttgir:
        if INTERPRET:
            raise SystemExit("--ttgir compiles for the GPU: run it without TRITON_INTERPRET=1")
        return ttgir_report(BLOCK_NS, STAGES)
    torch.manual_seed(0)
    if args.dry_run:
        linears, cold = {"tiny": (256, 256), "tiny-nk": (384, 512)}, 0  # E = 2
        setup = dict(device="cpu", dry=True, bw=cpu_copy_bandwidth(), block_ns=(32, 64),
                     stages=(3,))  # fmt: skip
        head = f"CPU interpreter (dry run), torch {torch.__version__}, triton {triton.__version__}"
    else:
        linears, cold = LINEARS, COLD_BYTES
        setup = dict(device="cuda", dry=False, bw=copy_bandwidth(), block_ns=BLOCK_NS,
                     stages=STAGES)  # fmt: skip
        head = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
                f"triton {triton.__version__}")  # fmt: skip
    print(f"{head}; same-run copy {setup['bw'] / 1e12:.3f} TB/s (read + write); {WARPS} warps")
    print()
    print("| linear | tokens | layout | mode | BLOCK_N | stages | us | TB/s of codes | vs copy |")
    print("|---|---|---|---|---|---|---|---|---|")
    best: Best = {}
    n_bytes: dict[str, int] = {}
    for name, (N, K) in linears.items():
        E = max(2, -(-cold // (N * K)))  # two copies at least: copies 0 and E-1 are checked
        n_bytes[name] = E * N * K
        probe_linear(name, N, K, E, setup, best)
        if not args.dry_run:
            torch.cuda.empty_cache()
    print()
    print("Best of BLOCK_N x stages: TB/s of codes (BLOCK_N, stages)")
    print()
    print("| linear | tokens | mode | rows | tiles | tiles / rows |")
    print("|---|---|---|---|---|---|")
    for name in linears:
        for tok, mode in [(str(T), 0) for T in TOKENS] + [("any", 1), ("any", 2)]:
            r, t = best.get((name, tok, mode, "rows")), best.get((name, tok, mode, "tiles"))
            if r is None or t is None:
                continue
            cell = [f"{n_bytes[name] / b[0] / 1e6:.3f} ({b[1]}, {b[2]})" for b in (r, t)]
            print(f"| {name} | {tok} | {mode} | {cell[0]} | {cell[1]} | {r[0] / t[0]:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
