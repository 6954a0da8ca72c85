"""Time the fused mHC pairs against their two-op compositions at the small T of MTP's draft step.

    cd bench; python3 diag/hc_post_fused.py --out DIR [--tokens 1,8,32,64] [--widths 4096,7168]

Per (op, D, T), n = 4, bf16 activations, fp32 parameters, 20 Sinkhorn iterations:
``hc_post_pre`` (hc_post, then hc_pre) and ``hc_post_head`` (hc_post, then hc_head), each with
backend "composed" (the hc_post and second operators, each with its own "auto" choice: FlashInfer
mhc_post where it applies) and "triton_fma" (hc_post folded into the second op's small-batch mix
launch).  GPU time per call by CUDA-graph replay (``h200_mhc.graph_time_us``: >= 100 calls
walking through input sets that together exceed 2.2x the L2; median of 10 replays).  Then on one
input set the fused outputs against "composed" and against hc_post(backend="triton") followed by
the second op's "triton_fma" (``=`` where bitwise equal, else max |diff| / max |composed|), and
against the float64 reference under the registry's tolerance (``ok`` / ``OUT``).  Prints one table;
writes DIR/hc_post_fused.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h200_mhc import empty_kernel_us, graph_time_us, nbytes

import dsv4mtp.conformance.pairs  # noqa: F401  (declares the pairs REGISTRY holds)
import dsv4mtp.optimized as opt
import dsv4mtp.reference as ref
from dsv4mtp.conformance.differential import compare
from dsv4mtp.conformance.inputs import op_inputs
from dsv4mtp.conformance.registry import REGISTRY

OPS = ("hc_post_pre", "hc_post_head")
SECOND = {"hc_post_pre": "hc_pre", "hc_post_head": "hc_head"}


def _vs(got: tuple[torch.Tensor, ...], base: tuple[torch.Tensor, ...]) -> list[str]:
    """Per output: "=" if bitwise equal to ``base``, else max |diff| / max |base|."""
    cells = []
    for g, b in zip(got, base, strict=True):
        if torch.equal(g, b):
            cells.append("=")
        else:
            diff = (g.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)
            cells.append(f"{float(diff):.1e}")
    return cells


def _triton_chain(op: str, args: tuple[torch.Tensor, ...], kw: dict[str, Any]):
    """hc_post (Triton) then the second op's "triton_fma": what "triton_fma" must equal."""
    f, x, post, comb, *params = args
    x_new = opt.hc_post(f, x, post, comb, backend="triton")
    second = getattr(opt, SECOND[op])(x_new, *params, **kw, backend="triton_fma")
    return (x_new, *(second if isinstance(second, tuple) else (second,)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--tokens", default="1,8,32,64")
    p.add_argument("--widths", default="4096,7168")
    a = p.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    l2 = int(torch.cuda.get_device_properties(0).L2_cache_size)
    empty = empty_kernel_us()
    rows: list[dict[str, Any]] = []
    print(f"empty Triton kernel {empty:.2f} us (graph replay); L2 {l2 / 2**20:.0f} MiB")
    for op in OPS:
        tol = REGISTRY[op].tolerance(torch.bfloat16)
        fn = getattr(opt, op)
        for D in map(int, a.widths.split(",")):
            for T in map(int, a.tokens.split(",")):
                probe, kw = op_inputs(op, T, D, seed=T)
                R = max(2, math.ceil(2.2 * l2 / nbytes(probe)))
                sets = [probe] + [op_inputs(op, T, D, seed=T + 1000 * i)[0] for i in range(1, R)]
                oracle = getattr(ref, op)(*(t.double() for t in probe), **kw)
                got: dict[str, tuple[torch.Tensor, ...]] = {}
                for b in ("composed", "triton_fma"):
                    row: dict[str, Any] = dict(op=op, D=D, T=T, backend=b)
                    got[b] = tuple(fn(*probe, **kw, backend=b))
                    outs = tuple(torch.empty_like(t) for t in got[b])
                    calls = [
                        lambda s=s, o=outs, b=b, f=fn, k=kw: f(*s, **k, backend=b, out=o)
                        for s in sets
                    ]
                    row["time_us"] = round(graph_time_us(calls, max(R, 100), 10), 3)
                    reps = [compare(g, o) for g, o in zip(got[b], oracle, strict=True)]
                    row["vs_f64"] = ["ok" if r.within(tol) else "OUT" for r in reps]
                    row["vs_composed"] = _vs(got[b], got["composed"])
                    row["vs_triton_chain"] = _vs(got[b], _triton_chain(op, probe, kw))
                    rows.append(row)
                    print(
                        f"{op:12s} D={D:5d} T={T:4d} {b:10s} {row['time_us']:8.2f} us  "
                        f"vs composed {row['vs_composed']}  vs triton chain "
                        f"{row['vs_triton_chain']}  vs f64 {row['vs_f64']}",
                        flush=True,
                    )
                del sets, probe, oracle
                torch.cuda.empty_cache()
    print("\n| op | D | T | composed us | triton_fma us | fused vs composed | fused vs f64 |")
    print("|---|---|---|---|---|---|---|")
    for op, D, T in dict.fromkeys((r["op"], r["D"], r["T"]) for r in rows):
        c, f = (
            next(r for r in rows if (r["op"], r["D"], r["T"], r["backend"]) == (op, D, T, b))
            for b in ("composed", "triton_fma")
        )
        print(
            f"| {op} | {D} | {T} | {c['time_us']:.2f} | {f['time_us']:.2f} | "
            f"{'/'.join(f['vs_composed'])} | {'/'.join(f['vs_f64'])} |"
        )
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        meta = dict(command="python " + " ".join(sys.argv), empty_us=empty, l2=l2,
                    gpu=torch.cuda.get_device_name(0), torch=torch.__version__)  # fmt: skip
        (a.out / "hc_post_fused.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
