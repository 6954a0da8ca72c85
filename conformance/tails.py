"""How close each pair's reference, run in the test dtype, comes to the pair's declared tolerance.

The contract (``test_contract.py``) draws a few cases per run and CI does not derandomize, so a
tolerance set near the tail of the error distribution fails now and then on a correct kernel.
The reference run in the test dtype is the natural yardstick of that tail (an implementation
rounds at similar points), and it is cheap: no kernel, no interpreter.  For each declared
(op, dtype, preset) this draws ``n`` cases from the pair's CPU strategy and reports the worst
``max(rel / tol.rel, max_abs / tol.max_abs)`` of the reference in dtype against float64, after
the pair's ``canonical`` (near-tie rows excused as in the contract)::

    python -m dsv4mtp.conformance.tails 2000            # every pair, 2000 draws each
    python -m dsv4mtp.conformance.tails 2000 linear moe # some pairs

A ratio near or above 1 says the tolerance sits in the reference's own tail: widen it with the
measured reason, or (act_quant flips inside the op) set ``Tolerance.own_factor``.
``test_registry.py`` runs a derandomized 40 draws of every pair and requires a ratio <= 1 for
pairs without ``own_factor``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dsv4mtp.conformance.pairs  # noqa: F401  (declares the pairs)
from dsv4mtp.conformance.contract import MAX_TOKENS
from dsv4mtp.conformance.differential import compare, reference_outputs
from dsv4mtp.conformance.registry import REGISTRY, Case, OpPair

__all__ = ["Tail", "own_error_tail"]


@dataclass
class Tail:
    """The worst draw of one (op, dtype, preset): ratio to the tolerance and its errors."""

    op: str
    dtype: torch.dtype
    preset: str
    draws: int = 0
    ratio: float = 0.0
    rel: float = 0.0
    max_abs: float = 0.0
    label: str = ""


def own_error_tail(
    pair: OpPair, dtype: torch.dtype, preset: str, n: int, *, derandomize: bool = False
) -> Tail:
    """The reference in ``dtype`` against float64 over ``n`` drawn CPU cases of ``pair``."""
    tol = pair.tolerance(dtype, preset)
    tail = Tail(pair.name, dtype, preset)

    @settings(
        max_examples=n, database=None, deadline=None, derandomize=derandomize,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(data=st.data())
    def draw(data: Any) -> None:
        drawn = data.draw(pair.strategy(dtype, "cpu", MAX_TOKENS["cpu"]))
        case = Case(drawn.args, {**drawn.kwargs, **pair.preset_kwargs(preset)}, drawn.label)
        oracle, mine = reference_outputs(pair, case)
        if pair.canonical is not None:
            mine, oracle, _ = pair.canonical(case, mine, oracle)
        tail.draws += 1
        for i, name in enumerate(pair.outputs):
            if name in pair.exact:
                continue
            rep = compare(mine[i], oracle[i])
            ratio = max(rep.rel / tol.rel, rep.max_abs / tol.max_abs)
            if ratio > tail.ratio:
                tail.ratio, tail.rel, tail.max_abs = ratio, rep.rel, rep.max_abs
                tail.label = f"{name}: {case.label}"

    draw()
    return tail


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "n", type=int, nargs="?", default=1000, help="draws per (op, dtype, preset)"
    )
    parser.add_argument("ops", nargs="*", help="pairs to measure (default: all)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")  # interpreter-free, but the reference warns on empty T
    print(f"{'op':<24}{'dtype':<10}{'preset':<9}{'draws':>6}{'worst/tol':>10}{'rel':>10}"
          f"{'max_abs':>10}{'own x':>6}{'s':>6}  worst case")  # fmt: skip
    for name, pair in REGISTRY.items():
        if args.ops and name not in args.ops:
            continue
        for (dtype, preset), tol in pair.tolerances.items():
            t0 = time.perf_counter()
            t = own_error_tail(pair, dtype, preset, args.n)
            dt = str(dtype).removeprefix("torch.")
            own = f"{tol.own_factor:g}" if tol.own_factor else "-"
            print(
                f"{name:<24}{dt:<10}{preset:<9}{t.draws:>6}{t.ratio:>10.2f}{t.rel:>10.2e}"
                f"{t.max_abs:>10.2e}{own:>6}{time.perf_counter() - t0:>6.1f}  {t.label}",
                flush=True,
            )


if __name__ == "__main__":
    main()
