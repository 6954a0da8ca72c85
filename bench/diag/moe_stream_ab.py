"""Does the MoE's shared expert on a side stream shorten the whole draft step, and where should
it fork?  (H200)

``MoESchedule.shared_stream`` (the default up to T 64) runs the shared expert on a second CUDA
stream beside the routed GEMMs (optimized/_ops.py, ``shared_fork``).  ``bench/diag/moe_sweep.py``
times the moe alone; this script times what the issue's targets count, the whole layer, both ways in one
process, so machine-to-machine spread (the step's times moved 2-3 % between GPU machines,
bench/results/mtp-h200.md) cancels:

* decode: the V4-Flash-shaped layer of ``bench/h200_mtp.py`` (random checkpoint written on the
  GPU, MXFP4 experts in the tiles layout), a greedy ``DecodeGraphs`` captured per setting for
  T 1, 8, 64 against full windows; each setting's replay timed as the median of 20 CUDA-event
  timed replays, in rounds that alternate the settings (A B A B ...); the table shows the
  median of the rounds;
* prefill: one sequence of 512 and of 4096 tokens, eager (host-paced), wall clock, rounds
  alternating likewise.

The settings: the side stream forking after the router ("router"), after the sort ("align")
or after the routed gate/up GEMM ("gate_up"; optimized/_ops.py, ``SHARED_FORK``, whose default
picks by T), and no side stream ("in order").  A setting is switched by wrapping the operators' ``moe_config`` (its
schedule with ``shared_stream`` set) and setting ``SHARED_FORK``, so the layer and its packs
are the same objects in all.  Outputs are compared bitwise between the settings (the stream
changes no value).  The prefill part compares the side stream (forking after the router)
with none.

Run (GPU machine, repository root, after the README's install):
``python3 bench/diag/moe_stream_ab.py [--rounds 5] [--no-prefill]`` (about two minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from h200_mhc import _median_event_ms as median_ms
from h200_mtp import DECODE_T, fill_cache, prefill_call, wall_ms

from dsv4mtp.checkpoint.fullsize import make_fullsize_checkpoint
from dsv4mtp.optimized import MTPLayer, _ops
from dsv4mtp.optimized.mtp import DecodeGraphs

_DEFAULT = _ops.moe_config


_FORK = _ops.SHARED_FORK  # None: the default by T
SETTINGS = {"router": True, "align": True, "gate_up": True, "in order": False}


def settings(names: str) -> dict[str, bool]:
    return {k: SETTINGS[k] for k in names.split(",")}


def set_shared_stream(on: bool, fork: str | None = _FORK) -> None:
    """The operators' default MoE schedules with ``shared_stream`` = ``on``, forking at
    ``fork``."""

    def config(T: int, *, batch_invariant: bool, fmt: str = "mxfp4") -> Any:
        s = _DEFAULT(T, batch_invariant=batch_invariant, fmt=fmt)
        return dataclasses.replace(s, shared_stream=on)

    _ops.moe_config = config  # type: ignore[assignment]
    _ops.SHARED_FORK = fork


def rounds(calls: dict[str, Callable[[], float]], n: int) -> dict[str, float]:
    """Median over ``n`` rounds of each call's time, the calls alternating within a round."""
    seen: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(n):
        for name, call in calls.items():
            seen[name].append(call())
    return {k: statistics.median(v) for k, v in seen.items()}


def decode_table(
    layer: MTPLayer,
    cache: Any,
    graphs: dict[str, DecodeGraphs],
    g: torch.Generator,
    n_rounds: int,
    label: str = "decode (greedy, graph)",
) -> None:
    """Fill ``cache``'s windows, then per T of ``DECODE_T`` (random ids, full windows): the
    step's outputs (ids, hidden) compared bitwise across the settings' graphs, and their
    replays timed in ``n_rounds`` alternating rounds; one markdown row per T (``label``)."""
    cfg, W = layer.config, layer.config.sliding_window
    fill_cache(layer, cache, max(DECODE_T), W - 1, g)
    print("| step | T | " + " | ".join(f"{k} (us)" for k in graphs) + " | outputs equal |")
    print("|---|---|" + "---|" * len(graphs) + "---|")
    for T in DECODE_T:
        ids = torch.randint(0, cfg.vocab_size, (T,), device="cuda", generator=g)
        pos = torch.full((T,), W - 1, dtype=torch.int64, device="cuda")
        prev = torch.randn(T, cfg.hc_dim, device="cuda", generator=g).to(layer.dtype)
        slots = torch.arange(T, device="cuda")
        outs = []
        for gr in graphs.values():
            cache.rollback(slots, pos - 1)
            outs.append([t.clone() for t in gr.step(ids, pos, prev, slots)[:2]])
        same = all(all(torch.equal(a, b) for a, b in zip(outs[0], o, strict=True)) for o in outs)
        replays = {k: gr.graphs[T].replay for k, gr in graphs.items()}
        for r in replays.values():
            for _ in range(3):
                r()
        t = rounds({k: (lambda r=r: median_ms(r, 20) * 1e3) for k, r in replays.items()},
                   n_rounds)  # fmt: skip
        cells = " | ".join(f"{t[k]:.1f}" for k in graphs)
        print(f"| {label} | {T} | {cells} | {same} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated")
    args = ap.parse_args(argv)
    chosen = settings(args.settings)
    torch.manual_seed(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    ckdir = tempfile.mkdtemp(prefix="v4flash-")
    make_fullsize_checkpoint(ckdir, "flash", expert_format="mxfp4", device="cuda")
    layer = MTPLayer.from_checkpoint(ckdir, device="cuda", max_num_tokens=4096, max_batch=64)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; MoE layout "
          f"{layer.layers[0].ffn.layout}")  # fmt: skip
    graphs: dict[str, DecodeGraphs] = {}
    cache = layer.new_device_cache(max(DECODE_T))
    for name, on in chosen.items():
        set_shared_stream(on, name if on else _FORK)
        graphs[name] = DecodeGraphs(layer, cache, buckets=DECODE_T, logits=False)
    set_shared_stream(True)
    decode_table(layer, cache, graphs, g, args.rounds)
    if args.no_prefill:
        set_shared_stream(True)
        _ops.moe_config = _DEFAULT  # type: ignore[assignment]
        return 0
    print("| step | T | side stream (us) | in order (us) | side / in order | outputs equal |")
    print("|---|---|---|---|---|---|")
    pcache = layer.new_device_cache(1)
    for T in (512, 4096):
        call = prefill_call(layer, pcache, T, g)

        def timed(on: bool, call: Callable[[], Any] = call) -> float:
            set_shared_stream(on)
            return wall_ms(call, 3) * 1e3

        set_shared_stream(True)
        x = call()
        set_shared_stream(False)
        same = bool(torch.equal(x, call()))
        t = rounds({"side stream": lambda: timed(True), "in order": lambda: timed(False)},
                   args.rounds)  # fmt: skip
        a, b = t["side stream"], t["in order"]
        print(f"| prefill (eager) | {T} | {a:.0f} | {b:.0f} | {a / b:.3f} | {same} |")
    set_shared_stream(True)
    _ops.moe_config = _DEFAULT  # type: ignore[assignment]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
