"""The op contract, generated from the registry for every (op, backend, dtype, preset).

Each test below runs once per combination that ``conformance/contract.py`` generates from
``conformance/pairs.py`` and ``optimized/_dispatch.py``'s backend tables; a combination whose
backend cannot run here is skipped with the table's reason.  Test ids read
``test_<name>[<op>-<backend>-<dtype>-<preset>]``.

* ``test_differential``: hypothesis cases against the float64 reference, within the pair's
  tolerance (``conformance/differential.py``); ``--impl`` swaps a third-party function in.
* ``test_empty_batch``: T = 0 returns the reference's shapes and dtypes, also into ``out=``.
* ``test_out_is_written``: ``out=`` buffers poisoned (NaN) before the call come back as the
  results, every element written, bitwise the result of the call without ``out=``.
* ``test_batch_invariance``: with ``batch_invariant=True`` a token's bits do not depend on its
  batch: alone, in a sub-range, and at another position of a rolled batch (outputs a pair
  declares ``reduced``, one value for the whole batch, are left out).
* ``test_graph_replay_equals_eager`` (gpu): a captured call replayed on fresh inputs equals the
  eager call bitwise, in the captured buffers.
* ``test_typed_error`` (per backend): a wrong dtype and a wrong shape are an ``InputError``
  naming the argument.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dsv4mtp.conformance.contract import IMPL_BACKEND, MAX_TOKENS, Contract, contracts
from dsv4mtp.conformance.differential import check_pair, poisoned_like
from dsv4mtp.conformance.inputs import token_rows
from dsv4mtp.conformance.plugin import IMPL_KEY
from dsv4mtp.conformance.registry import Case
from dsv4mtp.errors import InputError

_KIND = {"test_typed_error": "backend"}

# Contracts that leave the CPU tier (``slow``; the GPU tier runs them): under the interpreter
# each takes about a minute.  moe's math contract stays: it runs the routed GEMM kernels of
# fused_experts and the shared expert's (the presets differ in the shared expert's clamp and
# the activation rounding, which the CPU tier's differential contracts check in both presets).
_SLOW_ON_CPU = {
    "test_batch_invariance": {
        "moe-triton-bfloat16-official",
        "fused_experts-triton-bfloat16-official",
        "fused_experts-triton-bfloat16-math",
    },
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "contract" not in metafunc.fixturenames:
        return
    name = metafunc.function.__name__
    impl_ops: dict[str, str] = {}
    if name == "test_differential":
        impl_ops = metafunc.config.stash.get(IMPL_KEY, {})
    params = contracts(_KIND.get(name, "case"), impl_ops)
    slow = _SLOW_ON_CPU.get(name, set())
    metafunc.parametrize(
        "contract",
        [
            pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.id in slow else [])
            for c in params
        ],
        indirect=True,
    )


@pytest.fixture
def contract(request: pytest.FixtureRequest, device: str) -> Contract:
    """The combination under test; skipped (with the reason) where its backend cannot run."""
    c: Contract = request.param
    reason = c.skip_reason(device)
    if reason is not None:
        pytest.skip(reason)
    return c


def _cuda(device: str) -> bool:
    return device == "cuda"


def _out_kwarg(contract: Contract, buffers: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    assert contract.pair.out_kwarg is not None
    return {contract.pair.out_kwarg: buffers if len(buffers) > 1 else buffers[0]}


def _examples(contract: Contract, device: str, default: int) -> settings:
    """The profile's settings, at most the pair's ``cpu_examples`` examples on CPU."""
    cap = contract.pair.cpu_examples
    n = default if cap is None or _cuda(device) else min(default, cap)
    return settings(max_examples=n)


# ------------------------------------------------------------------------------ differential
def test_differential(contract: Contract, device: str, impl_override: Any) -> None:
    """Drawn cases against the float64 oracle under the (dtype, preset) tolerance; ``out=``
    poisoned.  Cases the backend cannot run (e.g. FlashInfer at n != 4) are not drawn."""
    pair = contract.pair
    max_tokens = MAX_TOKENS["cuda" if _cuda(device) else "cpu"]
    impl = impl_override(pair.name) if contract.backend == IMPL_BACKEND else None

    @_examples(contract, device, settings().max_examples)
    @given(data=st.data())
    def drawn(data: Any) -> None:
        case = contract.with_preset(
            data.draw(pair.strategy(contract.dtype, device, max_tokens), label="case")
        )
        if impl is None:
            assume(pair.requirement(contract.backend, case) is None)
        check_pair(
            pair, case, contract.dtype, preset=contract.preset, impl=impl,
            extra=contract.backend_kwargs(),
        )  # fmt: skip

    drawn()


# ------------------------------------------------------------------------------ T = 0
def test_empty_batch(contract: Contract, device: str) -> None:
    """T = 0: the reference's shapes and dtypes (no launch), and out= buffers returned as given."""
    case = contract.case(0, device, seed=0)
    want = contract.reference(case)
    dtypes = [contract.pair.result_dtype(i, w.dtype) for i, w in enumerate(want)]
    got = contract.run(case)
    assert [(tuple(g.shape), g.dtype) for g in got] == [
        (tuple(w.shape), d) for w, d in zip(want, dtypes, strict=True)
    ]
    if contract.pair.out_kwarg:
        bufs = tuple(
            torch.empty(w.shape, dtype=d, device=device) for w, d in zip(want, dtypes, strict=True)
        )
        got = contract.run(case, **_out_kwarg(contract, bufs))
        assert all(g is b for g, b in zip(got, bufs, strict=True)), "out= buffers not returned"


