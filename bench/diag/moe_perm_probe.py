"""Where does the reference MoE's output depend on a token's position in the batch?

Replays a token permutation (default: seed 255, T 3, the case that failed the bitwise form of
conformance/test_moe.py::test_tokens_are_independent on the H200 host, AVX-512 + torch 2.11)
and reports, stage by stage, whether permuting the input permutes the result bit for bit:
the gate matmul, the routing (ids, weights), the shared expert, the whole MoE; at 1 thread and
at all threads.  Runs on any CPU:

    python bench/diag/moe_perm_probe.py [--seed 255] [--tokens 3]

On the H200 host it printed: gate matmul equal, ids equal, weights NOT equal (1.4e-14), shared
expert equal -- softplus's exp / log1p, whose SIMD body and scalar tail differ in the last ulp.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from conformance.test_moe import CFG, cast_params, make
from dsv4mtp.reference.linear import rowwise_matmul
from dsv4mtp.reference.moe import moe, route, swiglu_expert


def max_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"equal={torch.equal(a, b)} max|diff|={float((a - b).abs().max()):.3g}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=255)
    p.add_argument("--tokens", type=int, default=3)
    a = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")  # fmt: skip
    x, params = make(a.seed, a.tokens, x_gain=4.0)
    perm = torch.randperm(a.tokens, generator=torch.Generator().manual_seed(a.seed))
    pd, xd = cast_params(params, torch.float64), x.to(torch.float64)
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        got, want = moe(xd[perm], pd, CFG), moe(xd, pd, CFG)[perm]
        print(f"moe, {threads} thread(s): {max_diff(got, want)}")
    w_t = pd.gate_weight.T.contiguous()
    print("gate matmul:", max_diff(rowwise_matmul(xd[perm], w_t), rowwise_matmul(xd, w_t)[perm]))
    w_p, ids_p = route(xd[perm], pd.gate_weight, pd.gate_bias, CFG)
    w, ids = route(xd, pd.gate_weight, pd.gate_bias, CFG)
    print(f"route ids equal={torch.equal(ids_p, ids[perm])}; weights: {max_diff(w_p, w[perm])}")
    shared = (pd.shared_w1, pd.shared_w3, pd.shared_w2)
    s_p = swiglu_expert(xd[perm], *shared, limit=CFG.swiglu_limit)
    s = swiglu_expert(xd, *shared, limit=CFG.swiglu_limit)[perm]
    print("shared expert:", max_diff(s_p, s))


if __name__ == "__main__":
    main()
