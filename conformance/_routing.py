"""Router near-ties in whole-layer comparisons.

A layer test feeds the optimized and the reference layer the same inputs and compares their
outputs row by row.  The two MoE inputs differ by the layer's accumulated rounding (bf16
activations, fp32 sums in other orders; more under ``act_quant``), so where the reference's
K-th and (K+1)-th biased router scores are closer than the score error that difference can
cause, the optimized router may pick another expert: a legitimate difference that changes the
row by O(1), not a bug.  Such a row is excused from the comparison (and from every later step of
its sequence in a draft, whose input is that row), and the excused rows are counted: a test
fails if more than :data:`MAX_EXCUSED` of them are.

:func:`routing_gaps` records the gap of every row of every reference router call made inside
its block (the reference MoE calls ``dsv4mtp.reference.moe.route`` by its module name).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

# the module, not the package's ``moe`` function of the same name
reference_moe = importlib.import_module("dsv4mtp.reference.moe")

#: A near-tie at the layer level, per preset: twice the largest change of a gap (two scores'
#: errors) measured between the two layers' MoE inputs.  Measured (tiny config, 48 rows, the
#: optimized layer's MoE input against the reference's, scores in float64): the MoE input differs
#: by <= 3.7e-3 rel. under ``math`` and <= 6.2e-3 under ``official`` (e4m3 activations), one
#: score by <= 2.8e-3 / 4.6e-3, so a gap by <= 5.5e-3 / 9.2e-3.
LAYER_TIE = {"math": 1e-2, "official": 2e-2}

#: The largest fraction of compared rows (or draft steps) a test may excuse.
MAX_EXCUSED = 0.5


@contextmanager
def routing_gaps() -> Iterator[list[torch.Tensor]]:
    """Inside the block, each reference router call appends its rows' gaps (T,) float64 on
    the CPU: the K-th minus the (K+1)-th biased score."""
    original = reference_moe.route
    calls: list[torch.Tensor] = []

    def spy(x, gate_weight, gate_bias, config, **kwargs):  # type: ignore[no-untyped-def]
        k = config.num_experts_per_tok
        logits = x.double().cpu() @ gate_weight.double().cpu().T  # (T, E)
        biased = torch.sqrt(F.softplus(logits)) + gate_bias.double().cpu()
        top = biased.topk(k + 1, dim=-1).values  # (T, K + 1) descending
        calls.append(top[:, k - 1] - top[:, k])
        return original(x, gate_weight, gate_bias, config, **kwargs)

    reference_moe.route = spy
    try:
        yield calls
    finally:
        reference_moe.route = original


class Excuses:
    """The rows a test excuses at router near-ties, tallied over the whole test: :meth:`keep`
    per comparison, :meth:`check` at the end (at most :data:`MAX_EXCUSED` of all rows)."""

    def __init__(self, preset: str) -> None:
        self.tie, self.excused, self.total = LAYER_TIE[preset], 0, 0

    def keep(self, gaps: torch.Tensor) -> torch.Tensor:
        """(T,) bool: the rows whose reference selection has no near-tie."""
        keep = gaps > self.tie
        self.excused += int((~keep).sum())
        self.total += keep.numel()
        return keep

    def check(self) -> None:
        assert self.excused <= MAX_EXCUSED * self.total, (
            f"{self.excused} of {self.total} rows excused at router near-ties"
        )


def draft_steps_kept(calls: list[torch.Tensor], last_rows: torch.Tensor, preset: str):
    """(B, k) bool for a draft of k steps whose reference recorded ``calls``: call 0 the
    prefix (its rows ``last_rows`` (B,) end the sequences), call s >= 1 step s (B rows).  A
    sequence's steps from its first near-tie on are excused."""
    gaps = torch.stack([calls[0][last_rows], *calls[1:]], dim=1)  # (B, k)
    clear = (gaps > LAYER_TIE[preset]).long().cumprod(dim=1).bool()
    excused = int((~clear).sum())
    assert excused <= MAX_EXCUSED * clear.numel(), f"{excused} of {clear.numel()} steps excused"
    return clear
