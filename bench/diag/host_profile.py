"""Where the eager step's host time goes, at V4-Flash shapes on the GPU (cProfile).

The eager prefill of 512 tokens spends more time outside kernels than in them
(bench/results/mtp-h200.md, "Where the time goes"): the host, not the GPU, sets its pace.  This
script builds the same V4-Flash-shaped random layer as ``bench/h200_mtp.py``, warms each call,
then for each case prints

* wall time per call (synchronized, least of 5) and the CUDA time in kernels per call
  (torch.profiler), so wall - kernels is the GPU's idle time;
* the host time per call with the GPU taken out of the way: the same call enqueued with
  ``CUDA_LAUNCH_BLOCKING`` off and timed to the return of the Python call only (the enqueue
  cost; a host read of a tensor value inside the call still waits for the GPU);
* the device -> host syncs of one call by source line (``torch.cuda.set_sync_debug_mode``);
* cProfile of 3 calls: the top functions by own time and by cumulative time;
* a timeline of one call: host and GPU start / end of every layer op (:func:`timeline`).

Cases: prefill of one 512- and one 4096-token sequence (logits of the last row, as
``h200_mtp.py``), and one eager decode step at T 1 and 64 (``DecodeGraphs(capture=False)``).

Run (GPU machine, repository root, after the README's install):
``python3 bench/diag/host_profile.py [--cases prefill512,decode1] [--top 30]``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from h200_mtp import fill_cache, prefill_call, profile_replay

from dsv4mtp.checkpoint.fullsize import make_fullsize_checkpoint
from dsv4mtp.optimized import MTPLayer
from dsv4mtp.optimized.mtp import DecodeGraphs


def least_ms(fn: Callable[[], Any], reps: int = 5, sync: bool = True) -> float:
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    torch.cuda.synchronize()
    return best * 1e3


def timeline(layer: MTPLayer, fn: Callable[[], Any]) -> None:
    """One call with every layer op (and the head's logits) wrapped: host start / end and GPU
    start / end of each, in ms from the call's start.  A GPU end at or before the host end means
    the GPU waited for the host (host-bound); after it, work was queued (GPU-bound)."""
    marks: list[tuple[str, float, float, Any, Any]] = []

    def wrap(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            t0 = time.perf_counter()
            r = f(*a, **k)
            t1 = time.perf_counter()
            e1.record()
            marks.append((name, t0, t1, e0, e1))
            return r

        return timed

    ops = layer.ops
    layer.ops = type(ops)(*(wrap(n, f) for n, f in zip(type(ops)._fields, ops, strict=True)))
    layer._logits = wrap("_logits", layer._logits)  # type: ignore[method-assign]
    try:
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        h0 = time.perf_counter()
        fn()
        h_end = time.perf_counter()
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        torch.cuda.synchronize()
    finally:
        layer.ops = ops
        del layer._logits
    print("| op | host start | host end | GPU start | GPU end | GPU end - host end |")
    print("|---|---|---|---|---|---|")
    for name, t0, t1, e0, e1 in marks:
        hs, he = (t0 - h0) * 1e3, (t1 - h0) * 1e3
        gs, ge = start.elapsed_time(e0), start.elapsed_time(e1)
        print(f"| {name} | {hs:.3f} | {he:.3f} | {gs:.3f} | {ge:.3f} | {ge - he:+.3f} |")
    print(f"| (call) | 0 | {(h_end - h0) * 1e3:.3f} | 0 | {start.elapsed_time(end):.3f} | |")


def report(name: str, fn: Callable[[], Any], top: int) -> None:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    wall = least_ms(fn)
    enq = least_ms(fn, sync=False)
    prof = profile_replay(fn, reps=2)
    kern, launches = prof["kernel_us"] / 1e3, round(prof["launches"])
    print(f"\n## {name}: wall {wall:.2f} ms, enqueue (to the call's return) {enq:.2f} ms, "
          f"kernels {kern:.2f} ms in {launches} launches, GPU idle {wall - kern:.2f} ms")  # fmt: skip
    # the host reads of tensor values (device -> host syncs) one call makes, by source line
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    torch.cuda.set_sync_debug_mode("default")
    where: dict[str, int] = {}
    for w in caught:
        key = f"{os.path.relpath(w.filename)}:{w.lineno}"
        where[key] = where.get(key, 0) + 1
    print(f"syncs per call: {sum(where.values())}: {where}")
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    pr.enable()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    stats = pstats.Stats(pr).stats  # type: ignore[attr-defined]
    rows = []
    for (path, line, func), (_, ncalls, tt, ct, _) in stats.items():
        short = path.split("site-packages/")[-1] if "site-packages" in path else path
        rows.append((f"{short}:{line}({func})", ncalls / 3, tt * 1e6 / 3, ct * 1e6 / 3))
    total = sum(r[2] for r in rows)
    print(f"cProfile: {total:.0f} us of own time per call (profiler overhead included)")
    for key, label in ((3, "cumulative"), (2, "own")):
        print(f"\n| function | calls / call | own us / call | cumulative us / call |  ({label})")
        print("|---|---|---|---|")
        for r in sorted(rows, key=lambda r: -r[key])[:top]:
            print(f"| {r[0]} | {r[1]:.0f} | {r[2]:.0f} | {r[3]:.0f} |")


def decode_call(layer: MTPLayer, cache: Any, T: int, g: torch.Generator) -> Callable[[], Any]:
    """One eager greedy decode step of T sequences, each against a full window."""
    cfg, W = layer.config, layer.config.sliding_window
    cache.reset(torch.arange(T, device="cuda"))
    fill_cache(layer, cache, T, W - 1, g)
    ids = torch.randint(0, cfg.vocab_size, (T,), device="cuda", generator=g)
    pos = torch.full((T,), W - 1, dtype=torch.int64, device="cuda")
    prev = torch.randn(T, cfg.hc_dim, device="cuda", generator=g).to(layer.dtype)
    slots = torch.arange(T, device="cuda")
    eager = DecodeGraphs(layer, cache, buckets=(T,), capture=False, logits=False)
    keep = pos - 1

    def step() -> Any:
        cache.rollback(slots, keep)
        return eager.step(ids, pos, prev, slots)

    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="prefill512,prefill4096,decode1,decode64")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    cases = args.cases.split(",")
    ckdir = tempfile.mkdtemp(prefix="v4flash-")
    make_fullsize_checkpoint(ckdir, "flash", expert_format="mxfp4", device="cuda")
    layer = MTPLayer.from_checkpoint(ckdir, device="cuda", max_num_tokens=4096, max_batch=64)
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = layer.new_device_cache(64)
    for case in cases:
        if case.startswith("prefill"):
            fn = prefill_call(layer, cache, int(case[len("prefill") :]), g)
        else:
            fn = decode_call(layer, cache, int(case[len("decode") :]), g)
        report(case, fn, args.top)
        timeline(layer, fn)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
