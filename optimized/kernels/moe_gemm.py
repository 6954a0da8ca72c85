"""Grouped expert GEMMs with in-register weight decode, the top-k combine and activation quant.

Layout (what ``optimized/moe.py``'s ``pack_moe`` builds; docs/semantics.md, "MoE: router,
clamped SwiGLU, shared expert"): per expert e, ``w13`` rows are [gate (I) ; up (I)] of D inputs,
``w2`` rows are D outputs of I inputs, exactly as the checkpoint stores them:

======== ============================== =========================================
FMT      codes (E, N, ...)              scales
======== ============================== =========================================
0 bf16   (E, N, K) bf16                 none
1 fp8    (E, N, K) e4m3 bytes (uint8)   (E, N/128, K/128) fp32 (e8m0 widened)
2 mxfp4  (E, N, K/2) uint8, low nibble  (E, N, K/32) e8m0 bytes
         = even column
3 nvfp4  (E, N, K/2) uint8              (E, N, K/16) e4m3 bytes
======== ============================== =========================================

plus ``gscale (E, 3)`` fp32: the per-expert global scales of gate, up and down (NVFP4's
``weight_scale_2``, or the folded fc1_alpha twice and fc2_alpha; ones otherwise), applied to the
fp32 accumulator.

Decode.  An E2M1 nibble n goes into an fp16 bit pattern ``(n & 7) << 9 | (n & 8) << 12`` whose
value is exactly ``e2m1(n) * 2**-14`` (code 1 lands on fp16's subnormal 2**-15), widened to fp32
(a conversion: exact, never flushed) and multiplied by ``block_scale * 2**14``; the product has
at most 2 + 4 significant bits, so its bf16 rounding is exact and the bf16 tensor-core dot sees
the checkpoint's values.  E4M3 bytes (NVFP4 block scales, FP8 codes) decode the same way into
fp16 ``(b & 0x7f) << 7 | (b & 0x80) << 8`` = ``e4m3(b) * 2**-8``.  FP8 weights: the decoded
codes feed the dot and the fp32 128x128 block scale (times 2**8) multiplies the fp32 partial of
each 128-wide K block (fp32 scales are not exact in bf16).  FP4 codes are not interleaved in
registers: the dot runs as ``x[:, 0::2] @ lo^T + x[:, 1::2] @ hi^T``.

Kernels.  ``moe_gate_up_kernel``: grid (M blocks, cdiv(I, BLOCK_N)); one program computes
BLOCK_N gate and the same BLOCK_N up columns for the BLOCK_M rows of one expert (rows from the
align kernel, or tokens 0..T-1 for the shared expert), applies the global scales, rounds g and u
to the activation dtype (as the reference's linear does), clamps (up both sides, gate from
above), ``h = silu(g) * u * routing weight`` in fp32 and stores h rounded to the activation
dtype.  ``moe_down_kernel``: grid (M blocks, cdiv(D, BLOCK_N)), ``y = h @ w2^T * down scale``,
stored in the activation dtype at the row's slot (t*K + k) of a (T*K, D) workspace.
``moe_reduce_kernel``: out[t] = sum of the valid slots k = 0..K-1 in slot order in fp32 (+ the
shared expert's row), one rounding; no atomics, so the result is deterministic.
Bytes per call: the codes and scales of every expert with a routed row, once per M block (once at
decode sizes), x and h from L2, workspace 2*T*K*D*itemsize.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, rne_bf16_if_interpreted
from .moe_common import jit_loop_bounds

__all__ = [
    "FMT_BF16",
    "FMT_FP8",
    "FMT_MXFP4",
    "FMT_NVFP4",
    "act_quant_triton",
    "moe_down_triton",
    "moe_gate_up_triton",
    "moe_reduce_triton",
]

FMT_BF16, FMT_FP8, FMT_MXFP4, FMT_NVFP4 = 0, 1, 2, 3


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
def _dot(a, b, acc, USE_F32: tl.constexpr):
    if USE_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _k_step(
    x_rows,
    xm,
    k0,
    w_base,
    s_base,
    n,
    nm,
    KDIM,
    FMT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_F32: tl.constexpr,
):
    """The fp32 (BLOCK_M, BLOCK_N) product of x_rows[:, k0:k0+BLOCK_K] and the expert rows n,
    block scales applied (FP8: the fp32 block scale on the partial)."""
    if FMT == 2 or FMT == 3:
        BKH: tl.constexpr = BLOCK_K // 2
        GH: tl.constexpr = 16 if FMT == 2 else 8  # bytes per scale group
        NG: tl.constexpr = BKH // GH
        jj = tl.arange(0, BKH)
        codes = tl.load(
            w_base + n[:, None].to(tl.int64) * (KDIM // 2) + (k0 // 2 + jj)[None, :],
            mask=nm[:, None],
            other=0,
        ).to(tl.int32)
        sg = tl.arange(0, NG)
        sraw = tl.load(
            s_base + n[:, None].to(tl.int64) * (KDIM // (2 * GH)) + (k0 // (2 * GH) + sg)[None, :],
            mask=nm[:, None],
            other=0,
        ).to(tl.int32)
        if FMT == 2:  # e8m0 2**(s-127), times 2**14; byte 0 is 2**-127 (fp32 subnormal)
            sf = tl.where(sraw == 0, 2.0**-113, (sraw << 23).to(tl.float32, bitcast=True) * 16384.0)
        else:  # e4m3, times 2**14
            sf = _e4m3_times_2m8(sraw) * (256.0 * 16384.0)
        lo = (_e2m1_times_2m14(codes & 15).reshape(BLOCK_N, NG, GH) * sf[:, :, None]).reshape(
            BLOCK_N, BKH
        )
        hi = (_e2m1_times_2m14(codes >> 4).reshape(BLOCK_N, NG, GH) * sf[:, :, None]).reshape(
            BLOCK_N, BKH
        )
        xe = tl.load(x_rows + (k0 + 2 * jj)[None, :], mask=xm, other=0.0)
        xo = tl.load(x_rows + (k0 + 2 * jj + 1)[None, :], mask=xm, other=0.0)
        acc = tl.zeros((xe.shape[0], BLOCK_N), dtype=tl.float32)
        acc = _dot(xe, tl.trans(lo.to(xe.dtype)), acc, USE_F32)
        acc = _dot(xo, tl.trans(hi.to(xo.dtype)), acc, USE_F32)
        return acc
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + kk[None, :], mask=xm, other=0.0)
        wp = w_base + n[:, None].to(tl.int64) * KDIM + kk[None, :]
        acc = tl.zeros((x.shape[0], BLOCK_N), dtype=tl.float32)
        if FMT == 1:
            w = _e4m3_times_2m8(tl.load(wp, mask=nm[:, None], other=0).to(tl.int32))
            acc = _dot(x, tl.trans(w.to(x.dtype)), acc, USE_F32)
            s = tl.load(s_base + (n // 128) * (KDIM // 128) + k0 // 128, mask=nm, other=0.0)
            return acc * (s * 256.0)[None, :]
        else:
            w = tl.load(wp, mask=nm[:, None], other=0.0)
            return _dot(x, tl.trans(w.to(x.dtype)), acc, USE_F32)


@triton.jit
def _rows(
    sorted_ptr,
    block_expert_ptr,
    pid_m,
    T,
    IDENTITY: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """(expert, slot or token per row, row valid) of M block pid_m; expert -1 = unused block."""
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if IDENTITY:
        e = pid_m * 0
        slot = r
        ok = r < T
    else:
        e = tl.load(block_expert_ptr + pid_m)
        slot = tl.load(sorted_ptr + r)
        ok = slot >= 0
    return e, slot, ok


@jit_loop_bounds("D")
def moe_gate_up_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    sorted_ptr,
    block_expert_ptr,
    topw_ptr,
    h_ptr,
    T,
    D,
    I,
    TOPK,
    limit,
    W_STRIDE_E,
    S_STRIDE_E,
    IDENTITY: tl.constexpr,
    FMT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_F32: tl.constexpr,
    INTERP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    h_ty = h_ptr.dtype.element_ty
    e, slot, ok = _rows(sorted_ptr, block_expert_ptr, pid_m, T, IDENTITY, BLOCK_M)
    token = slot if IDENTITY else slot // TOPK
    active = e >= 0  # unused blocks stream no weights
    e = tl.maximum(e, 0).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < I
    x_rows = x_ptr + token[:, None].to(tl.int64) * D
    xm = ok[:, None]
    w_base = w_ptr + e * W_STRIDE_E
    s_base = s_ptr + e * S_STRIDE_E
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if active:
        for k0 in range(0, D, BLOCK_K):
            acc_g += _k_step(
                x_rows, xm, k0, w_base, s_base, n, nm, D, FMT, BLOCK_N, BLOCK_K, USE_F32
            )
            acc_u += _k_step(
                x_rows, xm, k0, w_base, s_base, n + I, nm, D, FMT, BLOCK_N, BLOCK_K, USE_F32
            )
    g = acc_g * tl.load(gs_ptr + e * 3)
    u = acc_u * tl.load(gs_ptr + e * 3 + 1)
    # the reference's gate and up linears return the activation dtype
    g = rne_bf16_if_interpreted(g, h_ty, INTERP).to(h_ty).to(tl.float32)
    u = rne_bf16_if_interpreted(u, h_ty, INTERP).to(h_ty).to(tl.float32)
    if limit > 0:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
    h = g / (1.0 + tl.exp(-g)) * u
    if not IDENTITY:
        h = h * tl.load(topw_ptr + slot, mask=ok, other=0.0).to(tl.float32)[:, None]
    h = rne_bf16_if_interpreted(h, h_ty, INTERP)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(h_ptr + r[:, None].to(tl.int64) * I + n[None, :], h.to(h_ty), mask=xm & nm[None, :])


@jit_loop_bounds("I")
def moe_down_kernel(
    h_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    sorted_ptr,
    block_expert_ptr,
    y_ptr,
    T,
    D,
    I,
    W_STRIDE_E,
    S_STRIDE_E,
    IDENTITY: tl.constexpr,
    FMT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_F32: tl.constexpr,
    INTERP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    y_ty = y_ptr.dtype.element_ty
    e, slot, ok = _rows(sorted_ptr, block_expert_ptr, pid_m, T, IDENTITY, BLOCK_M)
    active = e >= 0
    e = tl.maximum(e, 0).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < D
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    h_rows = h_ptr + r[:, None].to(tl.int64) * I
    xm = ok[:, None]
    w_base = w_ptr + e * W_STRIDE_E
    s_base = s_ptr + e * S_STRIDE_E
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if active:
        for k0 in range(0, I, BLOCK_K):
            acc += _k_step(h_rows, xm, k0, w_base, s_base, n, nm, I, FMT, BLOCK_N, BLOCK_K, USE_F32)
    y = acc * tl.load(gs_ptr + e * 3 + 2)
    y = rne_bf16_if_interpreted(y, y_ty, INTERP)
    tl.store(y_ptr + slot[:, None].to(tl.int64) * D + n[None, :], y.to(y_ty), mask=xm & nm[None, :])


@triton.jit
def moe_reduce_kernel(
    ws_ptr,
    ids_ptr,
    map_ptr,
    shared_ptr,
    out_ptr,
    D,
    E_GLOBAL,
    E_LOCAL,
    TOPK: tl.constexpr,
    HAS_MAP: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERP: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    o_ty = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(TOPK):
        g = tl.load(ids_ptr + t * TOPK + k).to(tl.int32)
        valid = (g >= 0) & (g < E_GLOBAL)
        loc = tl.load(map_ptr + tl.where(valid, g, 0)).to(tl.int32) if HAS_MAP else g
        valid = valid & (loc >= 0) & (loc < E_LOCAL)
        y = tl.load(ws_ptr + (t * TOPK + k) * D + d, mask=dm & valid, other=0.0)
        acc += y.to(tl.float32)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + t * D + d, mask=dm, other=0.0).to(tl.float32)
    acc = rne_bf16_if_interpreted(acc, o_ty, INTERP)
    tl.store(out_ptr + t * D + d, acc.to(o_ty), mask=dm)


@triton.jit
def act_quant_kernel(x_ptr, out_ptr, R, K, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    """Round each 1 x BLOCK block of x through e4m3 with a power-of-two scale (amax floored at
    1e-4; dsv4mtp/quant.py) and write q * scale in x's dtype (exact: e4m3 fits bf16)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = c < K
    o_ty = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * K + c, mask=cm, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-4)
    # 2**ceil(log2(amax / 448)) from the exponent bits (exact; log2 of an fp32 can round)
    r = amax / 448.0
    rb = r.to(tl.int32, bitcast=True)
    ex = ((rb >> 23) & 0xFF) - 127
    ex = tl.where((rb & 0x7FFFFF) != 0, ex + 1, ex)
    scale = ((ex + 127) << 23).to(tl.float32, bitcast=True)
    v = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
    vb = v.to(tl.int32, bitcast=True)
    ve = tl.maximum(((vb >> 23) & 0xFF) - 127, -6)  # e4m3 subnormals share 2**-6's step
    ulp = ((ve - 3 + 127) << 23).to(tl.float32, bitcast=True)
    y = v / ulp  # exact (power of two); |y| < 16
    y = (y + 12582912.0) - 12582912.0  # round half to even at integer precision
    q = y * ulp * scale
    q = rne_bf16_if_interpreted(q, o_ty, INTERP)
    tl.store(out_ptr + row * K + c, q.to(o_ty), mask=cm)


