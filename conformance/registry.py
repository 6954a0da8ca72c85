"""The op-pair registry: every optimized public op, declared once against its reference.

An :class:`OpPair` names the op, the reference and optimized callables (as import paths, resolved
lazily so a missing optimized module is a test failure, not an import error at collection), a
hypothesis strategy that draws one valid :class:`Case`, the builder of one deterministic call
(``conformance/inputs.py``, shared with the GPU tests and bench/), how to read the dispatch
:class:`~dsv4mtp.optimized._dispatch.Facts` off a case, and a :class:`Tolerance` per input dtype
and semantics preset with the reason for it.  Pairs are declared in ``conformance/pairs.py``.

The op's backends are not declared here: they are ``optimized._dispatch.backend_names(op)``.
``conformance/contract.py`` crosses every pair with its backends and declared (dtype, preset)
keys, and ``conformance/test_contract.py`` runs the same contract on each: differential against
the float64 reference, T = 0, ``out=`` with poisoned buffers, batch invariance (bitwise), CUDA
graph replay equal to eager (bitwise, gpu) and a typed error.  So a new backend is one
``Backend(...)`` line in ``optimized/_dispatch.py`` plus its kernel, and its contract tests
appear with no edit here.  ``conformance/test_registry.py`` fails when an optimized op has no pair
or a contract combination has no collected test.

Comparison.  Under the ``math`` preset (exact math on dequantized weights; the only preset the
four current ops distinguish, rms_norm's norm order aside) an output is judged against the
float64 oracle by two norms: ||out - ref|| / ||ref|| and the worst element in units of the
output's own scale (:class:`Tolerance`).  Presets with ``act_quant`` (``official``, ``vllm``)
quantize activations to e4m3 inside the op: a one-ulp difference upstream of a quantizer (an
fp32 sum in another order) can move a value across an e4m3 rounding boundary and change that
element by a whole e4m3 step (2^-3 relative), which no small norm bound admits and a norm bound
loose enough to admit it would hide real bugs.  A pair that declares an act_quant preset compares
those outputs in two parts instead: (1) the elements whose quantized upstream value equals the
oracle's quantized value must meet the math tolerance; (2) the elements that differ must differ
by exactly one e4m3 step of the upstream value (never more) and be few: their count is bounded
by ``Tolerance.step_flips`` times the number of elements, a bound the pair justifies in ``why``
from the upstream error and the density of rounding boundaries it crosses.  A flip larger than
one step, or more flips than that, fails.

Where the quantizer sits inside the op (the MoE's hidden activation before ``w2``), a flip moves
a whole output row through the next product and no element shows it.  The norm error is then a
sum over few random flips, heavy-tailed when few rows and experts contribute (the CPU tier's
T <= 12), so a fixed bound that admits the tail would hide real bugs elsewhere.  Such a pair sets
``Tolerance.own_factor``: an output passes within the declared bounds, or within ``own_factor``
times the errors of the reference itself run in the test dtype on the same case (which flips
the same density of boundaries; the criterion FlashAttention's tests use).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from hypothesis import strategies as st

if TYPE_CHECKING:
    from dsv4mtp.optimized._dispatch import Facts
    from dsv4mtp.semantics import Semantics

__all__ = [
    "DEFAULT_BACKEND",
    "REGISTRY",
    "Case",
    "OpPair",
    "Tolerance",
    "pairs_for",
    "register",
    "resolve",
]

#: The backend name of an op without a dispatch table: called without ``backend=``.
DEFAULT_BACKEND = "default"


@dataclass(frozen=True)
class Tolerance:
    """Acceptance bounds against the float64 oracle.

    rel: bound on ||out - ref|| / ||ref|| (Frobenius norms over the whole output).
    max_abs: bound on max|out - ref| / max(max|ref|, 1e-30), i.e. the worst element measured in
        units of the output's own scale, so one bound serves inputs of any magnitude.
    why: the reason for the numbers; shown in failure messages and the closing report.
    step_flips: act_quant presets only (module docstring): the largest fraction of elements
        allowed to differ by exactly one e4m3 step of their quantized upstream value.
    own_factor: act_quant presets only, for flips no output element shows (module docstring):
        an output also passes when its rel and scaled max-abs errors are within this many times
        those of the reference run in the test dtype on the same case.  0: off.
    """

    rel: float
    max_abs: float
    why: str
    step_flips: float = 0.0
    own_factor: float = 0.0


@dataclass
class Case:
    """One drawn input: positional tensors and keyword arguments for both implementations.

    ``label`` summarises the shapes for failure messages.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    label: str = ""


# (case, got, oracle) -> (got, oracle, note); see OpPair.canonical.
Canonical = Callable[
    [Case, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
    tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], str],
]
ArgsMap = Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]

