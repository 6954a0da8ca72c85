"""The one tester every op pair runs through (TileKernels style: data builder + one tester).

For a drawn :class:`~conformance.registry.Case` it runs

1. the reference on the inputs promoted to float64: the oracle;
2. the reference in the test dtype: the shapes and dtypes the op must return;
3. the implementation under test, with its outputs preallocated and poisoned with NaN (or
   the dtype's max for integers, True for flags) when the op takes ``out=``, so a kernel that
   skips an element cannot pass by reading stale memory;

and compares each output with the oracle by ||out-ref||/||ref|| and scaled max-abs.  NaN never
passes.  Each comparison is recorded so the session summary can print the worst error seen per
op, dtype and preset next to its tolerance.  The contract (``conformance/test_contract.py``)
calls it on every drawn case of every backend.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dsv4mtp.conformance.registry import Case, OpPair, Tolerance

__all__ = [
    "SUMMARY",
    "ErrorReport",
    "check_pair",
    "compare",
    "poisoned_like",
    "reference_outputs",
    "to_float64",
]


@dataclass
class ErrorReport:
    rel: float
    max_abs: float  # max|out-ref| / max(max|ref|, 1e-30)
    nan: int

    def within(self, tol: Tolerance, own: ErrorReport | None = None) -> bool:
        """Within ``tol``; with ``own`` (the reference-in-dtype's report on the same case) and
        ``tol.own_factor`` set, bounds of ``own_factor`` times ``own``'s errors pass too."""
        rel, max_abs = tol.rel, tol.max_abs
        if own is not None and tol.own_factor > 0 and own.nan == 0:
            rel = max(rel, tol.own_factor * own.rel)
            max_abs = max(max_abs, tol.own_factor * own.max_abs)
        return self.nan == 0 and self.rel <= rel and self.max_abs <= max_abs


# (op, dtype, preset, output) -> [examples, worst rel, worst scaled max-abs, examples that
# passed only through Tolerance.own_factor]
SUMMARY: dict[tuple[str, str, str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0])


def to_float64(obj: Any) -> Any:
    """Floating tensors -> float64 (integers, bools and non-tensors untouched), recursively."""
    if isinstance(obj, torch.Tensor):
        return obj.to(torch.float64) if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_float64(o) for o in obj)
    if isinstance(obj, dict):
        return {k: to_float64(v) for k, v in obj.items()}
    return obj


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def compare(out: torch.Tensor, ref: torch.Tensor) -> ErrorReport:
    """Relative Frobenius error and scaled max-abs error of ``out`` against ``ref`` (float64)."""
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    nan = int(torch.isnan(o).sum()) + int(torch.isinf(o).sum())
    if o.numel() == 0:
        return ErrorReport(0.0, 0.0, nan)
    diff = torch.nan_to_num(o - r, nan=float("inf"))
    ref_norm = float(torch.linalg.vector_norm(r))
    diff_norm = float(torch.linalg.vector_norm(diff))
    rel = diff_norm / ref_norm if ref_norm > 0 else (0.0 if diff_norm == 0 else float("inf"))
    scale = max(float(r.abs().max()), 1e-30)
    return ErrorReport(rel, float(diff.abs().max()) / scale, nan)