# ----------------------------------------------------------------------------- launchers
def _use_f32(x: torch.Tensor) -> bool:
    # fp32 activations need an fp32 dot; the interpreter's bf16 dot is wrong, so it upcasts
    return INTERPRET or x.dtype == torch.float32


def moe_gate_up_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    gscale: torch.Tensor,
    sorted_slot: torch.Tensor | None,
    block_expert: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
    h: torch.Tensor,
    *,
    fmt: int,
    inter: int,
    top_k: int,
    limit: float,
    num_m_blocks: int,
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int = 4,
    num_stages: int = 3,
) -> None:
    """h (num_m_blocks*block_m, I) = clamped SwiGLU of x's rows (see the module doc)."""
    T, D = x.shape
    identity = sorted_slot is None
    dummy = gscale
    grid = (num_m_blocks, triton.cdiv(inter, block_n))
    moe_gate_up_kernel[grid](
        x, w13, s13, gscale,
        dummy if identity else sorted_slot, dummy if identity else block_expert,
        dummy if topk_weights is None else topk_weights, h,
        T, D, inter, top_k, float(limit), w13[0].numel(), s13[0].numel() if s13.numel() else 0,
        IDENTITY=identity, FMT=fmt, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        USE_F32=_use_f32(x) or w13.dtype == torch.float32, INTERP=INTERPRET, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def moe_down_triton(
    h: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    gscale: torch.Tensor,
    sorted_slot: torch.Tensor | None,
    block_expert: torch.Tensor | None,
    y: torch.Tensor,
    *,
    fmt: int,
    T: int,
    D: int,
    inter: int,
    num_m_blocks: int,
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int = 4,
    num_stages: int = 3,
) -> None:
    """y[slot] = h[row] @ w2^T (rows of each M block; see the module doc)."""
    identity = sorted_slot is None
    dummy = gscale
    grid = (num_m_blocks, triton.cdiv(D, block_n))
    moe_down_kernel[grid](
        h, w2, s2, gscale,
        dummy if identity else sorted_slot, dummy if identity else block_expert, y,
        T, D, inter, w2[0].numel(), s2[0].numel() if s2.numel() else 0,
        IDENTITY=identity, FMT=fmt, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        USE_F32=_use_f32(h) or w2.dtype == torch.float32, INTERP=INTERPRET, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def moe_reduce_triton(
    ws: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    shared: torch.Tensor | None,
    out: torch.Tensor,
    e_local: int,
) -> None:
    """out (T, D) = sum over valid slots of ws (T*K, D) (+ shared (T, D))."""
    T, D = out.shape
    K = topk_ids.shape[1]
    if T == 0:
        return
    block = min(1024, triton.next_power_of_2(D))
    e_global = expert_map.numel() if expert_map is not None else e_local
    moe_reduce_kernel[(T, triton.cdiv(D, block))](
        ws, topk_ids, topk_ids if expert_map is None else expert_map,
        out if shared is None else shared, out, D, e_global, e_local,
        TOPK=K, HAS_MAP=expert_map is not None, HAS_SHARED=shared is not None,
        BLOCK_D=block, INTERP=INTERPRET, num_warps=4,
    )  # fmt: skip


def act_quant_triton(x: torch.Tensor, out: torch.Tensor) -> None:
    """out (R, K) = e4m3 round trip of x (R, K) per 1x128 block (power-of-two scales)."""
    R, K = x.shape
    if R == 0:
        return
    act_quant_kernel[(R, triton.cdiv(K, 128))](x, out, R, K, BLOCK=128, INTERP=INTERPRET)
