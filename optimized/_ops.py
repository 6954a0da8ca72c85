"""The optimized ops as PyTorch operators in the ``dsv4mtp`` namespace.

``torch.ops.dsv4mtp.<op>`` (functional: allocates and returns its outputs) and
``torch.ops.dsv4mtp.<op>_out`` (writes keyword-only ``out`` tensors, declared mutated in the
schema, returns nothing) for ``rms_norm``, ``hc_pre``, ``hc_post`` and ``hc_head``.  Schemas carry
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
    from .kernels.mhc_head import mhc_head_fma
    from .kernels.mhc_mix import MixConfig, mhc_mix_splitk, mix_config
    from .kernels.mhc_post import mhc_post_triton
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
    rms_norm_triton = triton_kernel("rms_norm", "rms_norm_triton")

__all__ = ["NAMESPACE", "OPS", "SCHEMAS", "schedule_fields"]

NAMESPACE = "dsv4mtp"

_PRE_ARGS = (
    "Tensor x, Tensor fn, Tensor scale, Tensor base, float rms_norm_eps, float hc_eps, "
    "int sinkhorn_iters, float post_mult, str backend, int[] collapse, int[] mix"
)
_HEAD_ARGS = (
    "Tensor x, Tensor fn, Tensor scale, Tensor base, float rms_norm_eps, float hc_eps, "
    "str backend, int[] collapse"
)
_NORM_ARGS = "Tensor x, Tensor? weight, float eps, str order, str backend"
_POST_ARGS = "Tensor f, Tensor residual, Tensor post, Tensor comb, str backend"

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
    # (R, D) rows; a view only where x is not 2-D already (a view costs ~1 us of host time)
    x2d = x.contiguous()
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


def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, order: str, backend: str
) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rms_norm_out(x, weight, eps, order, backend, out=out)
    return out


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
    *,
    layer_input: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
) -> None:
    T = x.shape[0]
    if T == 0:
        return
    x, fn, scale32, base32 = _collapse_inputs(x, fn, scale, base)
    if backend == "triton":
        mhc_collapse(
            x, fn, scale32, base32, layer_input,
            rms_norm_eps=rms_norm_eps, hc_eps=hc_eps, post=post, comb=comb, post_mult=post_mult,
            sinkhorn_iters=sinkhorn_iters, cfg=_collapse_cfg(tuple(collapse)),
        )  # fmt: skip
        return
    if backend not in ("flashinfer", "flashinfer_prenorm"):
        raise _unknown("hc_pre", backend, ("triton", "flashinfer", "flashinfer_prenorm"))
    # The split-K mix producer, then FlashInfer's Sinkhorn + pre-weighted sum.  FlashInfer
    # writes post as (T, 4, 1); ours is (T, 4): the same bytes.
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


def _hc_post(
    f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, backend: str
) -> torch.Tensor:
    out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    _hc_post_out(f, residual, post, comb, backend, out=out)
    return out


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
    *,
    out: torch.Tensor,
) -> None:
    if x.shape[0] == 0:
        return
    x, fn, scale32, base32 = _collapse_inputs(x, fn, scale, base)
    if backend == "triton_fma":
        mhc_head_fma(x, fn, scale32, base32, out, rms_norm_eps=rms_norm_eps, hc_eps=hc_eps)
    elif backend == "triton_mma":
        mhc_collapse(
            x, fn, scale32, base32, out, rms_norm_eps=rms_norm_eps, hc_eps=hc_eps,
            post_mult=1.0, sinkhorn_iters=1, cfg=_collapse_cfg(tuple(collapse)),
        )  # fmt: skip
    else:
        raise _unknown("hc_head", backend, ("triton_fma", "triton_mma"))


def _hc_head(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    rms_norm_eps: float,
    hc_eps: float,
    backend: str,
    collapse: Sequence[int],
) -> torch.Tensor:
    out = x.new_empty((x.shape[0], x.shape[2]))
    _hc_head_out(x, fn, scale, base, rms_norm_eps, hc_eps, backend, collapse, out=out)
    return out


def _hc_head_fake(x: torch.Tensor, *args: Any) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[2]))


def _out_fake(*args: Any, **kwargs: Any) -> None:
    return None


# ------------------------------------------------------------------------------ registration
_KERNELS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "rms_norm": (_rms_norm, _rms_norm_fake),
    "rms_norm_out": (_rms_norm_out, _out_fake),
    "hc_pre": (_hc_pre, _hc_pre_fake),
    "hc_pre_out": (_hc_pre_out, _out_fake),
    "hc_post": (_hc_post, _hc_post_fake),
    "hc_post_out": (_hc_post_out, _out_fake),
    "hc_head": (_hc_head, _hc_head_fake),
    "hc_head_out": (_hc_head_out, _out_fake),
}


def _defined(name: str) -> bool:
    return hasattr(getattr(torch.ops, NAMESPACE), name)


def _register() -> torch.library.Library | None:
    if all(_defined(name) for name in SCHEMAS):
        return None  # registered by an earlier import of this module under another name
    lib = torch.library.Library(NAMESPACE, "DEF")
    for name, schema in SCHEMAS.items():
        kernel, fake = _KERNELS[name]
        lib.define(schema)
        lib.impl(name, kernel, "CPU")
        lib.impl(name, kernel, "CUDA")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
    return lib


_LIB = _register()  # kept alive: dropping the Library object would deregister the ops
