"""The weight-code decodes of the Triton GEMMs: E4M3 bytes and packed E2M1 nibbles to their
values, in registers (docs/semantics.md, "Number formats").

Three ways to the same values (the MoE GEMMs pick one per schedule, ``decode=`` in
kernels/moe_schedule.py; the dense linears use ``"asm"``):

* ``"f16"``: and/shift/or into an fp16 bit pattern whose value is the code's value times a power
  of two (:func:`_e4m3_times_2m8`, :func:`_e2m1_times_2m14`), widened to fp32 exactly;
* ``"bits"``: the fp32 pattern from integer ops and selects (:func:`_e4m3_f32`, :func:`_e2m1_f32`);
* ``"asm"`` (GPU only): PTX on four codes at a time straight into bf16 pairs
  (:func:`_e4m3_bf16`, :func:`_e2m1_pair_bf16`); under the interpreter, which cannot run PTX,
  the same values from the integer decode.

Every decode is exact: an E4M3 or E2M1 value fits bf16.  None has a NaN: the e4m3 NaN codes
0x7F / 0xFF decode to +-480 (the exponent-15 pattern read as a normal number).  They need not
produce NaN because no NaN code reaches a kernel: ``pack_linear``, ``pack_moe`` and ``pack_head``
refuse NaN codes and non-finite block scales at pack time (``dsv4mtp.checks.check_finite_codes``,
the checkpoint loader's scan rules in dsv4mtp/checkpoint/scan.py), as the loader does for a
checkpoint.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "_e2m1_f32",
    "_e2m1_pair_bf16",
    "_e2m1_times_2m14",
    "_e4m3_bf16",
    "_e4m3_f32",
    "_e4m3_times_2m8",
]


@triton.jit
def _fp16_pattern_to_f32(bits):
    """int32 holding a 16-bit pattern -> the fp16 value it encodes, widened to fp32 (exact)."""
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3_times_2m8(b):
    """e4m3 byte (int32) -> e4m3 value * 2**-8 in fp32."""
    return _fp16_pattern_to_f32(((b & 0x7F) << 7) | ((b & 0x80) << 8))


@triton.jit
def _e2m1_times_2m14(n):
    """e2m1 nibble (int32) -> e2m1 value * 2**-14 in fp32."""
    return _fp16_pattern_to_f32(((n & 7) << 9) | ((n & 8) << 12))


@triton.jit
def _e2m1_f32(n):
    """e2m1 nibble (int32) -> its value in fp32, from integer ops only (``decode="bits"``).

    Magnitudes 2..7 are (exponent e = m >> 1, mantissa bit m & 1): their fp32 pattern is
    ``(m << 22) + (126 << 23)``; 1 is 0.5 (``126 << 23``), 0 is zero; the sign is bit 3."""
    mag = n & 7
    b = (mag << 22) + (126 << 23)
    b = tl.where(mag == 1, 126 << 23, b)
    b = tl.where(mag == 0, 0, b)
    return (b | ((n >> 3) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_f32(b):
    """e4m3 byte (int32) -> its value in fp32, from integer ops and one exact subtraction.

    Normal codes: the 7 magnitude bits moved under fp32's exponent and re-biased (+120).
    Subnormal codes (exponent field 0, value m/8 * 2**-6): 2**-6 * (1 + m/8) - 2**-6."""
    mag = b & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    sub = ((mag << 20) + (121 << 23)).to(tl.float32, bitcast=True) - 0.015625
    v = tl.where(mag < 8, sub, normal).to(tl.int32, bitcast=True)
    return (v | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)


# ``decode="asm"`` (GPU only): PTX on four codes at a time, every step an integer op or an
# exact bf16x2 multiply, 2 (E4M3) to 3 (E2M1) instructions per weight against ~8 for the
# float-conversion decodes.  A code goes into a bf16 bit pattern whose value is the code's
# value times a power of two (E4M3: byte & 0x7f under bf16's exponent, times 2**-120; E2M1:
# nibble & 7 at bits 6..8, times 2**-126, code 1 landing on a bf16 subnormal), the sign to
# bit 15; one ``mul.rn.bf16x2`` by 2**120 / 2**126 restores the value exactly (sm_90's bf16
# arithmetic keeps subnormals), and FP4 codes take a second exact multiply by the group scale.
# prmt spreads bytes 0,1 (2,3) of the packed word into the low bytes of two 16-bit halves so each
# shift/mask works on a bf16x2 pair (E4M3's prmt also fills the high bytes with the signs).
def _ptx_pair(
    src: str, mag_mask: int, mag_shift: int, sign_shift: int, out: str, *muls: str
) -> str:
    """PTX of one bf16x2 pair: the codes of ``src`` (a byte in each 16-bit half) shifted into a
    bf16 bit pattern (magnitude, then sign to bit 15), then the exact multiplies ``muls``."""
    lines = [
        f"shl.b32 t, {src}, {mag_shift};",
        f"and.b32 t, t, {mag_mask:#010x};",
        f"shl.b32 u, {src}, {sign_shift};",
        "and.b32 u, u, 0x80008000;",
        "or.b32 t, t, u;",
    ]
    for i, m in enumerate(muls):
        lines.append(f"mul.rn.bf16x2 {out if i == len(muls) - 1 else 't'}, t, {m};")
    return "\n".join(lines)


def _ptx(consts: str, body: list[str], codes: str) -> str:
    # prmt: bytes 0,1 (a) and 2,3 (b) of the packed code word into the low bytes of two halves
    head = [
        "{",
        ".reg .b32 z, k, a, b, t, u;",
        "mov.b32 z, 0;",
        f"mov.b32 k, {consts};",
        f"prmt.b32 a, {codes}, z, 0x4140;",
        f"prmt.b32 b, {codes}, z, 0x4342;",
    ]
    return "\n".join([*head, *body, "}"])


# E4M3 (out $0, $1; codes $2): one prmt per pair puts code j in the low byte of a 16-bit half
# and its sign replicated (prmt's sign mode) in the high byte; << 4 and a mask leave sign << 15
# | (code & 0x7f) << 4, the bf16 pattern of the value times 2**-120 (the low half's sign byte
# spills into bits 16..19, which the mask clears): four instructions per pair, the multiply by
# 2**120 (bf16 0x7B80) included.
_ASM_E4M3 = tl.constexpr(
    "\n".join(
        [
            "{",
            ".reg .b32 t, u, k;",
            "prmt.b32 t, $2, $2, 0x9180;",
            "prmt.b32 u, $2, $2, 0xB3A2;",
            "shl.b32 t, t, 4;",
            "shl.b32 u, u, 4;",
            "and.b32 t, t, 0x87F087F0;",
            "and.b32 u, u, 0x87F087F0;",
            "mov.b32 k, 0x7B807B80;",
            "mul.rn.bf16x2 $0, t, k;",
            "mul.rn.bf16x2 $1, u, k;",
            "}",
        ]
    )
)
# E2M1 (low nibbles out $0, $1, high nibbles $2, $3; codes $4; scales $5, $6): magnitude 3 bits
# to bits 6..8, sign to bit 15, times 2**126 (bf16 0x7E80), times the code's group scale.
_E2M1_PAIRS = (  # (magnitude shift, sign shift, source, output, scale operand)
    (6, 12, "a", "$0", "$5"),
    (6, 12, "b", "$1", "$6"),
    (2, 8, "a", "$2", "$5"),
    (2, 8, "b", "$3", "$6"),
)
_ASM_E2M1 = tl.constexpr(
    _ptx(
        "0x7E807E80",
        [_ptx_pair(src, 0x01C001C0, m, sg, out, "k", sc) for m, sg, src, out, sc in _E2M1_PAIRS],
        "$4",
    )
)


@triton.jit
def _e4m3_bf16(b, INTERP: tl.constexpr):
    """uint8 e4m3 codes -> their values in bf16 (exact).  Compiled: the PTX above; the
    interpreter (which cannot run PTX) computes the same values with integer ops."""
    if INTERP:
        return _e4m3_f32(b.to(tl.int32)).to(tl.bfloat16)
    else:
        return tl.inline_asm_elementwise(
            _ASM_E4M3, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4
        )


@triton.jit
def _e2m1_pair_bf16(codes, scale, INTERP: tl.constexpr):
    """uint8 codes (two e2m1 nibbles each, low = even column) and a bf16 scale per code ->
    (low, high) nibble values times the scale, in bf16 (exact while in bf16's range)."""
    if INTERP:
        c = codes.to(tl.int32)
        sf = scale.to(tl.float32)
        return (
            (_e2m1_f32(c & 15) * sf).to(tl.bfloat16),
            (_e2m1_f32(c >> 4) * sf).to(tl.bfloat16),
        )
    else:
        return tl.inline_asm_elementwise(
            _ASM_E2M1, "=r,=r,=r,=r,r,r,r", [codes, scale],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
        )  # fmt: skip
