"""The sqrtsoftplus router (docs/semantics.md, "MoE: router, clamped SwiGLU, shared expert").

Two kernels, no host sync (at one token one: the top-k program also sorts the slots, below):

* ``route_logits_kernel``: grid (cdiv(T, BLOCK_T), cdiv(E, BLOCK_E), SPLIT).  Each program
  computes the logits of BLOCK_T tokens x BLOCK_E experts over one D slice (D_SPLIT columns, a
  multiple of BLOCK_K) as tensor-core dots: x (BLOCK_T, BLOCK_K) times the gate tile
  (BLOCK_E, BLOCK_K)^T, bf16 operands, fp32 accumulator.  fp32 inputs (either operand) take an
  fp32 dot with ``input_precision="ieee"`` (no TF32: its 10-bit mantissa is far outside the
  router's tolerance).  Under the interpreter the dot is an fp32 broadcast-and-sum instead:
  its ``tl.dot`` is wrong in bf16, and in fp32 it is numpy's BLAS, whose result for a row
  depends on the row's position in the tile (OpenBLAS kernels), which would break the bitwise
  batch-invariance tests on the CPU; on the GPU a tile's rows all run the same instructions.
  Writes fp32 partials (SPLIT, T, E).
* ``route_topk_kernel``: ROWS (``topk_rows``) tokens per program, one warp per 256 scores of
  its tile (:func:`topk_warps`).  Sums the SPLIT partials in split order 0..SPLIT-1, scores =
  sqrt(softplus(logits)), biased = scores + bias, K passes of an arg-max (tie: the lowest
  expert id wins on an equal biased score), weights = unbiased scores of the selected, summed
  one at a time in selection order (so the sum does not depend on the tile's layout or ROWS),
  renormalised, times ``routed_scaling_factor``.  Writes weights (T, K) fp32, ids (T, K)
  int32.  With ``ALIGN`` (the moe's decode call at T <= :data:`FUSED_ALIGN_MAX_T`,
  :class:`RouteAlign`) one program takes every row and then sorts the T*K slots it stored by
  expert (kernels/moe_align.py's one-program path, ``align_small``): the same integers as
  the align's own launch.

softplus follows torch (threshold 20: the identity above it) and uses log1p's Kahan form
``log(u) * e / (u - 1)``, u = 1 + e, which stays accurate where ``exp(l)`` is far below one ulp
of 1 (plain ``log(1 + exp(l))`` loses all digits there).

Bytes: the gate E*D*itemsize from HBM once, then from L2 once per BLOCK_T tokens (2 MiB at
V4-Flash in bf16); x T*D*itemsize once per E / BLOCK_E tile column (L2 after the first);
partials 2*SPLIT*T*E*4 (written, then read by the top-k); outputs T*K*8.

Numerics: for a fixed :class:`RouteSchedule` a row's logits do not depend on the other rows (a
dot's row depends only on that row of x), so any fixed schedule is batch invariant.  ``split``
and ``block_k`` change the fp32 summation order; ``block_t``, ``block_e`` and ``num_warps`` pick
the tile and so may change the tensor-core instruction (mma.sync below 64 rows, wgmma at 64)
and its internal order; ``num_stages`` and ``topk_rows`` change no bit.  All stay within the
route tolerance (conformance/pairs.py); near-ties may then select other experts.

Schedule (:func:`route_config`, V4-Flash: E 256, D 4096, bf16; the default picks by T):

* T <= 64: one 64-token tile, BLOCK_E 32, split 16 (256-column slices): 8 x 16 = 128 programs,
  each reading a 16 KB slice of the gate, so the gate streams from HBM once over most SMs;
  partials 16*T*E*4 (1 MiB at T 64) stay in L2.  At T 1 the 64-row tile is padding, but the
  dot is not what costs there (the gate's bytes are).
* T <= 1024: BLOCK_T 64, BLOCK_E 64, split 4: 128 programs at T 512, the gate re-read from L2
  once per 64 tokens, partials 4 MiB at T 1024.
* larger T: BLOCK_T 64, BLOCK_E 128, split 2: 256 programs at T 4096 (64 x 2 tiles x 2
  slices), gate L2 reads 128 MiB, x read twice, partials 8 MiB written and read.
* ``batch_invariant=True``: one schedule for every T, BLOCK_T 64, BLOCK_E 64, split 8: 32
  programs of 64 KB at T 1, 2048 programs and 32 MiB of partials at T 4096.

Every D split and tile is clipped to the shapes (a split never narrower than BLOCK_K, a tile
no wider than the padded E), so small test shapes launch few programs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from dsv4mtp.errors import ConfigError

from ._launch import INTERPRET, TritonLaunch, cdiv, next_pow2, plan, triton_launch, workspaces
from .moe_align import align_small, small_align
from .moe_common import jit_loop_bounds

__all__ = ["RouteAlign", "RouteSchedule", "fused_align", "route_config", "route_triton"]


def _pow2(name: str, v: object, lo: int, hi: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or v > hi or v & (v - 1):
        raise ConfigError(f"{name}: expected a power of two in [{lo}, {hi}], got {v!r}")


@dataclass(frozen=True)
class RouteSchedule:
    """The router's launch (see the module doc, "Numerics", for what each knob may change).

    ``block_t`` tokens x ``block_e`` experts per logits program, ``block_k`` D columns per dot
    step, ``split`` D slices (an upper bound: a slice is at least ``block_k`` columns),
    ``num_warps`` / ``num_stages`` of the logits kernel, ``topk_rows`` tokens per top-k program.
    """

    block_t: int
    block_e: int
    block_k: int
    split: int
    num_warps: int = 4
    num_stages: int = 3
    topk_rows: int = 1

    def __post_init__(self) -> None:
        _pow2("RouteSchedule.block_t", self.block_t, 16, 256)  # tl.dot: every side >= 16
        _pow2("RouteSchedule.block_e", self.block_e, 16, 256)
        _pow2("RouteSchedule.block_k", self.block_k, 16, 512)
        _pow2("RouteSchedule.split", self.split, 1, 256)
        _pow2("RouteSchedule.num_warps", self.num_warps, 1, 16)
        _pow2("RouteSchedule.topk_rows", self.topk_rows, 1, 64)
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int):
            raise ConfigError(f"RouteSchedule.num_stages: expected an int, got {self.num_stages!r}")
        if not 1 <= self.num_stages <= 8:
            raise ConfigError(
                f"RouteSchedule.num_stages: expected an int in [1, 8], got {self.num_stages}"
            )


_DECODE = RouteSchedule(block_t=64, block_e=32, block_k=128, split=16)
_MID = RouteSchedule(block_t=64, block_e=64, block_k=64, split=4, topk_rows=4)
_LARGE = RouteSchedule(block_t=64, block_e=128, block_k=64, split=2, topk_rows=4)
_INVARIANT = RouteSchedule(block_t=64, block_e=64, block_k=64, split=8)


def route_config(T: int, D: int, E: int, batch_invariant: bool = False) -> RouteSchedule:
    """The default schedule for T tokens of hidden size D over E experts (module doc,
    "Schedule"); ``batch_invariant=True``: the same schedule for every T.  D and E only clip
    it (:func:`_launch_shape`), so the choice itself depends on T alone."""
    del D, E  # the launcher clips the schedule to the shapes
    if batch_invariant:
        return _INVARIANT
    if T <= 64:
        return _DECODE
    if T <= 1024:
        return _MID
    return _LARGE


def _launch_shape(s: RouteSchedule, D: int, E: int) -> tuple[int, int, int, int]:
    """(block_e, block_k, d_split, split) clipped to the shapes: a tile no wider than E padded
    to a power of two, a step no wider than D padded, slices of whole steps.  Depends on D and
    E only, never on T."""
    block_e = min(s.block_e, max(16, next_pow2(E)))
    block_k = min(s.block_k, max(16, next_pow2(D)))
    d_split = cdiv(cdiv(D, s.split), block_k) * block_k
    return block_e, block_k, d_split, cdiv(D, d_split)


@jit_loop_bounds("D_SPLIT")
def route_logits_kernel(
    x_ptr,
    w_ptr,
    part_ptr,
    T,
    E,
    D,
    D_SPLIT,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    INTERP: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_e = tl.program_id(1)
    pid_s = tl.program_id(2)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    kk = tl.arange(0, BLOCK_K)
    tm = t < T
    em = e < E
    x_rows = x_ptr + t[:, None].to(tl.int64) * D
    w_rows = w_ptr + e[:, None].to(tl.int64) * D
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    k_lo = pid_s * D_SPLIT
    for kd in range(0, D_SPLIT, BLOCK_K):
        k = k_lo + kd + kk
        if EVEN_K:  # every slice lies inside D
            x = tl.load(x_rows + k[None, :], mask=tm[:, None], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=em[:, None], other=0.0)
        else:
            km = k < D
            x = tl.load(x_rows + k[None, :], mask=tm[:, None] & km[None, :], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=em[:, None] & km[None, :], other=0.0)
        if INTERP:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        elif DOT_F32:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    out = part_ptr + (pid_s * T + t[:, None]).to(tl.int64) * E + e[None, :]
    tl.store(out, acc, mask=tm[:, None] & em[None, :])


@jit_loop_bounds("NB_MAX")
def route_topk_kernel(
    part_ptr,
    bias_ptr,
    w_out_ptr,
    id_out_ptr,
    mask_ptr,
    map_ptr,
    sorted_ptr,
    block_expert_ptr,
    T,
    E,
    scaling,
    E_MAP,
    E_LOCAL,
    NB_MAX,
    HAS_MASK: tl.constexpr,
    SPLIT: tl.constexpr,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ALIGN: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SB: tl.constexpr,
    NB_B: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rm = rows < T
    e = tl.arange(0, BLOCK_E)
    em = e < E
    m2 = rm[:, None] & em[None, :]
    logits = tl.zeros((ROWS, BLOCK_E), dtype=tl.float32)
    for s in range(SPLIT):  # split order: the same sum for every schedule with this split
        logits += tl.load(part_ptr + (s * T + rows[:, None]) * E + e[None, :], mask=m2, other=0.0)
    ex = tl.exp(logits)
    u = 1.0 + ex
    log1p = tl.where(u == 1.0, ex, tl.log(u) * ex / (u - 1.0))
    softplus = tl.where(logits > 20.0, logits, log1p)
    scores = tl.sqrt(softplus)
    bias = tl.load(bias_ptr + e, mask=em, other=0.0).to(tl.float32)
    biased = tl.where(em[None, :], scores + bias[None, :], float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    sel_w = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    sel_id = tl.zeros((ROWS, BLOCK_K), dtype=tl.int32)
    total = tl.zeros((ROWS,), dtype=tl.float32)
    for k in range(K):
        best = tl.max(biased, axis=1)
        hit = biased == best[:, None]
        idx = tl.min(tl.where(hit, e[None, :], BLOCK_E), axis=1)  # lowest id on a tie
        pick = e[None, :] == idx[:, None]
        w = tl.sum(tl.where(pick, scores, 0.0), axis=1)  # one nonzero term: exact
        total += w  # selection order, whatever the layout
        sel_w = tl.where(slots[None, :] == k, w[:, None], sel_w)
        sel_id = tl.where(slots[None, :] == k, idx[:, None], sel_id)
        biased = tl.where(pick, float("-inf"), biased)
    sel_w = sel_w / total[:, None] * scaling
    if HAS_MASK:  # padding rows (mask False) route to no expert: id -1, here, not in a 2nd launch
        real = tl.load(mask_ptr + rows, mask=rm, other=0) != 0
        sel_id = tl.where(real[:, None], sel_id, -1)
    out = rows[:, None] * K + slots[None, :]
    om = rm[:, None] & (slots[None, :] < K)
    tl.store(w_out_ptr + out, sel_w, mask=om)
    tl.store(id_out_ptr + out, sel_id, mask=om)
    if ALIGN:
        # the one program of the grid (ROWS >= T) sorts the T*K slots it just stored by expert
        # (kernels/moe_align.py's one-program path): the ids' stores were made by other
        # threads of the program, and a CTA barrier orders them before the align's loads
        tl.debug_barrier()
        align_small(
            id_out_ptr, map_ptr, sorted_ptr, block_expert_ptr, T * K, E_MAP, E_LOCAL, NB_MAX,
            HAS_MAP, BLOCK_M, SB, NB_B,
        )  # fmt: skip


#: (row, expert) scores per warp of the top-k program: one warp for a one-row tile of 256
#: experts.  Its K passes are reductions over the tile (max, first index, the pick's sum); on
#: one warp they stay within the warp's shuffles, without a shared-memory round trip and barrier
#: per reduction, and a one-token step waits for that chain.  Exact reductions: no bit depends
#: on the warps.
TOPK_SCORES_PER_WARP = 256


def topk_warps(rows: int, block_e: int) -> int:
    """The top-k program's warps for a (rows, block_e) tile: one per
    :data:`TOPK_SCORES_PER_WARP` scores, 1 to 4."""
    return max(1, min(4, rows * block_e // TOPK_SCORES_PER_WARP))


#: The top-k and the slots' sort in one program up to this many tokens (and T*K slots within
#: the sort's one-program path, ``moe_align.small_align``: at most min(chunk, 128)).  One program of T rows replaces T one-row programs
#: and the sort's launch.  On the H200, the whole greedy step in one process
#: (bench/diag/fusion_ab.py, bench/results/mtp-h200.md): -1.9 us at T 1, +8.0 us at T 8 (its
#: one program of 8 rows on 4 warps against 8 one-warp programs, then a 64-slot sort), so
#: one token only; 0 turns it off.
FUSED_ALIGN_MAX_T = 1


@dataclass(frozen=True)
class RouteAlign:
    """Where a fused sort writes (kernels/moe_align.py's outputs for ``block_m``-row blocks over
    ``e_local`` experts, ``expert_map`` global -> local or None): ``sorted_slot``
    (NB_MAX*block_m,) and ``block_expert`` (NB_MAX,) int32, NB_MAX = ``max_blocks``."""

    expert_map: torch.Tensor | None
    e_local: int
    block_m: int
    chunk: int
    sorted_slot: torch.Tensor
    block_expert: torch.Tensor


def fused_align(
    T: int, K: int, e_local: int, block_m: int, chunk: int
) -> tuple[int, int, int] | None:
    """(NB_MAX, SB, NB_B) of the sort in the top-k's program for T tokens of K slots over
    ``e_local`` experts in ``block_m``-row blocks, or None (more than
    :data:`FUSED_ALIGN_MAX_T` tokens, or slots past the sort's one-program path)."""
    if T > FUSED_ALIGN_MAX_T:
        return None
    return small_align(T * K, e_local, block_m, chunk)


# A call's plan: (logits grid, logits launch, top-k grid, top-k launch, partials (split*T*E,)).
_Plan = tuple[tuple[int, int, int], TritonLaunch, tuple[int], TritonLaunch, torch.Tensor, int]


def _plan(
    device: torch.device,
    T: int,
    D: int,
    E: int,
    K: int,
    dot_f32: bool,
    s: RouteSchedule,
    masked: bool = False,
    align: tuple[int, int, int, int, bool] | None = None,
) -> _Plan:
    """Everything of a call but its tensors and scalars; kept per (shapes, stream) by
    :func:`~._launch.plan`.  ``align`` = (BLOCK_M, NB_MAX, SB, NB_B, HAS_MAP): the top-k as one
    program that also sorts the slots (:func:`route_triton`)."""
    block_e, block_k, d_split, split = _launch_shape(s, D, E)
    # fp32 operand tiles take twice the shared memory per stage: two stages keep the widest
    # tiles (256 x 64 gate, 64 x 64 x) within the SM's 228 KB
    stages = min(s.num_stages, 2) if dot_f32 else s.num_stages
    logits = triton_launch(
        route_logits_kernel, BLOCK_T=s.block_t, BLOCK_E=block_e, BLOCK_K=block_k,
        EVEN_K=D % d_split == 0, DOT_F32=dot_f32, INTERP=INTERPRET, num_warps=s.num_warps,
        num_stages=stages,
    )  # fmt: skip
    rows = s.topk_rows if align is None else max(s.topk_rows, next_pow2(T))
    block_m, _, sb, nb_b, has_map = align if align is not None else (1, 0, 1, 1, False)
    topk = triton_launch(
        route_topk_kernel, HAS_MASK=masked, SPLIT=split, K=K, ROWS=rows, BLOCK_E=next_pow2(E),
        BLOCK_K=next_pow2(K), ALIGN=align is not None, HAS_MAP=has_map, BLOCK_M=block_m, SB=sb,
        NB_B=nb_b, num_warps=topk_warps(rows, next_pow2(E)),
    )  # fmt: skip
    (part,) = workspaces("moe_route", device, split * T * E)  # (split, T, E), written first
    grid = (cdiv(T, s.block_t), cdiv(E, block_e), split)
    return grid, logits, (cdiv(T, rows),), topk, part, d_split


def route_triton(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor,
    top_k: int,
    scaling: float,
    weights_out: torch.Tensor,
    ids_out: torch.Tensor,
    batch_invariant: bool = False,
    schedule: RouteSchedule | None = None,
    row_mask: torch.Tensor | None = None,
    align: RouteAlign | None = None,
) -> None:
    """x (T, D) contiguous, gate_weight (E, D) contiguous, gate_bias (E,) -> weights_out (T, K)
    fp32, ids_out (T, K) int32 (both contiguous, written in place).  ``schedule`` None: the
    default of :func:`route_config` for this T (``batch_invariant``: the T-independent one).
    ``row_mask`` (T,) bool: rows where it is False get ids -1 (padding rows of a CUDA-graph
    bucket: no expert reads them); their weights are computed as for any row.

    ``align``: a :class:`RouteAlign` for a call whose slots :func:`fused_align` accepts (else a
    ConfigError: its outputs would stay unwritten): the top-k runs as one program that then
    sorts the T*K slots by expert into the align's outputs (kernels/moe_align.py's one-program
    path, the same integers as ``moe_align_triton``), one launch fewer on a decode step's
    chain."""
    T, D = x.shape
    E = gate_weight.shape[0]
    if T == 0:
        return
    s = schedule if schedule is not None else route_config(T, D, E, batch_invariant)
    # bf16 x bf16 runs on the tensor cores; anything fp32 in fp32
    dot_f32 = x.dtype != torch.bfloat16 or gate_weight.dtype != torch.bfloat16
    masked = row_mask is not None
    meta = None
    if align is not None:
        small = fused_align(T, int(top_k), align.e_local, align.block_m, align.chunk)
        if small is None:
            raise ConfigError(
                f"align: {T} tokens of {top_k} slots are not sorted in the router's program "
                f"(fused_align: at most {FUSED_ALIGN_MAX_T} tokens, the sort's one-program path)"
            )
        meta = (align.block_m, *small, align.expert_map is not None)
    grid, logits, tgrid, topk, part, d_split = plan(
        _plan, x.device, T, D, E, int(top_k), dot_f32, s, masked, meta
    )
    logits(grid, x, gate_weight, part, T, E, D, d_split)
    mask = row_mask.contiguous().view(torch.uint8) if row_mask is not None else ids_out
    if align is None:
        topk(tgrid, part, gate_bias, weights_out, ids_out, mask, ids_out, ids_out, ids_out, T, E,
             float(scaling), 0, 0, 0)  # fmt: skip
        return
    assert meta is not None
    emap = align.expert_map if align.expert_map is not None else ids_out
    e_map = align.expert_map.numel() if align.expert_map is not None else align.e_local
    topk(tgrid, part, gate_bias, weights_out, ids_out, mask, emap, align.sorted_slot,
         align.block_expert, T, E, float(scaling), e_map, align.e_local, meta[1])  # fmt: skip
