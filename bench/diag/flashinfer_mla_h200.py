"""Could FlashInfer's sm_90 MLA kernel (backend "fa3") run V4's sliding-window MQA with sinks?

V4's attention is MQA with one 512-dim latent per token serving as key and value for 64 query
heads (docs/semantics.md, "Visibility and the sink softmax").  In FlashInfer's MLA terms that is
``head_dim_ckv`` 512 with no RoPE part (``head_dim_kpe`` 0; if the build refuses 0, a 64-wide
part of zeros, which adds nothing to the scores), page size 1, and each query's visible window
given as its own run of KV indices (so the window needs no kernel support).  The per-head sink
is one more logit of value zero: with FlashInfer's natural-log LSE, the sink output is
``out * sigmoid(lse - sink)`` (the softmax denominator grows from exp(lse) to exp(lse) +
exp(sink)).  This script measures, on the GPU machine:

1. the JIT build of the fa3 MLA module (the slim wheel needs ``SLIM_KEEP="batch_mla_*"``),
   wall seconds, and whether ``head_dim_kpe`` 0 is accepted;
2. for decode (B sequences, one query row each against a full 128-row window) at B 1, 8, 64
   and prefill of one sequence of 512 and 4096 tokens (every query its own request of <= 128
   keys): FlashInfer's output with the sink applied against our Triton kernel's
   (``sink_attention_triton``) on the same inputs (rel. Frobenius difference), and the GPU time
   of each (CUDA-graph replay where FlashInfer's run captures, else CUDA events around eager
   calls; FlashInfer's time includes the sink multiply, a separate elementwise launch).

Every stage is in its own try block and prints what failed, so one run answers as much as it
can.  No result here changes the package: the decision and its numbers go to
bench/results/mtp-h200.md.

    python3 bench/diag/flashinfer_mla_h200.py [--decode 1,8,64] [--prefill 512,4096]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h200_mhc import _median_event_ms, graph_time_us

from dsv4mtp.optimized.kernels.sink_attention import attention_schedule, sink_attention_triton

H, DH, WINDOW = 64, 512, 128
SCALE = DH**-0.5
BF16 = torch.bfloat16


def timed(fn: Callable[[], Any]) -> tuple[float, str]:
    try:
        return graph_time_us([fn], 20, 10), "graph"
    except Exception as exc:  # FlashInfer's run may not capture without a graph plan
        print(f"    graph capture failed ({type(exc).__name__}: {exc}); eager events instead")
        torch.cuda.synchronize()
        for _ in range(3):
            fn()
        return _median_event_ms(fn, 50) * 1e3, "events"


def case(name: str, lens_q: list[int], lens_k: list[int]) -> dict[str, Any]:
    """Inputs of ``len(lens_q)`` sequences: sequence b has lens_k[b] keys at positions
    0..lens_k[b]-1 and its lens_q[b] queries at the last lens_q[b] positions."""
    g = torch.Generator(device="cuda").manual_seed(0)
    Tq, Tk = sum(lens_q), sum(lens_k)
    q = torch.randn(Tq, H, DH, device="cuda", generator=g).to(BF16)
    kv = torch.randn(Tk, DH, device="cuda", generator=g).to(BF16)
    sink = torch.randn(H, device="cuda", generator=g) * 2
    q_pos = torch.cat([torch.arange(k - n, k) for n, k in zip(lens_q, lens_k, strict=True)])
    k_pos = torch.cat([torch.arange(k) for k in lens_k])
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    # FlashInfer: every query row its own request, its KV indices the window it sees
    starts, lens = [], []
    for b, (n, k) in enumerate(zip(lens_q, lens_k, strict=True)):
        for p in range(k - n, k):
            lo = max(0, p - WINDOW + 1)
            starts.append(int(cu_k[b]) + lo)
            lens.append(p + 1 - lo)
    kv_len = torch.tensor(lens, dtype=torch.int32)
    kv_indptr = torch.tensor([0, *kv_len.cumsum(0).tolist()], dtype=torch.int32)
    kv_indices = torch.cat(
        [torch.arange(s, s + n, dtype=torch.int32) for s, n in zip(starts, lens, strict=True)]
    )
    dev = {"device": "cuda"}
    return {
        "name": name, "q": q, "kv": kv, "sink": sink,
        "q_pos": q_pos.to(**dev), "k_pos": k_pos.to(**dev),
        "cu_q": cu_q.to(**dev), "cu_k": cu_k.to(**dev),
        "qo_indptr": torch.arange(Tq + 1, dtype=torch.int32, **dev),
        "kv_indptr": kv_indptr.to(**dev), "kv_indices": kv_indices.to(**dev),
        "kv_len": kv_len.to(**dev), "bytes": Tk * DH * 2 + 2 * Tq * H * DH * 2,
    }  # fmt: skip


def ours(c: dict[str, Any]) -> tuple[Callable[[], Any], torch.Tensor]:
    out = torch.empty_like(c["q"])
    sched = attention_schedule(H, DH, WINDOW)

    def run() -> None:
        sink_attention_triton(
            c["q"], c["q_pos"], c["kv"], c["k_pos"], c["sink"], c["cu_q"], c["cu_k"], out,
            WINDOW, SCALE, sched,
        )  # fmt: skip

    return run, out


def flashinfer_call(c: dict[str, Any], kpe: int) -> tuple[Callable[[], Any], torch.Tensor]:
    from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = BatchMLAPagedAttentionWrapper(ws, backend="fa3")
    meta = MLAPlanMetadata.csr(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"])
    w.plan(
        metadata=meta, num_heads=H, head_dim_ckv=DH, head_dim_kpe=kpe, page_size=1,
        causal=False, sm_scale=SCALE, q_data_type=BF16, kv_data_type=BF16, lse_mode="basee",
    )  # fmt: skip
    Tq, Tk = c["q"].shape[0], c["kv"].shape[0]
    if kpe:  # a RoPE part of zeros: packed (ckv | kpe) rows
        qp = torch.cat([c["q"], c["q"].new_zeros(Tq, H, kpe)], dim=-1)
        kvp = torch.cat([c["kv"], c["kv"].new_zeros(Tk, kpe)], dim=-1).view(Tk, 1, DH + kpe)
    else:
        qp, kvp = c["q"], c["kv"].view(Tk, 1, DH)
    out = torch.empty_like(c["q"])
    lse = torch.empty(Tq, H, dtype=torch.float32, device="cuda")
    final = torch.empty_like(c["q"])

    def run() -> None:
        w.run(query=qp, kv_cache=kvp, out=out, lse=lse, return_lse=True, return_lse_base_on_e=True)
        torch.mul(out, torch.sigmoid(lse - c["sink"]).unsqueeze(-1), out=final)

    return run, final


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", default="1,8,64")
    ap.add_argument("--prefill", default="512,4096")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    try:
        import flashinfer

        print("flashinfer", flashinfer.__version__)
    except Exception as exc:
        print(f"flashinfer import failed: {exc}")
        return
    cases = [case(f"decode B {b}", [1] * b, [WINDOW] * b) for b in map(int, args.decode.split(","))]
    cases += [case(f"prefill T {t}", [t], [t]) for t in map(int, args.prefill.split(","))]

    kpe = None
    for k in (0, 64):  # the first call builds the module: its wall time is the JIT build
        t0 = time.perf_counter()
        try:
            run, _ = flashinfer_call(cases[0], k)
            run()
            torch.cuda.synchronize()
        except Exception as exc:
            print(f"head_dim_kpe {k}: failed after {time.perf_counter() - t0:.1f} s: "
                  f"{type(exc).__name__}: {str(exc)[:400]}")  # fmt: skip
            traceback.print_exc(limit=3)
            continue
        print(f"head_dim_kpe {k}: JIT build + plan + first run {time.perf_counter() - t0:.1f} s")
        kpe = k
        break
    if kpe is None:
        return
    print("| case | ours us | flashinfer fa3 us (+ sink) | timing | rel. diff | GB/s ours |")
    print("|---|---|---|---|---|---|")
    for c in cases:
        try:
            o_run, o_out = ours(c)
            f_run, f_out = flashinfer_call(c, kpe)
            o_run()
            f_run()
            torch.cuda.synchronize()
            diff = float((f_out.float() - o_out.float()).norm() / o_out.float().norm())
            finite = bool(torch.isfinite(f_out).all())
            us_o, _ = timed(o_run)
            us_f, how = timed(f_run)
            gbs = c["bytes"] / us_o / 1e3
            note = "" if finite else " (non-finite)"
            print(f"| {c['name']} | {us_o:.1f} | {us_f:.1f} | {how} | {diff:.1e}{note} | "
                  f"{gbs:.0f} |")  # fmt: skip
        except Exception as exc:
            print(f"| {c['name']} | failed: {type(exc).__name__}: {str(exc)[:300]} | | | | |")
        torch.cuda.empty_cache()
    print(f"scale {SCALE:.6f}, window {WINDOW}, H {H}, Dh {DH}; rel. diff of bf16 outputs "
          f"~{2 ** -8 / math.sqrt(3):.1e} is one rounding apart")  # fmt: skip


if __name__ == "__main__":
    main()
