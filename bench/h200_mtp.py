"""The headline: one MTP draft step of the optimized layer at V4-Flash shapes on one H200.

Builds a V4-Flash-shaped random checkpoint on the GPU (``dsv4-mtp make-checkpoint``, MXFP4
experts, FP8 dense linears, bf16 embedding and head), loads it with
``dsv4mtp.optimized.MTPLayer.from_checkpoint`` (load time, host and GPU memory) and measures:

* decode at batch T in {1, 8, 64}: one step = forward of one row per sequence against its
  device-cache slot (each slot holding a full window of ``sliding_window`` rows) + the logits
  and greedy ids, as captured by ``capture_decode`` (CUDA-graph replay; median over replays);
* the same step run eagerly (wall time per step, CUDA synchronized), whose excess over the
  replay is the host overhead the graphs remove;
* prefill of one sequence of 512 and of 4096 tokens into an empty cache, logits of its last
  row only: eager (the eager prefill reads its lengths on the host; wall time, synchronized),
  then the same inputs through ``capture_prefill``'s graphs (:class:`PrefillGraphs`: wall time
  of ``step``, inputs copied in; its logits compared with the eager call's bit for bit);
* the floor of each: max(bytes / copy bandwidth, FLOPs / bf16 GEMM peak), both measured in
  the same run.  Bytes from the real tensors: every dense weight the step reads (FP8 codes +
  scales, norms, mHC parameters), the routed experts the step's router actually selected
  (counted by re-running the router on the step's MoE input), the shared expert, the bf16 head,
  the embedding rows, each sequence's KV window and the activations in and out;
* a per-op breakdown of the T 1, 8 and 64 replays and of each prefill (torch.profiler, CUDA time
  per kernel name; launches per step and the time outside kernels);
* peers in the same run: the reference layer on the GPU, eager (``--reference``) and with its
  layer body under ``torch.compile`` (``--compile``), at T 1 and 8.

    python3 h200_mtp.py --out $OUT --commit <sha>      # on the GPU machine, from bench/

Writes ``mtp-h200.json`` and ``mtp-h200.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from h200_mhc import _median_event_ms as median_ms
from h200_mhc import copy_bandwidth

from dsv4mtp.checkpoint.fullsize import make_fullsize_checkpoint
from dsv4mtp.config import DSV4Config
from dsv4mtp.optimized import MTPLayer, pack_head, route
from dsv4mtp.optimized.mtp import DecodeGraphs, PrefillGraphs

BF16 = torch.bfloat16
DECODE_T = (1, 8, 64)
PREFILL_T = (512, 4096)
TARGETS = {"decode": 1.3, "prefill": 1.6}  # time / floor, from the issue


# ------------------------------------------------------------------------------------- timing
def wall_ms(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def gemm_peak() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=BF16)
    b = torch.randn(n, n, device="cuda", dtype=BF16)
    for _ in range(3):
        torch.mm(a, b)
    return 2 * n**3 / (median_ms(lambda: torch.mm(a, b), 10) * 1e-3)


# ------------------------------------------------------------------------------------- bytes
def tensors_of(obj: Any, seen: set[int] | None = None) -> list[torch.Tensor]:
    """Every tensor reachable through dataclass fields, dicts, lists and tuples (once each)."""
    seen = set() if seen is None else seen
    out: list[torch.Tensor] = []
    if isinstance(obj, torch.Tensor):
        if obj.data_ptr() not in seen and obj.numel():
            seen.add(obj.data_ptr())
            out.append(obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            out += tensors_of(getattr(obj, f.name), seen)
    elif isinstance(obj, dict):
        for v in obj.values():
            out += tensors_of(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out += tensors_of(v, seen)
    return out


def nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def layer_bytes(layer: MTPLayer) -> dict[str, int]:
    """Bytes of the step's fixed reads: dense weights (all but the routed experts and head)."""
    p = layer.layers[0]
    routed = {id(t) for t in (p.ffn.w13, p.ffn.s13, p.ffn.w2, p.ffn.s2, p.ffn.gscale)}
    dense = [
        t for t in tensors_of([p.e_proj, p.h_proj, p.attn, p.ffn, p.vectors])
        if id(t) not in routed
    ]  # fmt: skip
    ffn = p.ffn
    per_expert = nbytes([ffn.w13, ffn.s13, ffn.w2, ffn.s2, ffn.gscale]) // ffn.num_local_experts
    return {"dense": nbytes(dense), "head": nbytes([p.head]), "per_expert": per_expert}


