"""Does the Gluon FP8 linear shorten the whole draft step?  (H200; kernels/linear_gluon.py)

The decode step's dense linears (e_proj, h_proj, the fused wq_a + wkv, the grouped wo_a, wo_b;
not wq_b) on e8m0 packs ("fp8_fold") run the Gluon kernel at up to 4 rows, the T 1 step; "old"
runs every call on the Triton kernel.  This script times the whole layer both ways in one
process, so machine-to-machine spread cancels:
the V4-Flash-shaped layer of ``bench/h200_mtp.py`` (random checkpoint written on the GPU), a
greedy ``DecodeGraphs`` captured per setting for T 1, 8, 64 against full windows, each
setting's replay timed as the median of 20 CUDA-event timed replays, in rounds alternating the
settings; the table shows the median of the rounds.  The setting is switched by wrapping the
operators' ``gluon_linear_applies`` (False: every call takes the Triton kernel), so the layer
and its packs are the same objects in both.  The two settings' outputs differ by the fp32
summation order only: the table shows the hidden state's largest difference relative to its
largest magnitude, and whether the drafted ids agree.

Run (GPU machine, repository root, after the README's install):
``python3 bench/diag/linear_gluon_ab.py [--rounds 5]`` (about a minute).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from h200_mhc import _median_event_ms as median_ms
from h200_mtp import DECODE_T, fill_cache

from dsv4mtp.checkpoint.fullsize import make_fullsize_checkpoint
from dsv4mtp.optimized import MTPLayer, _ops
from dsv4mtp.optimized.mtp import DecodeGraphs

_APPLIES = _ops.gluon_linear_applies


def set_new(on: bool) -> None:
    """on: the defaults; off: every call on the Triton kernel."""
    _ops.gluon_linear_applies = _APPLIES if on else (lambda *a: False)  # type: ignore[assignment]


def rounds(calls: dict[str, Callable[[], float]], n: int) -> dict[str, float]:
    """Median over ``n`` rounds of each call's time, the calls alternating within a round."""
    seen: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(n):
        for name, call in calls.items():
            seen[name].append(call())
    return {k: statistics.median(v) for k, v in seen.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    ckdir = tempfile.mkdtemp(prefix="v4flash-")
    make_fullsize_checkpoint(ckdir, "flash", expert_format="mxfp4", device="cuda")
    layer = MTPLayer.from_checkpoint(ckdir, device="cuda", max_num_tokens=4096, max_batch=64)
    cfg, W = layer.config, layer.config.sliding_window
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    graphs: dict[str, DecodeGraphs] = {}
    cache = layer.new_device_cache(max(DECODE_T))
    for name, on in (("new", True), ("old", False)):
        set_new(on)
        graphs[name] = DecodeGraphs(layer, cache, buckets=DECODE_T, logits=False)
    set_new(True)
    fill_cache(layer, cache, max(DECODE_T), W - 1, g)
    print("| step | T | new linears (us) | old linears (us) | new / old | "
          "hidden max diff / max | rows > 1e-2 | ids equal |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for T in DECODE_T:
        ids = torch.randint(0, cfg.vocab_size, (T,), device="cuda", generator=g)
        pos = torch.full((T,), W - 1, dtype=torch.int64, device="cuda")
        prev = torch.randn(T, cfg.hc_dim, device="cuda", generator=g).to(layer.dtype)
        slots = torch.arange(T, device="cuda")
        outs: list[list[Any]] = []
        for gr in graphs.values():
            cache.rollback(slots, pos - 1)
            outs.append([t.clone() for t in gr.step(ids, pos, prev, slots)[:2]])
        (ia, ha), (ib, hb) = outs
        d = (ha.float() - hb.float()).abs()
        diff = float(d.max() / hb.float().abs().max())
        far = int((d.amax(1) > 1e-2 * hb.float().abs().max()).sum())
        same_ids = bool(torch.equal(ia, ib))
        replays = {k: gr.graphs[T].replay for k, gr in graphs.items()}
        for r in replays.values():
            for _ in range(3):
                r()
        t = rounds({k: (lambda r=r: median_ms(r, 20) * 1e3) for k, r in replays.items()},
                   args.rounds)  # fmt: skip
        a, b = t["new"], t["old"]
        print(f"| decode (greedy, graph) | {T} | {a:.1f} | {b:.1f} | {a / b:.3f} | {diff:.1e} | "
              f"{far} / {T} | {same_ids} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
