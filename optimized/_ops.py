"""The optimized ops as PyTorch operators in the ``dsv4mtp`` namespace.

``torch.ops.dsv4mtp.<op>`` (functional: allocates and returns its outputs) and
``torch.ops.dsv4mtp.<op>_out`` (writes keyword-only ``out`` tensors, declared mutated in the
schema, returns nothing) for ``rms_norm``, ``hc_pre``, ``hc_post``, ``hc_head`` and the fused pairs
``hc_post_pre`` / ``hc_post_head``.  Schemas carry
tensors and plain scalars only: the backend is the name the public function already chose (never
"auto"), and a hc_pre / hc_head schedule travels as two int lists (:func:`schedule_fields`; empty
means the measured default).  The operators trust their arguments: the public functions in
``norm.py`` / ``mhc.py`` validate, choose the backend through ``_dispatch.select`` and call them.

Registration: one ``torch.library.Library("dsv4mtp", "DEF")`` with ``define``, ``impl`` on the
CPU and CUDA keys (the same Python kernel: CPU tensors run under ``TRITON_INTERPRET=1``) and
``register_fake`` (shapes and dtypes only, for FakeTensor tracing and ``torch.compile``).  A
define/impl kernel is a plain Python function the dispatcher calls with the unboxed arguments;
``torch.library.custom_op`` would put its own Python wrapper (argument binding, mutation checks)
on every eager call.  No autograd kernel: the ops are inference-only.  Registration runs once per
process; a second import of this module (as ``optimized._ops`` beside ``dsv4mtp.optimized._ops``)
finds the schemas defined and registers nothing.  Nothing here imports triton or flashinfer: the
kernels load on the first call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from dsv4mtp.errors import InputError

from .kernels import _flashinfer as fi
from .kernels._launch import triton_kernel, workspace

if TYPE_CHECKING:
    from .kernels.mhc_collapse import CollapseConfig, mhc_collapse
    from .kernels.mhc_head import mhc_head_fma, mhc_post_head_fma
    from .kernels.mhc_mix import MixConfig, mhc_mix_splitk, mix_config
    from .kernels.mhc_post import mhc_post_triton
    from .kernels.mhc_pre_small import mhc_post_pre_fma, mhc_pre_fma
    from .kernels.rms_norm import rms_norm_triton
else:
    # Imported on the first call that needs them: triton is optional (the `gpu` extra).
    CollapseConfig = triton_kernel("mhc_collapse", "CollapseConfig")
    MixConfig = triton_kernel("mhc_mix", "MixConfig")
    mhc_collapse = triton_kernel("mhc_collapse", "mhc_collapse")
    mhc_head_fma = triton_kernel("mhc_head", "mhc_head_fma")
    mhc_mix_splitk = triton_kernel("mhc_mix", "mhc_mix_splitk")
    mix_config = triton_kernel("mhc_mix", "mix_config")
    mhc_post_triton = triton_kernel("mhc_post", "mhc_post_triton")
    mhc_pre_fma = triton_kernel("mhc_pre_small", "mhc_pre_fma")
    mhc_post_pre_fma = triton_kernel("mhc_pre_small", "mhc_post_pre_fma")
    mhc_post_head_fma = triton_kernel("mhc_head", "mhc_post_head_fma")
    rms_norm_triton = triton_kernel("rms_norm", "rms_norm_triton")

__all__ = ["NAMESPACE", "OPS", "SCHEMAS", "schedule_fields"]

NAMESPACE = "dsv4mtp"

# The mHC ops that collapse streams (hc_pre, hc_head and the fused pairs ending in them) end in
# the sublayer's RMSNorm when given its weight (``norm_weight``, ``norm_order``: rms_norm's
# weight and order, eps rms_norm_eps).
_NORM_TAIL = "Tensor? norm_weight, str norm_order"
_PRE_ARGS = (
    "Tensor x, Tensor fn, Tensor scale, Tensor base, float rms_norm_eps, float hc_eps, "
    "int sinkhorn_iters, float post_mult, str backend, int[] collapse, int[] mix, "
    f"bool batch_invariant, {_NORM_TAIL}"
)
_HEAD_ARGS = (
    "Tensor x, Tensor fn, Tensor scale, Tensor base, float rms_norm_eps, float hc_eps, "
    f"str backend, int[] collapse, {_NORM_TAIL}"
)
_NORM_ARGS = "Tensor x, Tensor? weight, float eps, str order, str backend"
_POST_ARGS = "Tensor f, Tensor residual, Tensor post, Tensor comb, str backend"
# The fused pairs: the backend ("triton_fma": one kernel pair; "composed": the two ops) and the
# two ops' own backends, which "composed" runs (chosen by the public function).
_POST_PRE_ARGS = (
    "Tensor a, Tensor x, Tensor post, Tensor comb, Tensor fn, Tensor scale, Tensor base, "
    "float rms_norm_eps, float hc_eps, int sinkhorn_iters, float post_mult, str backend, "
    f"str post_backend, str pre_backend, bool batch_invariant, {_NORM_TAIL}"
)
_POST_HEAD_ARGS = (
    "Tensor f, Tensor x, Tensor post, Tensor comb, Tensor fn, Tensor scale, Tensor base, "
    f"float rms_norm_eps, float hc_eps, str backend, str post_backend, str head_backend, "
    f"{_NORM_TAIL}"
)

#: The small-batch FMA kernels ("triton_fma") end in the norm inside their apply launch
#: (kernels/mhc_pre_small.py, kernels/mhc_head.py: one whole-row program per token).  False
#: runs the same arithmetic in two launches, the apply then ``rms_norm_triton`` at the apply's
#: warp count (the same bits): the A/B setting of bench/diag/fusion_ab.py.  Other backends
#: always run the norm as its own launch (``rms_norm_triton``'s default schedule).
FUSE_NORM = True
_FMA_NORM_WARPS = 4  # the FMA kernels' warps (pre_fma_config, mhc_head.NUM_WARPS)

SCHEMAS: dict[str, str] = {
    "rms_norm": f"rms_norm({_NORM_ARGS}) -> Tensor",
    "rms_norm_out": f"rms_norm_out({_NORM_ARGS}, *, Tensor(a!) out) -> ()",
    "hc_pre": f"hc_pre({_PRE_ARGS}) -> (Tensor, Tensor, Tensor)",
    "hc_pre_out": (
        f"hc_pre_out({_PRE_ARGS}, *, Tensor(a!) layer_input, Tensor(b!) post, "
        "Tensor(c!) comb) -> ()"
    ),
    "hc_post": f"hc_post({_POST_ARGS}) -> Tensor",
    "hc_post_out": f"hc_post_out({_POST_ARGS}, *, Tensor(a!) out) -> ()",
    "hc_head": f"hc_head({_HEAD_ARGS}) -> Tensor",
    "hc_head_out": f"hc_head_out({_HEAD_ARGS}, *, Tensor(a!) out) -> ()",
    "hc_post_pre": f"hc_post_pre({_POST_PRE_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)",
    "hc_post_pre_out": (
        f"hc_post_pre_out({_POST_PRE_ARGS}, *, Tensor(a!) x_out, Tensor(b!) layer_input, "
        "Tensor(c!) post_out, Tensor(d!) comb_out) -> ()"
    ),
    "hc_post_head": f"hc_post_head({_POST_HEAD_ARGS}) -> (Tensor, Tensor)",
    "hc_post_head_out": (
        f"hc_post_head_out({_POST_HEAD_ARGS}, *, Tensor(a!) x_out, Tensor(b!) head_input) -> ()"
    ),
}
OPS: tuple[str, ...] = tuple(SCHEMAS)

# ------------------------------------------------------------------------------ schedules
# A CollapseConfig as 8 ints (fused as 0 / 1, max_registers None as 0: its valid values are
# 24..255) and a MixConfig as 5; an empty list is the measured default.
_COLLAPSE_FIELDS = (
    "block_t", "d_slice", "block_k", "apply_d", "num_warps", "num_stages", "fused",
    "max_registers",
)  # fmt: skip
_MIX_FIELDS = ("block_t", "block_k", "num_splits", "num_warps", "num_stages")
NO_SCHEDULE: tuple[int, ...] = ()


def schedule_fields(collapse: Any, mix: Any) -> tuple[list[int], list[int]]:
    """A CollapseConfig / MixConfig pair (either None) as the operators' two int lists."""
    c = [int(getattr(collapse, f) or 0) for f in _COLLAPSE_FIELDS] if collapse else []
    m = [int(getattr(mix, f)) for f in _MIX_FIELDS] if mix else []
    return c, m


@functools.cache
def _collapse_cfg(fields: tuple[int, ...]) -> CollapseConfig | None:
    if not fields:
        return None
    block_t, d_slice, block_k, apply_d, num_warps, num_stages, fused, max_registers = fields
    return CollapseConfig(
        block_t, d_slice, block_k, apply_d, num_warps, num_stages, bool(fused),
        max_registers or None,
    )  # fmt: skip


@functools.cache
def _mix_cfg(fields: tuple[int, ...]) -> MixConfig | None:
    return MixConfig(**dict(zip(_MIX_FIELDS, fields, strict=True))) if fields else None


def _unknown(op: str, backend: str, names: Sequence[str]) -> InputError:
    return InputError(
        f"backend: torch.ops.dsv4mtp.{op} takes a chosen backend ({', '.join(names)}), "
        f"got {backend!r}; the public dsv4mtp.optimized.{op} resolves 'auto'"
    )


# ------------------------------------------------------------------------------ rms_norm
def _rms_norm_out(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    order: str,
    backend: str,
    *,
    out: torch.Tensor,
) -> None:
    if x.numel() == 0:
        return
    D = x.shape[-1]
    # (R, D) rows; a view only where x is not 2-D already (a view costs ~1 us of host time).
    # The Triton kernel reads 2-D rows through their stride (the attention's q rows, a column
    # slice of the fused wq_a + wkv output: no copy launch).
    strided = backend == "triton" and x.dim() == 2 and x.stride(1) == 1
    x2d = x if strided else x.contiguous()
    out2d = out
    if x.dim() != 2:
        x2d = x2d.view(-1, D)
        out2d = out.view(-1, D)
    w = weight.contiguous() if weight is not None else None
    if backend == "triton":
        rms_norm_triton(x2d, w, eps, out2d, vllm_order=(order == "vllm"))
    elif backend == "flashinfer":
        assert w is not None
        fi.rmsnorm(input=x2d, weight=w, eps=eps, out=out2d, enable_pdl=False)
    else:
        raise _unknown("rms_norm", backend, ("triton", "flashinfer"))


def _rms_norm_fake(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, order: str, backend: str
) -> torch.Tensor:
    return x.new_empty(x.shape)


