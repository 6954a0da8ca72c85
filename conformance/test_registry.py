"""Meta-tests: every optimized op has a registered pair, every (op, backend) its generated contract
tests, a new backend needs only its dispatch-table line, and signatures match the reference
(extra keyword-only arguments allowed, renames not)."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsv4mtp.conformance.pairs  # noqa: F401  (declares the pairs)
import dsv4mtp.optimized as optimized
import dsv4mtp.reference as reference
from dsv4mtp.conformance.contract import contracts
from dsv4mtp.conformance.inputs import op_inputs
from dsv4mtp.conformance.plugin import DESELECTED_KEY, SOURCE_ROOT
from dsv4mtp.conformance.registry import REGISTRY, Case
from dsv4mtp.optimized import _dispatch
from dsv4mtp.semantics import PRESETS

# The suite's folder: conformance/ in a checkout, dsv4mtp/conformance/ when installed.
HERE = Path(__file__).resolve().parent

# Public names of dsv4mtp.optimized that are not ops with a numeric output to compare (classes
# re-exported from the reference, model objects tested by their own module tests, and helpers
# with no reference counterpart: pack_moe, pack_linear and pack_head build the kernels' weight
# layouts, and their decodes are checked bit for bit against the core's in test_moe_pairs.py /
# test_linear.py / test_lm_head.py; pack_attention and pack_attention_weights alike, tested
# through the sublayer).  ``attention`` is a composition of registered ops with stateful KV
# caches, not an operator: its differential, cache, NaN, out= and error tests and its signature
# check are in test_attention_layer.py.
NOT_OPS = {
    "pack_moe",
    "pack_linear",
    "pack_head",
    "pack_attention",
    "pack_attention_weights",
    "attention",
    "DSV4Config",
    "DSV4Error",
    "ConfigError",
    "InputError",
    "CheckpointError",
    "FoldError",
    "MTPLayer",
}


def _optimized_ops() -> list[str]:
    return [
        name
        for name in getattr(optimized, "__all__", [])
        if name not in NOT_OPS and inspect.isfunction(getattr(optimized, name))
    ]


def test_every_optimized_op_has_a_registered_pair() -> None:
    missing = [name for name in _optimized_ops() if name not in REGISTRY]
    assert not missing, f"optimized ops without an OpPair in conformance/pairs.py: {missing}"


def test_every_pair_resolves_on_both_sides() -> None:
    for pair in REGISTRY.values():
        assert pair.name in reference.__all__, f"{pair.name}: not exported by dsv4mtp.reference"
        pair.reference_fn()
        # A registered op must exist in optimized: a pair whose op is absent fails here.
        assert pair.name in getattr(optimized, "__all__", []), (
            f"{pair.name}: not exported by dsv4mtp.optimized"
        )
        pair.optimized_fn()


def test_optimized_signatures_extend_the_reference() -> None:
    for name in _optimized_ops():
        ref = inspect.signature(getattr(reference, name)).parameters
        opt = inspect.signature(getattr(optimized, name)).parameters
        assert list(opt)[: len(ref)] == list(ref), (
            f"{name}: parameters {list(opt)} do not start with {list(ref)}"
        )
        for p in ref.values():
            assert opt[p.name].kind == p.kind, (
                f"{name}({p.name}): kind {opt[p.name].kind} != {p.kind}"
            )
            assert opt[p.name].default == p.default, (
                f"{name}({p.name}): default differs from the reference"
            )
        extra = [p for n, p in opt.items() if n not in ref]
        assert all(
            p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty
            for p in extra
        ), f"{name}: extra parameters must be keyword-only with defaults: {extra}"


def _pytest(tmp: Path, module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest on one module of this suite the way the suite runs: in a checkout by path (its
    pyproject.toml configures the run); installed, by name (a path would let a checkout that
    holds the environment, such as .nox/, configure the run and shadow the installed dsv4mtp).
    Hypothesis's cache and examples go to ``tmp``: a deliberately failing run touches neither
    site-packages nor the committed database."""
    if SOURCE_ROOT is not None:
        target = [str(HERE / f"{module}.py")]
    else:
        target = ["-p", "dsv4mtp.conformance.plugin", "--pyargs", f"dsv4mtp.conformance.{module}"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *target, *args],
        cwd=tmp,
        env={**os.environ, "DSV4_HYPOTHESIS_DB": str(tmp / "examples")},
        capture_output=True,
        text=True,
        check=False,
    )


