"""Backend choice of every optimized op: one table per op, one error path.

Each op lists its backends in ``TABLES[op]``: a name and a requirement check that returns the
reason the backend does not apply to a call (or None when it does), plus the order ``"auto"``
tries them in.  Adding a backend to an op is one :class:`Backend` line here plus its kernel; the
conformance suite generates that backend's contract tests from :func:`backend_names`.

The checks read :class:`Facts`, the few properties of a validated call that decide which
kernels can run it (device, dtypes, stream count, eps, whether FlashInfer imports).  They never
read T.  ``auto`` may read T through an op's ``by_T`` rule, and only when the call passes
``batch_invariant=False``: the op then puts T in its Facts; with ``batch_invariant=True`` Facts
carry ``T=None`` and every choice is the same for every batch size, so a token's bits do not
depend on its batch.  ``hc_head`` (:data:`HEAD_MMA_MIN_T`) and ``hc_pre`` (:data:`PRE_FMA_MAX_T`)
have ``by_T`` rules, and so do the fused pairs ``hc_post_head`` / ``hc_post_pre`` built on them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dsv4mtp.errors import InputError

from .kernels._flashinfer import flashinfer_mismatch

__all__ = [
    "HEAD_MMA_MIN_T",
    "PLANS",
    "PRE_FMA_MAX_T",
    "TABLES",
    "Backend",
    "Facts",
    "OpTable",
    "backend_names",
    "clear_plans",
    "remember",
    "requirement",
    "select",
]

_FI_HC = 4  # FlashInfer's mHC kernels are compiled for 4 streams only


@dataclass(frozen=True)
class Facts:
    """What decides which backends can run a call (filled by the op after validating it).

    dtypes: the dtypes of the tensors a kernel reads (for FlashInfer all must be bf16);
    n, D: streams and hidden size (mHC ops; 0 elsewhere); eps: the eps arguments;
    order: the RMSNorm order (rms_norm only); has_weight: rms_norm has a weight.
    T: the batch size, given only by a call with ``batch_invariant=False`` (else None); read by
    an op's ``by_T`` rule, never by a requirement check.
    """

    device: torch.device
    dtypes: tuple[torch.dtype, ...]
    n: int = 0
    D: int = 0
    eps: tuple[float, ...] = ()
    order: str = "official"
    has_weight: bool = True
    T: int | None = None


@dataclass(frozen=True)
class Backend:
    """One backend of an op: ``requires(facts)`` is the reason it does not apply, or None."""

    name: str
    requires: Callable[[Facts], str | None]


@dataclass(frozen=True)
class OpTable:
    """An op's backends (every explicit choice) and the order ``"auto"`` tries them in.

    ``by_T`` (optional): auto's pick by batch size, tried first when the Facts carry T; it
    returns a backend name or None (then the ``auto`` order decides).
    """

    op: str
    backends: tuple[Backend, ...]
    auto: tuple[str, ...]
    by_T: Callable[[Facts], str | None] | None = None

    def backend(self, name: str) -> Backend:
        for b in self.backends:
            if b.name == name:
                return b
        names = ", ".join(repr(b.name) for b in self.backends)
        raise InputError(f"backend: {self.op} has no backend {name!r}; expected 'auto', {names}")


def _always(facts: Facts) -> str | None:
    return None


def _bf16_cuda(facts: Facts) -> str | None:
    if facts.device.type != "cuda":
        return f"needs CUDA tensors, got {facts.device}"
    if any(dt != torch.bfloat16 for dt in facts.dtypes):
        return "needs bf16 inputs, got " + ", ".join(
            str(d).removeprefix("torch.") for d in facts.dtypes
        )
    return None


def _flashinfer_mhc(facts: Facts) -> str | None:
    reason = _bf16_cuda(facts)
    if reason is None and facts.n != _FI_HC:
        reason = f"needs n = {_FI_HC} streams (FlashInfer's mHC kernels), got {facts.n}"
    if reason is None and facts.D % 8:
        reason = f"needs D % 8 == 0, got D = {facts.D}"
    if reason is None and not all(e > 0 for e in facts.eps):
        reason = f"needs eps > 0, got {facts.eps}"
    if reason is None:
        reason = flashinfer_mismatch()
    return reason


def _flashinfer_norm(facts: Facts) -> str | None:
    # FlashInfer multiplies the weight in fp32 and rounds once (the official order) and takes one
    # dtype for x, weight and out.
    reason = _bf16_cuda(facts)
    if reason is None and not facts.has_weight:
        reason = "needs a weight"
    if reason is None and facts.order != "official":
        reason = f"computes order='official' only, got {facts.order!r}"
    if reason is None:
        reason = flashinfer_mismatch("norm")
    return reason


# hc_head's default (batch_invariant=False) runs the tensor-core collapse from this T on and the
# FMA kernel below it (None: the FMA kernel at every T).  Device time on the H200
# (bench/results/mhc-h200.md): FMA wins at T <= 64 (8.7 vs 17.8 us, D 4096), the collapse at
# T 512 (19.9 vs 29.1 us at D 4096, 24.9 vs 49.6 us at D 7168).  The eager sweep of
# bench/h200_overhead.py (host launch cost included) puts the crossover at 512 (D 7168) and
# 1024 (D 4096); under CUDA graphs, as the draft step runs, device time decides.
HEAD_MMA_MIN_T: int | None = 512


def _head_by_T(facts: Facts) -> str | None:
    if HEAD_MMA_MIN_T is not None and facts.T is not None and facts.T >= HEAD_MMA_MIN_T:
        return "triton_mma"
    return None


# hc_pre's default (batch_invariant=False) runs the small-batch FMA kernel
# (kernels/mhc_pre_small.py) up to this T and the one-pass collapse above it: the collapse costs
# 21-23 us at T <= 64, most of it a serial Sinkhorn and one token block's 16 / 28 programs; the
# FMA kernel spreads fn over 192 / 336 programs and re-reads it from L2 once per 16 tokens.
# With batch_invariant=True auto
# runs the FMA kernel at every T (its auto order below), as hc_head does: MTP's draft step, which
# calls hc_pre twice per step at T = batch, is the hot path, and a T-independent choice must
# serve it.  A prefill-sized batch then pays for that choice.
#
# Measured on the H200 (bench/diag/hc_pre_small_t.py, CUDA-graph replay, inputs rotated past the
# L2; bench/results/mhc-h200.md): triton_fma vs the collapse at D 4096 9.7 / 9.9 / 12.4 / 17.0 /
# 26.5 us (16-token blocks; 7.2 / 8.7 us at T 1 / 8 on the block by T) vs 21.4 / 21.9 / 21.9 /
# 22.7 / 23.2 us at T 1 / 8 / 32 / 64 / 128; at D 7168 13.5 / 14.3 / 19.9 / 28.4 us vs 21.0 /
# 21.1 / 21.7 / 23.0 us at T 1 / 8 / 32 / 64.  So the FMA kernel
# up to T 64 at D <= 4096 and up to T 32 at wider D (its mix re-reads fn per 16-token block).
PRE_FMA_MAX_T = 64
PRE_FMA_MAX_T_WIDE = 32  # D > 4096


def _pre_by_T(facts: Facts) -> str | None:
    tokens = facts.T
    if tokens is not None:
        limit = PRE_FMA_MAX_T if facts.D <= 4096 else PRE_FMA_MAX_T_WIDE
        return "triton_fma" if tokens <= limit else "triton"
    return None


# The fused pairs hc_post_pre / hc_post_head (optimized/mhc.py) take "triton_fma" (hc_post folded
# into the small-batch hc_pre / hc_head kernels) where those kernels are the ops' own choice, and
# "composed" (hc_post, then hc_pre / hc_head, each choosing its own backend) where they are not:
# fusion pays only where it removes a launch from the small-T critical path.
def _post_pre_by_T(facts: Facts) -> str | None:
    pick = _pre_by_T(facts)
    return None if pick is None else ("triton_fma" if pick == "triton_fma" else "composed")


def _post_head_by_T(facts: Facts) -> str | None:
    return "composed" if _head_by_T(facts) is not None else None


# The auto orders are measured on the H200 (bench/results/mhc-h200.md, norm-h200.md).  hc_pre:
# the one-pass Triton collapse beat the producer + FlashInfer pair at every measured T and D
# (T 4096: 88 vs 173 us at D 4096, 177 vs 232 us at D 7168).  hc_head: the FMA kernel is ~2x
# faster at the T of MTP's compute_logits (<= 64); "triton_mma" wins from T 512.  hc_post:
# FlashInfer where it applies (98 / 90 % of copy bandwidth at T 4096).  rms_norm: Triton.
TABLES: dict[str, OpTable] = {
    "rms_norm": OpTable(
        "rms_norm",
        (Backend("triton", _always), Backend("flashinfer", _flashinfer_norm)),
        auto=("triton",),
    ),
    "hc_pre": OpTable(
        "hc_pre",
        (
            Backend("triton", _always),
            Backend("triton_fma", _always),
            Backend("flashinfer", _flashinfer_mhc),
            Backend("flashinfer_prenorm", _flashinfer_mhc),
        ),
        auto=("triton_fma", "triton"),
        by_T=_pre_by_T,
    ),
    "hc_post": OpTable(
        "hc_post",
        (Backend("flashinfer", _flashinfer_mhc), Backend("triton", _always)),
        auto=("flashinfer", "triton"),
    ),
    "hc_head": OpTable(
        "hc_head",
        (Backend("triton_fma", _always), Backend("triton_mma", _always)),
        auto=("triton_fma",),
        by_T=_head_by_T,
    ),
    "hc_post_pre": OpTable(
        "hc_post_pre",
        (Backend("triton_fma", _always), Backend("composed", _always)),
        auto=("triton_fma",),
        by_T=_post_pre_by_T,
    ),
    "hc_post_head": OpTable(
        "hc_post_head",
        (Backend("triton_fma", _always), Backend("composed", _always)),
        auto=("triton_fma",),
        by_T=_post_head_by_T,
    ),
}


# ------------------------------------------------------------------------------ plans
# The validated plan of a call signature (chosen backend, schedule fields), keyed by everything
# the public function's checks and choice read: each tensor's class, dtype, shape and device,
# each scalar's class and value, backend, schedule, and each ``out`` tensor's class, shape,
# dtype, device and contiguity.  A call whose key is here passed every check with those exact
# properties, so it skips them; any other call (a new dtype, device, shape or out stride, or a
# key that cannot be built because an argument is not a tensor) takes the full path, which
# raises the same typed error as before.  Nothing is cached for a refused call.  No check of the
# ops reads tensor values (none syncs the device), so nothing per call is skipped that the
# uncached path does.  While torch.compile traces, the full path runs (its checks become guards).
# The keys hold T, so a serving loop adds one plan per distinct batch size; past _MAX_PLANS the
# cache starts over.  Tests that monkeypatch the tables or the checks call clear_plans().
_MAX_PLANS = 4096
PLANS: dict[tuple[object, ...], tuple[object, ...]] = {}


def remember(key: tuple[object, ...], plan: tuple[object, ...]) -> None:
    """Keep ``plan`` for calls with ``key`` (a validated call only)."""
    if len(PLANS) >= _MAX_PLANS:
        PLANS.clear()
    PLANS[key] = plan


def _out_part(out: Any) -> object:
    """What check_out reads from an ``out`` tensor, or from each tensor of an ``out`` tuple."""
    if out is None:
        return None
    if isinstance(out, torch.Tensor):
        return (out.__class__, out.shape, out.dtype, out.device, out.is_contiguous())
    if isinstance(out, (tuple, list)):
        return (out.__class__, *[_out_part(o) for o in out])
    return (out.__class__,)  # refused by the checks, so never cached


def signature(name: str, *parts: Any, out: Any = None) -> tuple[object, ...] | None:
    """A call's plan key: ``name``, each tensor's class, dtype, shape and device, each other
    argument's class and value, and ``out`` as check_out reads it.  None while torch.compile
    traces (the checks then run every time and become its guards)."""
    if torch.compiler.is_compiling():
        return None
    key = tuple(
        (p.__class__, p.dtype, p.shape, p.device) if isinstance(p, torch.Tensor)
        else (p.__class__, p)
        for p in parts
    )  # fmt: skip
    return (name, *key, _out_part(out))


def planned(
    key: tuple[object, ...] | None, build: Callable[[], tuple[Any, ...]]
) -> tuple[Any, ...]:
    """The plan of a call: from the cache under ``key``, else ``build()`` (every check and the
    choice; it raises for a refused call, which is then not cached), remembered."""
    plan = None
    if key is not None:
        try:
            plan = PLANS.get(key)
        except TypeError:  # an unhashable argument: the checks say what
            key = None
    if plan is None:
        plan = build()
        if key is not None:
            remember(key, plan)
    return plan


def clear_plans() -> None:
    """Forget every cached plan (after changing a table or a check in a test)."""
    PLANS.clear()


def backend_names(op: str) -> tuple[str, ...]:
    """Every explicit backend of ``op`` (the choices besides ``"auto"``), in table order."""
    return tuple(b.name for b in TABLES[op].backends)


def requirement(op: str, backend: str, facts: Facts) -> str | None:
    """Why ``backend`` cannot run a call with these facts, or None when it can."""
    return TABLES[op].backend(backend).requires(facts)


def select(op: str, backend: str, facts: Facts) -> str:
    """The backend that runs the call: ``backend`` itself, checked, or auto's pick: the op's
    ``by_T`` rule where the Facts carry T, else the first of its auto order that applies.

    The one error path: an unknown name or a backend that does not apply is an
    :class:`InputError` naming the op, the backend and the reason.
    """
    table = TABLES[op]
    if backend == "auto":
        if facts.T is not None and table.by_T is not None:
            name = table.by_T(facts)
            if name is not None and table.backend(name).requires(facts) is None:
                return name
        for name in table.auto:
            if table.backend(name).requires(facts) is None:
                return name
        raise InputError(f"backend: no {op} backend applies to this call")  # a table bug
    if not isinstance(backend, str):
        raise InputError(f"backend: expected a backend name (str), got {type(backend).__name__}")
    reason = table.backend(backend).requires(facts)
    if reason is not None:
        raise InputError(f"backend: {op} backend {backend!r} does not apply: it {reason}")
    return backend


# ------------------------------------------------------------------------------ MoE
# route, fused_experts and moe run the Triton kernels of optimized/kernels/moe_*.py (FlashInfer's
# sm_90 CUTLASS W4A16 MoE did not finish its JIT build in 9 minutes on the GPU machine, and its
# moe_ep modules have no FP4 path on sm_90).  The kernels take bf16 / fp32 activations on CUDA or
# under the interpreter; the entry points check dtypes and devices before the table is read.
TABLES.update(
    {
        "route": OpTable("route", (Backend("triton", _always),), auto=("triton",)),
        "fused_experts": OpTable("fused_experts", (Backend("triton", _always),), auto=("triton",)),
        "moe": OpTable("moe", (Backend("triton", _always),), auto=("triton",)),
    }
)


# ------------------------------------------------------------------------------ attention
# sink_attention / sink_attention_varlen run the Triton kernel of
# optimized/kernels/sink_attention.py (bf16 / fp32 on CUDA or under the interpreter; the entry
# points check dtypes and devices before the table is read).  No by_T rule: the default schedule
# reads H, Dh and the window only.
TABLES.update(
    {
        "sink_attention": OpTable(
            "sink_attention", (Backend("triton", _always),), auto=("triton",)
        ),
        "sink_attention_varlen": OpTable(
            "sink_attention_varlen", (Backend("triton", _always),), auto=("triton",)
        ),
    }
)


# ------------------------------------------------------------------------------ linear
# linear / grouped_linear / eh_proj run the Triton kernel of optimized/kernels/linear.py (FP8
# block or bf16 / fp32 weights, bf16 / fp32 activations, on CUDA or under the interpreter; the
# entry points check dtypes and devices before the table is read).  No by_T rule: the backend's own
# schedule reads the row count (kernels/linear.py, linear_schedule; from DEQUANT_MM_MIN_ROWS rows
# an exact-bf16 FP8 pack is dequantized by a Triton pass and multiplied by cuBLAS,
# ``dequant_mm_selected``), and batch_invariant pins the Triton kernel's decode schedule.
TABLES.update(
    {
        "linear": OpTable("linear", (Backend("triton", _always),), auto=("triton",)),
        "grouped_linear": OpTable(
            "grouped_linear", (Backend("triton", _always),), auto=("triton",)
        ),
        "eh_proj": OpTable("eh_proj", (Backend("triton", _always),), auto=("triton",)),
    }
)


# ------------------------------------------------------------------------------ RoPE, q / kv paths
# apply_rope, q_head_norm_rope and kv_norm_rope run the Triton kernel of optimized/kernels/rope.py
# (bf16 / fp32 on CUDA or under the interpreter; the entry points check dtypes and devices before
# the table is read).  No by_T rule: the tile reads H and D only.
TABLES.update(
    {
        op: OpTable(op, (Backend("triton", _always),), auto=("triton",))
        for op in ("apply_rope", "q_head_norm_rope", "kv_norm_rope")
    }
)


# ------------------------------------------------------------------------------ KV ring cache
# sink_attention_cache runs the ring-cache Triton kernel of optimized/kernels/sink_attention.py
# (bf16 / fp32 on CUDA or under the interpreter; the entry point checks dtypes and devices before
# the table is read).  No by_T rule: the schedule is sink_attention's, read by H, Dh and window.
TABLES.update(
    {
        "sink_attention_cache": OpTable(
            "sink_attention_cache", (Backend("triton", _always),), auto=("triton",)
        ),
    }
)


# ------------------------------------------------------------------------------ paged KV cache
# sink_attention_paged runs the paged-cache Triton kernel of optimized/kernels/sink_attention.py
# (bf16 / fp32 on CUDA or under the interpreter; the entry point checks dtypes and devices before
# the table is read).  No by_T rule: the schedule is sink_attention's, read by H, Dh and window.
TABLES.update(
    {
        "sink_attention_paged": OpTable(
            "sink_attention_paged", (Backend("triton", _always),), auto=("triton",)
        ),
    }
)
