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


def test_auto_never_reads_the_batch_size() -> None:
    """Facts carry no T, so auto cannot pick by batch size (the batch-invariance rule)."""
    assert "T" not in {f for f in Facts.__dataclass_fields__}


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
    x = torch.randn(2, 8)
    with pytest.raises(InputError, match=r"rms_norm has no backend 'fast'"):
        opt.rms_norm(x, None, 1e-6, backend="fast")  # type: ignore[arg-type]
