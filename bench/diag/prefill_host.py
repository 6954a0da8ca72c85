"""Host time of the eager prefill's bookkeeping at V4-Flash shapes on CPU tensors (no kernel).

The attention launch and the ring write are replaced by no-ops, so what is timed is the Python
and the small torch ops around them: the layer's input checks, the attention's ring checks with
the ring prefill's key gather / write indices, and the no-cache sequence check.  ``host reads``
counts the reads of tensor values (tolist / item / int / bool / float / index) one call makes:
each is a device->host sync on a GPU.  ``DH=16`` shrinks the rows (32 bytes) so that the copies
cost nothing on this CPU and what remains is the per-call work.
Run: ``DH=16 python bench/diag/prefill_host.py``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from dsv4mtp.config import DSV4Config
from dsv4mtp.layer import MTPLayerAPI
from dsv4mtp.optimized.kv_cache import DeviceKVCache

A = importlib.import_module("dsv4mtp.optimized.attention")
_COUNT = [0]


def _counting(name: str) -> None:
    orig = getattr(torch.Tensor, name)

    def wrapped(self: torch.Tensor, *a: Any, **k: Any) -> Any:
        _COUNT[0] += 1
        return orig(self, *a, **k)

    setattr(torch.Tensor, name, wrapped)


def timed(fn: Callable[[], object], reps: int = 20) -> tuple[float, int]:
    fn()
    best = float("inf")  # the least of reps calls: this machine's CPUs are shared
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    us = best * 1e6
    _COUNT[0] = 0
    fn()
    return us, _COUNT[0]


def rows_at(T: int, cfg: DSV4Config, tiny: DSV4Config, Dh: int) -> None:
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(T)
    slots = torch.zeros(1, dtype=torch.int64)
    C = DeviceKVCache(cfg, num_seqs=1, dtype=torch.bfloat16, device="cpu").capacity

    def ring() -> DeviceKVCache:
        kv_rows = torch.zeros(4, C, Dh, dtype=torch.bfloat16)
        empty = torch.full((4, C), -1, dtype=torch.int32)
        return DeviceKVCache.from_tensors(kv_rows, empty, cfg.sliding_window)

    cache, full = ring(), ring()
    full.pos[0] = torch.arange(C, dtype=torch.int32)  # a second chunk: C rows held
    q = torch.zeros(T, 1, Dh, dtype=torch.bfloat16)
    kv = torch.randn(T, Dh, generator=g).to(torch.bfloat16)
    sink = torch.zeros(1, dtype=torch.bfloat16)
    ids = torch.randint(0, tiny.vocab_size, (T,), generator=g)
    prev = torch.randn(T, tiny.hc_dim, generator=g).to(torch.bfloat16)
    layer = SimpleNamespace(config=tiny, dtype=torch.bfloat16, device=torch.device("cpu"))

    def ring_prefill(p: torch.Tensor, c: DeviceKVCache) -> object:
        if "plan" not in inspect.signature(A._ring_prefill).parameters:  # the host version
            A._check_ring_sequences(p, [T], c, slots)
            return A._ring_prefill(q, kv, p, [T], c, slots, sink, False)
        plan = A._check_ring_sequences(p, [T], c, slots, True)
        return A._ring_prefill(q, kv, p, [T], c, slots, sink, False, plan)

    rows: list[tuple[str, Callable[[], object]]] = [
        ("MTPLayerAPI._check_inputs (tiny hc_dim)",
         lambda: MTPLayerAPI._check_inputs(layer, ids, pos, prev, torch.tensor([T]))),  # type: ignore[arg-type]
        ("ring checks + prefill (kernels stubbed)", lambda: ring_prefill(pos, cache)),
        ("ring checks + prefill, 2nd chunk (full ring)", lambda: ring_prefill(pos + C, full)),
        ("_check_sequences (no cache)", lambda: A._check_sequences(pos, [T], None)),
    ]  # fmt: skip
    for name, fn in rows:
        us, n = timed(fn)
        print(f"T {T:5d}  {name:46s} {us:8.0f} us  host reads {n}")


def main() -> None:
    torch.set_num_threads(1)
    cfg, tiny = DSV4Config.flash(), DSV4Config.tiny()
    A._ops_varlen = lambda q, *a, **k: torch.empty_like(q)
    A._write_out = lambda *a, **k: None
    for name in ("tolist", "item", "__int__", "__bool__", "__float__", "__index__"):
        _counting(name)
    for T in (512, 4096):
        rows_at(T, cfg, tiny, int(os.environ.get("DH", cfg.head_dim)))


if __name__ == "__main__":
    main()