def step_bytes(layer: MTPLayer, fixed: dict[str, int], T: int, rows: int, kv_rows: int,
               distinct: int, logit_rows: int) -> int:  # fmt: skip
    cfg = layer.config
    item = torch.finfo(layer.dtype).bits // 8
    acts = rows * cfg.hc_dim * item * 2 + rows * cfg.hidden_size * item  # prev in, out; embed
    kv = kv_rows * cfg.head_dim * item + rows * cfg.head_dim * item  # read window, write rows
    logits = logit_rows * cfg.vocab_size * 4
    return fixed["dense"] + fixed["head"] + distinct * fixed["per_expert"] + acts + kv + logits


def step_flops(cfg: DSV4Config, rows: int, slots: int, kv_pairs: int, logit_rows: int) -> int:
    """2 x multiply-adds: dense linears per row, experts per routed slot, attention, head."""
    D, Rq, Dh, H = cfg.hidden_size, cfg.q_lora_rank, cfg.head_dim, cfg.num_attention_heads
    G, Ro, I = cfg.o_groups, cfg.o_lora_rank, cfg.moe_intermediate_size
    dense = 2 * D * D + D * (Rq + Dh) + Rq * H * Dh + H * Dh * Ro + G * Ro * D
    mix = 2 * 24 * cfg.hc_dim + 4 * cfg.hc_dim
    shared = 3 * I * D
    per_row = dense + mix + shared + cfg.n_routed_experts * D
    return 2 * (rows * per_row + slots * 3 * I * D + kv_pairs * H * Dh * 2
                + logit_rows * cfg.vocab_size * D)  # fmt: skip


