"""The backend tables of dsv4mtp.optimized (optimized/_dispatch.py): every op's choices and the
one error path for a backend that is unknown or does not apply."""

from __future__ import annotations

import inspect

import pytest
import torch

import dsv4mtp.optimized as opt
from dsv4mtp.errors import InputError
from dsv4mtp.optimized._dispatch import TABLES, Facts, backend_names, requirement, select


def test_every_table_is_an_optimized_op_with_a_backend_argument() -> None:
    for op, table in TABLES.items():
        fn = getattr(opt, op)
        assert inspect.signature(fn).parameters["backend"].default == "auto", op
        assert backend_names(op), op
        assert set(table.auto) <= set(backend_names(op)), op
        assert len(set(backend_names(op))) == len(backend_names(op)), op


def test_auto_reads_the_batch_size_only_when_batch_invariant_is_false(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """T reaches the Facts only from a call with ``batch_invariant=False``; no requirement check
    reads it, and auto consults an op's ``by_T`` rule only when it is there."""
    import dsv4mtp.optimized._dispatch as dispatch
    import dsv4mtp.optimized.mhc as mhc

    base = dict(n=4, D=64, eps=(1e-6, 1e-6))
    for op in TABLES:
        for name in backend_names(op):
            for dev, dt in (
                (torch.device("cpu"), torch.float32),
                (torch.device("cuda"), torch.bfloat16),
            ):
                plain = requirement(op, name, Facts(dev, (dt,), **base))  # type: ignore[arg-type]
                for T in (1, 64, 1 << 20):
                    with_t = Facts(dev, (dt,), T=T, **base)  # type: ignore[arg-type]
                    assert requirement(op, name, with_t) == plain, (op, name, T)
    monkeypatch.setattr(dispatch, "HEAD_MMA_MIN_T", 64)
    cpu = torch.device("cpu")
    assert select("hc_head", "auto", Facts(cpu, (torch.float32,), T=64, **base)) == "triton_mma"  # type: ignore[arg-type]
    assert select("hc_head", "auto", Facts(cpu, (torch.float32,), T=63, **base)) == "triton_fma"  # type: ignore[arg-type]
    assert select("hc_head", "auto", Facts(cpu, (torch.float32,), **base)) == "triton_fma"  # type: ignore[arg-type]
    monkeypatch.setattr(dispatch, "PRE_FMA_MAX_T", 64)
    assert select("hc_pre", "auto", Facts(cpu, (torch.float32,), T=64, **base)) == "triton_fma"  # type: ignore[arg-type]
    assert select("hc_pre", "auto", Facts(cpu, (torch.float32,), T=65, **base)) == "triton"  # type: ignore[arg-type]
    assert select("hc_pre", "auto", Facts(cpu, (torch.float32,), **base)) == "triton_fma"  # type: ignore[arg-type]
    wide = {**base, "D": 7168}
    assert select("hc_pre", "auto", Facts(cpu, (torch.float32,), T=32, **wide)) == "triton_fma"  # type: ignore[arg-type]
    assert select("hc_pre", "auto", Facts(cpu, (torch.float32,), T=33, **wide)) == "triton"  # type: ignore[arg-type]
    seen: list[tuple[str, int | None]] = []

    class Chosen(Exception):
        pass

    def spy(op: str, backend: str, facts: Facts) -> str:
        seen.append((op, facts.T))
        raise Chosen  # stop before the launch: only the choice is under test

    monkeypatch.setattr(mhc, "select", spy)
    monkeypatch.setattr(mhc, "check_device", lambda named: named[0][1].device)
    dispatch.clear_plans()  # a cached plan of an earlier call would skip the spy
    x = torch.randn(3, 4, 8)
    eps = dict(rms_norm_eps=1e-6, hc_eps=1e-6)
    for invariant in (False, True):
        with pytest.raises(Chosen):
            opt.hc_head(x, torch.randn(4, 32), torch.ones(1), torch.zeros(4), **eps,
                        batch_invariant=invariant)  # fmt: skip
        with pytest.raises(Chosen):
            opt.hc_pre(x, torch.randn(24, 32), torch.ones(3), torch.zeros(24), **eps,
                       sinkhorn_iters=2, batch_invariant=invariant)  # fmt: skip
    # hc_head and hc_pre pass T only without batch_invariant.
    assert seen == [("hc_head", 3), ("hc_pre", 3), ("hc_head", None), ("hc_pre", None)]


def test_unknown_and_inapplicable_backends_are_input_errors_naming_op_and_reason() -> None:
    cpu = Facts(torch.device("cpu"), (torch.float32,), n=4, D=64, eps=(1e-6, 1e-6))
    with pytest.raises(
        InputError, match=r"backend: hc_pre has no backend 'cutlass'; expected 'auto'"
    ):
        select("hc_pre", "cutlass", cpu)
    with pytest.raises(
        InputError, match=r"hc_post backend 'flashinfer' does not apply: it needs CUDA"
    ):
        select("hc_post", "flashinfer", cpu)
    assert requirement("rms_norm", "flashinfer", cpu) == "needs CUDA tensors, got cpu"
    assert select("hc_post", "auto", cpu) == "triton"  # auto falls through to what applies
    x = torch.randn(2, 8, device="cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(InputError, match=r"rms_norm has no backend 'fast'"):
        opt.rms_norm(x, None, 1e-6, backend="fast")  # type: ignore[arg-type]
