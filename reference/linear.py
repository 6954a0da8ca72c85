"""The one matmul every projection of the layer goes through (the LM head in ``compute_logits``
apart: a chunked fp32 product), and its grouped form (``wo_a``).

``y = x @ W^T`` in promote(x.dtype, float32) (the official GEMMs accumulate in fp32 and write the
activation dtype), optionally after simulated FP8 activation quantization (``docs/semantics.md``,
"Activation and KV quantization").  ``W`` is a dense tensor, or a checkpoint's
:class:`~dsv4mtp.checkpoint.weights.QuantizedWeight` (FP8 blocks or bf16), which is dequantized
once into x.dtype first, as :func:`~dsv4mtp.params.build_layer_params` gives the layer its dense
linears ("Notation and shapes": linear weights are dequantized once into ``a``); in float64 that
is the exact math on the stored codes and scales.

Rows are computed independently (a batched product of one row each): BLAS picks different
kernels, hence different rounding, for 1 row and for many, and we want a token's output to be
bit-for-bit the same whether it is decoded alone (incremental decoding with a KV cache) or inside
a longer prefill.
"""

from __future__ import annotations

import torch

from dsv4mtp.checkpoint.weights import QuantizedWeight
from dsv4mtp.checks import FLOAT_DTYPES, check_dtype, check_ndim, compute_dtype
from dsv4mtp.errors import InputError
from dsv4mtp.quant import ACT_QUANT_BLOCK

from .quant_sim import fp8_block_roundtrip

__all__ = ["eh_proj", "grouped_linear", "linear", "rowwise_matmul"]


def rowwise_matmul(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """``x (R, K) @ weight_t (K, N)`` with each row's result independent of the other rows."""
    R = x.shape[0]
    return torch.bmm(x[:, None, :], weight_t.expand(R, -1, -1))[:, 0, :]  # (R, N)


def _dense(weight: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """A dense weight as given; a QuantizedWeight dequantized once into ``dtype``."""
    if isinstance(weight, QuantizedWeight):
        return weight.dequantize(dtype)
    if not isinstance(weight, torch.Tensor):
        raise InputError(
            f"weight: expected a torch.Tensor or a QuantizedWeight, got {type(weight).__name__}"
        )
    return weight


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | QuantizedWeight,
    *,
    act_quant: bool = False,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x (..., K) @ weight (N, K)^T -> (..., N)`` in x.dtype.

    ``act_quant``: round x through e4m3 in 1x128 blocks first, as before an FP8/FP4 GEMM.
    ``batch_invariant``: no effect (every row is computed alone already); the optimized op's
    keyword.  ``out``: an (..., N) tensor of x.dtype to write the result into (returned).
    """
    check_dtype("x", x, FLOAT_DTYPES)
    w = _dense(weight, x.dtype)
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise InputError(
            f"x: expected last dim {w.shape[-1]} to match weight {tuple(w.shape)}, "
            f"got shape {tuple(x.shape)}"
        )
    cd = compute_dtype(x.dtype)
    if act_quant:
        x = fp8_block_roundtrip(x, ACT_QUANT_BLOCK)
    rows = x.reshape(-1, x.shape[-1]).to(cd)  # (R, K)
    y = rowwise_matmul(rows, w.to(cd).T)  # (R, N)
    y = y.reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)
    return _write(y, out)


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor | QuantizedWeight,
    *,
    act_quant: bool = False,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x (T, G, K)``, ``weight (G, N, K)`` -> ``(T, G, N)``: group g is ``linear(x[:, g],
    weight[g])`` (the grouped ``wo_a``, docs/semantics.md "Output").  A QuantizedWeight holds the
    groups stacked along rows, (G*N, K).  Keywords as :func:`linear`."""
    check_dtype("x", x, FLOAT_DTYPES)
    check_ndim("x", x, 3)
    T, G, K = x.shape
    w = _dense(weight, x.dtype)
    if isinstance(weight, QuantizedWeight):
        if w.shape[0] % max(G, 1):
            raise InputError(
                f"weight: expected {G} groups of rows (x's dim 1), got shape {tuple(w.shape)}"
            )
        w = w.view(G, -1, w.shape[1])
    if w.dim() != 3 or w.shape[0] != G or w.shape[2] != K:
        raise InputError(
            f"x: expected shape (T, {w.shape[0]}, {w.shape[-1]}) to match weight "
            f"{tuple(w.shape)}, got {tuple(x.shape)}"
        )
    ys = [linear(x[:, g], w[g], act_quant=act_quant) for g in range(G)]  # G x (T, N)
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(T, 0, w.shape[1])  # (T, G, N)
    return _write(y, out)


def eh_proj(
    e: torch.Tensor,
    h: torch.Tensor,
    e_proj: torch.Tensor | QuantizedWeight,
    h_proj: torch.Tensor | QuantizedWeight,
    *,
    act_quant: bool = False,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The layer's input projection (docs/semantics.md, "The MTP layer end to end"):
    ``x = h_proj(h) + e_proj(e)``, e's projection added to every stream.  e (T, K) the normed
    embedding rows, h (T, n, K) the normed hidden streams; each product rounded to x's dtype
    (:func:`linear`), then their sum.  Keywords as :func:`linear`; ``out`` (T, n, N)."""
    check_dtype("e", e, FLOAT_DTYPES)
    check_ndim("e", e, 2)
    check_ndim("h", h, 3)
    (Ne, Ke), (Nh, Kh) = _out_in("e_proj", e_proj), _out_in("h_proj", h_proj)
    if e.shape[1] != Ke:
        raise InputError(f"e: expected shape (T, {Ke}) (e_proj's K), got {tuple(e.shape)}")
    if h.shape[0] != e.shape[0] or h.shape[2] != Kh or h.dtype != e.dtype:
        raise InputError(
            f"h: expected (T={e.shape[0]}, n, {Kh}) in {e.dtype} (e's tokens and dtype, "
            f"h_proj's K), got {h.dtype} {tuple(h.shape)}"
        )
    if Nh != Ne:
        raise InputError(f"h_proj: expected {Ne} output features (e_proj's), got {Nh}")
    ep = linear(e, e_proj, act_quant=act_quant)  # (T, N)
    hp = linear(h, h_proj, act_quant=act_quant)  # (T, n, N)
    return _write(hp + ep[:, None, :], out)  # (T, n, N)


def _out_in(name: str, weight: torch.Tensor | QuantizedWeight) -> tuple[int, int]:
    """(N, K) of a plain linear's weight (a QuantizedWeight's logical shape), checked 2-D."""
    if not isinstance(weight, (torch.Tensor, QuantizedWeight)):
        raise InputError(
            f"{name}: expected a torch.Tensor or a QuantizedWeight, got {type(weight).__name__}"
        )
    shape = tuple(weight.shape)
    if len(shape) != 2:
        raise InputError(f"{name}: expected a 2-D (N, K) weight, got shape {shape}")
    return shape[0], shape[1]


def _write(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return y
    if not isinstance(out, torch.Tensor) or out.shape != y.shape or out.dtype != y.dtype:
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out)
        raise InputError(f"out: expected {y.dtype} of shape {tuple(y.shape)}, got {got}")
    return out.copy_(y)
