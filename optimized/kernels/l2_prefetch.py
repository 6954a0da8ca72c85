"""Warming the L2 with a weight the step reads next (optimized/prefetch.py is the entry point).

At decode sizes a dense linear reads 6-34 MB once, and most of its time is its start: the first
tiles wait a full HBM round trip while the grid fills (bench/results/linear-h200.md, "Decode
schedules").  The kernels that run before it (norms, RoPE, the attention against a 128-row
window, the mHC mixes) use little of the HBM's bandwidth.  This kernel asks the L2 to fetch a
byte range ahead of its reader, so that the HBM reads overlap those latency-bound kernels and
the linear then finds its weight in the L2.

One program issues ``CHUNK // PIECE`` bulk prefetches (``cp.async.bulk.prefetch.L2``, sm_90's
bulk copy engine: one instruction per ``PIECE`` bytes, no registers, no completion to wait for),
so the kernel retires in about a microsecond while the L2 fetches the bytes behind it.  It
writes nothing: a prefetch is a hint, and dropping it changes no result, only the time.

``MODE`` 0: plain bulk prefetch; 1: the same with an L2 evict-last policy (the lines then
outlive streaming traffic that passes between the prefetch and the read); 2: one
``prefetch.global.L2::evict_last`` per 128-byte line (the pre-Hopper form, for comparison).
"""

from __future__ import annotations

import triton
import triton.language as tl

# A bulk prefetch's size must be a multiple of 16 bytes, its address 16-byte aligned.
ALIGN = 16

_BULK = tl.constexpr("""{
.reg .pred p;
setp.gt.s32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.b32 $0, 0;
}""")

_BULK_LAST = tl.constexpr("""{
.reg .pred p;
.reg .b64 pol;
setp.gt.s32 p, $2, 0;
createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
mov.b32 $0, 0;
}""")

_LINE_LAST = tl.constexpr("""{
.reg .pred p;
setp.gt.s32 p, $2, 0;
@p prefetch.global.L2::evict_last [$1];
mov.b32 $0, 0;
}""")


@triton.jit
def l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, PIECE: tl.constexpr, MODE: tl.constexpr):
    """Program p prefetches bytes [p * CHUNK, (p + 1) * CHUNK) of ``ptr`` (uint8), clipped to
    ``nbytes`` (a multiple of 16 for the bulk modes)."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * CHUNK + tl.arange(0, CHUNK // PIECE).to(tl.int64) * PIECE
    size = tl.minimum(nbytes - offs, PIECE).to(tl.int32)  # <= 0 past the end: no prefetch
    if MODE == 0:
        tl.inline_asm_elementwise(
            _BULK, "=r,l,r", [ptr + offs, size], dtype=tl.int32, is_pure=False, pack=1
        )
    elif MODE == 1:
        tl.inline_asm_elementwise(
            _BULK_LAST, "=r,l,r", [ptr + offs, size], dtype=tl.int32, is_pure=False, pack=1
        )
    else:
        tl.inline_asm_elementwise(
            _LINE_LAST, "=r,l,r", [ptr + offs, size], dtype=tl.int32, is_pure=False, pack=1
        )