# ------------------------------------------------------------------------------ hc_pre
def _collapse_inputs(
    x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_pre's and hc_head's kernels read contiguous x and fn, and scale / base in fp32 (the
    conversions only where needed: a no-op ``.to`` still costs a dispatcher round trip)."""
    return (
        x.contiguous(),
        fn.contiguous(),
        _f32(scale),
        _f32(base),
    )


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous() if t.dtype == torch.float32 else t.to(torch.float32).contiguous()


def _hc_pre_out(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    rms_norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    post_mult: float,
    backend: str,
    collapse: Sequence[int],
    mix: Sequence[int],
    batch_invariant: bool,
    norm_weight: torch.Tensor | None,
    norm_order: str,
    *,
    layer_input: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
) -> None:
    if x.shape[0] == 0:
        return
    fused = _fused_norm(backend == "triton_fma", norm_weight)
    li = layer_input if norm_weight is None or fused else torch.empty_like(layer_input)
    x, fn, scale32, base32 = _collapse_inputs(x, fn, scale, base)
    if backend == "triton":
        mhc_collapse(
            x, fn, scale32, base32, li,
            rms_norm_eps=rms_norm_eps, hc_eps=hc_eps, post=post, comb=comb, post_mult=post_mult,
            sinkhorn_iters=sinkhorn_iters, cfg=_collapse_cfg(tuple(collapse)),
        )  # fmt: skip
    elif backend == "triton_fma":
        mhc_pre_fma(
            x, fn, scale32, base32, li, post, comb, rms_norm_eps=rms_norm_eps,
            hc_eps=hc_eps, post_mult=post_mult, sinkhorn_iters=sinkhorn_iters,
            by_tokens=not batch_invariant, **_norm_kw(norm_weight if fused else None, norm_order),
        )  # fmt: skip
    elif backend in ("flashinfer", "flashinfer_prenorm"):
        _flashinfer_pre(
            backend, x, fn, scale32, base32, rms_norm_eps, hc_eps, sinkhorn_iters, post_mult, mix,
            (li, post, comb),
        )  # fmt: skip
    else:
        raise _unknown(
            "hc_pre", backend, ("triton", "triton_fma", "flashinfer", "flashinfer_prenorm")
        )
    if norm_weight is not None and not fused:
        _norm_after(li, norm_weight, rms_norm_eps, norm_order, backend == "triton_fma",
                    layer_input)  # fmt: skip


def _fused_norm(fma: bool, norm_weight: torch.Tensor | None) -> bool:
    """Whether the norm runs inside the FMA kernels' apply launch."""
    return fma and norm_weight is not None and FUSE_NORM


def _norm_after(
    rows: torch.Tensor, weight: torch.Tensor, eps: float, order: str, fma: bool,
    out: torch.Tensor,
) -> None:  # fmt: skip
    """The norm as its own launch over ``rows`` (T, D) into ``out``: at the FMA kernels' warp
    count after them (the fused launch's bits), else rms_norm's default schedule."""
    rms_norm_triton(
        rows, weight.contiguous(), eps, out, vllm_order=order == "vllm",
        num_warps=_FMA_NORM_WARPS if fma else None,
    )  # fmt: skip


def _flashinfer_pre(
    backend: str, x: torch.Tensor, fn: torch.Tensor, scale32: torch.Tensor,
    base32: torch.Tensor, rms_norm_eps: float, hc_eps: float, sinkhorn_iters: int,
    post_mult: float, mix: Sequence[int], outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:  # fmt: skip
    """hc_pre's FlashInfer backends: the split-K mix producer, then FlashInfer's Sinkhorn +
    pre-weighted sum into ``outs`` (layer_input, post, comb).  FlashInfer writes post as
    (T, 4, 1); ours is (T, 4): the same bytes."""
    layer_input, post, comb = outs
    T = x.shape[0]
    M, K = fn.shape
    mcfg = _mix_cfg(tuple(mix)) or mix_config(M, K)
    if backend == "flashinfer_prenorm":
        mcfg = replace(mcfg, num_splits=1)
    S = mcfg.num_splits
    # The split-K partials live in per-stream workspaces (kernels/_launch.py, "workspaces"):
    # written by the producer, read by FlashInfer's consumer next on the same stream.
    dev = x.device
    mixes, sq = mhc_mix_splitk(
        x.view(T, K), fn, mcfg,
        workspace("hc_pre.mix", (S, T, M), torch.float32, dev),
        workspace("hc_pre.sqsum", (S, T), torch.float32, dev),
    )  # fmt: skip
    if backend == "flashinfer":
        fi.mhc_pre_big_fuse(
            post_mix=post, comb_mix=comb, layer_input=layer_input,
            dot_mix=mixes[0] if S == 1 else mixes, sqrsum=sq[0] if S == 1 else sq, residual=x,
            mhc_scale=scale32, mhc_base=base32, k=K, rms_eps=rms_norm_eps, mhc_pre_eps=hc_eps,
            mhc_sinkhorn_eps=hc_eps, mhc_post_mult_value=post_mult,
            sinkhorn_repeat=sinkhorn_iters, num_splits=S, block_size=0,
        )  # fmt: skip
    else:
        fi.mhc_pre_big_fuse_with_prenorm(
            post_mix=post, comb_mix=comb, layer_input=layer_input, dot_mix=mixes[0], residual=x,
            mhc_scale=scale32, mhc_base=base32, rms_eps=rms_norm_eps, mhc_pre_eps=hc_eps,
            mhc_sinkhorn_eps=hc_eps, mhc_post_mult_value=post_mult,
            sinkhorn_repeat=sinkhorn_iters, block_size=0,
        )  # fmt: skip


def _norm_kw(norm_weight: torch.Tensor | None, norm_order: str) -> dict[str, Any]:
    """The FMA kernels' norm arguments."""
    if norm_weight is None:
        return {}
    return dict(norm_weight=norm_weight.contiguous(), vllm_order=norm_order == "vllm")


def _pre_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T, n, D = x.shape
    f32 = torch.float32
    return (
        x.new_empty((T, D)),
        x.new_empty((T, n), dtype=f32),
        x.new_empty((T, n, n), dtype=f32),
    )


def _hc_pre(
    x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *args: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    li, post, comb = _pre_outputs(x)
    _hc_pre_out(x, fn, scale, base, *args, layer_input=li, post=post, comb=comb)
    return li, post, comb


def _hc_pre_fake(
    x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *args: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _pre_outputs(x)


# ------------------------------------------------------------------------------ hc_post
def _hc_post_out(
    f: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    backend: str,
    *,
    out: torch.Tensor,
) -> None:
    if residual.shape[0] == 0:
        return
    f = f.contiguous()
    residual = residual.contiguous()
    post32 = _f32(post)
    comb32 = _f32(comb)
    if backend == "flashinfer":
        fi.mhc_post(out=out, x=f, residual=residual, post_layer_mix=post32, comb_res_mix=comb32)
    elif backend == "triton":
        mhc_post_triton(f, residual, post32, comb32, out)
    else:
        raise _unknown("hc_post", backend, ("flashinfer", "triton"))


def _hc_post_fake(
    f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, backend: str
) -> torch.Tensor:
    return residual.new_empty(residual.shape)


# ------------------------------------------------------------------------------ hc_head
def _hc_head_out(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    rms_norm_eps: float,
    hc_eps: float,
    backend: str,
    collapse: Sequence[int],
    norm_weight: torch.Tensor | None,
    norm_order: str,
    *,
    out: torch.Tensor,
) -> None:
    if x.shape[0] == 0:
        return
    fused = _fused_norm(backend == "triton_fma", norm_weight)
    y = out if norm_weight is None or fused else torch.empty_like(out)
    x, fn, scale32, base32 = _collapse_inputs(x, fn, scale, base)
    if backend == "triton_fma":
        mhc_head_fma(
            x, fn, scale32, base32, y, rms_norm_eps=rms_norm_eps, hc_eps=hc_eps,
            **_norm_kw(norm_weight if fused else None, norm_order),
        )  # fmt: skip
    elif backend == "triton_mma":
        mhc_collapse(
            x, fn, scale32, base32, y, rms_norm_eps=rms_norm_eps, hc_eps=hc_eps,
            post_mult=1.0, sinkhorn_iters=1, cfg=_collapse_cfg(tuple(collapse)),
        )  # fmt: skip
    else:
        raise _unknown("hc_head", backend, ("triton_fma", "triton_mma"))
    if norm_weight is not None and not fused:
        _norm_after(y, norm_weight, rms_norm_eps, norm_order, backend == "triton_fma", out)


def _hc_head(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    rms_norm_eps: float,
    hc_eps: float,
    backend: str,
    collapse: Sequence[int],
    norm_weight: torch.Tensor | None,
    norm_order: str,
) -> torch.Tensor:
    out = x.new_empty((x.shape[0], x.shape[2]))
    _hc_head_out(
        x, fn, scale, base, rms_norm_eps, hc_eps, backend, collapse, norm_weight, norm_order,
        out=out,
    )  # fmt: skip
    return out


def _hc_head_fake(x: torch.Tensor, *args: Any) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[2]))


# ------------------------------------------------------------------------------ hc_post_pre
def _hc_post_pre_out(
    a: torch.Tensor,
    x: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    rms_norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    post_mult: float,
    backend: str,
    post_backend: str,
    pre_backend: str,
    batch_invariant: bool,
    norm_weight: torch.Tensor | None,
    norm_order: str,
    *,
    x_out: torch.Tensor,
    layer_input: torch.Tensor,
    post_out: torch.Tensor,
    comb_out: torch.Tensor,
) -> None:
    if x.shape[0] == 0:
        return
    if backend == "composed":
        _hc_post_out(a, x, post, comb, post_backend, out=x_out)
        _hc_pre_out(
            x_out, fn, scale, base, rms_norm_eps, hc_eps, sinkhorn_iters, post_mult, pre_backend,
            NO_SCHEDULE, NO_SCHEDULE, batch_invariant, norm_weight, norm_order,
            layer_input=layer_input, post=post_out, comb=comb_out,
        )  # fmt: skip
    elif backend == "triton_fma":
        fused = _fused_norm(True, norm_weight)
        li = layer_input if norm_weight is None or fused else torch.empty_like(layer_input)
        x, fn, scale32, base32 = _collapse_inputs(x, fn, scale, base)
        mhc_post_pre_fma(
            a.contiguous(), x, _f32(post), _f32(comb), fn, scale32, base32, x_out, li,
            post_out, comb_out, rms_norm_eps=rms_norm_eps, hc_eps=hc_eps, post_mult=post_mult,
            sinkhorn_iters=sinkhorn_iters, by_tokens=not batch_invariant,
            **_norm_kw(norm_weight if fused else None, norm_order),
        )  # fmt: skip
        if norm_weight is not None and not fused:
            _norm_after(li, norm_weight, rms_norm_eps, norm_order, True, layer_input)
    else:
        raise _unknown("hc_post_pre", backend, ("triton_fma", "composed"))


def _post_pre_outputs(
    a: torch.Tensor, x: torch.Tensor, *args: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (x.new_empty(x.shape), *_pre_outputs(x))


def _hc_post_pre(
    *args: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    xo, li, post, comb = _post_pre_outputs(*args)
    _hc_post_pre_out(*args, x_out=xo, layer_input=li, post_out=post, comb_out=comb)
    return xo, li, post, comb


# ------------------------------------------------------------------------------ hc_post_head
def _hc_post_head_out(
    f: torch.Tensor,
    x: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    rms_norm_eps: float,
    hc_eps: float,
    backend: str,
    post_backend: str,
    head_backend: str,
    norm_weight: torch.Tensor | None,
    norm_order: str,
    *,
    x_out: torch.Tensor,
    head_input: torch.Tensor,
) -> None:
    if x.shape[0] == 0:
        return
    if backend == "composed":
        _hc_post_out(f, x, post, comb, post_backend, out=x_out)
        _hc_head_out(
            x_out, fn, scale, base, rms_norm_eps, hc_eps, head_backend, NO_SCHEDULE,
            norm_weight, norm_order, out=head_input,
        )  # fmt: skip
    elif backend == "triton_fma":
        fused = _fused_norm(True, norm_weight)
        y = head_input if norm_weight is None or fused else torch.empty_like(head_input)
        x, fn, scale32, base32 = _collapse_inputs(x, fn, scale, base)
        mhc_post_head_fma(
            f.contiguous(), x, _f32(post), _f32(comb), fn, scale32, base32, x_out, y,
            rms_norm_eps=rms_norm_eps, hc_eps=hc_eps,
            **_norm_kw(norm_weight if fused else None, norm_order),
        )  # fmt: skip
        if norm_weight is not None and not fused:
            _norm_after(y, norm_weight, rms_norm_eps, norm_order, True, head_input)
    else:
        raise _unknown("hc_post_head", backend, ("triton_fma", "composed"))


def _post_head_outputs(
    f: torch.Tensor, x: torch.Tensor, *args: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), x.new_empty((x.shape[0], x.shape[2]))


def _hc_post_head(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    xo, y = _post_head_outputs(*args)
    _hc_post_head_out(*args, x_out=xo, head_input=y)
    return xo, y


def _out_fake(*args: Any, **kwargs: Any) -> None:
    return None


# ------------------------------------------------------------------------------ registration
def _functional(
    out_kernel: Callable[..., None], like: Callable[..., torch.Tensor]
) -> Callable[..., torch.Tensor]:
    """The functional kernel of a one-output op: ``like``'s (the fake's) empty output on the
    inputs' device, written by the op's ``_out`` kernel."""

    def kernel(*args: Any) -> torch.Tensor:
        out = like(*args)
        out_kernel(*args, out=out)
        return out

    return kernel


_rms_norm = _functional(_rms_norm_out, _rms_norm_fake)
_hc_post = _functional(_hc_post_out, _hc_post_fake)

_KERNELS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "rms_norm": (_rms_norm, _rms_norm_fake),
    "rms_norm_out": (_rms_norm_out, _out_fake),
    "hc_pre": (_hc_pre, _hc_pre_fake),
    "hc_pre_out": (_hc_pre_out, _out_fake),
    "hc_post": (_hc_post, _hc_post_fake),
    "hc_post_out": (_hc_post_out, _out_fake),
    "hc_head": (_hc_head, _hc_head_fake),
    "hc_head_out": (_hc_head_out, _out_fake),
    "hc_post_pre": (_hc_post_pre, _post_pre_outputs),
    "hc_post_pre_out": (_hc_post_pre_out, _out_fake),
    "hc_post_head": (_hc_post_head, _post_head_outputs),
    "hc_post_head_out": (_hc_post_head_out, _out_fake),
}


def _defined(name: str) -> bool:
    return hasattr(getattr(torch.ops, NAMESPACE), name)


def _register(schemas: dict[str, str], kind: str = "FRAGMENT") -> torch.library.Library | None:
    """Define ``schemas``' operators with their CPU / CUDA kernels and fakes in one Library:
    "DEF" for the first section, "FRAGMENT"s beside it for the later ones.  None when an
    earlier import of this module under another name registered them already."""
    if all(_defined(name) for name in schemas):
        return None
    lib = torch.library.Library(NAMESPACE, kind)
    for name, schema in schemas.items():
        kernel, fake = _KERNELS[name]
        lib.define(schema)
        lib.impl(name, kernel, "CPU")
        lib.impl(name, kernel, "CUDA")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
    return lib


_LIB = _register(
    dict(SCHEMAS), "DEF"
)  # kept alive: dropping the Library object would deregister the ops


# ------------------------------------------------------------------------------ MoE
# The MoE operators (optimized/moe.py validates and packs; these run the kernels of
# optimized/kernels/moe_*.py).  A MoEPack cannot cross a schema: its tensors travel flat, the
# weight format as a string ("bf16", "fp8", "mxfp4", "nvfp4"; the shared expert "bf16", "fp8" or
# "fp8_exact").
if TYPE_CHECKING:
    from .kernels.moe_align import moe_align_triton
    from .kernels.moe_gemm import (
        act_quant_triton,
        moe_down_triton,
        moe_gate_up_triton,
        moe_reduce_triton,
        shared_expert_mm,
        shared_mm_selected,
    )
    from .kernels.moe_route import RouteAlign, fused_align, route_triton
else:
    moe_align_triton = triton_kernel("moe_align", "moe_align_triton")
    act_quant_triton = triton_kernel("moe_gemm", "act_quant_triton")
    moe_down_triton = triton_kernel("moe_gemm", "moe_down_triton")
    moe_gate_up_triton = triton_kernel("moe_gemm", "moe_gate_up_triton")
    moe_reduce_triton = triton_kernel("moe_gemm", "moe_reduce_triton")
    shared_expert_mm = triton_kernel("moe_gemm", "shared_expert_mm")
    shared_mm_selected = triton_kernel("moe_gemm", "shared_mm_selected")
    route_triton = triton_kernel("moe_route", "route_triton")
    RouteAlign = triton_kernel("moe_route", "RouteAlign")
    fused_align = triton_kernel("moe_route", "fused_align")

# A MoESchedule travels as an int list (kernels/moe_schedule.py, schedule_to_fields); an empty
# list is the default of the call's T (moe_config).
from .kernels.moe_schedule import MoESchedule, moe_config, schedule_from_fields  # noqa: E402

_ROUTE_ARGS = "Tensor x, Tensor gate_weight, Tensor gate_bias, int top_k, float scaling"
# moe carries batch_invariant once, with the experts' arguments; the router alone takes it here.
_ROUTE_OP_ARGS = f"{_ROUTE_ARGS}, bool batch_invariant"
_EXPERTS_ARGS = (
    "Tensor expert_map, Tensor w13, Tensor s13, Tensor w2, Tensor s2, Tensor gscale, str fmt, "
    "float limit, bool act_quant, bool batch_invariant, int[] schedule"
)
_SHARED_ARGS = (
    "Tensor shared_w13, Tensor shared_s13, Tensor shared_w2, Tensor shared_s2, str shared_fmt, "
    "float shared_limit, bool shared_act_quant"
)
_FE_ARGS = f"Tensor x, Tensor topk_ids, Tensor topk_weights, {_EXPERTS_ARGS}"
# row_mask (T,) bool, optional: rows where it is False are padding (a CUDA-graph bucket's
# filler): their routing ids become -1, so they touch no routed expert.
_MOE_ARGS = f"{_ROUTE_ARGS}, {_EXPERTS_ARGS}, {_SHARED_ARGS}, Tensor? row_mask=None"
_MOE_SCHEMAS: dict[str, str] = {
    "moe_route": f"moe_route({_ROUTE_OP_ARGS}) -> (Tensor, Tensor)",
    "moe_route_out": (
        f"moe_route_out({_ROUTE_OP_ARGS}, *, Tensor(a!) weights, Tensor(b!) ids) -> ()"
    ),
    "fused_experts": f"fused_experts({_FE_ARGS}) -> Tensor",
    "fused_experts_out": f"fused_experts_out({_FE_ARGS}, *, Tensor(a!) out) -> ()",
    "moe": f"moe({_MOE_ARGS}) -> Tensor",
    "moe_out": f"moe_out({_MOE_ARGS}, *, Tensor(a!) out) -> ()",
}
SCHEMAS.update(_MOE_SCHEMAS)
OPS = tuple(SCHEMAS)

# "mxfp4_tiles": MXFP4 codes and scales in MoEPack's "tiles" layout (optimized/moe.py);
# "mxfp4_tiles_fold": the same, every scale byte <= 128 (MoEPack.mx_fold)
_FMT_CODE = {
    "bf16": 0, "fp8": 1, "mxfp4": 2, "nvfp4": 3, "mxfp4_tiles": 2, "mxfp4_tiles_fold": 2,
}  # fmt: skip
# the shared expert's formats: "fp8_exact" is FP8 whose every block scale is a power of two
# (MoEPack.shared_exact_bf16), which prefill-sized calls run on cuBLAS (_shared_expert)
_SHARED_FMTS = ("bf16", "fp8", "fp8_exact")


def _fmt(fmt: str) -> tuple[int, bool, bool]:
    """(the kernels' format code, tiles layout, scales foldable into the bf16 decode) of an
    operator's ``fmt`` string."""
    if fmt not in _FMT_CODE:
        raise InputError(f"fmt: expected one of {tuple(_FMT_CODE)}, got {fmt!r}")
    return _FMT_CODE[fmt], fmt.startswith("mxfp4_tiles"), fmt == "mxfp4_tiles_fold"


def _moe_schedule(T: int, batch_invariant: bool, fields: Sequence[int], fmt: str) -> MoESchedule:
    if fields:
        return schedule_from_fields(tuple(fields))
    return moe_config(T, batch_invariant=batch_invariant, fmt=fmt)


@functools.cache
def _ones3(device: torch.device) -> torch.Tensor:
    return torch.ones((1, 3), dtype=torch.float32, device=device)


def _act_quant(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    act_quant_triton(x, out)
    return out


def _routed_into(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_map: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    gscale: torch.Tensor,
    fmt: str,
    limit: float,
    act_quant: bool,
    batch_invariant: bool,
    schedule: Sequence[int],
    shared: Callable[[], torch.Tensor | None],
    out: torch.Tensor,
    fork: Callable[[], None] | None = None,
    aligned: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """The routed experts into ``out``; ``shared()`` gives the shared expert's rows (or None)
    to the reduce, called just before it (it may join a side stream there); ``fork()`` (when
    given) starts the shared expert on its side stream where :func:`shared_fork` says: the
    side stream then waits for everything this stream launched up to that point.
    ``aligned``: (sorted_slot, block_expert) already sorted by the router's program (for this
    call's ``block_m``), else the sort runs here."""
    T, D = x.shape
    K = topk_ids.shape[1]
    if T == 0:
        return
    at = shared_fork(T) if fork is not None else None
    start_shared = fork if fork is not None else (lambda: None)
    if at == "router":
        start_shared()
    code, tiled, fold = _fmt(fmt)
    inter = w13.shape[1] // 2
    sched = _moe_schedule(T, batch_invariant, schedule, fmt)
    bm = sched.block_m
    xin = _act_quant(x.contiguous()) if act_quant else x.contiguous()
    ids = topk_ids.contiguous()
    if aligned is not None:
        sorted_slot, block_expert = aligned
    else:
        sorted_slot, block_expert = moe_align_triton(
            ids, expert_map, w13.shape[0], bm, chunk=sched.align_chunk,
            num_warps=sched.align_warps,
        )  # fmt: skip
    if at == "align":
        start_shared()
    nb = block_expert.numel()
    h = torch.empty((nb * bm, inter), dtype=x.dtype, device=x.device)
    moe_gate_up_triton(
        xin, w13, s13, gscale, sorted_slot, block_expert, topk_weights.contiguous(), h,
        fmt=code, inter=inter, top_k=K, limit=limit, tile=sched.gate_up, num_m_blocks=nb,
        block_m=bm, decode=sched.decode, fp4_join=sched.fp4_join, tiled=tiled, fold=fold,
    )  # fmt: skip
    if at == "gate_up":
        start_shared()
    if act_quant:
        act_quant_triton(h, h)  # in place: each program reads its 128 values before writing
    ws = moe_down_triton(
        h, w2, s2, gscale, sorted_slot, block_expert,
        fmt=code, T=T, D=D, inter=inter, rows_out=T * K, tile=sched.down, num_m_blocks=nb,
        block_m=bm, decode=sched.decode, fp4_join=sched.fp4_join, tiled=tiled, fold=fold,
    )  # fmt: skip
    moe_reduce_triton(ws, ids, expert_map, shared(), out, w13.shape[0], gscale)


def _shared_expert(
    x: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    fmt: str,
    limit: float,
    act_quant: bool,
    sched: MoESchedule,
    batch_invariant: bool,
) -> torch.Tensor:
    """The shared expert on every token: (T, D) in x.dtype, or with a K-split down its fp32
    partials (split, T, D) for the reduce kernel.  ``fmt`` "bf16", "fp8" or "fp8_exact" (FP8
    whose block scales are powers of two, :attr:`MoEPack.shared_exact_bf16`): the bf16 and
    exact FP8 weights run on cuBLAS from :data:`DEQUANT_MM_MIN_ROWS` rows (kernels/moe_gemm.py,
    ``shared_expert_mm``), everything else the routed path's kernels with one expert."""
    T, D = x.shape
    if fmt not in _SHARED_FMTS:
        raise InputError(f"shared_fmt: expected one of {_SHARED_FMTS}, got {fmt!r}")
    exact = fmt == _FP8_EXACT or (fmt == "bf16" and w13.dtype == torch.bfloat16)
    code = _FMT_CODE["fp8" if fmt == _FP8_EXACT else fmt]
    xin = _act_quant(x.contiguous()) if act_quant else x.contiguous()
    ones = _ones3(x.device)
    if shared_mm_selected(T, exact, x.dtype, batch_invariant):
        return shared_expert_mm(
            xin, w13, s13, w2, s2, ones, limit=limit, act_quant=act_quant
        )  # fmt: skip
    inter = w13.shape[1] // 2
    bm = sched.shared_block_m
    nb = -(-T // bm)
    h = torch.empty((nb * bm, inter), dtype=x.dtype, device=x.device)
    moe_gate_up_triton(
        xin, w13, s13, ones, None, None, None, h,
        fmt=code, inter=inter, top_k=1, limit=limit, tile=sched.shared_gate_up,
        num_m_blocks=nb, block_m=bm, decode=sched.decode, fp4_join=sched.fp4_join,
    )  # fmt: skip
    if act_quant:
        act_quant_triton(h, h)
    return moe_down_triton(
        h, w2, s2, ones, None, None,
        fmt=code, T=T, D=D, inter=inter, rows_out=T, tile=sched.shared_down, num_m_blocks=nb,
        block_m=bm, decode=sched.decode, fp4_join=sched.fp4_join,
    )  # fmt: skip


def _moe_route_out(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor,
    top_k: int,
    scaling: float,
    batch_invariant: bool,
    *,
    weights: torch.Tensor,
    ids: torch.Tensor,
    row_mask: torch.Tensor | None = None,
    align: RouteAlign | None = None,
) -> None:
    # ``align`` (Python callers only, not in the schema): the moe's fused sort, see
    # :func:`_route_and_align`
    if x.shape[0] == 0:
        return
    route_triton(
        x.contiguous(), gate_weight.contiguous(), gate_bias.contiguous(), top_k, scaling,
        weights, ids, batch_invariant, row_mask=row_mask, align=align,
    )  # fmt: skip


def _route_outputs(x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = x.shape[0]
    return (
        x.new_empty((T, top_k), dtype=torch.float32),
        x.new_empty((T, top_k), dtype=torch.int32),
    )


def _moe_route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor,
    top_k: int,
    scaling: float,
    batch_invariant: bool,
    row_mask: torch.Tensor | None = None,
    align: RouteAlign | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    w, ids = _route_outputs(x, top_k)
    _moe_route_out(
        x, gate_weight, gate_bias, top_k, scaling, batch_invariant, weights=w, ids=ids,
        row_mask=row_mask, align=align,
    )  # fmt: skip
    return w, ids


def _route_and_align(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor,
    top_k: int,
    scaling: float,
    batch_invariant: bool,
    row_mask: torch.Tensor | None,
    expert_map: torch.Tensor,
    e_local: int,
    sched: MoESchedule,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """The router, and where the slots fit (kernels/moe_route.py, ``fused_align``) their sort
    by expert in the top-k's program -> (weights, ids, (sorted_slot, block_expert) or None:
    :func:`_routed_into` sorts)."""
    T = x.shape[0]
    small = fused_align(T, top_k, e_local, sched.block_m, sched.align_chunk)
    if small is None or T == 0:
        w, ids = _moe_route(x, gate_weight, gate_bias, top_k, scaling, batch_invariant, row_mask)
        return w, ids, None
    nb, bm = small[0], sched.block_m
    align = RouteAlign(
        expert_map, e_local, bm, sched.align_chunk,
        torch.empty((nb * bm,), dtype=torch.int32, device=x.device),
        torch.empty((nb,), dtype=torch.int32, device=x.device),
    )  # fmt: skip
    w, ids = _moe_route(
        x, gate_weight, gate_bias, top_k, scaling, batch_invariant, row_mask, align
    )  # fmt: skip
    return w, ids, (align.sorted_slot, align.block_expert)


def _moe_route_fake(x: torch.Tensor, gw: Any, gb: Any, top_k: int, scaling: float, bi: Any) -> Any:
    return _route_outputs(x, top_k)


def _fused_experts_out(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *args: Any,
    out: torch.Tensor,
) -> None:
    _routed_into(x, topk_ids, topk_weights, *args, lambda: None, out)  # type: ignore[call-arg]


def _x_like(x: torch.Tensor, *args: Any) -> torch.Tensor:
    return x.new_empty(x.shape)


def _moe_out(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor,
    top_k: int,
    scaling: float,
    expert_map: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    gscale: torch.Tensor,
    fmt: str,
    limit: float,
    act_quant: bool,
    batch_invariant: bool,
    schedule: Sequence[int],
    shared_w13: torch.Tensor,
    shared_s13: torch.Tensor,
    shared_w2: torch.Tensor,
    shared_s2: torch.Tensor,
    shared_fmt: str,
    shared_limit: float,
    shared_act_quant: bool,
    row_mask: torch.Tensor | None = None,
    *,
    out: torch.Tensor,
) -> None:
    if x.shape[0] == 0:
        return
    sched = _moe_schedule(x.shape[0], batch_invariant, schedule, fmt)
    # padding rows (row_mask False) get ids -1 inside the top-k kernel; at decode sizes the
    # same program sorts the slots by expert (one launch fewer)
    weights, ids, aligned = _route_and_align(
        x, gate_weight, gate_bias, top_k, scaling, batch_invariant, row_mask, expert_map,
        w13.shape[0], sched,
    )  # fmt: skip
    shared_args = (
        x, shared_w13, shared_s13, shared_w2, shared_s2, shared_fmt, shared_limit,
        shared_act_quant, sched, batch_invariant,
    )  # fmt: skip
    side = side_stream(x.device, "moe.shared") if sched.shared_stream else None
    if side is None:
        rows = _shared_expert(*shared_args)
        _routed_into(
            x, ids, weights, expert_map, w13, s13, w2, s2, gscale, fmt, limit, act_quant,
            batch_invariant, schedule, lambda: rows, out, aligned=aligned,
        )  # fmt: skip
        return
    # The shared expert on a side stream, beside the routed GEMMs (forking at shared_fork): at
    # decode sizes neither fills the H200 (the routed GEMMs stream their experts at about half
    # the copy bandwidth), so the shared expert's 25 MB (FP8) overlap them instead of following
    # them.  The reduce waits for it.  Captured into a CUDA graph the fork and join become the
    # graph's edges; the values are the same.
    cur = torch.cuda.current_stream(x.device)
    box: list[torch.Tensor] = []

    def fork() -> None:
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            box.append(_shared_expert(*shared_args))

    def shared() -> torch.Tensor:
        cur.wait_stream(side)
        (rows,) = box
        rows.record_stream(cur)  # allocated on the side stream, read on this one
        return rows

    _routed_into(
        x, ids, weights, expert_map, w13, s13, w2, s2, gscale, fmt, limit, act_quant,
        batch_invariant, schedule, shared, out, fork, aligned,
    )  # fmt: skip


_SIDE_STREAMS: dict[tuple[str, torch.device], torch.cuda.Stream] = {}
# Where the moe forks the shared expert onto its side stream, in the routed chain: "router"
# (right after the top-k), "align" (after the sort), "gate_up" (after the routed gate/up GEMM).
# The fork is a stream wait, so the shared expert then starts after that kernel has finished
# and is launched after it: at "align" the routed chain's sort runs before the shared expert's
# first GEMM takes SMs, at "gate_up" the two no longer overlap in the gate/up GEMM.  Where the
# router's program sorts the slots itself (T <= moe_route.FUSED_ALIGN_MAX_T, one token), "router"
# and "align" are the same point: after that one launch.  Measured
# on the H200 (bench/diag/moe_stream_ab.py, the whole step in one process, two runs;
# bench/results/moe-h200.md, "Where the shared expert forks"): at T 8 "align" 630.3 / 625.2 us
# against "router" 642.4 / 638.5; at T 1 "router" and "align" within 0.5 us ("gate_up" 5 us
# slower); at T 64 "router" 1205.0 / 1201.9 against "align" 1211.0 / 1211.4 and "gate_up"
# 1232.0.  None: the default of the row count (:func:`shared_fork`); a name overrides it (the
# benchmark's switch).
SHARED_FORK: str | None = None
SHARED_FORK_ALIGN_MAX_T = 8
_FORKS = ("router", "align", "gate_up")


def shared_fork(T: int) -> str:
    """Where the shared expert forks at T rows (:data:`SHARED_FORK`): after the sort up to
    :data:`SHARED_FORK_ALIGN_MAX_T` rows, after the router above."""
    if SHARED_FORK is not None:
        if SHARED_FORK not in _FORKS:
            raise InputError(f"SHARED_FORK: expected one of {_FORKS} or None, got {SHARED_FORK!r}")
        return SHARED_FORK
    return "align" if SHARED_FORK_ALIGN_MAX_T >= T else "router"


def side_stream(device: torch.device, role: str) -> torch.cuda.Stream | None:
    """The side stream of ``role`` on a CUDA device (one per role and device, made once): the
    MoE's shared expert ("moe.shared") and the attention's kv path ("attention.kv") each fork
    onto their own and are joined before their results are read.  None on the CPU (the
    interpreter), where everything runs in order on one stream."""
    if device.type != "cuda":
        return None
    side = _SIDE_STREAMS.get((role, device))
    if side is None:
        side = _SIDE_STREAMS[(role, device)] = torch.cuda.Stream(device=device)
    return side


_fused_experts = _functional(_fused_experts_out, _x_like)
_moe = _functional(_moe_out, _x_like)
_KERNELS.update(
    {
        "moe_route": (_moe_route, _moe_route_fake),
        "moe_route_out": (_moe_route_out, _out_fake),
        "fused_experts": (_fused_experts, _x_like),
        "fused_experts_out": (_fused_experts_out, _out_fake),
        "moe": (_moe, _x_like),
        "moe_out": (_moe_out, _out_fake),
    }
)


_MOE_LIB = _register(_MOE_SCHEMAS)


# ------------------------------------------------------------------------------ attention
# The attention core (optimized/attention.py validates and picks the schedule; the kernel is
# optimized/kernels/sink_attention.py).  The single-sequence op passes no offsets; the varlen op
# passes cu_q / cu_k.  A schedule travels as its int list (AttentionSchedule.fields; empty: the
# default of H, Dh and the window).
if TYPE_CHECKING:
    from .kernels.sink_attention import (
        AttentionSchedule,
        attention_schedule,
        sink_attention_triton,
    )
else:
    AttentionSchedule = triton_kernel("sink_attention", "AttentionSchedule")
    attention_schedule = triton_kernel("sink_attention", "attention_schedule")
    sink_attention_triton = triton_kernel("sink_attention", "sink_attention_triton")

_ATTN_ARGS = "Tensor q, Tensor q_pos, Tensor kv, Tensor k_pos, Tensor attn_sink"
_ATTN_TAIL = "int window, float scale, str backend, int[] schedule"
_ATTN_SCHEMAS: dict[str, str] = {
    "sink_attention": f"sink_attention({_ATTN_ARGS}, {_ATTN_TAIL}) -> Tensor",
    "sink_attention_out": (
        f"sink_attention_out({_ATTN_ARGS}, {_ATTN_TAIL}, *, Tensor(a!) out) -> ()"
    ),
    "sink_attention_varlen": (
        f"sink_attention_varlen({_ATTN_ARGS}, Tensor cu_q, Tensor cu_k, {_ATTN_TAIL}) -> Tensor"
    ),
    "sink_attention_varlen_out": (
        f"sink_attention_varlen_out({_ATTN_ARGS}, Tensor cu_q, Tensor cu_k, {_ATTN_TAIL}, *, "
        "Tensor(a!) out) -> ()"
    ),
}
SCHEMAS.update(_ATTN_SCHEMAS)
OPS = tuple(SCHEMAS)


@functools.lru_cache(maxsize=1024)
def _attn_schedule(
    fields: tuple[int, ...],
    H: int,
    Dh: int,
    window: int,
    fp32: bool,
    rows: int,
    device: torch.device,
    cached: bool = False,
) -> AttentionSchedule:
    """The given schedule, or the default of the call's row count on this device for the
    contiguous kernel or (``cached``) the ring-cache and paged ones (kernels/sink_attention.py,
    ``attention_schedule``; ``batch_invariant=True`` passes the T-independent one's fields)."""
    if fields:
        return AttentionSchedule(*fields)
    smem = _smem_per_block(device)
    return attention_schedule(H, Dh, window, fp32, rows, max_smem=smem, cached=cached)


@functools.cache
def _smem_per_block(device: torch.device) -> int | None:
    """The shared memory a block may opt into on a CUDA device (None on the CPU, or where torch
    does not report it)."""
    if device.type != "cuda":
        return None
    optin = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", None)
    return None if optin is None else int(optin)


def _attention_into(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    kv: torch.Tensor,
    k_pos: torch.Tensor,
    attn_sink: torch.Tensor,
    cu_q: torch.Tensor | None,
    cu_k: torch.Tensor | None,
    window: int,
    scale: float,
    backend: str,
    schedule: Sequence[int],
    out: torch.Tensor,
) -> None:
    if backend != "triton":
        raise _unknown("sink_attention", backend, ("triton",))
    Tq, H, Dh = q.shape
    if Tq == 0:
        return
    sched = _attn_schedule(tuple(schedule), H, Dh, window, q.dtype == torch.float32, Tq, q.device)
    sink_attention_triton(
        q.contiguous(), q_pos.contiguous(), kv.contiguous(), k_pos.contiguous(),
        attn_sink.contiguous(), None if cu_q is None else cu_q.contiguous(),
        None if cu_k is None else cu_k.contiguous(), out, window, scale, sched,
    )  # fmt: skip


def _sink_attention_out(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    kv: torch.Tensor,
    k_pos: torch.Tensor,
    attn_sink: torch.Tensor,
    window: int,
    scale: float,
    backend: str,
    schedule: Sequence[int],
    *,
    out: torch.Tensor,
) -> None:
    _attention_into(
        q, q_pos, kv, k_pos, attn_sink, None, None, window, scale, backend, schedule, out
    )


def _sink_attention_varlen_out(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    kv: torch.Tensor,
    k_pos: torch.Tensor,
    attn_sink: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    window: int,
    scale: float,
    backend: str,
    schedule: Sequence[int],
    *,
    out: torch.Tensor,
) -> None:
    _attention_into(
        q, q_pos, kv, k_pos, attn_sink, cu_q, cu_k, window, scale, backend, schedule, out
    )


_sink_attention = _functional(_sink_attention_out, _x_like)
_sink_attention_varlen = _functional(_sink_attention_varlen_out, _x_like)
_KERNELS.update(
    {
        "sink_attention": (_sink_attention, _x_like),
        "sink_attention_out": (_sink_attention_out, _out_fake),
        "sink_attention_varlen": (_sink_attention_varlen, _x_like),
        "sink_attention_varlen_out": (_sink_attention_varlen_out, _out_fake),
    }
)


_ATTN_LIB = _register(_ATTN_SCHEMAS)


# ------------------------------------------------------------------------------ linear
# The dense linears (optimized/linear.py validates and packs; the kernel is
# optimized/kernels/linear.py).  A LinearPack travels flat: the (G, N, K) weight (uint8 e4m3
# codes, or bf16 / fp32), its fp32 block scales (empty for a dense weight), the format as a
# string ("fp8", "bf16") and its int32 split-K tile counters (``counters``, kwarg-only and
# written: the kernel counts each output tile's K splits there and its last split zeroes the
# count again, so the tensor holds zeros before and after every call; empty for a dense weight
# passed without a pack: the stream's zeroed counters are used).  linear takes x (..., K) and a
# pack with G = 1; grouped_linear x (T, G, K).  The schedule is the default of the row count,
# or with batch_invariant the T-independent one (kernels/linear.py, linear_schedule).  The format
# "fp8_exact" is "fp8" whose every code x scale product is exact in bf16 (power-of-two scales,
# decided once by pack_linear: LinearPack.exact_bf16); with bf16 x, not batch-invariant, from
# DEQUANT_MM_MIN_ROWS rows on, such a call dequantizes the weight to bf16 and runs one cuBLAS
# GEMM (kernels/linear.py, dequant_mm_selected, linear_dequant_mm); everything else runs the
# Triton kernel, which computes the same math for "fp8" and "fp8_exact".
if TYPE_CHECKING:
    from .kernels.linear import (
        add_rows_triton,
        dequant_mm_selected,
        eh_linear_triton,
        eh_one_launch,
        linear_dequant_mm,
        linear_schedule,
        linear_triton,
    )
else:
    add_rows_triton = triton_kernel("linear", "add_rows_triton")
    dequant_mm_selected = triton_kernel("linear", "dequant_mm_selected")
    eh_linear_triton = triton_kernel("linear", "eh_linear_triton")
    eh_one_launch = triton_kernel("linear", "eh_one_launch")
    linear_dequant_mm = triton_kernel("linear", "linear_dequant_mm")
    linear_schedule = triton_kernel("linear", "linear_schedule")
    linear_triton = triton_kernel("linear", "linear_triton")

_LINEAR_ARGS = (
    "Tensor x, Tensor weight, Tensor scale, str fmt, bool act_quant, bool batch_invariant"
)
_LINEAR_SCHEMAS: dict[str, str] = {
    "linear": f"linear({_LINEAR_ARGS}, *, Tensor(a!) counters) -> Tensor",
    "linear_out": f"linear_out({_LINEAR_ARGS}, *, Tensor(a!) out, Tensor(b!) counters) -> ()",
    "grouped_linear": f"grouped_linear({_LINEAR_ARGS}, *, Tensor(a!) counters) -> Tensor",
    "grouped_linear_out": (
        f"grouped_linear_out({_LINEAR_ARGS}, *, Tensor(a!) out, Tensor(b!) counters) -> ()"
    ),
}
SCHEMAS.update(_LINEAR_SCHEMAS)
OPS = tuple(SCHEMAS)

_LINEAR_FMT = {"bf16": 0, "fp8": 1}
# linear / grouped_linear and the MoE's shared expert (the LM head packs its own formats)
_FP8_EXACT = "fp8_exact"
_LINEAR_OP_FMT = {**_LINEAR_FMT, _FP8_EXACT: 1}


def _check_linear_args(
    x: torch.Tensor, weight: torch.Tensor, fmt: str, counters: torch.Tensor, name: str = ""
) -> None:
    """The format string against the weight's dtype and the split-K counters' layout and
    device (``name``: the prefix of the weight's and counters' argument names)."""
    if fmt not in _LINEAR_OP_FMT:
        raise InputError(f"{name}fmt: expected one of {tuple(_LINEAR_OP_FMT)}, got {fmt!r}")
    if _LINEAR_OP_FMT[fmt] == 1 and weight.dtype != torch.uint8:
        raise InputError(f"{name}weight: format {fmt!r} takes uint8 e4m3 codes, got {weight.dtype}")
    if counters.dtype != torch.int32 or counters.dim() != 1 or not counters.is_contiguous():
        raise InputError(
            f"{name}counters: expected a contiguous 1-D int32 tensor, got {counters.dtype} of "
            f"shape {tuple(counters.shape)}"
        )
    if counters.device != x.device:
        raise InputError(
            f"{name}counters: expected device {x.device} (as x), got {counters.device}"
        )


def _linear_into(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    fmt: str,
    act_quant: bool,
    batch_invariant: bool,
    out: torch.Tensor,
    counters: torch.Tensor,
    add: torch.Tensor | None = None,
    name: str = "",
) -> None:
    """x (R, G, K) rows into out (R, G, N) (both views of the caller's tensors); ``add``
    (R', N), G = 1: out's row r plus add's row ``r // (R / R')`` after the product's rounding,
    rounded again (kernels/linear.py, ``linear_triton``'s ``add``).  ``name``: the prefix of
    the weight's and counters' argument names in errors."""
    _check_linear_args(x, weight, fmt, counters, name)
    R, G, K = x.shape
    if R == 0:
        return
    xin = x.contiguous()
    if act_quant:
        xin = _act_quant(xin.view(R * G, K)).view(R, G, K)
    w, s = weight.contiguous(), scale.contiguous()
    if dequant_mm_selected(R, fmt == _FP8_EXACT, x.dtype, batch_invariant):
        linear_dequant_mm(xin, w, s, out)
        if add is not None:
            add_rows_triton(out.view(R, -1), add)
        return
    sched = linear_schedule(R, weight.shape[1], K, G, batch_invariant)
    linear_triton(
        xin, w, s, out, fmt=_LINEAR_OP_FMT[fmt], sched=sched,
        counters=counters if counters.numel() else None, add=add,
    )  # fmt: skip


def _linear_out(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    fmt: str,
    act_quant: bool,
    batch_invariant: bool,
    *,
    out: torch.Tensor,
    counters: torch.Tensor,
) -> None:
    K, N = x.shape[-1], weight.shape[1]
    _linear_into(
        x.reshape(-1, 1, K), weight, scale, fmt, act_quant, batch_invariant, out.view(-1, 1, N),
        counters,
    )  # fmt: skip


def _linear_fake(x: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[1]))


def _grouped_linear_out(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    fmt: str,
    act_quant: bool,
    batch_invariant: bool,
    *,
    out: torch.Tensor,
    counters: torch.Tensor,
) -> None:
    _linear_into(x, weight, scale, fmt, act_quant, batch_invariant, out, counters)


def _grouped_linear_fake(
    x: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[1], weight.shape[1]))


def _with_counters(
    out_kernel: Callable[..., None], like: Callable[..., torch.Tensor]
) -> Callable[..., torch.Tensor]:
    """The functional kernel of linear / grouped_linear (``_functional`` with the kwarg-only
    ``counters`` passed through)."""

    def kernel(*args: Any, counters: torch.Tensor) -> torch.Tensor:
        out = like(*args)
        out_kernel(*args, out=out, counters=counters)
        return out

    return kernel


_linear = _with_counters(_linear_out, _linear_fake)
_grouped_linear = _with_counters(_grouped_linear_out, _grouped_linear_fake)

_KERNELS.update(
    {
        "linear": (_linear, _linear_fake),
        "linear_out": (_linear_out, _out_fake),
        "grouped_linear": (_grouped_linear, _grouped_linear_fake),
        "grouped_linear_out": (_grouped_linear_out, _out_fake),
    }
)


_LINEAR_LIB = _register(_LINEAR_SCHEMAS)


# ------------------------------------------------------------------------------ eh_proj
# The layer's input projection x = h_proj(h) + e_proj(e) per stream (optimized/linear.py,
# eh_proj): e (T, K) and h (T, n, K) with the two packs flat as in linear, each with its own
# split-K counters.  At decode sizes both products in one launch where the weights are alike
# (kernels/linear.py, eh_one_launch: h's counters serve its tiles).  Otherwise e's projection
# (T, N) is computed first, into a scratch tensor; h's (T*n rows) then adds its row t to the n
# rows of token t after its own rounding: in the Triton kernel's epilogue, or after the prefill
# path's cuBLAS GEMM in one Triton pass.
_EH_ARGS = (
    "Tensor e, Tensor h, Tensor e_weight, Tensor e_scale, str e_fmt, Tensor h_weight, "
    "Tensor h_scale, str h_fmt, bool act_quant, bool batch_invariant"
)
_EH_SCHEMAS: dict[str, str] = {
    "eh_proj": f"eh_proj({_EH_ARGS}, *, Tensor(a!) e_counters, Tensor(b!) h_counters) -> Tensor",
    "eh_proj_out": (
        f"eh_proj_out({_EH_ARGS}, *, Tensor(a!) out, Tensor(b!) e_counters, "
        "Tensor(c!) h_counters) -> ()"
    ),
}
SCHEMAS.update(_EH_SCHEMAS)
OPS = tuple(SCHEMAS)


def _eh_proj_out(
    e: torch.Tensor,
    h: torch.Tensor,
    e_weight: torch.Tensor,
    e_scale: torch.Tensor,
    e_fmt: str,
    h_weight: torch.Tensor,
    h_scale: torch.Tensor,
    h_fmt: str,
    act_quant: bool,
    batch_invariant: bool,
    *,
    out: torch.Tensor,
    e_counters: torch.Tensor,
    h_counters: torch.Tensor,
) -> None:
    T, n, K = h.shape
    N = h_weight.shape[1]
    if e.dim() != 2 or e.shape[0] != T or e.shape[1] != e_weight.shape[2]:
        raise InputError(f"e: expected shape ({T}, {e_weight.shape[2]}), got {tuple(e.shape)}")
    if e_weight.shape[1] != N or h_weight.shape[2] != K:
        raise InputError(
            f"h_weight: expected N {e_weight.shape[1]} (e_weight's) and K {K} (h's), got shape "
            f"{tuple(h_weight.shape)}"
        )
    if T == 0:
        return
    # one launch for both products where the two weights are alike (one plain pack each)
    alike = (e_fmt, e_weight.dtype, e_weight.shape, e_scale.shape, e.dtype) == (
        h_fmt, h_weight.dtype, h_weight.shape, h_scale.shape, h.dtype,
    ) and e_weight.shape[0] == 1  # fmt: skip
    f32 = torch.float32 in (e.dtype, e_weight.dtype)
    one = eh_one_launch(T, T * n, N, K, alike, batch_invariant, f32)
    if one is not None:
        _check_linear_args(e, e_weight, e_fmt, e_counters, "e_")
        _check_linear_args(e, h_weight, h_fmt, h_counters, "h_")
        ein, hin = e.contiguous(), h.reshape(T * n, K).contiguous()
        if act_quant:
            ein, hin = _act_quant(ein), _act_quant(hin)
        eh_linear_triton(
            ein, hin, e_weight[0].contiguous(), e_scale.contiguous().view(-1),
            h_weight[0].contiguous(), h_scale.contiguous().view(-1), out.view(T * n, N),
            fmt=_LINEAR_OP_FMT[e_fmt], sched=one,
            counters=h_counters if h_counters.numel() else None,
        )  # fmt: skip
        return
    ep = e.new_empty((T, N))
    _linear_into(
        e.reshape(T, 1, -1), e_weight, e_scale, e_fmt, act_quant, batch_invariant,
        ep.view(T, 1, N), e_counters, name="e_",
    )  # fmt: skip
    _linear_into(
        h.reshape(T * n, 1, K), h_weight, h_scale, h_fmt, act_quant, batch_invariant,
        out.view(T * n, 1, N), h_counters, add=ep, name="h_",
    )  # fmt: skip


def _eh_proj_fake(e: torch.Tensor, h: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    h_weight = args[3]  # after e_weight, e_scale, e_fmt
    return h.new_empty((h.shape[0], h.shape[1], h_weight.shape[1]))


def _eh_proj(*args: Any, e_counters: torch.Tensor, h_counters: torch.Tensor) -> torch.Tensor:
    out = _eh_proj_fake(*args)
    _eh_proj_out(*args, out=out, e_counters=e_counters, h_counters=h_counters)
    return out


_KERNELS.update({"eh_proj": (_eh_proj, _eh_proj_fake), "eh_proj_out": (_eh_proj_out, _out_fake)})
_EH_LIB = _register(_EH_SCHEMAS)


# ------------------------------------------------------------------------------ RoPE, q / kv paths
# apply_rope, q_head_norm_rope and kv_norm_rope (optimized/rope.py validates; the kernel is
# optimized/kernels/rope.py).  The rope width is freqs' length times two; the norm order travels
# as its name.
if TYPE_CHECKING:
    from .kernels.rope import NORM_HEAD, NORM_RMS, norm_rope_triton
else:
    norm_rope_triton = triton_kernel("rope", "norm_rope_triton")
    NORM_HEAD, NORM_RMS = 1, 2  # kernels/rope.py's NORM modes (triton loads on the first call)

_ROPE_ARGS = "Tensor x, Tensor positions, Tensor freqs, bool inverse, str backend"
_Q_ARGS = "Tensor q, Tensor positions, Tensor freqs, float eps, str backend"
_KV_ARGS = (
    "Tensor kv, Tensor kv_norm_weight, Tensor positions, Tensor freqs, float eps, bool fp8_kv, "
    "str norm_order, str backend"
)
_ROPE_SCHEMAS: dict[str, str] = {
    "apply_rope": f"apply_rope({_ROPE_ARGS}) -> Tensor",
    "apply_rope_out": f"apply_rope_out({_ROPE_ARGS}, *, Tensor(a!) out) -> ()",
    "q_head_norm_rope": f"q_head_norm_rope({_Q_ARGS}) -> Tensor",
    "q_head_norm_rope_out": f"q_head_norm_rope_out({_Q_ARGS}, *, Tensor(a!) out) -> ()",
    "kv_norm_rope": f"kv_norm_rope({_KV_ARGS}) -> Tensor",
    "kv_norm_rope_out": f"kv_norm_rope_out({_KV_ARGS}, *, Tensor(a!) out) -> ()",
}
SCHEMAS.update(_ROPE_SCHEMAS)
OPS = tuple(SCHEMAS)


def _rows3(x: torch.Tensor) -> torch.Tensor:
    """x (T, ..., D) as (T, H, D) with unit stride along D: a view where the middle dims
    flatten into one stride (the output's rope dims ``o[..., Dn:]`` do), else a copy."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(x.shape[0], -1, x.shape[-1]) if x.dim() != 3 else x


def _apply_rope_out(
    x: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor,
    inverse: bool,
    backend: str,
    *,
    out: torch.Tensor,
) -> None:
    if backend != "triton":
        raise _unknown("apply_rope", backend, ("triton",))
    if x.numel() == 0:
        return
    x3 = _rows3(x)
    # out: contiguous, or a (T, H, Dr) view with unit stride along Dr (optimized/rope.py checks;
    # x itself for the attention output's in-place inverse rotation)
    if out.is_contiguous():
        out3 = out.view(x3.shape)
    else:
        assert out.dim() == 3 and out.stride(-1) == 1, "apply_rope checks a strided out"
        out3 = out
    norm_rope_triton(
        x3, None, positions.contiguous(), freqs.contiguous(), out3, rope_dim=x.shape[-1],
        inverse=inverse,
    )  # fmt: skip


def _q_head_norm_rope_out(
    q: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor,
    eps: float,
    backend: str,
    *,
    out: torch.Tensor,
) -> None:
    if backend != "triton":
        raise _unknown("q_head_norm_rope", backend, ("triton",))
    if q.numel() == 0:
        return
    norm_rope_triton(
        _rows3(q), None, positions.contiguous(), freqs.contiguous(), out,
        rope_dim=2 * freqs.shape[0], norm=NORM_HEAD, eps=eps,
    )  # fmt: skip


def _kv_norm_rope_out(
    kv: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor,
    eps: float,
    fp8_kv: bool,
    norm_order: str,
    backend: str,
    *,
    out: torch.Tensor,
) -> None:
    if backend != "triton":
        raise _unknown("kv_norm_rope", backend, ("triton",))
    if kv.numel() == 0:
        return
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    norm_rope_triton(
        kv.unsqueeze(1), kv_norm_weight.contiguous(), positions.contiguous(), freqs.contiguous(),
        out.unsqueeze(1),
        rope_dim=2 * freqs.shape[0], norm=NORM_RMS, eps=eps, vllm_order=norm_order == "vllm",
        fp8=fp8_kv,
    )  # fmt: skip


_apply_rope = _functional(_apply_rope_out, _x_like)
_q_head_norm_rope = _functional(_q_head_norm_rope_out, _x_like)
_kv_norm_rope = _functional(_kv_norm_rope_out, _x_like)
_KERNELS.update(
    {
        "apply_rope": (_apply_rope, _x_like),
        "apply_rope_out": (_apply_rope_out, _out_fake),
        "q_head_norm_rope": (_q_head_norm_rope, _x_like),
        "q_head_norm_rope_out": (_q_head_norm_rope_out, _out_fake),
        "kv_norm_rope": (_kv_norm_rope, _x_like),
        "kv_norm_rope_out": (_kv_norm_rope_out, _out_fake),
    }
)


_ROPE_LIB = _register(_ROPE_SCHEMAS)


# ------------------------------------------------------------------------------ KV ring cache
# The decode attention over a preallocated ring cache (optimized/attention.py validates; the
# kernels are optimized/kernels/sink_attention.py) and the ring write of new rows
# (optimized/kv_cache.py's DeviceKVCache and the attention sublayer call it).  The write's
# functional variant returns written copies of the cache tensors; its ``_out`` variant writes
# the cache in place (the form a captured decode step runs).
if TYPE_CHECKING:
    from .kernels.sink_attention import ring_write_triton, sink_attention_cache_triton
else:
    ring_write_triton = triton_kernel("sink_attention", "ring_write_triton")
    sink_attention_cache_triton = triton_kernel("sink_attention", "sink_attention_cache_triton")

_CACHE_ARGS = (
    "Tensor q, Tensor q_pos, Tensor cache_kv, Tensor cache_pos, Tensor slots, Tensor attn_sink"
)
_WRITE_ARGS = "Tensor kv, Tensor positions, Tensor slots"
_CACHE_SCHEMAS: dict[str, str] = {
    "sink_attention_cache": f"sink_attention_cache({_CACHE_ARGS}, {_ATTN_TAIL}) -> Tensor",
    "sink_attention_cache_out": (
        f"sink_attention_cache_out({_CACHE_ARGS}, {_ATTN_TAIL}, *, Tensor(a!) out) -> ()"
    ),
    "kv_cache_write": (
        f"kv_cache_write({_WRITE_ARGS}, Tensor cache_kv, Tensor cache_pos) -> (Tensor, Tensor)"
    ),
    "kv_cache_write_out": (
        f"kv_cache_write_out({_WRITE_ARGS}, *, Tensor(a!) cache_kv, Tensor(b!) cache_pos) -> ()"
    ),
}
SCHEMAS.update(_CACHE_SCHEMAS)
OPS = tuple(SCHEMAS)


def _sink_attention_cache_out(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cache_kv: torch.Tensor,
    cache_pos: torch.Tensor,
    slots: torch.Tensor,
    attn_sink: torch.Tensor,
    window: int,
    scale: float,
    backend: str,
    schedule: Sequence[int],
    *,
    out: torch.Tensor,
) -> None:
    if backend != "triton":
        raise _unknown("sink_attention_cache", backend, ("triton",))
    B, H, Dh = q.shape
    if B == 0:
        return
    fp32 = q.dtype == torch.float32
    sched = _attn_schedule(tuple(schedule), H, Dh, window, fp32, B, q.device, cached=True)
    sink_attention_cache_triton(
        q.contiguous(), q_pos.contiguous(), cache_kv.contiguous(), cache_pos.contiguous(),
        slots.contiguous(), attn_sink.contiguous(), out, window, scale, sched,
    )  # fmt: skip


def _kv_cache_write_out(
    kv: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    *,
    cache_kv: torch.Tensor,
    cache_pos: torch.Tensor,
) -> None:
    # The kernel writes the caches through their base pointers: they must be contiguous (a
    # copy would leave the caller's tensors unwritten); optimized/kv_cache.py guarantees it.
    assert cache_kv.is_contiguous() and cache_pos.is_contiguous()
    ring_write_triton(
        kv.contiguous(), positions.contiguous(), slots.contiguous(), cache_kv, cache_pos
    )


def _kv_cache_write_fake(
    kv: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cache_kv: torch.Tensor,
    cache_pos: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(cache_kv), torch.empty_like(cache_pos)


def _kv_cache_write(
    kv: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cache_kv: torch.Tensor,
    cache_pos: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    new_kv, new_pos = (
        cache_kv.clone(memory_format=torch.contiguous_format),
        cache_pos.clone(memory_format=torch.contiguous_format),
    )
    _kv_cache_write_out(kv, positions, slots, cache_kv=new_kv, cache_pos=new_pos)
    return new_kv, new_pos


_sink_attention_cache = _functional(_sink_attention_cache_out, _x_like)
_KERNELS.update(
    {
        "sink_attention_cache": (_sink_attention_cache, _x_like),
        "sink_attention_cache_out": (_sink_attention_cache_out, _out_fake),
        "kv_cache_write": (_kv_cache_write, _kv_cache_write_fake),
        "kv_cache_write_out": (_kv_cache_write_out, _out_fake),
    }
)


_CACHE_LIB = _register(_CACHE_SCHEMAS)


# ------------------------------------------------------------------------------ LM head
# The shared LM head (optimized/lm_head.py validates and packs; the argmax kernel is
# optimized/kernels/lm_head.py, the FP8 / batch-invariant logits the dense-linear kernel).  A
# HeadPack travels flat: the (V, D) weight (bf16 / fp32, or uint8 e4m3 codes), its fp32 block
# scales (ceil(V/128), ceil(D/128)) (empty for a dense head) and the format ("bf16" for a dense
# head of either dtype, "fp8").  The argmax schedule travels as LmHeadSchedule.fields (empty:
# the default of T).
if TYPE_CHECKING:
    from .kernels.lm_head import (
        LmHeadSchedule,
        lm_head_argmax_linear,
        lm_head_argmax_triton,
        lm_head_schedule,
        logits_argmax_triton,
    )
else:
    LmHeadSchedule = triton_kernel("lm_head", "LmHeadSchedule")
    logits_argmax_triton = triton_kernel("lm_head", "logits_argmax_triton")
    lm_head_argmax_linear = triton_kernel("lm_head", "lm_head_argmax_linear")
    lm_head_argmax_triton = triton_kernel("lm_head", "lm_head_argmax_triton")
    lm_head_schedule = triton_kernel("lm_head", "lm_head_schedule")

#: The FP8 head's greedy ids through the dense-linear kernel's tiles with an argmax epilogue
#: (kernels/lm_head.py, ``lm_head_argmax_linear``) where its schedule has no K split, instead
#: of the argmax kernel (the benchmarks' A/B switch).  On the H200 (V4-Flash head, T 1 / 8 /
#: 64) the FP8 linear kernel streams the codes in 145 / 146 / 229 us, the argmax kernel in
#: 204 / 230 / 453 (bench/results/head-fp8.md).
FP8_ARGMAX_ON_LINEAR = True

_HEAD_ARGS = "Tensor y, Tensor head, Tensor scale, str fmt, bool batch_invariant"
_LM_HEAD_SCHEMAS: dict[str, str] = {
    "lm_head_argmax": (
        f"lm_head_argmax({_HEAD_ARGS}, int[] schedule, Tensor? row_mask=None) -> Tensor"
    ),
    "lm_head_argmax_out": (
        f"lm_head_argmax_out({_HEAD_ARGS}, int[] schedule, Tensor? row_mask=None, *, "
        "Tensor(a!) out) -> ()"
    ),
    "lm_head_logits": f"lm_head_logits({_HEAD_ARGS}) -> Tensor",
    "lm_head_logits_out": f"lm_head_logits_out({_HEAD_ARGS}, *, Tensor(a!) out) -> ()",
    "logits_argmax": "logits_argmax(Tensor logits, Tensor? row_mask=None) -> Tensor",
    "logits_argmax_out": (
        "logits_argmax_out(Tensor logits, Tensor? row_mask=None, *, Tensor(a!) out) -> ()"
    ),
}
SCHEMAS.update(_LM_HEAD_SCHEMAS)
OPS = tuple(SCHEMAS)


# torch.mm(..., out_dtype=, out=) (aten::mm.dtype_out): bf16 products written as fp32 logits
# straight into the caller's buffer.
_MM_DTYPE_OUT = hasattr(torch.ops.aten.mm, "dtype_out")


def _lm_head_fmt(fmt: str) -> int:
    if fmt not in _LINEAR_FMT:
        raise InputError(f"fmt: expected one of {tuple(_LINEAR_FMT)}, got {fmt!r}")
    return _LINEAR_FMT[fmt]


def _lm_head_argmax_out(
    y: torch.Tensor,
    head: torch.Tensor,
    scale: torch.Tensor,
    fmt: str,
    batch_invariant: bool,
    schedule: Sequence[int],
    row_mask: torch.Tensor | None = None,
    *,
    out: torch.Tensor,
) -> None:
    code = _lm_head_fmt(fmt)
    T = y.shape[0]
    if T == 0:
        return
    fp32 = y.dtype == torch.float32 or head.dtype == torch.float32
    if code == _LINEAR_FMT["fp8"] and not schedule and FP8_ARGMAX_ON_LINEAR:
        lsched = linear_schedule(T, head.shape[0], y.shape[1], 1, batch_invariant)
        if lsched.split_k == 1:
            lm_head_argmax_linear(
                y.contiguous(), head.contiguous(), scale.contiguous(), out, fmt=code,
                sched=lsched, row_mask=None if row_mask is None else row_mask.contiguous(),
            )  # fmt: skip
            return
    sched = LmHeadSchedule(*schedule) if schedule else lm_head_schedule(T, batch_invariant, fp32)
    lm_head_argmax_triton(
        y.contiguous(), head.contiguous(), scale.contiguous(), out, fmt=code, sched=sched,
        row_mask=None if row_mask is None else row_mask.contiguous(),
    )  # fmt: skip


def _lm_head_argmax_fake(y: torch.Tensor, *args: Any) -> torch.Tensor:
    return y.new_empty((y.shape[0],), dtype=torch.int64)


def _lm_head_logits_out(
    y: torch.Tensor,
    head: torch.Tensor,
    scale: torch.Tensor,
    fmt: str,
    batch_invariant: bool,
    *,
    out: torch.Tensor,
) -> None:
    """cuBLAS for a dense head in y's dtype on CUDA (bf16 products accumulated and written in
    fp32: the head read once); the dense-linear Triton kernel writing fp32 for an FP8 head, a
    head of another dtype than y, the interpreter, and ``batch_invariant`` (cuBLAS picks its
    algorithm by T: no bitwise guarantee across batch sizes)."""
    code = _lm_head_fmt(fmt)
    T, D = y.shape
    V = head.shape[0]
    if T == 0:
        return
    if code == 0 and not batch_invariant and y.is_cuda and y.dtype == head.dtype:
        if y.dtype != torch.bfloat16:
            torch.mm(y, head.T, out=out)
        elif _MM_DTYPE_OUT:
            torch.mm(y, head.T, out_dtype=torch.float32, out=out)
        else:  # a torch with mm's out_dtype but not its out= form: one (T, V) copy more
            out.copy_(torch.mm(y, head.T, out_dtype=torch.float32))
        return
    sched = linear_schedule(T, V, D, 1, batch_invariant)
    linear_triton(
        y.contiguous().view(T, 1, D), head.contiguous().view(1, V, D),
        scale.contiguous().view(1, *scale.shape) if scale.numel() else scale,
        out.view(T, 1, V), fmt=code, sched=sched,
    )  # fmt: skip


def _lm_head_logits_fake(y: torch.Tensor, head: torch.Tensor, *args: Any) -> torch.Tensor:
    return y.new_empty((y.shape[0], head.shape[0]), dtype=torch.float32)


def _logits_argmax_out(
    logits: torch.Tensor, row_mask: torch.Tensor | None = None, *, out: torch.Tensor
) -> None:
    logits_argmax_triton(logits, out, row_mask=None if row_mask is None else row_mask.contiguous())


def _logits_argmax_fake(logits: torch.Tensor, *args: Any) -> torch.Tensor:
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


_KERNELS.update(
    {
        "logits_argmax": (
            _functional(_logits_argmax_out, _logits_argmax_fake),
            _logits_argmax_fake,
        ),
        "logits_argmax_out": (_logits_argmax_out, _out_fake),
        "lm_head_argmax": (
            _functional(_lm_head_argmax_out, _lm_head_argmax_fake),
            _lm_head_argmax_fake,
        ),
        "lm_head_argmax_out": (_lm_head_argmax_out, _out_fake),
        "lm_head_logits": (
            _functional(_lm_head_logits_out, _lm_head_logits_fake),
            _lm_head_logits_fake,
        ),
        "lm_head_logits_out": (_lm_head_logits_out, _out_fake),
    }
)


_LM_HEAD_LIB = _register(_LM_HEAD_SCHEMAS)


# ------------------------------------------------------------------------------ paged KV cache
# The decode attention over an engine's paged pool through a block table (optimized/attention.py
# validates; the kernel is optimized/kernels/sink_attention.py).  Its writes need no operator
# of their own: a pool (N, bs, Dh) is kv_cache_write's ring cache of N * bs rings of one row,
# and a slot of vLLM's slot mapping is that ring's index (optimized/kv_cache.py, PagedKVCache).
if TYPE_CHECKING:
    from .kernels.sink_attention import sink_attention_paged_triton
else:
    sink_attention_paged_triton = triton_kernel("sink_attention", "sink_attention_paged_triton")

_PAGED_ARGS = (
    "Tensor q, Tensor q_pos, Tensor cache_kv, Tensor cache_pos, Tensor block_table, "
    "Tensor attn_sink"
)
_PAGED_SCHEMAS: dict[str, str] = {
    "sink_attention_paged": f"sink_attention_paged({_PAGED_ARGS}, {_ATTN_TAIL}) -> Tensor",
    "sink_attention_paged_out": (
        f"sink_attention_paged_out({_PAGED_ARGS}, {_ATTN_TAIL}, *, Tensor(a!) out) -> ()"
    ),
}
SCHEMAS.update(_PAGED_SCHEMAS)
OPS = tuple(SCHEMAS)


def _sink_attention_paged_out(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cache_kv: torch.Tensor,
    cache_pos: torch.Tensor,
    block_table: torch.Tensor,
    attn_sink: torch.Tensor,
    window: int,
    scale: float,
    backend: str,
    schedule: Sequence[int],
    *,
    out: torch.Tensor,
) -> None:
    if backend != "triton":
        raise _unknown("sink_attention_paged", backend, ("triton",))
    B, H, Dh = q.shape
    if B == 0:
        return
    fp32 = q.dtype == torch.float32
    sched = _attn_schedule(tuple(schedule), H, Dh, window, fp32, B, q.device, cached=True)
    sink_attention_paged_triton(
        q.contiguous(), q_pos.contiguous(), cache_kv.contiguous(), cache_pos.contiguous(),
        block_table.contiguous(), attn_sink.contiguous(), out, window, scale, sched,
    )  # fmt: skip


_KERNELS.update(
    {
        "sink_attention_paged": (_functional(_sink_attention_paged_out, _x_like), _x_like),
        "sink_attention_paged_out": (_sink_attention_paged_out, _out_fake),
    }
)


_PAGED_LIB = _register(_PAGED_SCHEMAS)


# ------------------------------------------------------------------------------ step guard
# The decode step's input guard (optimized/step_guard.py validates; the kernel is
# optimized/kernels/step_guard.py).  The functional variant takes the bad-input record and
# returns a lowered copy; the ``_out`` variant lowers the caller's record in place (the form a
# captured decode step runs, its record persisting across replays) and writes the four masked
# outputs.
if TYPE_CHECKING:
    from .kernels.step_guard import step_guard_triton
else:
    step_guard_triton = triton_kernel("step_guard", "step_guard_triton")

_GUARD_ARGS = "Tensor input_ids, Tensor positions, Tensor prev_hidden, Tensor slots, Tensor real"
_GUARD_LIMITS = "int vocab_size, int max_positions"
_GUARD_SCHEMAS: dict[str, str] = {
    "step_guard": (
        f"step_guard({_GUARD_ARGS}, Tensor record, {_GUARD_LIMITS}) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
    "step_guard_out": (
        f"step_guard_out({_GUARD_ARGS}, {_GUARD_LIMITS}, *, Tensor(a!) ok, Tensor(b!) ids_out, "
        "Tensor(c!) positions_out, Tensor(d!) slots_out, Tensor(e!) record) -> ()"
    ),
}
SCHEMAS.update(_GUARD_SCHEMAS)
OPS = tuple(SCHEMAS)


def _step_guard_out(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    prev_hidden: torch.Tensor,
    slots: torch.Tensor,
    real: torch.Tensor,
    vocab_size: int,
    max_positions: int,
    *,
    ok: torch.Tensor,
    ids_out: torch.Tensor,
    positions_out: torch.Tensor,
    slots_out: torch.Tensor,
    record: torch.Tensor,
) -> None:
    if input_ids.shape[0] == 0:
        return
    # The kernel writes its outputs and the record through their base pointers: contiguous
    # (a copy would leave the caller's tensors unwritten); optimized/step_guard.py checks it.
    prev = prev_hidden if prev_hidden.stride(-1) == 1 else prev_hidden.contiguous()
    step_guard_triton(
        input_ids.contiguous(), positions.contiguous(), prev, slots.contiguous(),
        real.contiguous(), vocab_size, max_positions, ok, ids_out, positions_out, slots_out,
        record,
    )  # fmt: skip


def _guard_outputs(
    input_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B = input_ids.shape[0]
    return (
        input_ids.new_empty((B,), dtype=torch.bool),
        input_ids.new_empty((B,)),
        input_ids.new_empty((B,)),
        input_ids.new_empty((B,)),
    )


def _step_guard_fake(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    prev_hidden: torch.Tensor,
    slots: torch.Tensor,
    real: torch.Tensor,
    record: torch.Tensor,
    vocab_size: int,
    max_positions: int,
) -> tuple[torch.Tensor, ...]:
    return (*_guard_outputs(input_ids), torch.empty_like(record))


def _step_guard(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    prev_hidden: torch.Tensor,
    slots: torch.Tensor,
    real: torch.Tensor,
    record: torch.Tensor,
    vocab_size: int,
    max_positions: int,
) -> tuple[torch.Tensor, ...]:
    ok, ids, pos, slot = _guard_outputs(input_ids)
    new = record.clone(memory_format=torch.contiguous_format)
    _step_guard_out(
        input_ids, positions, prev_hidden, slots, real, vocab_size, max_positions,
        ok=ok, ids_out=ids, positions_out=pos, slots_out=slot, record=new,
    )  # fmt: skip
    return ok, ids, pos, slot, new


_KERNELS.update(
    {
        "step_guard": (_step_guard, _step_guard_fake),
        "step_guard_out": (_step_guard_out, _out_fake),
    }
)


_GUARD_LIB = _register(_GUARD_SCHEMAS)


# ------------------------------------------------------------------------------ embed_norms
# The MTP layer's entry (optimized/norm.py validates): the embedding gather with enorm and
# hnorm over the previous hidden streams, one launch of optimized/kernels/rms_norm.py.
if TYPE_CHECKING:
    from .kernels.rms_norm import embed_norms_triton
else:
    embed_norms_triton = triton_kernel("rms_norm", "embed_norms_triton")

_EMBED_ARGS = (
    "Tensor input_ids, Tensor positions, Tensor embed, Tensor prev_hidden, Tensor enorm, "
    "Tensor hnorm, float eps, str order, bool mask_pos0"
)
_EMBED_SCHEMAS: dict[str, str] = {
    "embed_norms": f"embed_norms({_EMBED_ARGS}) -> (Tensor, Tensor)",
    "embed_norms_out": (
        f"embed_norms_out({_EMBED_ARGS}, *, Tensor(a!) e_out, Tensor(b!) h_out) -> ()"
    ),
}
SCHEMAS.update(_EMBED_SCHEMAS)
OPS = tuple(SCHEMAS)


def _embed_norms_out(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    embed: torch.Tensor,
    prev_hidden: torch.Tensor,
    enorm: torch.Tensor,
    hnorm: torch.Tensor,
    eps: float,
    order: str,
    mask_pos0: bool,
    *,
    e_out: torch.Tensor,
    h_out: torch.Tensor,
) -> None:
    D = embed.shape[1]
    if input_ids.shape[0] == 0 or D == 0:
        return
    # The kernel writes its outputs through their base pointers: optimized/norm.py checks that
    # they are contiguous.  prev_hidden's rows, like rms_norm's, are made contiguous here; the
    # embedding (1 GB at V4-Flash) is read through its row stride, never copied.
    emb = embed if embed.stride(1) == 1 else embed.contiguous()
    embed_norms_triton(
        input_ids.contiguous(), positions.contiguous(), emb,
        prev_hidden.contiguous().view(-1, D), enorm.contiguous(), hnorm.contiguous(), eps,
        e_out, h_out.view(-1, D), vllm_order=(order == "vllm"), mask_pos0=mask_pos0,
    )  # fmt: skip


def _embed_norms_fake(
    input_ids: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor,
    prev_hidden: torch.Tensor, *args: Any,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    e = embed.new_empty((input_ids.shape[0], embed.shape[1]))
    return e, prev_hidden.new_empty(prev_hidden.shape)


def _embed_norms(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    e, h = _embed_norms_fake(*args)
    _embed_norms_out(*args, e_out=e, h_out=h)
    return e, h


_KERNELS.update(
    {
        "embed_norms": (_embed_norms, _embed_norms_fake),
        "embed_norms_out": (_embed_norms_out, _out_fake),
    }
)


_EMBED_LIB = _register(_EMBED_SCHEMAS)
