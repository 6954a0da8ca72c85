"""Does staging a captured step's inputs in one launch shorten ``DecodeGraphs.step`` and
``PrefillGraphs.step``?  (H200)

A CUDA graph reads its inputs from the addresses it was captured with, so each ``step`` first
copies the caller's tensors into static buffers and pads the bucket.  The steps now do that in
one launch (kernels/step_inputs.py) and send the prefill's row offsets from a ring of pinned
buffers; before, it took up to ten torch ops (five copies, five fills) and a freshly pinned
tensor.  This script keeps the torch-op version here (:func:`torch_ops_prefill`,
:func:`torch_ops_decode`: the same buffers, the same replay) and times both, and the replay
alone, in alternating rounds in one process: CUDA-event time of a call (median of 10 / 20,
median over 5 rounds), which counts the host's work wherever the GPU waits for it, and the
host time of one decode call.  The outputs are compared bit for bit.

V4-Flash-shaped random checkpoint written on the GPU (MXFP4 experts), prefill graphs for 512
and 4096 tokens (up to 8 sequences), decode graphs for buckets 1, 8, 64 (greedy, no logits).

Run (GPU machine, repository root, after the README's install):
``python3 bench/diag/step_staging_ab.py`` (about a minute and a half).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from h200_mhc import _median_event_ms as median_ms
from moe_stream_ab import rounds

from dsv4mtp.checkpoint.fullsize import make_fullsize_checkpoint
from dsv4mtp.optimized import MTPLayer
from dsv4mtp.optimized.kernels._launch import device_ints
from dsv4mtp.optimized.mtp import DecodeGraphs, PrefillGraphs

Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def torch_ops_prefill(
    pg: PrefillGraphs, ids: torch.Tensor, pos: torch.Tensor, prev: torch.Tensor,
    lens: Sequence[int], slots: torch.Tensor,
) -> Outputs:  # fmt: skip
    """``PrefillGraphs.step`` with its inputs staged by torch ops (the host checks left out)."""
    T, B = ids.shape[0], len(lens)
    b, S = pg.bucket(T), pg.max_seqs + 1
    offsets = [0] * (S + 1)
    for i, n in enumerate(lens):
        offsets[i + 1] = offsets[i] + n
    for i in range(B + 1, S):
        offsets[i] = T
    offsets[S] = b
    pg.cu[pg.buckets.index(b)].copy_(device_ints(offsets, ids.device, torch.int32))
    pg.ids[:T].copy_(ids)
    pg.pos[:T].copy_(pos)
    pg.prev[:T].copy_(prev)
    pg.real[:T].fill_(True)
    pg.slots[:B].copy_(slots)
    pg.slots[B:].fill_(-1)
    if b > T:
        pg.ids[T:b].zero_()
        pg.pos[T:b].zero_()
        pg.prev[T:b].zero_()
        pg.real[T:b].fill_(False)
    pg.graphs[b].replay()
    out = pg.outputs[b]
    return out[0][:B], out[1][:T], out[2][:B]


def torch_ops_decode(
    dg: DecodeGraphs, ids: torch.Tensor, pos: torch.Tensor, prev: torch.Tensor,
    slots: torch.Tensor,
) -> Outputs:  # fmt: skip
    """``DecodeGraphs.step`` with its inputs staged by torch ops (the host checks left out)."""
    B = ids.shape[0]
    b = dg.bucket(B)
    dg.ids[:B].copy_(ids)
    dg.pos[:B].copy_(pos)
    dg.prev[:B].copy_(prev)
    dg.slots[:B].copy_(slots)
    dg.real[:B].fill_(True)
    if b > B:
        dg.ids[B:b].zero_()
        dg.pos[B:b].zero_()
        dg.prev[B:b].zero_()
        dg.slots[B:b].fill_(-1)
        dg.real[B:b].fill_(False)
    dg.graphs[b].replay()
    out = dg.outputs[b]
    return out[0][:B], out[1][:B], out[2][:B]


def compare(calls: dict[str, Callable[[], Any]], reps: int) -> tuple[bool, dict[str, float]]:
    """Outputs of "torch ops" and "one launch" equal bit for bit; event-timed rounds."""
    outs = [[t.clone() for t in calls[k]()] for k in ("torch ops", "one launch")]
    same = all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    return same, rounds({k: (lambda f=f: median_ms(f, reps) * 1e3) for k, f in calls.items()}, 5)


def host_us(f: Callable[[], Any], reps: int = 20) -> float:
    """Median host time of one call (no sync inside: the GPU runs earlier calls meanwhile)."""
    torch.cuda.synchronize()
    v = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        v.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return sorted(v)[reps // 2]


def prefill_row(layer: MTPLayer, pg: PrefillGraphs, lens: list[int], g: torch.Generator) -> None:
    """One sequence per length, each into an empty ring: one markdown row."""
    cfg, T = layer.config, sum(lens)
    ids = torch.randint(0, cfg.vocab_size, (T,), device="cuda", generator=g)
    pos = torch.cat([torch.arange(n, device="cuda") for n in lens])
    prev = torch.randn(T, cfg.hc_dim, device="cuda", generator=g).to(layer.dtype)
    slots = torch.arange(len(lens), device="cuda")
    empty = pg.cache.pos[: len(lens)]  # each call prefills empty rings
    calls = {
        "torch ops": lambda: (empty.fill_(-1), torch_ops_prefill(pg, ids, pos, prev, lens, slots))[1],
        "one launch": lambda: (empty.fill_(-1), pg.step(ids, pos, prev, lens, slots))[1],
        "replay": lambda: (empty.fill_(-1), pg.graphs[pg.bucket(T)].replay()),
    }  # fmt: skip
    same, t = compare(calls, 10)
    pg.check()
    cells = f"{t['torch ops']:.0f} | {t['one launch']:.0f} | {t['replay']:.0f}"
    print(f"| prefill | {T} | {len(lens)} | {cells} | {same} |", flush=True)


def decode_rows(layer: MTPLayer, dg: DecodeGraphs, B: int, g: torch.Generator) -> None:
    """B sequences of one row against full windows: two markdown rows."""
    cfg = layer.config
    ids = torch.randint(0, cfg.vocab_size, (B,), device="cuda", generator=g)
    pos = torch.full((B,), cfg.sliding_window - 1, dtype=torch.int64, device="cuda")
    prev = torch.randn(B, cfg.hc_dim, device="cuda", generator=g).to(layer.dtype)
    slots = torch.arange(B, device="cuda")
    calls = {
        "torch ops": lambda: torch_ops_decode(dg, ids, pos, prev, slots),
        "one launch": lambda: dg.step(ids, pos, prev, slots),
        "replay": lambda: dg.graphs[dg.bucket(B)].replay(),
    }
    same, t = compare(calls, 20)
    dg.check()
    cells = f"{t['torch ops']:.0f} | {t['one launch']:.0f} | {t['replay']:.0f}"
    print(f"| decode (event-timed) | {B} | {B} | {cells} | {same} |")
    h = {k: host_us(f) for k, f in calls.items()}
    cells = f"{h['torch ops']:.0f} | {h['one launch']:.0f} | {h['replay']:.0f}"
    print(f"| decode (host per call) | {B} | {B} | {cells} | |", flush=True)


def main() -> int:
    ckdir = tempfile.mkdtemp(prefix="v4flash-")
    make_fullsize_checkpoint(ckdir, "flash", expert_format="mxfp4", device="cuda")
    layer = MTPLayer.from_checkpoint(ckdir, device="cuda", max_num_tokens=4096, max_batch=64)
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| step | T | sequences | torch ops (us) | one launch (us) | replay alone (us) | equal |")
    print("|---|---|---|---|---|---|---|")
    pg = layer.capture_prefill(tokens=(512, 4096), max_seqs=8)
    for lens in ([512], [250, 250], [4096]):
        prefill_row(layer, pg, lens, g)
    dg = DecodeGraphs(layer, layer.new_device_cache(64), buckets=(1, 8, 64), logits=False)
    for B in (1, 5, 64):
        decode_rows(layer, dg, B, g)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
