"""The shared LM head: logits and greedy ids (docs/semantics.md, "The MTP layer end to end").

``compute_logits`` ends in ``norm(hc_head(h)) @ head^T``: the normed rows y (T, D) times the
target's head (V, D), in fp32 for bf16 / fp32 layers (float64 for the float64 oracle), as the
official ``ParallelHead``.  Greedy drafting takes the argmax of each row (torch.argmax: the
lowest index among equal maxima, a NaN counts as the maximum).  The head may come as a dense
tensor or as a core :class:`QuantizedWeight` (an FP8 head: codes and 128x128 block scales),
dequantized exactly in the compute dtype.
"""

from __future__ import annotations

import torch

from dsv4mtp.checkpoint.weights import QuantizedWeight
from dsv4mtp.checks import check_dtype, check_shape, compute_dtype
from dsv4mtp.errors import InputError

__all__ = ["lm_head_argmax", "lm_head_logits"]

_CHUNK = 16384  # vocab rows per product: bounds the float64 temporaries at V4's V 129280


def _dense_head(head: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The head (V, D) in ``dtype``: a tensor as given, a QuantizedWeight decoded exactly."""
    if isinstance(head, QuantizedWeight):
        return head.dequantize(dtype)
    if not isinstance(head, torch.Tensor):
        raise InputError(
            f"head: expected a torch.Tensor or a QuantizedWeight, got {type(head).__name__}"
        )
    return head.to(dtype)


def lm_head_logits(y: torch.Tensor, head: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """y (T, D) @ head (V, D)^T -> logits (T, V) in promote(y.dtype, float32)."""
    check_dtype("y", y, (torch.float64, torch.float32, torch.bfloat16))
    if y.dim() != 2:
        raise InputError(f"y: expected shape (T, D), got {tuple(y.shape)}")
    cd = compute_dtype(y.dtype)
    w = _dense_head(head, cd)  # (V, D)
    check_shape("head", w, (None, y.shape[1]))
    y = y.to(cd)
    parts = [y @ w[v : v + _CHUNK].T for v in range(0, w.shape[0], _CHUNK)]  # (T, chunk) each
    return torch.cat(parts, dim=1)  # (T, V)


def lm_head_argmax(y: torch.Tensor, head: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """Greedy ids (T,) int64: each row's argmax of :func:`lm_head_logits`."""
    return lm_head_logits(y, head).argmax(-1)  # (T,)
