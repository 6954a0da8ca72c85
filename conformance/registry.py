"""The op-pair registry: every optimized public op, declared once against its reference.

An :class:`OpPair` names the op, the reference and optimized callables (as import paths, resolved
lazily so a missing optimized module is a test failure, not an import error at collection), a
hypothesis strategy that draws one valid :class:`Case`, and a :class:`Tolerance` per input dtype
with the reason for it.  Pairs are declared in ``conformance/pairs.py`` (one block per concept);
``conformance/test_<concept>.py`` runs them through :func:`conformance.differential.check_pair`, and
``conformance/test_registry.py`` fails when an optimized op has no pair or a pair has no test.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st

__all__ = ["REGISTRY", "Case", "OpPair", "Tolerance", "pairs_for", "register", "resolve"]


@dataclass(frozen=True)
class Tolerance:
    """Acceptance bounds against the float64 oracle.

    rel: bound on ||out - ref|| / ||ref|| (Frobenius norms over the whole output).
    max_abs: bound on max|out - ref| / max(max|ref|, 1e-30), i.e. the worst element measured in
        units of the output's own scale, so one bound serves inputs of any magnitude.
    why: the reason for the numbers; shown in failure messages and the closing report.
    """

    rel: float
    max_abs: float
    why: str


@dataclass
class Case:
    """One drawn input: positional tensors and keyword arguments for both implementations.

    ``label`` summarises the shapes for failure messages.  ``outputs`` optionally names the
    outputs (e.g. ``("layer_input", "post", "comb")``) for per-output error reports.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    label: str = ""


@dataclass(frozen=True)
class OpPair:
    """One public op: reference vs optimized.

    name: the public name, the same in ``dsv4mtp.reference`` and ``dsv4mtp.optimized``.
    concept: the file stem shared by reference/, optimized/ and conformance/test_<concept>.py.
    strategy: ``(dtype, device, max_tokens) -> SearchStrategy[Case]``.
    tolerances: per input dtype; dtypes absent here are not tested for this op.
    outputs: names of the outputs (a 1-tuple for single-tensor ops).
    out_kwarg: the optimized op accepts preallocated outputs under this keyword, which the tester
        fills with NaN before the call (poisoning) and checks were written in place.
    """

    name: str
    concept: str
    strategy: Callable[[torch.dtype, str, int], st.SearchStrategy[Case]]
    tolerances: dict[torch.dtype, Tolerance]
    outputs: tuple[str, ...] = ("out",)
    reference: str = ""
    optimized: str = ""
    out_kwarg: str | None = "out"

    def reference_fn(self) -> Callable[..., Any]:
        return resolve(self.reference or f"dsv4mtp.reference:{self.name}")

    def optimized_fn(self) -> Callable[..., Any]:
        return resolve(self.optimized or f"dsv4mtp.optimized:{self.name}")


REGISTRY: dict[str, OpPair] = {}


def register(pair: OpPair) -> OpPair:
    if pair.name in REGISTRY:
        raise ValueError(f"op pair {pair.name!r} registered twice")
    REGISTRY[pair.name] = pair
    return pair


def pairs_for(concept: str) -> list[OpPair]:
    import dsv4mtp.conformance.pairs  # noqa: F401  (declares the pairs)

    return [p for p in REGISTRY.values() if p.concept == concept]


def resolve(path: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the callable."""
    module, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"expected 'module:function', got {path!r}")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
