"""Which tiles should the sink attention use on the H200?  Times candidate
``AttentionSchedule``s of our three attention kernels at V4-Flash shapes (H 64, Dh 512, window 128,
bf16) and says, for each, whether its output is bitwise the default's.

* decode: the ring-cache kernel (``sink_attention_cache_triton``, what the captured step runs),
  B sequences of one query row at position 127 against a full 128-row window, B 1 / 8 / 64;
* paged: the paged-cache kernel (``sink_attention_paged_triton``, an engine's cache), 64 rows in
  vLLM's 16-row blocks;
* prefill: the contiguous varlen kernel (``sink_attention_triton``), one sequence of T 512 /
  4096 tokens, every query seeing its own <= 128 keys.

Every schedule computes the same function; the reduction order over keys (``block_n``) and the
dot instruction's M (``block_h``) are what can change bits, while the Dh chunk (``block_d``: on
the GPU a dot's Dh reduction is one chain of 16-wide MMA steps whatever the chunk), output
slices and warps choose how the work is split.  A schedule is only a candidate default if the
kernels keep giving the same bits for the same row (optimized/kernels/sink_attention.py, module
docstring): each cell says (=) where the output is bitwise the default schedule's on the same
inputs, else the max abs difference.
Times: CUDA-graph replay of 20 calls, median of 10 replays (bench/h200_mhc.py's timer).

    python3 bench/diag/attention_sweep.py [--only default,dv256_w8_s3,...] [--decode 1,8,64]
        [--paged 64] [--prefill 512,4096]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h200_mhc import graph_time_us

from dsv4mtp.optimized.kernels.sink_attention import (
    AttentionSchedule,
    attention_schedule,
    sink_attention_cache_triton,
    sink_attention_paged_triton,
    sink_attention_triton,
)

H, DH, WINDOW = 64, 512, 128
SCALE = DH**-0.5
BF16 = torch.bfloat16


def schedules() -> list[tuple[str, AttentionSchedule]]:
    d = attention_schedule(H, DH, WINDOW)
    s = AttentionSchedule
    return [
        ("default", d),
        ("dv64", s(64, 32, 64, 64, 64, 4, 2)),
        ("h32", s(32, 32, 64, 128, 64, 4, 2)),
        ("h16", s(16, 32, 64, 128, 64, 4, 2)),
        ("h32_dv64", s(32, 32, 64, 64, 64, 4, 2)),
        ("w8", s(64, 32, 64, 128, 64, 8, 2)),
        ("dv256_w8", s(64, 32, 64, 256, 64, 8, 2)),
        ("n16", s(64, 16, 64, 128, 64, 4, 2)),
        ("n64_w8", s(64, 64, 64, 128, 64, 8, 2)),
        ("s3", s(64, 32, 64, 128, 64, 4, 3)),
        ("dv256_w8_s3", s(64, 32, 64, 256, 64, 8, 3)),
        ("dv256_w8_s4", s(64, 32, 64, 256, 64, 8, 4)),
        ("whole_s2", s(64, 32, 512, 512, 64, 8, 2)),
        ("whole_s3", s(64, 32, 512, 512, 64, 8, 3)),
        ("whole_s4", s(64, 32, 512, 512, 64, 8, 4)),
        ("whole_n64", s(64, 64, 512, 512, 64, 8, 2)),
    ]


Maker = Callable[[AttentionSchedule], tuple[Callable[[], Any], torch.Tensor]]


def _case(name: str, kernel: Callable[..., Any], q: torch.Tensor, *args: Any) -> tuple[str, Maker]:
    """(name, make): make(sched) gives a call of ``kernel(q, *args, out, WINDOW, SCALE, sched)``
    writing a fresh ``out`` like q, and that out."""

    def make(sched: AttentionSchedule) -> tuple[Callable[[], Any], torch.Tensor]:
        out = torch.empty_like(q)
        return (lambda: kernel(q, *args, out, WINDOW, SCALE, sched)), out

    return name, make


def decode_case(B: int, g: torch.Generator) -> tuple[str, Maker]:
    q = torch.randn(B, H, DH, device="cuda", generator=g).to(BF16)
    kv = torch.randn(B, WINDOW, DH, device="cuda", generator=g).to(BF16)
    pos = torch.arange(WINDOW, device="cuda").repeat(B, 1)  # row p % C holds position p
    slots = torch.arange(B, device="cuda")
    q_pos = torch.full((B,), WINDOW - 1, device="cuda")
    sink = torch.randn(H, device="cuda", generator=g) * 2
    return _case(f"decode B {B}", sink_attention_cache_triton, q, q_pos, kv, pos, slots, sink)


def paged_case(B: int, g: torch.Generator) -> tuple[str, Maker]:
    """Decode rows against vLLM-style 16-row blocks, each row's window in its own 8 blocks."""
    BS = 16
    q = torch.randn(B, H, DH, device="cuda", generator=g).to(BF16)
    kv = torch.randn(B * WINDOW // BS, BS, DH, device="cuda", generator=g).to(BF16)
    pos = torch.arange(WINDOW, device="cuda", dtype=torch.int32).repeat(B).view(-1, BS)
    table = torch.arange(B * WINDOW // BS, device="cuda", dtype=torch.int32).view(B, -1)
    q_pos = torch.full((B,), WINDOW - 1, device="cuda")
    sink = torch.randn(H, device="cuda", generator=g) * 2
    return _case(f"paged B {B}", sink_attention_paged_triton, q, q_pos, kv, pos, table, sink)


def prefill_case(T: int, g: torch.Generator) -> tuple[str, Maker]:
    q = torch.randn(T, H, DH, device="cuda", generator=g).to(BF16)
    kv = torch.randn(T, DH, device="cuda", generator=g).to(BF16)
    pos = torch.arange(T, device="cuda")
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    sink = torch.randn(H, device="cuda", generator=g) * 2
    return _case(f"prefill T {T}", sink_attention_triton, q, pos, kv, pos, sink, cu, cu)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="", help="only these schedules (the default is kept)")
    p.add_argument("--decode", default="1,8,64", help="ring-cache decode row counts")
    p.add_argument("--paged", default="64", help="paged-cache decode row counts")
    p.add_argument("--prefill", default="512,4096", help="prefill lengths")
    a = p.parse_args()
    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = [decode_case(b, g) for b in ints(a.decode)] + [paged_case(b, g) for b in ints(a.paged)]
    cases += [prefill_case(t, g) for t in ints(a.prefill)]
    only = {"default", *a.only.split(",")} if a.only else None
    scheds = [(n, sc) for n, sc in schedules() if only is None or n in only]
    print("| schedule | " + " | ".join(name for name, _ in cases) + " |")
    print("|---|" + "---|" * len(cases))
    ref: dict[str, torch.Tensor] = {}
    for sname, sched in scheds:
        cells = []
        for cname, make in cases:
            try:
                run, out = make(sched)
                out.fill_(float("nan"))  # poisoned: a row the kernel skips shows
                run()
                torch.cuda.synchronize()
                if sname == "default":
                    ref[cname] = out.clone()
                    same = "="
                else:
                    same = (
                        "="
                        if torch.equal(out, ref[cname])
                        else (f"diff {float((out.float() - ref[cname].float()).abs().max()):.1e}")
                    )
                ok = bool(torch.isfinite(out).all())
                us = graph_time_us([run], 20, 10)
                cells.append(f"{us:.1f} ({same}{'' if ok else ', NON-FINITE'})")
            except Exception as exc:
                cells.append(f"failed: {type(exc).__name__}: {str(exc)[:80]}")
        print(f"| {sname} {sched.fields()} | " + " | ".join(cells) + " |", flush=True)
    print("us per call; (=) bitwise the default schedule's output, else the max abs difference")


if __name__ == "__main__":
    main()
