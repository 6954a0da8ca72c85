"""Rejected design (session 11): the mHC collapse as a persistent, lookahead-pipelined stream.

    python3 diag/ab_stream.py --variants v2base,v2dyn,...   (from bench/; the A/B driver)

Why it was tried.  The committed collapse (optimized/kernels/mhc_collapse.py) re-reads each
program's piece after two barriers; with ~500 resident programs the ~65 MB of pieces in flight
outgrow the L2, so part of the re-read comes from HBM (ncu: 202 vs 134 MB at hc_head D 4096).
Here programs are persistent and take work items from a ticket stream, so the data between a
line's first read and its re-read is bounded by the lookahead, not by the residency:
* mix(b, s): stream token block b's slice s (BLOCK_T x n x D_SLICE) from HBM, store its partial
  mix and square sum (the committed workspace layout), release-increment the block's counter;
* finalize(b, f): wait for the block's S_MIX partials, reduce tokens [f*TPF, (f+1)*TPF) with
  the committed ``_reduce_gates`` (gates, post, Sinkhorn comb), release-increment the counter;
* apply(b, a): wait for the block's F finalizes, re-read slice a with the committed
  ``_apply_tile`` and write the output.
Ticket group q = the mix items of block q, the finalize items of block q - LOOKAHEAD_F, the apply
items of block q - LOOKAHEAD.  Tickets go to programs statically (ticket i to program i mod G,
G <= resident programs) or dynamically (an atomic counter); either way an item waits only on
items with smaller tickets, which running programs hold.  Same bits as the committed kernel
(same slot order, same reduce and apply helpers).  MODE 1 runs the mix items only, MODE 2 mix and
finalize (apply skipped): streaming ceilings of this item shape.

What it measured (H200; bench/results/mhc-h200.md, "The persistent-stream collapse", and
mhc-h200-stream-*.log): slower than the committed kernel at T 4096 in every case but two (+3 %),
up to 2x slower for hc_pre at T 512.  With short lookaheads programs spun 20-76 % of their time
waiting for gates (a block's last partial lands late under full HBM load, and a finalize under
load takes tens of us); the first version (one finalizer per block, the last mix item to arrive)
also convoyed: the finalizing program fell behind, arrived last again and finalized again (one
program spent 470 us finalizing).  Lookaheads sized from the grid ("w" variants) cut the spin to
4-23 %, but at the 2-3 programs per SM that keeps the working set inside the L2 the mix items
stream too slowly.  The mix items alone stream at most 3.1 TB/s (hc_head D 4096, 256-column
slices, 4 programs/SM, 5 stages: 43 us for 134 MB), so even a perfect overlap of this item
shape would not reach the issue's 75 % of copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from sm90_resources import programs_by_registers

from dsv4mtp.optimized.kernels._launch import INTERPRET, next_pow2
from dsv4mtp.optimized.kernels.mhc_collapse import _apply_tile, _reduce_gates
from dsv4mtp.optimized.kernels.mhc_mix import mix_step


@triton.jit
def _mix_item(x_ptr, fn_ptr, part_ptr, sq_ptr, blk, s, T,
              D: tl.constexpr, S_MIX: tl.constexpr, D_SLICE: tl.constexpr, N: tl.constexpr,
              M: tl.constexpr, MP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
              X_IS_BF16: tl.constexpr, INTERP: tl.constexpr, ROW_MAJOR: tl.constexpr,
              NO_MMA: tl.constexpr):  # fmt: skip
    K = N * D
    tt = tl.arange(0, BLOCK_T)
    t = blk * BLOCK_T + tt
    t_ok = t < T
    x_row = x_ptr + t.to(tl.int64)[:, None] * K
    m = tl.arange(0, MP)
    acc = tl.zeros((BLOCK_T, MP), dtype=tl.float32)
    sq = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    for k in range(0, N * D_SLICE, BLOCK_K):
        if ROW_MAJOR:
            j = k // D_SLICE
            c = tl.multiple_of(k % D_SLICE, BLOCK_K)
        else:
            j = (k // BLOCK_K) % N
            c = tl.multiple_of((k // (BLOCK_K * N)) * BLOCK_K, BLOCK_K)
        d = s * D_SLICE + c + tl.arange(0, BLOCK_K)
        d_ok = d < D
        x = tl.load(x_row + j * D + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        if NO_MMA:
            sq += x.to(tl.float32) * x.to(tl.float32)
        else:
            w = tl.load(fn_ptr + m[:, None] * K + j * D + d[None, :],
                        mask=(m[:, None] < M) & d_ok[None, :], other=0.0)  # fmt: skip
            acc, sq = mix_step(x, w, acc, sq, X_IS_BF16, INTERP)
    row = s * T.to(tl.int64) + t  # slot s's slab, as in the committed kernel's workspace
    tl.store(part_ptr + row[:, None] * M + m[None, :], acc, mask=t_ok[:, None] & (m[None, :] < M))
    tl.store(sq_ptr + row, tl.sum(sq, axis=1), mask=t_ok)


@triton.jit
def _apply_item(x_ptr, gate_ptr, out_ptr, blk, a, T,
                D: tl.constexpr, A_SLICE: tl.constexpr, APPLY_D: tl.constexpr, N: tl.constexpr,
                NP: tl.constexpr, BLOCK_T: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    K = N * D
    out_ty = out_ptr.dtype.element_ty
    t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    t64 = t.to(tl.int64)
    jj = tl.arange(0, NP)
    x_base = x_ptr + t64[:, None, None] * K + jj[None, :, None] * D  # (BT, NP, 1)
    ok_tj = t_ok[:, None, None] & (jj[None, :, None] < N)
    for c in tl.range(0, A_SLICE, APPLY_D, num_stages=1, loop_unroll_factor=1):
        c_rev = tl.multiple_of(A_SLICE - APPLY_D - c, APPLY_D)
        d = a * A_SLICE + c_rev + tl.arange(0, APPLY_D)
        d3 = d[None, None, :]
        xa = tl.load(x_base + d3, mask=ok_tj & (d3 < D), other=0.0, eviction_policy="evict_first")
        _apply_tile(xa, gate_ptr, out_ptr, t64, t_ok, d, D, N, NP, out_ty, INTERP)


@triton.jit(do_not_specialize=["T", "n_blocks", "LOOKAHEAD", "LOOKAHEAD_F"])
def mhc_stream_kernel(
    x_ptr, fn_ptr, scale_ptr, base_ptr, part_ptr, sq_ptr, gate_ptr, sync_ptr,
    out_ptr, post_ptr, comb_ptr,
    T, n_blocks, rms_eps, hc_eps, post_mult, LOOKAHEAD, LOOKAHEAD_F,
    D: tl.constexpr, S_MIX: tl.constexpr, D_SLICE: tl.constexpr, S_APPLY: tl.constexpr,
    A_SLICE: tl.constexpr, TPF: tl.constexpr,
    SINKHORN_ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, M: tl.constexpr,
    MP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, APPLY_D: tl.constexpr,
    DYNAMIC: tl.constexpr, WITH_POST_COMB: tl.constexpr, X_IS_BF16: tl.constexpr,
    INTERP: tl.constexpr, MODE: tl.constexpr, TRACE: tl.constexpr, ROW_MAJOR: tl.constexpr,
    NO_MMA: tl.constexpr, trace_ptr=None,
):  # fmt: skip
    F: tl.constexpr = BLOCK_T // TPF
    GS: tl.constexpr = S_MIX + F + S_APPLY
    total = (n_blocks + LOOKAHEAD) * GS
    i = tl.atomic_add(sync_ptr, 1) if DYNAMIC else tl.program_id(0)
    c_mix = tl.zeros((), dtype=tl.int64)
    c_fin = tl.zeros((), dtype=tl.int64)
    c_spin = tl.zeros((), dtype=tl.int64)
    c_app = tl.zeros((), dtype=tl.int64)
    n_mix = tl.zeros((), dtype=tl.int64)
    n_app = tl.zeros((), dtype=tl.int64)
    t_begin = _clock(TRACE)
    while i < total:
        q = i // GS
        r = i % GS
        if r < S_MIX:
            if q < n_blocks:
                t0 = _clock(TRACE)
                _mix_item(x_ptr, fn_ptr, part_ptr, sq_ptr, q, r, T, D, S_MIX, D_SLICE, N, M, MP,
                          BLOCK_T, BLOCK_K, X_IS_BF16, INTERP, ROW_MAJOR, NO_MMA)  # fmt: skip
                tl.debug_barrier()
                tl.atomic_add(sync_ptr + 1 + q, 1, sem="release", scope="gpu")
                c_mix += _clock(TRACE) - t0
                n_mix += 1
        elif r < S_MIX + F:
            b = q - LOOKAHEAD_F
            if (b >= 0) & (b < n_blocks) & (MODE != 1):
                t0 = _clock(TRACE)
                _wait_count(sync_ptr, 1 + b, S_MIX, n_blocks)
                t1 = _clock(TRACE)
                local = (r - S_MIX) * TPF + tl.arange(0, TPF)
                tr = b * BLOCK_T + local
                _reduce_gates(part_ptr, sq_ptr, scale_ptr, base_ptr, gate_ptr, post_ptr, comb_ptr,
                              tr, tr < T, T, N * D, rms_eps, hc_eps, post_mult, S_MIX,
                              SINKHORN_ITERS, N, NP, M, TPF, WITH_POST_COMB)  # fmt: skip
                tl.debug_barrier()
                tl.atomic_add(sync_ptr + 1 + b, 1, sem="release", scope="gpu")
                c_spin += t1 - t0
                c_fin += _clock(TRACE) - t1
        else:
            b = q - LOOKAHEAD
            if (b >= 0) & (MODE == 0):
                t0 = _clock(TRACE)
                _wait_count(sync_ptr, 1 + b, S_MIX + F, n_blocks)
                t1 = _clock(TRACE)
                _apply_item(x_ptr, gate_ptr, out_ptr, b, r - S_MIX - F, T, D, A_SLICE, APPLY_D,
                            N, NP, BLOCK_T, INTERP)  # fmt: skip
                t2 = _clock(TRACE)
                c_spin += t1 - t0
                c_app += t2 - t1
                n_app += 1
        if DYNAMIC:
            i = tl.atomic_add(sync_ptr, 1)
        else:
            i += tl.num_programs(0)
    if TRACE:
        row = trace_ptr + tl.program_id(0) * 8
        tl.store(row + 0, _clock(TRACE) - t_begin)
        tl.store(row + 1, c_mix)
        tl.store(row + 2, c_fin)
        tl.store(row + 3, c_spin)
        tl.store(row + 4, c_app)
        tl.store(row + 5, n_mix)
        tl.store(row + 6, n_app)


@triton.jit
def _wait_count(sync_ptr, k, target, n_blocks):
    """Spin (acquire) until counter k reaches target; the experiment's watchdog counts a wait
    that gives up after ~4M polls instead of hanging."""
    ready = tl.atomic_add(sync_ptr + k, 0, sem="acquire", scope="gpu")
    polls = 0
    while (ready < target) & (polls < 4_000_000):
        ready = tl.atomic_add(sync_ptr + k, 0, sem="acquire", scope="gpu")
        polls += 1
    if ready < target:
        tl.atomic_add(sync_ptr + 1 + n_blocks, 1)
    tl.debug_barrier()


@triton.jit
def _clock(TRACE: tl.constexpr):
    if TRACE:
        return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)  # fmt: skip
    else:
        return tl.zeros((), dtype=tl.int64)


@dataclass(frozen=True)
class StreamConfig:
    block_t: int = 64
    d_slice: int = 128
    a_slice: int = 128
    block_k: int = 64
    apply_d: int = 64
    lookahead: int = 8  # groups (token blocks) between a block's mix and its apply items
    lookahead_f: int = 2  # ... and its finalize items
    # If set, the lookaheads in tickets as multiples of the grid (overrides the group counts):
    # a block's finalize items come la_f * grid tickets after its mix items, the apply la * grid.
    la_f: float | None = None
    la: float | None = None
    tpf: int = 8
    programs_per_sm: int = 3
    num_warps: int = 4
    num_stages: int = 3
    dynamic: bool = False
    mode: int = 0  # 0 full, 1 mix only, 2 mix + finalize
    trace: bool = False
    row_major: bool = False
    no_mma: bool = False
    maxnreg: int | None = None


SMEM_PER_SM = 233472  # 228 KB; 1 KB of it reserved per resident block


def resident_per_sm(compiled, num_warps: int) -> int:
    """Programs of this compiled kernel one SM holds: registers, shared memory, threads."""
    compiled._init_handles()
    by_regs = programs_by_registers(compiled.n_regs, num_warps)
    by_smem = SMEM_PER_SM // (compiled.metadata.shared + 1024)
    by_threads = 2048 // (num_warps * 32)
    return max(1, min(by_regs, by_smem, by_threads, 32))


_RESIDENT: dict = {}
LAST_INFO: dict = {}


def mhc_collapse(
    x, fn, scale, base, out, *, rms_norm_eps, hc_eps, post=None, comb=None, post_mult=2.0,
    sinkhorn_iters=1, cfg: StreamConfig | None = None, trace=None,
):  # fmt: skip
    T, n, D = x.shape
    if T == 0:
        return
    cfg = cfg or StreamConfig()
    M = fn.shape[0]
    NP = next_pow2(n)
    S_MIX = triton.cdiv(D, cfg.d_slice)
    S_APPLY = triton.cdiv(D, cfg.a_slice)
    n_blocks = triton.cdiv(T, cfg.block_t)
    dev = x.device
    part = torch.empty((S_MIX, T, M), dtype=torch.float32, device=dev)
    sq = torch.empty((S_MIX, T), dtype=torch.float32, device=dev)
    gate = torch.empty((T, NP), dtype=torch.float32, device=dev)
    sync = torch.zeros((2 + n_blocks,), dtype=torch.int32, device=dev)
    LAST_INFO["sync"] = sync
    with_pc = post is not None
    sms = 1 if INTERPRET else torch.cuda.get_device_properties(dev).multi_processor_count
    GS = S_MIX + cfg.block_t // cfg.tpf + S_APPLY
    look, look_f = cfg.lookahead, cfg.lookahead_f
    if cfg.la_f is not None and cfg.la is not None:
        cap = 1 if INTERPRET else sms * cfg.programs_per_sm  # grid upper bound
        look_f = max(1, -(-int(cfg.la_f * cap) // GS))
        look = max(look_f + 1, -(-int(cfg.la * cap) // GS))
    args = (
        x, fn, scale, base, part, sq, gate, sync, out,
        post if with_pc else out, comb if with_pc else out,
        T, n_blocks, float(rms_norm_eps), float(hc_eps), float(post_mult), look, look_f,
    )  # fmt: skip
    meta = dict(
        D=D,
        S_MIX=S_MIX,
        D_SLICE=cfg.d_slice,
        S_APPLY=S_APPLY,
        A_SLICE=cfg.a_slice,
        TPF=cfg.tpf,
        SINKHORN_ITERS=int(sinkhorn_iters),
        N=n,
        NP=NP,
        M=M,
        MP=max(16, next_pow2(M)),
        BLOCK_T=cfg.block_t,
        BLOCK_K=cfg.block_k,
        APPLY_D=cfg.apply_d,
        DYNAMIC=cfg.dynamic,
        WITH_POST_COMB=with_pc,
        X_IS_BF16=(x.dtype == torch.bfloat16),
        INTERP=INTERPRET,
        MODE=cfg.mode,
        TRACE=cfg.trace,
        ROW_MAJOR=cfg.row_major,
        NO_MMA=cfg.no_mma,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.maxnreg:
        meta["maxnreg"] = cfg.maxnreg
    total = (n_blocks + look) * GS
    tr = None
    if cfg.trace:
        tr = torch.zeros((sms * 32, 8), dtype=torch.int64, device=dev)
        LAST_INFO["trace"] = tr
    if INTERPRET:
        grid = 1
    else:
        key = (dev.index, tuple(sorted((k, v) for k, v in meta.items())))
        if key not in _RESIDENT:
            compiled = mhc_stream_kernel.warmup(*args, grid=(1,), trace_ptr=tr, **meta)
            _RESIDENT[key] = (resident_per_sm(compiled, cfg.num_warps), compiled.n_regs,
                              compiled.metadata.shared)  # fmt: skip
        per_sm, regs, smem = _RESIDENT[key]
        grid = min(total, sms * min(per_sm, cfg.programs_per_sm))
        LAST_INFO.update(per_sm=per_sm, regs=regs, smem=smem, grid=grid, look=(look_f, look))
    mhc_stream_kernel[(grid,)](*args, trace_ptr=tr, **meta)