# ------------------------------------------------------------------------------------- setup
def fill_cache(layer: MTPLayer, cache: Any, B: int, window: int, g: torch.Generator) -> None:
    """Prefill slots 0..B-1 with ``window`` rows each (positions 0..window-1), a few sequences
    per call (the layer's max_num_tokens)."""
    cfg = layer.config
    per = max(1, layer.max_num_tokens // window)
    for s0 in range(0, B, per):
        n = min(per, B - s0)
        ids = torch.randint(0, cfg.vocab_size, (n * window,), device="cuda", generator=g)
        pos = torch.arange(window, device="cuda").repeat(n)
        prev = torch.randn(n * window, cfg.hc_dim, device="cuda", generator=g).to(layer.dtype)
        lens = torch.full((n,), window, dtype=torch.int64, device="cuda")
        slots = torch.arange(s0, s0 + n, device="cuda")
        layer.forward(ids, pos, prev, seq_lens=lens, kv_cache=cache, cache_slots=slots)


def count_experts(layer: MTPLayer, call: Callable[[], Any]) -> tuple[int, int]:
    """(distinct routed experts, routed slots) of one eager run of ``call``: the layer's moe op
    wrapped to re-run the router on the MoE input (same kernel, same picks)."""
    seen: list[torch.Tensor] = []
    orig = layer.ops

    def spy(x: torch.Tensor, params: Any, config: DSV4Config, **kw: Any) -> torch.Tensor:
        _, ids = route(x, params.gate_weight, params.gate_bias, config)
        mask = kw.get("row_mask")
        seen.append(ids[mask] if mask is not None else ids)
        return orig.moe(x, params, config, **kw)

    layer.ops = orig._replace(moe=spy)  # type: ignore[misc]
    try:
        call()
    finally:
        del layer.ops  # back to the class's ops
    ids = torch.cat([i.reshape(-1) for i in seen])
    return int(torch.unique(ids).numel()), int(ids.numel())


def profile_replay(replay: Callable[[], Any], top: int = 14, reps: int = 5) -> dict[str, Any]:
    """CUDA time per kernel name over ``reps`` calls of ``replay`` (torch.profiler), per call:
    the ``top`` kernels, and every kernel's launches and time summed (``launches``,
    ``kernel_us``): what the step's time spends outside kernels is its time minus
    ``kernel_us`` (graph-node gaps, and idle SMs between dependent launches)."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / reps
        if us > 0:
            rows.append(
                {"kernel": e.key[:90], "us_per_step": round(us, 2), "calls": e.count / reps}
            )
    rows.sort(key=lambda r: -r["us_per_step"])
    return {
        "top": rows[:top],
        "launches": sum(r["calls"] for r in rows),
        "kernel_us": round(sum(r["us_per_step"] for r in rows), 1),
        "all": rows,
    }


# ------------------------------------------------------------------------------------- cells
def bench_decode(layer: MTPLayer, graph: DecodeGraphs, fixed: dict[str, int], T: int,
                 inputs: tuple[torch.Tensor, ...], bw: float, peak: float, reps: int,
                 name: str, experts: tuple[int, int] | None) -> dict[str, Any]:  # fmt: skip
    """One decode step of T sequences, each against a full window in its slot, through
    ``graph`` (greedy ids only, or with logits).  ``experts``: (distinct, slots) of the same
    inputs if already counted (then the eager step is not timed again)."""
    cfg, W = layer.config, layer.config.sliding_window
    ids, pos, prev, slots = inputs
    cache = graph.cache
    tok, hidden, logits = (t.clone() for t in graph.step(ids, pos, prev, slots))
    eager = DecodeGraphs(layer, cache, buckets=(T,), capture=False, logits=graph.logits)
    keep = pos - 1  # rollback to the filled window: the eager step re-decodes the same row

    def eager_step() -> Any:
        cache.rollback(slots, keep)
        return eager.step(ids, pos, prev, slots)

    e_tok, e_hidden, _ = eager_step()
    same = bool(torch.equal(tok, e_tok) and torch.equal(hidden, e_hidden))
    finite = bool(torch.isfinite(hidden).all() and torch.isfinite(logits).all())
    replay = graph.graphs[T].replay  # its static inputs are still this step's
    for _ in range(3):
        replay()
    us = median_ms(replay, reps) * 1e3
    row: dict[str, Any] = {}
    if experts is None:
        experts = count_experts(layer, eager_step)
        # eager wall time of a step (its input checks' host reads included), rollback excluded
        rb = wall_ms(lambda: cache.rollback(slots, keep), 5) * 1e3
        row["eager_us"] = wall_ms(eager_step, 5) * 1e3 - rb
    distinct, slots_n = experts
    head = nbytes(tensors_of(layer.heads[0]))
    by = step_bytes(layer, {**fixed, "head": head}, T, T, T * (W - 1), distinct,
                    T if graph.logits else 0)  # fmt: skip
    fl = step_flops(cfg, T, slots_n, T * W, T)
    floor = max(by / bw, fl / peak) * 1e6
    print(f"decode {name} T {T}: {us:.1f} us, floor {floor:.1f} us ({us / floor:.2f}x), "
          f"{distinct} experts, replay==eager {same}, {row}")  # fmt: skip
    row.update({
        "kind": "decode", "variant": name, "T": T, "us": us, "floor_us": floor,
        "ratio": us / floor, "bytes": by, "flops": fl, "distinct_experts": distinct,
        "routed_slots": slots_n, "replay_equals_eager": same, "finite": finite,
        "head_floor_us": head / bw * 1e6,
    })  # fmt: skip
    return row


def prefill_inputs(layer: MTPLayer, T: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """One sequence of T random tokens at positions 0..T-1 -> (ids, positions, prev_hidden)."""
    cfg = layer.config
    ids = torch.randint(0, cfg.vocab_size, (T,), device="cuda", generator=g)
    pos = torch.arange(T, device="cuda")
    prev = torch.randn(T, cfg.hc_dim, device="cuda", generator=g).to(layer.dtype)
    return ids, pos, prev


def prefill_call(
    layer: MTPLayer, cache: Any, inputs: tuple[torch.Tensor, ...]
) -> Callable[[], Any]:
    """The timed prefill: ``inputs`` into the emptied slot 0 of ``cache``, logits of its last
    row (eager)."""
    ids, pos, prev = inputs
    slots = torch.zeros(1, dtype=torch.int64, device="cuda")
    lens = torch.tensor([ids.shape[0]], device="cuda")

    def prefill() -> torch.Tensor:
        cache.reset(slots)
        h = layer.forward(ids, pos, prev, seq_lens=lens, kv_cache=cache, cache_slots=slots)
        return layer.compute_logits(h[-1:])

    return prefill


def bench_prefill(layer: MTPLayer, cache: Any, fixed: dict[str, int], T: int,
                  g: torch.Generator, bw: float, peak: float) -> dict[str, Any]:  # fmt: skip
    """One sequence of T tokens into an empty slot, logits of its last row (eager)."""
    cfg, W = layer.config, layer.config.sliding_window
    inputs = prefill_inputs(layer, T, g)
    prefill = prefill_call(layer, cache, inputs)
    logits = prefill()
    finite = bool(torch.isfinite(logits).all())
    distinct, slots_n = count_experts(layer, prefill)
    us = wall_ms(prefill, 5) * 1e3
    by = step_bytes(layer, fixed, T, T, 0, distinct, 1)
    fl = step_flops(cfg, T, slots_n, sum(min(i + 1, W) for i in range(T)), 1)
    floor = max(by / bw, fl / peak) * 1e6
    print(f"prefill T {T}: {us:.0f} us, floor {floor:.0f} us ({us / floor:.2f}x)")
    return {
        "kind": "prefill", "variant": "eager", "T": T, "us": us, "eager_us": us,
        "floor_us": floor, "ratio": us / floor, "bytes": by, "flops": fl,
        "distinct_experts": distinct, "logits_finite": finite,
        "profile": profile_replay(prefill, top=16, reps=2), "_inputs": inputs, "_logits": logits,
    }  # fmt: skip


def bench_prefill_graph(pg: PrefillGraphs, eager: dict[str, Any]) -> dict[str, Any]:
    """``eager``'s prefill (the same inputs, one sequence into slot 0 of the graphs' cache,
    emptied first by a one-row fill) through :class:`PrefillGraphs`: wall time of ``step``
    (inputs copied into the graph's buffers, the offsets to the device, the replay), the same
    floor; ``equals_eager``: its last-row logits against the eager call's, bit for bit."""
    ids, pos, prev = eager["_inputs"]
    T = ids.shape[0]
    slots = torch.zeros(1, dtype=torch.int64, device="cuda")

    def call() -> Any:
        pg.cache.pos[0].fill_(-1)
        return pg.step(ids, pos, prev, [T], slots)

    tok, _, logits = call()
    same = bool(torch.equal(logits, eager["_logits"]))
    us = wall_ms(call, 5) * 1e3
    pg.check()
    print(f"prefill graph T {T}: {us:.0f} us ({us / eager['floor_us']:.2f}x), "
          f"equals eager {same}, bucket {pg.bucket(T)}")  # fmt: skip
    return {
        "kind": "prefill", "variant": "graph", "T": T, "us": us, "eager_us": eager["us"],
        "floor_us": eager["floor_us"],
        "ratio": us / eager["floor_us"], "bytes": eager["bytes"], "flops": eager["flops"],
        "distinct_experts": eager["distinct_experts"], "equals_eager": same,
        "token": int(tok[0]), "profile": profile_replay(call, top=16, reps=2),
    }  # fmt: skip


def bench_reference(ref: Any, T: int, g: torch.Generator, compiled: bool = False) -> dict[str, Any]:
    """The reference layer's step (T sequences of one row, no cache) + logits, eager or with
    its layer body compiled (``first_call_s``: the first call, compilation included)."""
    cfg = ref.config
    ids = torch.randint(0, cfg.vocab_size, (T,), device="cuda", generator=g)
    pos = torch.zeros(T, dtype=torch.int64, device="cuda")
    prev = torch.randn(T, cfg.hc_dim, device="cuda", generator=g).to(BF16)
    lens = torch.ones(T, dtype=torch.int64, device="cuda")

    def step() -> torch.Tensor:
        return ref.compute_logits(ref.forward(ids, pos, prev, seq_lens=lens))

    name = "reference eager (empty cache)"
    t0 = time.perf_counter()
    if compiled:
        # the reference's layer body under torch.compile (its host-side checks stay eager)
        ref._run = torch.compile(ref._run, dynamic=False)
        name = "reference under torch.compile (empty cache)"
    step()
    first_s = time.perf_counter() - t0
    row = {"peer": name, "T": T, "us": wall_ms(step, 3) * 1e3, "first_call_s": first_s}
    print(row)
    return row


# ------------------------------------------------------------------------------------- report
def markdown(result: dict[str, Any]) -> str:
    """The tables of one run (bench/results/mtp-h200.md adds the reading of them)."""
    m, rows = result["meta"], result["rows"]
    out = [
        f"Command: `{m['command']}`, commit {m['commit']}, {m['gpu']}, torch {m['torch']}, "
        f"triton {m['triton']}; same-run copy {m['copy_bw_TBps']:.3f} TB/s, bf16 GEMM "
        f"{m['gemm_TFLOPs']:.1f} TFLOP/s.  V4-Flash shapes, {m['expert_format']} experts, FP8 "
        f"dense linears, bf16 head; checkpoint written in {m['write_s']:.1f} s, loaded in "
        f"{m['load_s']:.1f} s (GPU {m['gpu_kept_GB']:.2f} GB kept, host peak RSS "
        f"{m['load_peak_rss_GB']:.1f} GB), {len(DECODE_T)} buckets captured in "
        f"{m['capture_s']:.1f} s.",
        "",
        "| step | T | time (us) | eager (us) | floor (us) | time / floor | target | bytes (MB) "
        "| GFLOP | experts |",
        "|---|---|---|---|---|---|---|---|---|---|",
        # decode variants: greedy = ids from the logit-free argmax (bf16 head); logits = the
        # (T, V) fp32 logits + argmax (for sampling); FP8 head = greedy over the FP8 head
    ]
    for r in rows:
        target = TARGETS[r["kind"]]
        met = "met" if r["ratio"] <= target else "missed"
        eager = f"{r['eager_us']:.0f}" if "eager_us" in r else "-"
        kind = r["kind"] + (f" ({r['variant']})" if "variant" in r else " (eager)")
        out.append(
            f"| {kind} | {r['T']} | {r['us']:.1f} | {eager} | {r['floor_us']:.1f} | "
            f"{r['ratio']:.2f} | <= {target} {met} | {r['bytes'] / 1e6:.0f} | "
            f"{r['flops'] / 1e9:.1f} | {r['distinct_experts']} |"
        )
    for p in result["peers"]:
        first = f" (first call {p['first_call_s']:.1f} s)" if "first_call_s" in p else ""
        out.append(f"\nPeer: {p['peer']}, T {p['T']}: {p['us']:.0f} us{first}.")
    steps = {r["T"]: r["us"] for r in rows if r.get("variant") == "greedy"}
    profiles = [(f"decode T {T} (greedy, 5 replays)", steps.get(int(T)), prof)
                for T, prof in result["breakdown"].items()]  # fmt: skip
    profiles += [(f"prefill T {r['T']} ({r['variant']}, 2 calls)", r["us"], r["profile"])
                 for r in rows if "profile" in r]  # fmt: skip
    for what, step_us, prof in profiles:
        idle = f", {step_us - prof['kernel_us']:.0f} us outside kernels" if step_us else ""
        out += ["", f"Per kernel, {what}: {prof['launches']:.0f} launches, "
                f"{prof['kernel_us']:.0f} us in kernels{idle}:", "",
                "| kernel | us / step | launches |", "|---|---|---|"]  # fmt: skip
        out += [
            f"| `{k['kernel'][:70]}` | {k['us_per_step']:.1f} | {k['calls']:g} |"
            for k in prof["top"]
        ]
    return "\n".join(out) + "\n"


def svg(rows: list[dict[str, Any]]) -> str:
    """Time and floor per step as paired bars on a log axis (no plotting dependency)."""
    import math

    w, h, left, bottom = 560, 300, 60, 40
    lo, hi = 1.0, math.log10(max(r["us"] for r in rows) * 2)
    y = lambda v: h - bottom - (math.log10(v) - lo) / (hi - lo) * (h - bottom - 20)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
             'font-family="sans-serif" font-size="11">']  # fmt: skip
    for e in range(int(lo), int(hi) + 1):
        parts.append(f'<line x1="{left}" x2="{w - 10}" y1="{y(10**e):.0f}" y2="{y(10**e):.0f}" '
                     f'stroke="#ddd"/><text x="4" y="{y(10**e) + 4:.0f}">{10**e} us</text>')  # fmt: skip
    step = (w - left - 20) / len(rows)
    rows = [r for r in rows if r.get("variant", "greedy") == "greedy"]
    step = (w - left - 20) / len(rows)
    for i, r in enumerate(rows):
        x0 = left + i * step + 8
        for j, (key, color) in enumerate((("us", "#3367d6"), ("floor_us", "#aaa"))):
            top = y(max(r[key], 10**lo))
            parts.append(f'<rect x="{x0 + j * 22:.0f}" y="{top:.0f}" width="20" '
                         f'height="{h - bottom - top:.0f}" fill="{color}"/>')  # fmt: skip
        parts.append(f'<text x="{x0:.0f}" y="{h - bottom + 14}">{r["kind"][:3]} {r["T"]}</text>'
                     f'<text x="{x0:.0f}" y="{h - bottom + 27}">{r["ratio"]:.2f}x</text>')  # fmt: skip
    parts.append(f'<text x="{left}" y="12">time (blue) vs floor (grey), log scale</text></svg>')
    return "\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    ap.add_argument("--expert-format", default="mxfp4")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--reference", action="store_true", help="time the reference layer too")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--compile", action="store_true", help="the reference under torch.compile")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    meta: dict[str, Any] = {
        "command": "python3 h200_mtp.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": args.commit,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "expert_format": args.expert_format,
    }
    import triton

    meta["triton"] = triton.__version__
    meta["copy_bw_TBps"] = copy_bandwidth() / 1e12
    meta["gemm_TFLOPs"] = gemm_peak() / 1e12
    print(f"copy {meta['copy_bw_TBps']:.3f} TB/s, bf16 GEMM {meta['gemm_TFLOPs']:.1f} TFLOP/s")

    ckdir = args.dir or tempfile.mkdtemp(prefix="v4flash-")
    t0 = time.perf_counter()
    if not os.path.exists(os.path.join(ckdir, "model.safetensors.index.json")):
        make_fullsize_checkpoint(ckdir, "flash", expert_format=args.expert_format, device="cuda")
    meta["write_s"] = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    layer = MTPLayer.from_checkpoint(ckdir, device="cuda", max_num_tokens=4096, max_batch=64)
    torch.cuda.synchronize()
    meta["load_s"] = time.perf_counter() - t0
    meta["load_peak_rss_GB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    meta["rss_before_GB"] = rss0 * 1024 / 1e9
    meta["gpu_peak_load_GB"] = torch.cuda.max_memory_allocated() / 1e9
    meta["gpu_kept_GB"] = torch.cuda.memory_allocated() / 1e9
    print(f"write {meta['write_s']:.1f} s, load {meta['load_s']:.1f} s, GPU kept "
          f"{meta['gpu_kept_GB']:.2f} GB, peak RSS {meta['load_peak_rss_GB']:.1f} GB")  # fmt: skip
    cfg = layer.config
    W = cfg.sliding_window
    fixed = layer_bytes(layer)
    meta["fixed_bytes"] = fixed
    bw, peak = meta["copy_bw_TBps"] * 1e12, meta["gemm_TFLOPs"] * 1e12
    rows: list[dict[str, Any]] = []

    # decode: graphs over full-window caches
    t0 = time.perf_counter()
    graphs = layer.capture_decode(buckets=DECODE_T, num_seqs=max(DECODE_T))
    meta["capture_s"] = time.perf_counter() - t0
    cache = graphs[0].cache
    greedy = DecodeGraphs(layer, cache, buckets=DECODE_T, logits=False)
    bf16_heads = layer.heads
    layer.heads = [pack_head(layer.layers[0].head, format="fp8")]
    fp8 = DecodeGraphs(layer, cache, buckets=DECODE_T, logits=False)
    fp8_heads, layer.heads = layer.heads, bf16_heads
    fill_cache(layer, cache, max(DECODE_T), W - 1, g)
    breakdown: dict[int, Any] = {}
    peers: list[dict[str, Any]] = []
    result = {"meta": meta, "rows": rows, "breakdown": breakdown, "peers": peers}
    for T in DECODE_T:
        inputs = (
            torch.randint(0, cfg.vocab_size, (T,), device="cuda", generator=g),
            torch.full((T,), W - 1, dtype=torch.int64, device="cuda"),
            torch.randn(T, cfg.hc_dim, device="cuda", generator=g).to(layer.dtype),
            torch.arange(T, device="cuda"),
        )
        head = bench_decode(layer, greedy, fixed, T, inputs, bw, peak, args.reps, "greedy", None)
        experts = (head["distinct_experts"], head["routed_slots"])
        rows.append(head)
        rows.append(bench_decode(layer, graphs[0], fixed, T, inputs, bw, peak, args.reps,
                                 "logits", experts))  # fmt: skip
        layer.heads = fp8_heads
        rows.append(bench_decode(layer, fp8, fixed, T, inputs, bw, peak, args.reps,
                                 "greedy, FP8 head", experts))  # fmt: skip
        layer.heads = bf16_heads
        breakdown[T] = profile_replay(greedy.graphs[T].replay)
        write(args.out, result)  # what is measured so far survives a later failure or time limit
    for gr in (graphs[0], greedy, fp8):
        gr.check()

    # prefill: one sequence into an empty slot, logits of its last row
    if not args.no_prefill:
        for T in PREFILL_T:
            rows.append(bench_prefill(layer, cache, fixed, T, g, bw, peak))
            write(args.out, result)
        # the same prefills through CUDA graphs (one per token bucket, up to 8 sequences)
        torch.cuda.synchronize()
        mem0 = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        pg = layer.capture_prefill(tokens=PREFILL_T, cache=cache)
        meta["prefill_capture_s"] = time.perf_counter() - t0
        meta["prefill_graph_pool_GB"] = (torch.cuda.memory_allocated() - mem0) / 1e9
        for r in [r for r in rows if r["kind"] == "prefill"]:
            rows.append(bench_prefill_graph(pg, r))
            write(args.out, result)

    # peers: the reference layer on the GPU
    if args.reference or args.compile:
        from dsv4mtp.reference import MTPLayer as RefLayer

        ref = RefLayer.from_checkpoint(ckdir, device="cuda", dtype=BF16)
        for T in (1, 8) if args.reference else ():
            peers.append(bench_reference(ref, T, g))
            write(args.out, result)
        # last: its compilation may be cut by the caller's time limit (the results so far
        # are written already)
        for T in (1, 8) if args.compile else ():
            peers.append(bench_reference(ref, T, g, compiled=True))
            write(args.out, result)
        del ref
    print(json.dumps({T: b["top"] for T, b in breakdown.items()}, indent=1)[:4000])
    return 0


def write(out: str, result: dict[str, Any]) -> None:
    # keys starting with "_" are the run's tensors (a prefill's inputs and logits), not results
    rows = [{k: v for k, v in r.items() if not k.startswith("_")} for r in result["rows"]]
    with open(os.path.join(out, "mtp-h200.json"), "w") as f:
        json.dump({**result, "rows": rows}, f, indent=1, default=str)
    with open(os.path.join(out, "mtp-h200-table.md"), "w") as f:
        f.write(markdown(result))
    with open(os.path.join(out, "mtp-h200.svg"), "w") as f:
        f.write(svg(result["rows"]))


if __name__ == "__main__":
    raise SystemExit(main())
