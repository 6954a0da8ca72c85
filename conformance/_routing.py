"""Router near-ties in whole-layer comparisons: the rows whose expert selection moved.

A layer test feeds the optimized and the reference layer the same inputs and compares their
outputs row by row.  The two MoE inputs differ by the layer's accumulated rounding (bf16
activations, fp32 sums in other orders; more under ``act_quant``).  Where a row's K-th and
(K+1)-th biased router scores are closer than that difference can move them, the two layers
pick different experts: a legitimate difference that changes the row by O(1), not a bug.

Which rows those are is computed, not guessed from a threshold: :func:`record_moe_inputs` records
every MoE input both layers compute (through their ``ops.moe``), and :meth:`MoEInputs.moved`
routes both inputs of a call with the reference's router weights in float64 and compares the
selections as sets.  A row is excused where the sets differ, or where either input sits within
:data:`ROUTER_TIE` of a tie, below which the routers' own fp32 logits may order the two experts
either way.  At V4-Flash (256 experts, top 6) a threshold would not do: a third of the rows of
a random checkpoint have the K-th and (K+1)-th scores within 1e-2, while the selection moves in
far fewer.  Excused rows (and draft steps from a sequence's first moved row on, whose input is
that row) are counted: a test fails if more than :data:`MAX_EXCUSED` of them are.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

#: A tie for the routers themselves: both compute the logits in fp32 from bf16 (or fp32) x and
#: gate over D <= 7168 products, a relative error of ~1e-6 on scores of order 1, so two scores
#: closer than 1e-4 (100x that) may come out in either order in either router.
ROUTER_TIE = 1e-4

#: The largest fraction of compared rows (or draft steps) a test may excuse.
MAX_EXCUSED = 0.5


@dataclass
class MoEInputs:
    """Each layer's MoE inputs, call by call (float64, CPU), and the router of each call."""

    ref: list[torch.Tensor] = field(default_factory=list)
    opt: list[torch.Tensor] = field(default_factory=list)
    routers: list[tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=list)

    def moved(self, call: int) -> torch.Tensor:
        """(T,) bool over the reference's rows of ``call``: the rows whose selection moved
        between the two layers' inputs, or that sit within :data:`ROUTER_TIE` of a tie."""
        gate_weight, gate_bias, k = self.routers[call]
        x_ref = self.ref[call]
        x_opt = self.opt[call][: x_ref.shape[0]]  # a decode bucket's filler rows come last
        sets, near = [], torch.zeros(x_ref.shape[0], dtype=torch.bool)
        for x in (x_ref, x_opt):
            biased = torch.sqrt(F.softplus(x @ gate_weight.T)) + gate_bias  # (T, E)
            top = biased.topk(k + 1, dim=-1)  # (T, K + 1) descending
            sets.append(top.indices[:, :k].sort(dim=-1).values)
            near |= (top.values[:, k - 1] - top.values[:, k]) < ROUTER_TIE
        return (sets[0] != sets[1]).any(dim=-1) | near


@contextmanager
def record_moe_inputs(reference: Any, optimized: Any) -> Iterator[MoEInputs]:
    """Inside the block, every ``ops.moe`` call of the two layers (reference and optimized
    ``MTPLayer``, eager: a captured graph runs no Python) appends its input to the record, and
    each reference call its router (gate weight and bias in float64, top-k)."""
    record = MoEInputs()

    def spy(layer: Any, inputs: list[torch.Tensor], routers: bool):  # type: ignore[no-untyped-def]
        moe = layer.ops.moe

        def recorded(x, params, config, **kwargs):  # type: ignore[no-untyped-def]
            inputs.append(x.detach().double().cpu())
            if routers:
                gw, gb = params.gate_weight, params.gate_bias
                k = config.num_experts_per_tok
                record.routers.append((gw.double().cpu(), gb.double().cpu(), k))
            return moe(x, params, config, **kwargs)

        return layer.ops._replace(moe=recorded)

    reference.ops = spy(reference, record.ref, True)
    optimized.ops = spy(optimized, record.opt, False)
    try:
        yield record
    finally:
        del reference.ops, optimized.ops  # the class attribute again


class Excuses:
    """The rows a test excuses where the selection moved, tallied over the whole test:
    :meth:`keep` per comparison, :meth:`check` at the end (at most :data:`MAX_EXCUSED`)."""

    def __init__(self) -> None:
        self.excused, self.total = 0, 0

    def keep(self, moved: torch.Tensor) -> torch.Tensor:
        """(T,) bool: the rows whose selection did not move (``moved`` from
        :meth:`MoEInputs.moved`)."""
        self.excused += int(moved.sum())
        self.total += moved.numel()
        return ~moved

    def check(self) -> None:
        assert self.excused <= MAX_EXCUSED * self.total, (
            f"{self.excused} of {self.total} rows excused: their expert selection moved"
        )


def draft_steps_kept(record: MoEInputs, last_rows: torch.Tensor) -> torch.Tensor:
    """(B, k) bool for a draft of k steps recorded in ``record``: call 0 the prefix (its rows
    ``last_rows`` (B,) end the sequences), call s >= 1 step s (B rows).  A sequence's steps
    from its first moved selection on are excused."""
    calls = len(record.ref)
    assert len(record.opt) == calls, f"{calls} reference MoE calls, {len(record.opt)} optimized"
    moved = [record.moved(0)[last_rows], *(record.moved(s) for s in range(1, calls))]
    clear = (~torch.stack(moved, dim=1)).long().cumprod(dim=1).bool()  # (B, k)
    excused = int((~clear).sum())
    assert excused <= MAX_EXCUSED * clear.numel(), f"{excused} of {clear.numel()} steps excused"
    return clear
