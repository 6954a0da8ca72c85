"""The LM head step on the H200: cuBLAS logits vs the logit-free greedy argmax, bf16 and FP8 head.

    python3 bench/diag/head_h200.py [--out DIR] [--sweep]   # on the GPU machine, < 60 s
    python3 bench/diag/head_h200.py --resources              # anywhere: sm_90 registers / spills

At V4-Flash's head (V 129280, D 4096; synthetic N(0, 1/D) bf16, its FP8 pack from
``pack_head(format="fp8")``) and T 1, 8, 64 normed rows, the GPU time per call (CUDA graph of
10 calls, median of 5 replays) of:

* ``cublas_logits``: ``torch.mm(y, head.T, out_dtype=float32, out=...)`` (the layer's head today);
* ``cublas_logits_argmax``: the same, then ``torch.argmax(-1)`` (the greedy step today);
* ``argmax_bf16`` / ``argmax_fp8``: ``lm_head_argmax`` on the bf16 head / the FP8 pack (the
  FP8 pack's default: the dense-linear kernel's tiles with the argmax epilogue);
* ``argmax_fp8_kernel``: the FP8 pack through the argmax kernel (its default schedule given
  explicitly, which selects it);
* ``logits_fp8``: ``lm_head_logits`` on the FP8 pack (the dense-linear Triton kernel, fp32 out).

Each line gives the time, the bytes the call must move (the head: 1.06 GB bf16 or 0.53 GB of
codes plus scales; the logits T*V*4 where written), and time / (bytes / copy bandwidth): the
copy bandwidth (read + write bytes per second of a 1 GiB device copy) is measured in the same
run.  The head (1 GB) does not fit the 60 MB L2, so every call streams it from HBM; no input
rotation is needed.  Checks: ``argmax_bf16`` ids equal cuBLAS + argmax (a mismatch is printed
with the float64 gap of the two logits), ``argmax_fp8`` equals ``logits_fp8``'s argmax, and the
FP8 ids' agreement with the bf16 ids is reported (random head: see bench/results/head-fp8.md).
``--sweep``: a few other argmax schedules per T (each compiles: ~1-2 s per schedule and format).
``--out DIR`` writes DIR/head-h200.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

V, D = 129280, 4096
TS = (1, 8, 64)
F32 = torch.float32
DTYPE_OUT = hasattr(torch.ops.aten.mm, "dtype_out")  # torch.mm(..., out_dtype=, out=)


def median_ms(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def graph_us(call: Callable[[], Any], n_calls: int = 10, reps: int = 5) -> float:
    """GPU time per call of a CUDA graph of ``n_calls`` calls (warmed up off the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
        call()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n_calls):
            call()
    g.replay()
    torch.cuda.synchronize()
    ms = median_ms(g.replay, reps)
    del g
    return ms * 1e3 / n_calls


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    n = 1 << 30
    bufs = [torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255) for _ in range(2)]

    def copy() -> None:
        bufs[1].copy_(bufs[0])

    for _ in range(3):
        copy()
    ms = median_ms(copy, 20)
    bufs.clear()
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dsv4mtp.optimized import lm_head_argmax, lm_head_logits, pack_head
    from dsv4mtp.optimized.kernels.lm_head import LmHeadSchedule, lm_head_schedule

    t0 = time.time()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    print(f"{props.name}: copy {bw / 1e12:.3f} TB/s (read + write); L2 {props.L2_cache_size >> 20} "
          f"MiB < head {V * D * 2 / 1e9:.2f} GB; mm.dtype_out {DTYPE_OUT}", flush=True)  # fmt: skip
    g = torch.Generator(device=dev).manual_seed(0)
    head = (torch.randn(V, D, generator=g, device=dev) * D**-0.5).to(torch.bfloat16)
    fp8 = pack_head(head, format="fp8")
    bf16_bytes = V * D * 2
    fp8_bytes = V * D + fp8.scale.numel() * 4
    rows: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    for T in TS:
        x = torch.randn(T, D, generator=g, device=dev)
        y = (x * torch.rsqrt(x.square().mean(-1, keepdim=True))).to(torch.bfloat16)
        logits = torch.empty(T, V, dtype=F32, device=dev)
        ids = torch.empty(T, dtype=torch.int64, device=dev)

        def mm(y: torch.Tensor = y, logits: torch.Tensor = logits) -> torch.Tensor:
            if DTYPE_OUT:
                return torch.mm(y, head.T, out_dtype=F32, out=logits)
            return torch.mm(y, head.T, out_dtype=F32)

        def mm_argmax(y: torch.Tensor = y) -> torch.Tensor:
            return mm(y).argmax(-1)

        kernel_sched = lm_head_schedule(T, False)
        cases: list[tuple[str, Callable[[], Any], int]] = [
            ("cublas_logits", mm, bf16_bytes + T * V * 4),
            ("cublas_logits_argmax", mm_argmax, bf16_bytes + 2 * T * V * 4),
            ("argmax_bf16", lambda y=y, ids=ids: lm_head_argmax(y, head, out=ids), bf16_bytes),
            ("argmax_fp8", lambda y=y, ids=ids: lm_head_argmax(y, fp8, out=ids), fp8_bytes),
            ("argmax_fp8_kernel", lambda y=y, ids=ids, sc=kernel_sched:
             lm_head_argmax(y, fp8, out=ids, schedule=sc), fp8_bytes),
            ("logits_fp8", lambda y=y, lg=logits: lm_head_logits(y, fp8, out=lg),
             fp8_bytes + T * V * 4),
        ]  # fmt: skip
        if args.sweep:
            bt = lm_head_schedule(T, False).block_t
            for bv, bk, w, st in ((64, 128, 4, 4), (128, 128, 4, 3), (128, 64, 4, 6),
                                  (256, 64, 8, 4), (256, 128, 8, 2)):  # fmt: skip
                sc = LmHeadSchedule(bv, bt, bk, w, st)
                for name, h, nbytes in (("bf16", head, bf16_bytes), ("fp8", fp8, fp8_bytes)):
                    cases.append((f"argmax_{name} {tuple(sc.fields())}",
                                  lambda y=y, ids=ids, h=h, sc=sc: lm_head_argmax(
                                      y, h, out=ids, schedule=sc), nbytes))  # fmt: skip
        for name, call, nbytes in cases:
            try:
                us = graph_us(call)
            except Exception as e:  # a schedule that does not compile (shared memory) is reported
                print(f"T={T:3d} {name:34s} failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            ratio = us * 1e-6 / (nbytes / bw)
            rows.append(dict(T=T, case=name, us=us, bytes=nbytes, x_copy_floor=ratio))
            print(f"T={T:3d} {name:34s} {us:8.1f} us  {nbytes / 1e9:6.3f} GB  "
                  f"{ratio:5.2f} x copy floor", flush=True)  # fmt: skip
        # checks
        want = mm_argmax()
        got = lm_head_argmax(y, head)
        bad = (got != want).nonzero()[:, 0].tolist()
        gaps = []
        for t in bad:
            lg = y[t].double() @ head[[int(got[t]), int(want[t])]].double().T
            gaps.append(float(lg[0] - lg[1]))
        got8 = lm_head_argmax(y, fp8)
        want8 = lm_head_logits(y, fp8).argmax(-1)
        checks[f"T{T}"] = dict(
            argmax_bf16_vs_cublas_mismatches=len(bad), mismatch_logit_gaps_f64=gaps,
            argmax_fp8_vs_logits_fp8_mismatches=int((got8 != want8).sum()),
            fp8_vs_bf16_top1_agreement=float((got8 == want).float().mean()),
        )  # fmt: skip
        print(f"T={T:3d} checks: {checks[f'T{T}']}", flush=True)
    torch.cuda.synchronize()
    return dict(
        device=props.name, torch=torch.__version__, copy_bw_bytes_per_s=bw, V=V, D=D,
        mm_dtype_out=DTYPE_OUT,
        rows=rows, checks=checks, seconds=round(time.time() - t0, 1),
    )  # fmt: skip


def resources() -> None:
    """sm_90 registers / spills / shared memory of the argmax kernels at their default
    schedules (T 1, 8, 64, batch-invariant), bf16 and FP8 heads; no GPU needed."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from sm90_resources import resources as res

    from dsv4mtp.optimized.kernels.lm_head import (
        FMT_DENSE,
        FMT_FP8,
        lm_head_argmax_kernel,
        lm_head_argmax_reduce_kernel,
        lm_head_schedule,
    )

    sig = dict(
        y_ptr="*bf16", w_ptr="*bf16", s_ptr="*fp32", pval_ptr="*fp32", pidx_ptr="*i32",
        T="i32", V="i32", D="i32", CHUNKS="i32",
    )  # fmt: skip
    seen = set()
    for fp32 in (False, True):
        for T, bi in ((1, False), (8, False), (64, False), (1, True)):
            sc = lm_head_schedule(T, bi, fp32)
            for fmt in (FMT_DENSE, FMT_FP8):
                if (sc, fmt, fp32) in seen:
                    continue
                seen.add((sc, fmt, fp32))
                act = "*fp32" if fp32 else "*bf16"
                s = dict(sig, y_ptr=act, w_ptr="*u8" if fmt == FMT_FP8 else act)
                consts = dict(FMT=fmt, BLOCK_V=sc.block_v, BLOCK_T=sc.block_t,
                              BLOCK_K=sc.block_k, USE_F32=fp32, INTERP=False)  # fmt: skip
                line = res(lm_head_argmax_kernel, s, consts, ints=("D",),
                           num_warps=sc.num_warps, num_stages=sc.num_stages)  # fmt: skip
                what = ("fp8 " if fmt == FMT_FP8 else "dense") + (" fp32 y" if fp32 else "")
                print(f"lm_head_argmax {what:12s} T={T:<2d} bi={bi!s:5s} "
                      f"{tuple(sc.fields())}: {line}")  # fmt: skip
    rsig = dict(pval_ptr="*fp32", pidx_ptr="*i32", out_ptr="*i64", V="i32", CHUNKS="i32")
    line = res(lm_head_argmax_reduce_kernel, rsig, dict(BLOCK_C=1024), num_warps=4)
    print(f"lm_head_argmax reduce (1024 chunks per step): {line}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="directory for head-h200.json")
    p.add_argument("--sweep", action="store_true", help="also time other argmax schedules")
    p.add_argument("--resources", action="store_true", help="sm_90 resource usage, no GPU")
    args = p.parse_args()
    if args.resources:
        resources()
        return
    result = run(args)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "head-h200.json"), "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