# ------------------------------------------------------------------------------ out=
def test_out_is_written(contract: Contract, device: str) -> None:
    """NaN-poisoned out= buffers: returned as the results, every element written, bitwise equal
    to the same call without out=."""
    if not contract.pair.out_kwarg:
        pytest.skip(f"{contract.pair.name} takes no out=")
    T = 77 if _cuda(device) else 5
    case = contract.case(T, device, seed=T)
    want = contract.run(case)
    bufs = tuple(poisoned_like(w) for w in want)
    got = contract.run(case, **_out_kwarg(contract, bufs))
    for i, (g, b, w) in enumerate(zip(got, bufs, want, strict=True)):
        name = contract.pair.outputs[i]
        assert g.data_ptr() == b.data_ptr(), f"{name}: not returned in the out= buffer"
        unwritten = int(torch.isnan(b).sum()) if b.is_floating_point() else 0
        assert unwritten == 0, f"{name}: {unwritten} of {b.numel()} elements never written"
        assert torch.equal(b, w), f"{name}: out= result differs from the call without out="


# ------------------------------------------------------------------------------ batch invariance
def test_batch_invariance(contract: Contract, device: str) -> None:
    """batch_invariant=True: every token's outputs are bitwise the same alone, inside a drawn
    sub-range, and at another position (the batch rolled by a drawn shift)."""

    # On CUDA each example runs 6 batches of up to 8192 x 4 x 7168.  Under the interpreter
    # a batch costs up to a second (MoE, mHC): 3 examples of 4 batches each, the first and last
    # token drawn often (see _batch_invariance).
    @_examples(contract, device, 8 if _cuda(device) else 3)
    @given(data=st.data())
    def drawn(data: Any) -> None:
        _batch_invariance(contract, data, device)

    drawn()


class _Fixed:
    """Hypothesis's ``data`` with given draws: an example found outside Hypothesis, replayed."""

    def __init__(self, **draws: int) -> None:
        self.draws = draws

    def draw(self, strategy: Any, label: str) -> int:
        return self.draws[label]


# (contract id, draws) that once failed test_batch_invariance, replayed on every run
_BATCH_INVARIANCE_EXAMPLES = [
    # under the interpreter the shared expert's dot went to numpy's BLAS, which rounds a row by
    # its place in the tile: token 4 of 12 differed in one bit when the batch was rolled by 6
    # (kernels/moe_gemm.py, _dot, now a row-independent sum there)
    ("moe-triton-bfloat16-math", dict(T=12, D=256, seed=65, lo=0, hi=1, shift=6)),
]


@pytest.mark.parametrize(("contract_id", "draws"), _BATCH_INVARIANCE_EXAMPLES)
def test_batch_invariance_examples(contract_id: str, draws: dict[str, int], device: str) -> None:
    """The kept examples of test_batch_invariance, with their exact draws."""
    (contract,) = [c for c in contracts("case") if c.id == contract_id]
    _batch_invariance(contract, _Fixed(**draws), device)


