"""Triton device functions shared by the kernels (``kernels/*.py`` import them through
``_launch``, which loads this module, and with it triton, on first use)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["rne_bf16_if_interpreted", "sigmoid"]


@triton.jit
def rne_bf16_if_interpreted(y, out_dtype: tl.constexpr, INTERP: tl.constexpr):
    """Round fp32 ``y`` to nearest-even bf16 before a store, under the interpreter only.

    Triton 3.6's interpreter converts fp32 -> bf16 by truncation (the compiled GPU code rounds to
    nearest even), which would double the CPU tier's rounding error.  Adding half an ulp (ties to
    even) to the bit pattern and clearing the low 16 bits makes the interpreter's truncating
    conversion exact.  Compiled kernels skip this: INTERP is a compile-time constant.
    """
    if INTERP and out_dtype == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        y = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    return y


@triton.jit
def sigmoid(v):
    """``1 / (1 + exp(-v))`` (fp32 operands in our kernels); shared by the mHC kernels."""
    return 1.0 / (1.0 + tl.exp(-v))