# (T, D, dtype, device, seed) -> (args, kwargs); see conformance/inputs.py.
Builder = Callable[[int, int, torch.dtype, str, int], tuple[tuple[Any, ...], dict[str, Any]]]


def _no_switches(semantics: Semantics) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class OpPair:
    """One public op: reference vs optimized.

    name: the public name, the same in ``dsv4mtp.reference`` and ``dsv4mtp.optimized``.
    concept: the file stem shared by reference/, optimized/ and conformance/test_<concept>.py
        (which holds the op's reference properties and kernel-specific tests).
    strategy: ``(dtype, device, max_tokens) -> SearchStrategy[Case]``.
    build: one deterministic call, ``(T, D, dtype, device, seed) -> (args, kwargs)``.
    facts: the dispatch facts of a case (what ``optimized._dispatch.requirement`` reads), built
        the way the op builds them after validating its arguments.
    tolerances: per (input dtype, preset); combinations absent here are not tested.
    switches: the op's keyword arguments under a preset's :class:`~dsv4mtp.semantics.Semantics`
        (e.g. rms_norm's ``order``); merged into every case of that preset.
    outputs: names of the outputs (a 1-tuple for single-tensor ops).
    out_kwarg: the optimized op accepts preallocated outputs under this keyword.
    result_dtypes: output name -> the optimized op's dtype, where it differs from the
        reference's (in the test dtype).
    canonical: ``(case, got, oracle) -> (got, oracle, note)``: both output tuples in comparable
        form (same length and order as ``outputs``); ``note`` is added to failure messages.
    exact: outputs compared bitwise after ``canonical`` (integer outputs).
    optimized_args: ``(args, kwargs) -> (args, kwargs)`` for the optimized op (reference
        arguments it takes in another form); the reference always gets the case as drawn.
    reduced: outputs that summarize the whole batch instead of holding one row per token
        (step_guard's record): ``out=`` lowers them (``min(out, result)``) rather than
        overwriting them, so their poison (the dtype's max) is the identity and a poisoned
        buffer comes back as the result.  The batch-invariance test leaves them out (they name
        a row by its index in the batch) and the graph-replay test resets them to the poison
        before each replay.
    cpu_D: the hidden size of the deterministic calls on CPU (the builder's D).
    cpu_examples: at most this many hypothesis examples per generated test on CPU (None: the
        profile's); the GPU tier always runs the profile's.
    """

    name: str
    concept: str
    strategy: Callable[[torch.dtype, str, int], st.SearchStrategy[Case]]
    build: Builder
    facts: Callable[[Case], Facts]
    tolerances: dict[tuple[torch.dtype, str], Tolerance]
    switches: Callable[[Semantics], dict[str, Any]] = _no_switches
    outputs: tuple[str, ...] = ("out",)
    reference: str = ""
    optimized: str = ""
    out_kwarg: str | None = "out"
    result_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    canonical: Canonical | None = None
    exact: tuple[str, ...] = ()
    optimized_args: ArgsMap | None = None
    reduced: tuple[str, ...] = ()
    cpu_D: int = 64
    cpu_examples: int | None = None

    def result_dtype(self, index: int, reference_dtype: torch.dtype) -> torch.dtype:
        """The dtype of output ``index`` of the optimized op, given the reference's."""
        return self.result_dtypes.get(self.outputs[index], reference_dtype)

    def optimized_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]):
        """The arguments as the optimized op takes them (``optimized_args`` applied)."""
        return (args, kwargs) if self.optimized_args is None else self.optimized_args(args, kwargs)

    def reference_fn(self) -> Callable[..., Any]:
        return resolve(self.reference or f"dsv4mtp.reference:{self.name}")

    def optimized_fn(self) -> Callable[..., Any]:
        return resolve(self.optimized or f"dsv4mtp.optimized:{self.name}")

    def backends(self) -> tuple[str, ...]:
        """The op's explicit backends, from its dispatch table (``DEFAULT_BACKEND`` without)."""
        from dsv4mtp.optimized import _dispatch

        if self.name not in _dispatch.TABLES:
            return (DEFAULT_BACKEND,)
        return _dispatch.backend_names(self.name)

    def requirement(self, backend: str, case: Case) -> str | None:
        """Why ``backend`` cannot run ``case`` (None when it can)."""
        from dsv4mtp.optimized import _dispatch

        if backend == DEFAULT_BACKEND:
            return None
        return _dispatch.requirement(self.name, backend, self.facts(case))

    def preset_kwargs(self, preset: str) -> dict[str, Any]:
        from dsv4mtp.semantics import PRESETS

        return self.switches(PRESETS[preset])

    def tolerance(self, dtype: torch.dtype, preset: str = "math") -> Tolerance:
        return self.tolerances[(dtype, preset)]

    def dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(dict.fromkeys(dt for dt, _ in self.tolerances))


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