def _batch_invariance(contract: Contract, data: Any, device: str) -> None:
    cuda = _cuda(device)
    T = data.draw(st.integers(2, 8192 if cuda else 12), label="T")
    D = data.draw(
        st.sampled_from([4096, 7168]) if cuda else st.just(contract.pair.cpu_D), label="D"
    )
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    case = contract.case(T, device, seed, D=D)
    op = contract.pair.name

    def run(index: Any) -> tuple[torch.Tensor, ...]:
        part = Case(token_rows(op, case.args, index), case.kwargs)
        return contract.run(part, batch_invariant=True)

    full = contract.run(case, batch_invariant=True)
    lo = data.draw(st.one_of(st.sampled_from([0, T - 1]), st.integers(0, T - 1)), label="lo")
    hi = data.draw(st.integers(lo + 1, T), label="hi")
    shift = data.draw(st.integers(1, T - 1), label="shift")
    rolled = torch.roll(torch.arange(T, device=device), shift)
    edges = [(0, 1), (T - 1, T)] if cuda else []  # on CPU `lo` draws them (cost, above)
    checks: list[tuple[str, Any]] = [
        (f"tokens [{a}, {b})", slice(a, b)) for a, b in [(lo, hi), *edges]
    ]
    checks += [(f"token {lo} alone", slice(lo, lo + 1)), (f"batch rolled by {shift}", rolled)]
    for what, index in checks:
        for name, f, p in zip(contract.pair.outputs, full, run(index), strict=True):
            if name in contract.pair.reduced:  # one value for the batch (registry.py)
                continue
            assert torch.equal(f[index], p), f"{op}.{name}: {what} of T={T} D={D} differ"


# ------------------------------------------------------------------------------ CUDA graphs
@pytest.mark.gpu
@pytest.mark.parametrize(("T", "D"), [(1, 7168), (8, 4096), (64, 7168), (513, 4096)])
def test_graph_replay_equals_eager(contract: Contract, T: int, D: int) -> None:
    """Capture the op writing into out= buffers; replay it on fresh inputs copied into the
    captured input buffers: bitwise the eager result, in the same addresses."""
    case = contract.case(T, "cuda", seed=1, D=D)
    outs = contract.run(case)
    out_kw = _out_kwarg(contract, outs)
    ptrs = [o.data_ptr() for o in outs]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (JIT, allocator) off the capture
        contract.run(case, **out_kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        contract.run(case, **out_kw)
    for seed in (2, 3):
        # Fresh tensors go into the captured buffers.  A non-tensor argument (the MoE's
        # parameters, a linear's QuantizedWeight) is baked into the graph, so the eager call
        # below reads the captured one too: it runs on ``case``, whose tensors now hold the
        # fresh values.
        fresh = contract.case(T, "cuda", seed=seed, D=D)
        for dst, src in zip(case.args, fresh.args, strict=True):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        for key, dst in case.kwargs.items():
            if isinstance(dst, torch.Tensor):
                dst.copy_(fresh.kwargs[key])
        for name, o in zip(contract.pair.outputs, outs, strict=True):
            if name in contract.pair.reduced:  # lowered by each replay: start from the identity
                o.copy_(poisoned_like(o))
        graph.replay()
        torch.cuda.synchronize()
        eager = contract.run(case)
        for o, e, p in zip(outs, eager, ptrs, strict=True):
            assert o.data_ptr() == p
            assert torch.equal(o, e), f"{contract.id}: graph replay differs from eager"


# ------------------------------------------------------------------------------ typed errors
def test_typed_error(contract: Contract, device: str) -> None:
    """The first argument in float64 and the last tensor argument one element short are each an
    InputError whose message starts with that argument's name."""
    case = contract.case(3, device, seed=0)
    names = list(inspect.signature(contract.pair.optimized_fn()).parameters)
    args = list(case.args)
    last = max(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    bad_dtype = [args[0].double(), *args[1:]]
    bad_shape = [*args[:last], args[last][..., :-1], *args[last + 1 :]]
    for bad, i, what in ((bad_dtype, 0, "dtype"), (bad_shape, last, "shape")):
        with pytest.raises(InputError, match=rf"^{names[i]}: expected {what}"):
            contract.run(Case(tuple(bad), case.kwargs))