def reference_outputs(
    pair: OpPair, case: Case
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The pair's reference on ``case`` as (oracle, expected): run on the inputs promoted to
    float64, and in the test dtype; each a tuple of outputs."""
    ref_fn = pair.reference_fn()
    oracle = _as_tuple(ref_fn(*to_float64(case.args), **to_float64(case.kwargs)))
    return oracle, _as_tuple(ref_fn(*case.args, **case.kwargs))


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return torch.full_like(t, float("nan"))
    if t.dtype == torch.bool:  # True: a flag left unwritten reads as the permissive answer
        return torch.ones_like(t)
    return torch.full_like(t, torch.iinfo(t.dtype).max)


def check_pair(
    pair: OpPair,
    case: Case,
    dtype: torch.dtype,
    *,
    preset: str = "math",
    impl: Callable[..., Any] | None = None,
    poison: bool = True,
    extra: dict[str, Any] | None = None,
) -> dict[str, ErrorReport]:
    """Run ``impl`` (default: the pair's optimized op, with the keyword arguments ``extra``,
    e.g. ``backend=``) on ``case`` and assert conformance under the (dtype, preset) tolerance."""
    tol = pair.tolerance(dtype, preset)
    under_test = impl if impl is not None else pair.optimized_fn()
    oracle, expected = reference_outputs(pair, case)

    args, kwargs = case.args, dict(case.kwargs)
    if impl is None:
        args, kwargs = pair.optimized_call(args, kwargs)
        kwargs = {**kwargs, **(extra or {})}
    dtypes = [pair.result_dtype(i, e.dtype) for i, e in enumerate(expected)]
    buffers: tuple[torch.Tensor, ...] = ()
    if poison and impl is None and pair.out_kwarg:
        buffers = tuple(poisoned_like(e.to(d)) for e, d in zip(expected, dtypes, strict=True))
        kwargs[pair.out_kwarg] = buffers if len(buffers) > 1 else buffers[0]
    got = _as_tuple(under_test(*args, **kwargs))

    assert len(got) == len(pair.outputs), (
        f"{pair.name}: expected {len(pair.outputs)} outputs {pair.outputs}, got {len(got)}"
    )
    dt = str(dtype).removeprefix("torch.")
    for i, name in enumerate(pair.outputs):
        g, e = got[i], expected[i]
        assert tuple(g.shape) == tuple(e.shape), (
            f"{pair.name}.{name}: shape {tuple(g.shape)} != reference {tuple(e.shape)} [{case.label}]"
        )
        assert g.dtype == dtypes[i], (
            f"{pair.name}.{name}: dtype {g.dtype} != expected {dtypes[i]} [{case.label}]"
        )
        if buffers:
            assert g.data_ptr() == buffers[i].data_ptr() or g.numel() == 0, (
                f"{pair.name}.{name}: result was not written into the provided out= buffer"
            )
    note = ""
    mine = expected  # the reference in dtype, judged like the output when tol.own_factor is set
    if pair.canonical is not None:
        if tol.own_factor > 0:
            mine = pair.canonical(case, expected, oracle)[0]
        got, oracle, note = pair.canonical(case, got, oracle)
    label = f"{case.label}; {note}" if note else case.label
    reports: dict[str, ErrorReport] = {}
    failures = []
    for i, name in enumerate(pair.outputs):
        g, o = got[i], oracle[i]
        if name in pair.exact:
            differ = int((g.long().cpu() != o.long().cpu()).any(-1).sum()) if g.numel() else 0
            assert differ == 0, (
                f"{pair.name}.{name} [{dt}, preset {preset}; {label}]: {differ} rows differ "
                f"from the float64 reference (compared exactly)"
            )
            continue
        rep = compare(g, o)
        reports[name] = rep
        own = compare(mine[i], o) if tol.own_factor > 0 else None
        entry = SUMMARY[(pair.name, dt, preset, name)]
        entry[0] += 1
        entry[1] = max(entry[1], rep.rel)
        entry[2] = max(entry[2], rep.max_abs)
        if own is not None and rep.within(tol, own) and not rep.within(tol):
            entry[3] += 1
        if not rep.within(tol, own):
            own_note = (
                f"; the reference in {dt}: rel={own.rel:.3e}, max_abs={own.max_abs:.3e} "
                f"(x{tol.own_factor:g} also passes)"
                if own is not None
                else ""
            )
            failures.append(
                f"{name}: rel={rep.rel:.3e} (tol {tol.rel:.1e}), max_abs={rep.max_abs:.3e} "
                f"(tol {tol.max_abs:.1e}), non-finite={rep.nan}{own_note}"
            )
    via = "" if impl is not None else "".join(f" {k}={v}" for k, v in (extra or {}).items())
    assert not failures, (
        f"{pair.name}{via} [{dt}, preset {preset}; {label}] exceeds tolerance "
        f"({tol.why}):\n  " + "\n  ".join(failures)
    )
    return reports
