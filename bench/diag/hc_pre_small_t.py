"""Time hc_pre's backends at the small T of MTP's draft step and check them against "triton".

    cd bench; python3 diag/hc_pre_small_t.py --out DIR [--tokens 1,2,4] [--widths 4096]
        [--backends triton,triton_fma,flashinfer] [--fma-tiles '[[8, 8, 64, 2, 4, 256, 4]]']
        [--sinkhorn-iters N]

Per (D, T), n = 4, bf16 x, fp32 parameters, 20 Sinkhorn iterations (``--sinkhorn-iters``:
another count, to see what the Sinkhorn's dependent chain costs): GPU time per call of each
backend (and, with ``--fma-tiles``, of the FMA kernel at each other schedule: PreFmaConfig
7-tuples, named ``fma:<tuple>``) by CUDA-graph replay (``h200_mhc.graph_time_us``: a graph of
>= 100 calls walking through input sets, parameters included, that together exceed 2.2x the
L2, so fn comes from HBM as in a draft step whose other weights evict it; median of 10
replays), then each backend's outputs (layer_input, post, comb) against the first backend's
(the first that ran: "triton" by default; JSON ``vs_first`` / ``vs_backend``) on one input
set: ``=`` where bitwise equal, else max |diff| / max |first|, and against the float64
reference under the registry's tolerance (``ok`` / ``OUT``).  The public "triton_fma" runs the
default of the call's T (``batch_invariant=False``: its token block follows T below 16); a
``fma:<tuple>`` runs exactly that schedule.  A backend that does not apply (FlashInfer missing)
or fails is reported and skipped.  Prints one table; writes DIR/hc_pre_small_t.json.  About a
minute on the H200, most of it compiling the kernels for the two widths.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h200_mhc import empty_kernel_us, graph_time_us, min_bytes, nbytes

import dsv4mtp.conformance.pairs  # noqa: F401  (declares the pairs REGISTRY holds)
import dsv4mtp.optimized as opt
import dsv4mtp.reference as ref
from dsv4mtp.conformance.differential import compare
from dsv4mtp.conformance.inputs import op_inputs
from dsv4mtp.conformance.registry import REGISTRY
from dsv4mtp.optimized.kernels.mhc_pre_small import PreFmaConfig, mhc_pre_fma


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


def _runner(backend: str, cfg: PreFmaConfig | None, kw: dict):
    """``run(inputs, outs)``: the public hc_pre with ``backend``, or (``cfg``) the FMA kernel at
    that schedule; ``outs`` None allocates them.  Returns (layer_input, post, comb)."""

    def run(s, outs):
        if cfg is None:
            return tuple(opt.hc_pre(*s, **kw, backend=backend, out=outs))
        x = s[0]
        T, n, D = x.shape
        if outs is None:
            f32 = torch.float32
            outs = (x.new_empty((T, D)), x.new_empty((T, n), dtype=f32),
                    x.new_empty((T, n, n), dtype=f32))  # fmt: skip
        mhc_pre_fma(*s, *outs, cfg=cfg, **kw)
        return outs

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--tokens", default="1,2,4,8,16,32,64,128")
    p.add_argument("--widths", default="4096,7168")
    p.add_argument("--backends", default="triton,triton_fma,flashinfer")
    p.add_argument("--fma-tiles", default="[]", help="JSON list of PreFmaConfig 7-tuples")
    p.add_argument("--sinkhorn-iters", type=int, default=None, help="instead of the inputs' 20")
    a = p.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    l2 = int(torch.cuda.get_device_properties(0).L2_cache_size)
    empty = empty_kernel_us()
    tol = REGISTRY["hc_pre"].tolerance(torch.bfloat16)
    backends = a.backends.split(",")
    tiles = {"fma:" + ",".join(map(str, t)): PreFmaConfig(*t) for t in json.loads(a.fma_tiles)}
    backends += list(tiles)
    rows: list[dict] = []
    print(f"empty Triton kernel {empty:.2f} us (graph replay); L2 {l2 / 2**20:.0f} MiB")
    for D in map(int, a.widths.split(",")):
        for T in map(int, a.tokens.split(",")):
            probe, kw = op_inputs("hc_pre", T, D, seed=T)
            if a.sinkhorn_iters is not None:
                kw = {**kw, "sinkhorn_iters": a.sinkhorn_iters}
            R = max(2, math.ceil(2.2 * l2 / nbytes(probe)))
            sets = [probe] + [op_inputs("hc_pre", T, D, seed=T + 1000 * i)[0] for i in range(1, R)]
            oracle = ref.hc_pre(*(t.double() for t in probe), **kw)
            base: tuple[torch.Tensor, ...] | None = None
            base_name = ""
            for b in backends:
                row: dict = dict(D=D, T=T, backend=b, min_bytes=min_bytes("hc_pre", T, D))
                try:
                    run = _runner(b, tiles.get(b), kw)
                    got = run(probe, None)
                    outs = tuple(torch.empty_like(t) for t in got)
                    calls = [lambda s=s, o=outs, r=run: r(s, o) for s in sets]
                    row["time_us"] = round(graph_time_us(calls, max(R, 100), 10), 3)
                except Exception as e:  # a backend that does not apply or fails: reported
                    row["error"] = f"{type(e).__name__}: {e}"[:200]
                    print(f"D={D} T={T} {b}: {row['error']}", flush=True)
                    rows.append(row)
                    continue
                if base is None:  # the first backend that ran: the comparisons' reference
                    base, base_name = got, b
                row["vs_first"] = _vs(got, base)
                row["vs_backend"] = base_name
                reps = [compare(g, o) for g, o in zip(got, oracle, strict=True)]
                row["vs_f64"] = ["ok" if r.within(tol) else "OUT" for r in reps]
                row["vs_f64_detail"] = [str(r) for r in reps]
                rows.append(row)
                print(
                    f"D={D:5d} T={T:4d} {b:11s} {row['time_us']:8.2f} us  "
                    f"vs {base_name} {row['vs_first']}  vs f64 {row['vs_f64']}",
                    flush=True,
                )
            del sets, probe, oracle
            torch.cuda.empty_cache()
    print("\n| D | T | " + " | ".join(backends) + " |\n|---|---|" + "---|" * len(backends))
    for D, T in dict.fromkeys((r["D"], r["T"]) for r in rows):
        cells = []
        for b in backends:
            r = next(r for r in rows if (r["D"], r["T"], r["backend"]) == (D, T, b))
            cells.append(
                "fail"
                if "time_us" not in r
                else f"{r['time_us']:.2f} ({'/'.join(r['vs_first'])}; {'/'.join(r['vs_f64'])})"
            )
        print(f"| {D} | {T} | " + " | ".join(cells) + " |")
    print(
        "\ncells: us per call (layer_input/post/comb vs the first backend that ran in each row "
        "(JSON: vs_backend): '=' bitwise, else scaled max diff;"
    )
    print("vs the float64 reference under the registry's bf16 tolerance)")
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        meta = dict(command="python " + " ".join(sys.argv), empty_us=empty, l2=l2,
                    gpu=torch.cuda.get_device_name(0), torch=torch.__version__)  # fmt: skip
        (a.out / "hc_pre_small_t.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
