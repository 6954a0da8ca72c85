"""The captured prefill with the shared expert on cuBLAS (the default from 256 rows) against the
Triton kernels, in one process (H200).

V4-Flash-shaped random checkpoint written on the GPU (MXFP4 experts, the FP8 shared expert with
power-of-two block scales), one sequence of 512 or 4096 tokens into an empty ring; two
``PrefillGraphs`` captured on the same layer, one with ``_ops.shared_mm_selected`` answering
no (the Triton kernels, as before the cuBLAS path).  Timed in alternating rounds (median of 10
calls, median over 5 rounds): ``step`` (its host work, the staging launch and the replay) and
the replay alone; the two forms' hidden outputs compared (relative Frobenius difference: the
shared expert's fp32 summation order differs).

Run (GPU machine, repository root, after the README's install):
``python3 bench/diag/prefill_shared_ab.py``
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from h200_mhc import _median_event_ms as median_ms
from moe_stream_ab import rounds

from dsv4mtp.checkpoint.fullsize import make_fullsize_checkpoint
from dsv4mtp.optimized import MTPLayer, _ops
from dsv4mtp.optimized.mtp import PrefillGraphs

TOKENS = (512, 4096)


def _row(layer: MTPLayer, forms: dict[str, PrefillGraphs], T: int, g: torch.Generator) -> None:
    """One sequence of T tokens into an empty ring through each form: two markdown rows."""
    cfg = layer.config
    slots = torch.zeros(1, dtype=torch.int64, device="cuda")
    empty = next(iter(forms.values())).cache.pos[:1]
    ids = torch.randint(0, cfg.vocab_size, (T,), device="cuda", generator=g)
    pos = torch.arange(T, device="cuda")
    prev = torch.randn(T, cfg.hc_dim, device="cuda", generator=g).to(layer.dtype)
    hidden = {}
    calls = {}
    for name, pg in forms.items():
        hidden[name] = (empty.fill_(-1), pg.step(ids, pos, prev, [T], slots))[1][1].clone()
        graph = pg.graphs[pg.bucket(T)]
        calls[f"{name} step"] = lambda pg=pg: median_ms(
            lambda: (empty.fill_(-1), pg.step(ids, pos, prev, [T], slots)), 10
        ) * 1e3  # fmt: skip
        calls[f"{name} replay"] = lambda graph=graph: median_ms(
            lambda: (empty.fill_(-1), graph.replay()), 10
        ) * 1e3  # fmt: skip
    t = rounds(calls, 5)
    a, b = (hidden[k].double() for k in forms)
    rel = float((a - b).norm() / b.norm())
    for name, pg in forms.items():
        pg.check()
        print(f"| {T} | {name} | {t[name + ' step']:.0f} | {t[name + ' replay']:.0f} | "
              f"{rel:.1e} |", flush=True)  # fmt: skip


def main() -> int:
    ckdir = tempfile.mkdtemp(prefix="v4flash-")
    make_fullsize_checkpoint(ckdir, "flash", expert_format="mxfp4", device="cuda")
    layer = MTPLayer.from_checkpoint(ckdir, device="cuda", max_num_tokens=4096, max_batch=8)
    assert layer.layers[0].ffn.shared_exact_bf16, "the checkpoint's shared scales are not e8m0"
    cuda_path = layer.capture_prefill(tokens=TOKENS, max_seqs=1)
    selected = _ops.shared_mm_selected
    _ops.shared_mm_selected = lambda *args: False  # the Triton kernels, captured
    try:
        triton_path = layer.capture_prefill(tokens=TOKENS, max_seqs=1, cache=cuda_path.cache)
    finally:
        _ops.shared_mm_selected = selected
    forms = {"cuBLAS shared": cuda_path, "Triton shared": triton_path}
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| T | form | step (us) | replay alone (us) | rel. difference of hidden |")
    print("|---|---|---|---|---|")
    for T in TOKENS:
        _row(layer, forms, T, g)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
