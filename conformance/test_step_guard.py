"""The decode step's input guard (docs/semantics.md, "The decode step's input guard"): the
reference's rules on hand-made rows, the record lowered by ``out=`` across calls, the
operators' opcheck, and the kernel's strided and multi-step rows.  The differential, empty
batch, out=, batch-invariance and graph tests are generated from conformance/pairs.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dsv4mtp.reference as ref
from dsv4mtp.conformance.inputs import step_guard_inputs
from dsv4mtp.errors import InputError

NONE = torch.iinfo(torch.int64).max
NAN, INF = float("nan"), float("inf")


def _rows(device: str) -> tuple[Any, ...]:
    """Eight hand-made rows (vocab 10, max_positions 20): ok, NaN, id -1, position 20, NaN and
    id 10 (reason 1 first), id 10 and position -1 (reason 2 first), filler with a NaN, ok."""
    ids = torch.tensor([3, 3, -1, 3, 10, 10, 3, 9])
    pos = torch.tensor([5, 5, 5, 20, 5, -1, 5, 19])
    prev = torch.ones(8, 6)
    prev[1, 2] = NAN
    prev[4, 5] = -INF
    prev[6, 0] = INF
    slots = torch.arange(8) + 100
    real = torch.tensor([True] * 6 + [False, True])
    return (*(t.to(device) for t in (ids, pos, prev, slots, real)), 10, 20)


def test_reference_rules() -> None:
    ok, ids, pos, slots, record = ref.step_guard(*_rows("cpu"))
    assert ok.tolist() == [True, False, False, False, False, False, False, True]
    assert ids.tolist() == [3, 0, 0, 0, 0, 0, 0, 9]
    assert pos.tolist() == [5, 0, 0, 0, 0, 0, 0, 19]
    assert slots.tolist() == [100, -1, -1, -1, -1, -1, -1, 107]
    assert record.tolist() == [1 * 4 + 1]
    # each bad row's own key: the record of that row alone, at index 0
    for row, reason in [(1, 1), (2, 2), (3, 3), (4, 1), (5, 2)]:
        one = (*(a[row : row + 1] for a in _rows("cpu")[:5]), 10, 20)
        assert ref.step_guard(*one)[4].tolist() == [reason], row
    filler = (*(a[6:7] for a in _rows("cpu")[:5]), 10, 20)
    assert ref.step_guard(*filler)[4].tolist() == [NONE]


def test_optimized_matches_the_hand_made_rows(device: str) -> None:
    from dsv4mtp.optimized import step_guard

    got = step_guard(*_rows(device))
    for g, w in zip(got, ref.step_guard(*_rows("cpu")), strict=True):
        assert torch.equal(g.cpu(), w)


def test_out_lowers_the_record_across_calls(device: str) -> None:
    """The record of ``out=`` ends as min(record, this call's key): a lower record stays, a
    higher one (or none) takes the call's key; the other four outputs are overwritten."""
    from dsv4mtp.optimized import step_guard

    args = _rows(device)
    key = 1 * 4 + 1
    for before, after in [(NONE, key), (key + 1, key), (key, key), (2, 2), (0, 0)]:
        outs = (
            torch.ones(8, dtype=torch.bool, device=device),
            *[torch.full((8,), 77, device=device) for _ in range(3)],
            torch.full((1,), before, device=device),
        )
        got = step_guard(*args, out=outs)
        assert all(g is o for g, o in zip(got, outs, strict=True))
        assert outs[4].item() == after, before
        assert outs[0].tolist() == [True, False, False, False, False, False, False, True]
        assert outs[3].tolist() == [100, -1, -1, -1, -1, -1, -1, 107]
    # a call with no bad row leaves the record as it is
    good = tuple(a[[0, 7]] for a in args[:5]) + args[5:]
    rec = torch.full((1,), 9, device=device)
    outs2 = (
        torch.empty(2, dtype=torch.bool, device=device),
        *[torch.empty(2, dtype=torch.int64, device=device) for _ in range(3)],
        rec,
    )
    step_guard(*good, out=outs2)
    assert rec.item() == 9


@pytest.mark.parametrize("H", [4096 + 5, 28672, 32768 + 5, 2 * 32768 + 100])
def test_non_finite_in_the_last_step_of_a_long_row(H: int, device: str) -> None:
    """The kernel reads a row in one piece up to 32768 values (V4-Pro's 28672 among them) and
    in 32768-wide steps past that: a NaN in the last column (past the first step where there
    are several) and a row whose stride exceeds H (a column slice) are both read right."""
    from dsv4mtp.optimized import step_guard
    from dsv4mtp.optimized.kernels.step_guard import guard_schedule

    steps = -(-H // guard_schedule(H)[0])
    assert steps == (1 if H <= 32768 else 2 if H <= 65536 else 3)  # the cases above

    wide = torch.zeros(3, H + 64, device=device)
    wide[1, H - 1] = NAN
    wide[2, H] = INF  # outside the slice: row 2 stays ok
    prev = wide[:, :H]
    assert prev.stride(0) != H
    ids = torch.zeros(3, dtype=torch.int64, device=device)
    real = torch.ones(3, dtype=torch.bool, device=device)
    ok, *_, record = step_guard(ids, ids, prev, ids, real, 1, 1)
    assert ok.tolist() == [True, False, True]
    assert record.item() == 1 * 4 + 1


@pytest.mark.parametrize("variant", ["", "_out"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(variant: str, dtype: torch.dtype, device: str) -> None:
    from dsv4mtp.optimized import step_guard  # noqa: F401  (defines the operators)

    args, _ = step_guard_inputs(6, 3, H=40, dtype=dtype, device=device, vocab_size=50)
    tensors, limits = args[:5], args[5:]
    record = torch.full((1,), NONE, device=device)
    ops = torch.ops.dsv4mtp
    if variant:
        B = tensors[0].shape[0]
        outs = {
            "ok": torch.empty(B, dtype=torch.bool, device=device),
            "ids_out": torch.empty(B, dtype=torch.int64, device=device),
            "positions_out": torch.empty(B, dtype=torch.int64, device=device),
            "slots_out": torch.empty(B, dtype=torch.int64, device=device),
            "record": record,
        }
        torch.library.opcheck(ops.step_guard_out.default, (*tensors, *limits), outs)
    else:
        torch.library.opcheck(ops.step_guard.default, (*tensors, record, *limits), {})


def test_typed_errors(device: str) -> None:
    from dsv4mtp.optimized import step_guard

    args = list(_rows(device))
    with pytest.raises(InputError, match=r"^prev_hidden: expected shape \(8, \*\)"):
        step_guard(*args[:2], args[2][:3], *args[3:])
    with pytest.raises(InputError, match=r"^vocab_size: expected an int >= 1"):
        step_guard(*args[:5], 0, 20)
    with pytest.raises(InputError, match=r"^out: expected a 5-tuple"):
        step_guard(*args, out=(args[0],))  # type: ignore[arg-type]
    outs = [torch.empty(8, dtype=torch.bool, device=device)]
    outs += [torch.empty(8, dtype=torch.int64, device=device) for _ in range(3)]
    outs.append(torch.empty(2, dtype=torch.int64, device=device))
    with pytest.raises(InputError, match=r"^out\[4\]: expected shape \(1,\)"):
        step_guard(*args, out=tuple(outs))  # type: ignore[arg-type]