def _collected_ids(request: pytest.FixtureRequest, module: str, tmp: Path) -> list[str]:
    path = (HERE / f"{module}.py").resolve()
    items = [*request.session.items, *request.config.stash.get(DESELECTED_KEY, [])]
    ids = [item.nodeid for item in items if item.path.resolve() == path]
    if ids:
        return ids
    out = _pytest(tmp, module, "--collect-only", "-q")
    # One module collected: every node id is its (outside the rootdir the file part is empty).
    return [line for line in out.stdout.splitlines() if "::" in line]


# The generated tests and what each is parametrized over (conformance/contract.py KINDS).
CONTRACT_TESTS = {
    "test_differential": "case",
    "test_empty_batch": "case",
    "test_out_is_written": "case",
    "test_batch_invariance": "case",
    "test_graph_replay_equals_eager": "case",
    "test_typed_error": "backend",
}


def test_every_backend_has_its_contract_tests(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Every (op, backend, dtype, preset) the registry and the dispatch tables declare has each
    generated test collected, and nothing else is generated."""
    ids = _collected_ids(request, "test_contract", tmp_path)
    for test, kind in CONTRACT_TESTS.items():
        want = {c.id for c in contracts(kind)}
        got = {i.rpartition("[")[2].split("]")[0] for i in ids if f"::{test}[" in i}
        # The graph test adds its own (T, D) parameters after the contract's id.
        got = {g.rsplit("-", 2)[0] if test == "test_graph_replay_equals_eager" else g for g in got}
        assert got == want, f"{test}: missing {sorted(want - got)}, unexpected {sorted(got - want)}"
    backends = {(c.pair.name, c.backend) for c in contracts("backend")}
    for pair in REGISTRY.values():
        for backend in pair.backends():  # the dispatch table's, or the default without one
            assert (pair.name, backend) in backends, f"{pair.name}: backend {backend} untested"


def test_a_new_backend_is_one_table_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adding a ``Backend(...)`` to an op's table in optimized/_dispatch.py is all it takes for
    that backend's contract tests to be generated (every dtype and preset of the op, and a
    typed-error test), each skipped with the backend's own reason where it does not apply."""
    table = _dispatch.TABLES["hc_post"]
    new = _dispatch.Backend("cutlass", lambda facts: "needs the (imaginary) cutlass kernels")
    monkeypatch.setitem(
        _dispatch.TABLES, "hc_post", dataclasses.replace(table, backends=(*table.backends, new))
    )
    generated = [c for c in contracts("case") if c.backend == "cutlass"]
    assert [c.id for c in generated] == [
        "hc_post-cutlass-bfloat16-math",
        "hc_post-cutlass-float32-math",
    ]
    assert [c.id for c in contracts("backend") if c.backend == "cutlass"] == [
        "hc_post-cutlass-bfloat16-math"
    ]
    assert generated[0].skip_reason("cpu") == (
        "hc_post backend 'cutlass' does not apply to bfloat16 (preset math) on cpu: "
        "it needs the (imaginary) cutlass kernels"
    )


def test_every_pair_declares_a_reasoned_tolerance() -> None:
    presets = set(PRESETS)
    for pair in REGISTRY.values():
        assert pair.tolerances, f"{pair.name}: no dtype declared"
        assert (pair.dtypes()[0], "math") in pair.tolerances, f"{pair.name}: no math tolerance"
        for (dtype, preset), tol in pair.tolerances.items():
            assert preset in presets, f"{pair.name}/{dtype}: unknown preset {preset!r}"
            assert 0 < tol.rel < 1 and 0 < tol.max_abs < 1, (
                f"{pair.name}/{dtype}/{preset}: tolerance out of range"
            )
            assert len(tol.why) > 10, (
                f"{pair.name}/{dtype}/{preset}: say why the tolerance is what it is"
            )
            if not PRESETS[preset].act_quant:
                assert tol.step_flips == 0, f"{pair.name}/{preset}: e4m3 flips without act_quant"
                assert tol.own_factor == 0, f"{pair.name}/{preset}: own_factor without act_quant"
            assert tol.own_factor == 0 or 1 <= tol.own_factor <= 4, (
                f"{pair.name}/{dtype}/{preset}: own_factor {tol.own_factor} outside [1, 4]"
            )


def test_builder_is_the_one_behind_each_pair() -> None:
    """Each pair's deterministic call is the shared builder's (conformance/inputs.py), and its
    facts are the ones the op dispatches on: the builder's call runs on the op's auto backend."""
    for pair in REGISTRY.values():
        D = pair.cpu_D
        args, kw = op_inputs(pair.name, 3, D, seed=7, dtype=torch.float32, device="cpu")
        built = pair.build(3, D, torch.float32, "cpu", 7)
        assert all(
            torch.equal(a, b) if isinstance(a, torch.Tensor) else a is b or a == b
            for a, b in zip(args, built[0], strict=True)
        ), pair.name
        assert kw == built[1], pair.name
        facts = pair.facts(Case(args, kw))
        assert facts.device == torch.device("cpu") and torch.float32 in facts.dtypes, pair.name


# The differential tests of rms_norm in float32; with --impl for rms_norm, one per preset.
_IMPL_SUBSET = "differential and rms_norm and float32"


def wrong_rms_norm(x, weight, eps, *, order="official"):  # type: ignore[no-untyped-def]
    """A deliberately wrong third-party implementation: 1% too large."""
    return (reference.rms_norm(x, weight, eps, order=order).double() * 1.01).to(x.dtype)


def test_impl_option_swaps_in_a_third_party_implementation(tmp_path: Path) -> None:
    """``--impl`` must really run the given function: the reference itself passes, a 1% wrong
    implementation fails the same differential test."""

    def run(spec: str) -> subprocess.CompletedProcess[str]:
        return _pytest(tmp_path, "test_contract", "-q", "-k", _IMPL_SUBSET, "--impl", spec)

    good = run("rms_norm=dsv4mtp.reference:rms_norm")
    assert good.returncode == 0, good.stdout[-2000:] + good.stderr[-2000:]
    # The third-party function replaces every backend: one test per (dtype, preset), no more.
    assert "2 passed" in good.stdout, good.stdout[-2000:]
    # This module by its installed name, which a checkout's editable install provides too.
    bad = run("rms_norm=dsv4mtp.conformance.test_registry:wrong_rms_norm")
    assert bad.returncode == 1, bad.stdout[-2000:]
    assert "exceeds tolerance" in bad.stdout


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("rms_norm=no.such.module:fn", "cannot import module 'no.such.module'"),
        (
            "rms_norm=dsv4mtp.reference:no_such_fn",
            "dsv4mtp.reference has no attribute 'no_such_fn'",
        ),
        ("nosuchop=dsv4mtp.reference:rms_norm", "no op named 'nosuchop' is registered"),
        ("dsv4mtp.reference.rms_norm", "expected [OP=]module:function"),
    ],
    ids=["module", "function", "op", "syntax"],
)
def test_impl_option_typo_is_a_usage_error(spec: str, message: str, tmp_path: Path) -> None:
    """A mistyped ``--impl`` stops pytest before any test runs (exit code 4, usage error)."""
    out = _pytest(tmp_path, "test_contract", "-q", "-k", _IMPL_SUBSET, "--impl", spec)
    log = out.stdout[-2000:] + out.stderr[-2000:]
    assert out.returncode == pytest.ExitCode.USAGE_ERROR, log
    assert f"--impl {spec!r}: {message}" in out.stderr, log


@pytest.mark.parametrize(
    ("op", "dtype", "preset"),
    [(name, dt, preset) for name, pair in REGISTRY.items() for dt, preset in pair.tolerances],
    ids=lambda v: str(v).removeprefix("torch."),
)
def test_the_reference_in_dtype_stays_within_the_declared_tolerance(
    op: str, dtype: torch.dtype, preset: str
) -> None:
    """A tolerance is no tighter than the reference's own error in the test dtype, over 40
    derandomized draws of the pair's CPU strategy (conformance/tails.py; run it with more draws
    to calibrate).  Pairs with ``own_factor`` are heavy-tailed by design and checked at 3x."""
    from dsv4mtp.conformance.tails import own_error_tail

    pair = REGISTRY[op]
    tail = own_error_tail(pair, dtype, preset, 40, derandomize=True)
    bound = 3.0 if pair.tolerance(dtype, preset).own_factor else 1.0
    assert tail.draws > 0 and tail.ratio <= bound, tail
