"""The op contract, generated: every (op, backend, dtype, preset) the registry and the dispatch
tables declare, as the parameters of ``conformance/test_contract.py``.

An op's backends are ``optimized._dispatch.backend_names(op)``, so adding a backend to an op is
one ``Backend(...)`` line in ``optimized/_dispatch.py`` plus its kernel: its contract tests
appear here with no conformance edit.  Whether a backend applies is the dispatch table's own
``requirement`` on the facts of a case (:meth:`OpPair.requirement`): a combination that cannot
run on this machine (FlashInfer without CUDA, FlashInfer on fp32 inputs) is skipped with that
reason, never passed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from dsv4mtp.conformance.registry import DEFAULT_BACKEND, REGISTRY, Case, OpPair

__all__ = ["IMPL_BACKEND", "KINDS", "MAX_TOKENS", "Contract", "contracts"]

#: The backend id of ``--impl``: a third-party implementation replaces every backend of its op.
IMPL_BACKEND = "impl"
#: The largest T of a drawn differential case, per device type: small on the CPU (the interpreter).
MAX_TOKENS = {"cpu": 33, "cuda": 8192}

#: What each generated test is parametrized over: "case" is every (backend, dtype, preset);
#: "backend" one call per backend (the op's first dtype, the math preset).
KINDS = ("case", "backend")


def _cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


@dataclass(frozen=True)
class Contract:
    """One (op, backend, dtype, preset) of the contract and how to call it."""

    pair: OpPair
    backend: str
    dtype: torch.dtype
    preset: str = "math"

    @property
    def id(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return f"{self.pair.name}-{self.backend}-{dt}-{self.preset}"

    def backend_kwargs(self) -> dict[str, Any]:
        if self.backend in (DEFAULT_BACKEND, IMPL_BACKEND):
            return {}
        return {"backend": self.backend}

    def with_preset(self, case: Case) -> Case:
        return Case(case.args, {**case.kwargs, **self.pair.preset_kwargs(self.preset)}, case.label)

    def case(self, T: int, device: str, seed: int, D: int | None = None) -> Case:
        """A deterministic call from the shared builder; D defaults to a V4 width on CUDA and
        an interpreter-sized one on CPU."""
        D = D if D is not None else (4096 if _cuda(device) else self.pair.cpu_D)
        args, kw = self.pair.build(T, D, self.dtype, device, seed)
        return self.with_preset(Case(args, kw, label=f"T={T} D={D} seed={seed}"))

    def run(self, case: Case, **extra: Any) -> tuple[torch.Tensor, ...]:
        """The optimized op on ``case`` through this backend; outputs as a tuple."""
        fn = self.pair.optimized_fn()
        args, kwargs = self.pair.optimized_call(case.args, case.kwargs)
        out = fn(*args, **kwargs, **self.backend_kwargs(), **extra)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def reference(self, case: Case) -> tuple[torch.Tensor, ...]:
        out = self.pair.reference_fn()(*case.args, **case.kwargs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def skip_reason(self, device: str) -> str | None:
        """Why this combination cannot run on ``device`` (its backend's requirement on a
        one-token case of the shared builder), or None."""
        if self.backend == IMPL_BACKEND:
            return None
        reason = self.pair.requirement(self.backend, self.case(1, device, seed=0))
        if reason is None:
            return None
        dt = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.pair.name} backend {self.backend!r} does not apply to {dt} "
            f"(preset {self.preset}) on {device}: it {reason}"
        )


def contracts(kind: str, impl_ops: Iterable[str] = ()) -> list[Contract]:
    """Every contract of ``kind`` (:data:`KINDS`) over the registry.  Ops in ``impl_ops`` (the
    ``--impl`` overrides) get one :data:`IMPL_BACKEND` entry per (dtype, preset) instead of their
    backends."""
    import dsv4mtp.conformance.pairs  # noqa: F401  (declares the pairs)

    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    impl = set(impl_ops)
    out: list[Contract] = []
    for pair in REGISTRY.values():
        backends = (IMPL_BACKEND,) if pair.name in impl else pair.backends()
        for backend in backends:
            if kind == "backend":
                out.append(Contract(pair, backend, pair.dtypes()[0]))
                continue
            out.extend(Contract(pair, backend, dt, preset) for dt, preset in pair.tolerances)
    return out
