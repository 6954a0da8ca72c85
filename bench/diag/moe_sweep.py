"""Pick MoE schedules on the H200: time candidate ``MoESchedule``s of the whole optimized moe.

For MXFP4 and FP8 routed experts at V4-Flash shapes (E 256, top-6, I 2048, D 4096), uniform
routing (fixed seeds), T in {1, 8, 64, 512, 4096}: each candidate schedule of that T
(:func:`candidates`, most promising first) is

* checked against the default schedule's output on the same input (rel. Frobenius error <=
  ``--max-rel``, finite; the router is the same kernel, so only summation order and the dot
  instruction can differ: a failing candidate is printed and skipped, never picked);
* timed as the whole ``moe`` (route, align, routed experts, shared expert, reduce) from CUDA-graph
  replay of a graph of back-to-back calls cycling through ``--weight-copies`` packs (each its
  own experts, router and shared expert) and ``--input-sets`` inputs, so no call finds the
  previous call's weights in the 60 MB L2 (bench/h200_moe.py's method and byte model).

For the default and the best schedule of each (format, T) (or the one ``--parts-of`` names)
the parts are also timed alone, the same way: router, align (the sort), routed gate/up
(+ split-K epilogue), routed down, the reduce, and the shared expert; so the table attributes
the time.  A global time cap
(``--cap-s``, default 480 s) stops the sweep between candidates; what ran is printed.  Output:
one table (us per call, time / floor, rel. error vs the default) and the best schedule per
(format, T) as a ``MoESchedule(...)`` literal; ``--json PATH`` also writes the rows.

Plain command on the GPU machine (repository root, its own Python, no nox):
    python bench/diag/moe_sweep.py [--formats mxfp4,fp8] [--tokens 1,8,64,512,4096]
        [--cap-s 480] [--json /tmp/moe_sweep.json]
``--dry-run``: the same code paths on the CPU (TRITON_INTERPRET=1 is set by the script) at the
tiny shape (E 8, top-2, I 128, D 256), T 1, three candidates, wall-clock timed (~1 min).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h200_moe import Clock, call_bytes, call_flops, copy_bandwidth, gemm_peak, routing_stats

from dsv4mtp.conformance.inputs import MOE_SHAPES, moe_inputs, moe_params
from dsv4mtp.optimized import _ops
from dsv4mtp.optimized.kernels.moe_align import moe_align_triton
from dsv4mtp.optimized.kernels.moe_gemm import (
    moe_down_triton,
    moe_gate_up_triton,
    moe_reduce_triton,
)
from dsv4mtp.optimized.kernels.moe_gemm_gluon import uses_wgmma
from dsv4mtp.optimized.moe import MoEPack, MoESchedule, moe, moe_config, pack_moe, route

TOKENS = (1, 8, 64, 512, 4096)
FORMATS = ("mxfp4", "fp8")
_FMT = {"bf16": 0, "fp8": 1, "mxfp4": 2, "nvfp4": 3}


# ------------------------------------------------------------------------------ candidates
def _all(s: MoESchedule, **tile: Any) -> MoESchedule:
    """``s`` with the same GemmTile changes on all four GEMMs."""
    return replace(
        s,
        gate_up=replace(s.gate_up, **tile),
        down=replace(s.down, **tile),
        shared_gate_up=replace(s.shared_gate_up, **tile),
        shared_down=replace(s.shared_down, **tile),
    )


def _routed(s: MoESchedule, **tile: Any) -> MoESchedule:
    """``s`` with the same GemmTile changes on the two routed GEMMs only (the shared expert,
    FP8 in V4, keeps its tiles)."""
    return replace(s, gate_up=replace(s.gate_up, **tile), down=replace(s.down, **tile))


def mxdot_candidates(T: int, dry: bool) -> list[tuple[str, MoESchedule]]:
    """The group-scaled ``dot_scaled`` GEMMs (``decode="mxdot"``, MXFP4 routed experts, 128-wide
    K steps; other formats fall back to "asm"): at decode sizes 8- and 16-row blocks on the
    swapped dot (the weight rows on the MMA's M side, tokens on its N side), 32- to 128-row
    weight tiles, 4 or 8 warps, 2-4 stages, the default's K split and more; at prefill sizes
    64-row blocks, swapped and not."""
    d = moe_config(T, batch_invariant=False)
    m = replace(d, decode="mxdot")
    if dry:
        return [("mxdot_m8_swap", _routed(replace(m, block_m=8), swap_ab=True))]
    split = d.gate_up.split_k
    m8, m16 = replace(m, block_m=8), replace(m, block_m=16)
    if T <= 64:
        out = [
            ("mxdot_m8_swap_n64", _routed(m8, swap_ab=True, block_n=64)),
            ("mxdot_m8_swap_n64_w2", _routed(m8, swap_ab=True, block_n=64, num_warps=2)),
            ("mxdot_m8_swap_n128_w2", _routed(m8, swap_ab=True, block_n=128, num_warps=2)),
            ("mxdot_m8_swap_n256", _routed(m8, swap_ab=True, block_n=256)),
            ("mxdot_m8_swap_n256_w8", _routed(m8, swap_ab=True, block_n=256, num_warps=8)),
            ("mxdot_m8_swap_n128_s2", _routed(m8, swap_ab=True, block_n=128, num_stages=2)),
            ("mxdot_m8_swap_n128_s4", _routed(m8, swap_ab=True, block_n=128, num_stages=4)),
            ("mxdot_m8_swap_n128_w8", _routed(m8, swap_ab=True, block_n=128, num_warps=8)),
            ("mxdot_m8_swap_n128_x2split", _routed(m8, swap_ab=True, split_k=2 * split)),
            ("mxdot_m16_swap", _routed(m16, swap_ab=True, block_n=64)),
            ("mxdot_m16", _routed(m16, swap_ab=False, block_n=64)),
        ]
        return out
    # prefill sizes: an expert holds ~T*6/256 rows (12 at T 512, 96 at T 4096); the decode
    # tiles re-read an expert's weights per 8-row block (adjacent blocks, so mostly from L2)
    a64 = replace(moe_config(T, batch_invariant=True), align_chunk=d.align_chunk)
    return [
        ("asm_m64", a64),
        ("mxdot_m8_swap_n128", _routed(m8, swap_ab=True, block_n=128, split_k=1)),
        ("mxdot_m16_n128", _routed(m16, block_n=128, swap_ab=False, split_k=1)),
        ("mxdot_m32_n128", _routed(replace(m, block_m=32), block_n=128, swap_ab=False)),
        ("mxdot_m8_swap", _routed(m8, swap_ab=True, block_n=64)),
        ("mxdot_m16", _routed(m16, block_n=64, swap_ab=False)),
    ]


def wgmma_candidates(d: MoESchedule) -> list[tuple[str, MoESchedule]]:
    """The Gluon wgmma GEMMs (32-, 64- and 128-row M blocks, kernels/moe_gemm_gluon.py): 128
    weight rows on 8 warps or 64 on 4, 3-5 stages of x and codes in shared memory; on 32-row
    blocks also 8 warps for gate/up with 4 for down (``wg_m32_mix``)."""
    g = replace(d, decode="gluon")

    def wg(bm: int, warps: int = 8, stages: int = 3) -> MoESchedule:
        return _routed(
            replace(g, block_m=bm), block_n=16 * warps, num_warps=warps, num_stages=stages,
            split_k=1, swap_ab=False,
        )  # fmt: skip

    w8, w4 = wg(32, stages=4), wg(32, warps=4, stages=4)
    return [
        ("wg_m32", w8),
        ("wg_m32_w4", w4),
        ("wg_m32_mix", replace(w8, down=w4.down)),
        ("wg_m128", wg(128)),
        ("wg_m64", wg(64)),
        ("wg_m64_s4", wg(64, stages=4)),
        ("wg_m128_s5", wg(128, stages=5)),
        ("wg_m128_s4", wg(128, stages=4)),
        ("wg_m64_w4", wg(64, warps=4)),
        ("wg_m128_w4", wg(128, warps=4)),
    ]


def layout_candidates(
    T: int, layout: str, dry: bool, kfmt: str = ""
) -> list[tuple[str, MoESchedule]]:
    """MXFP4 experts in each ``pack_moe`` layout (``--layouts``): its default first, then the
    default with the shared expert in order on the one stream (``shared_stream`` flipped; the
    default takes the side stream up to T 64).  Rows: the per-group loads (``"mxdot"``) and
    the whole-step load (``"mxstep"``, the same bits).  Tiles (gate and up rows interleaved, so
    ``block_n`` counts both), where the default is the Gluon GEMMs (up to T 1024): the Triton
    ``"mxstep"`` schedule they replaced (and its 16-row blocks above T 256), another K split,
    64- / 256-row programs, 16- and 32-row blocks, the FP8 shared expert on other M blocks.
    Above T 256, where the scales fold, also the wgmma GEMMs (:func:`wgmma_candidates`); above
    T 1024 those are the default, and the PTX decode they replaced is ``ptx_m64``.  Tiles
    above T 1024 without the fold (the PTX decode): the other gate/up tile (256 or 64 rows),
    4 or 5 stages, 2 stages, 8 warps, 64- and 256-row down tiles, the Gluon GEMMs on 8-, 16-
    and 32-row blocks, swapped 8- and 16-row blocks, 32-row blocks, 64-row gate/up tiles.
    The layout "tiles_nofold" (``main``) is the tiles pack with ``mx_fold`` off.  ``kfmt``:
    the packs' kernel format (``MoEPack.kernel_fmt``).  ``--names`` keeps only the named
    ones."""
    # the packs' own kernel format ("mxfp4_tiles_fold" where the scales fold)
    fmt = kfmt or ("mxfp4_tiles" if layout == "tiles" else "mxfp4")
    d = moe_config(T, batch_invariant=False, fmt=fmt)
    flip = "shared_in_order" if d.shared_stream else "shared_side_stream"
    out = [("default", d), (flip, replace(d, shared_stream=not d.shared_stream))]
    if dry:
        return out
    if layout == "rows":
        if d.decode == "mxdot":
            out.append(("mxstep", replace(d, decode="mxstep")))
        return out
    gu, dn = d.gate_up, d.down
    fold = fmt == "mxfp4_tiles_fold"  # the wgmma GEMMs take folded scales only
    if d.decode == "gluon" and uses_wgmma(d.gate_up, d.block_m, fold):
        # the wgmma default (from T 768): what it replaced (the PTX decode above T 1024, the
        # mma_v2 GEMMs on 16-row blocks up to it), 32- to 128-row blocks, other stages, one
        # warpgroup
        if d.block_m >= 64:
            old = ("ptx_m64", moe_config(T, batch_invariant=False, fmt="mxfp4_tiles"))
        else:
            m16 = _routed(d, block_n=128, num_warps=4, num_stages=3)
            old = ("gluon_m16", replace(m16, block_m=16))
        return [*out, old, *wgmma_candidates(d)]
    if d.decode == "gluon":
        # the Gluon GEMMs (kernels/moe_gemm_gluon.py): against the Triton "mxstep" default they
        # replaced (its K split: 4-way at T <= 2), other splits and 64- / 256-row programs
        old = 4 if T <= 2 else gu.split_k
        out += [
            ("mxstep", _routed(replace(d, decode="mxstep"), split_k=old)),
            ("gluon_split_x2", _routed(d, split_k=2 * gu.split_k)),
            ("gluon_n64", _routed(d, block_n=64)),
            ("gluon_n256", _routed(d, block_n=256)),
        ]
        if gu.split_k > 1:
            out.append(("gluon_split_half", _routed(d, split_k=gu.split_k // 2)))
        if T > 8:
            out.append(("gluon_m16", replace(d, block_m=16)))
        if T > 256:
            out.append(("gluon_m32", replace(d, block_m=32)))
        # the FP8 shared expert (Triton, beside the routed GEMMs on the side stream up to T 64)
        # on other M blocks
        # (from 256 rows the shared expert runs on cuBLAS: its tiles then change nothing)
        for bm in (8, 32, 64):
            if bm != d.shared_block_m and (bm < 32 or T > 16) and T < 256:
                out.append((f"shared_m{bm}", replace(d, shared_block_m=bm)))
        if T > 256 and fold:
            out += wgmma_candidates(d)
        if T > 256:  # the 16-row unswapped "mxstep" blocks the Gluon GEMMs replaced here
            out.append(("mxstep_m16", _routed(replace(d, block_m=16, decode="mxstep"),
                                              swap_ab=False)))  # fmt: skip
        return out
    other_n = 256 if gu.block_n == 128 and T <= 768 else (64 if gu.block_n == 128 else 128)
    out += [
        (f"gu_n{other_n}", replace(d, gate_up=replace(gu, block_n=other_n))),
        ("s4", _routed(d, num_stages=4)),
        ("w8", _routed(d, num_warps=8)),
        (
            f"gu_n{other_n}_s4",
            replace(
                d,
                gate_up=replace(gu, block_n=other_n, num_stages=4),
                down=replace(dn, num_stages=4),
            ),
        ),
        ("dn_n64", replace(d, down=replace(dn, block_n=64))),
        ("dn_n256", replace(d, down=replace(dn, block_n=256))),
        ("s2", _routed(d, num_stages=2)),
        (f"gu_n{other_n}_w8", replace(d, gate_up=replace(gu, block_n=other_n, num_warps=8))),
    ]
    if T > 64:
        out.append(("m8_swap", _routed(replace(d, block_m=8), swap_ab=True)))
    if T > 64:
        # the Gluon GEMMs on 8- and 16-row blocks
        g = _routed(replace(d, decode="gluon"), block_n=128, split_k=1)
        out += [(f"gluon_m{bm}", replace(g, block_m=bm)) for bm in (8, 16, 32)]
        if fold:
            out += wgmma_candidates(d)
    if 64 < T <= 768:
        out += [
            ("m16_swap", _routed(d, swap_ab=True)),
            ("m32", replace(d, block_m=32)),
            ("m16_gu_n64", replace(d, gate_up=replace(gu, block_n=64))),
            ("m16_s2", _routed(d, num_stages=2)),
        ]
    if T <= 64:
        out += [
            ("gu_n64", replace(d, gate_up=replace(gu, block_n=64))),
            ("n64_w2", _routed(d, block_n=64, num_warps=2)),
            ("split2", _routed(d, split_k=2 * gu.split_k)),
            ("m16", replace(d, block_m=16)),
            ("s5", _routed(d, num_stages=5)),
        ]
    return out


def candidates(T: int, dry: bool) -> list[tuple[str, MoESchedule]]:
    """Schedules to try at T, the default first, then by expected value (the time cap cuts
    the tail).  Decode sizes: the PTX decode with K splits, narrower N tiles, more warps or
    stages, the swapped and the interleaved dot, and the integer decode for comparison.  Large
    T: the interleaved FP4 dot (contiguous x) with bigger M and N tiles (x re-read once per N
    tile; two stages where three would not fit in shared memory), 8 warps, grouped launch
    order, a 64-wide K step."""
    d = moe_config(T, batch_invariant=False)
    b = replace(d, decode="bits")
    a = replace(d, decode="asm")
    out = [("default", d), ("asm", a)]
    if dry:  # tiny shape: D 256, I 128
        j = replace(b, fp4_join=True)
        out.append(("bits_split2_swap_join", _all(j, block_k=64, split_k=2, swap_ab=True)))
        out.append(("asm_join_split2", _all(replace(a, fp4_join=True), block_k=64, split_k=2)))
        return out
    if T <= 2:
        # more programs than the default's 4-way split (the dense linears' decode GEMVs were
        # fastest at one program per SM or more, linear-h200.md), and narrower or wider tiles
        out += [
            ("asm_split8", _all(a, split_k=8)),
            ("asm_n32_split8", _all(a, block_n=32, split_k=8)),
            ("asm_split16", _all(a, split_k=16)),
            ("asm_n32_split4", _all(a, block_n=32, split_k=4)),
            ("asm_n128_split8", _all(a, block_n=128, split_k=8)),
            ("asm_split8_s4", _all(a, split_k=8, num_stages=4)),
        ]
    elif T <= 64:
        aj = replace(a, fp4_join=True)
        out += [
            ("asm_join_split2", _all(aj, split_k=2)),
            ("asm_join_n32", _all(aj, block_n=32)),
            ("asm_join_split4", _all(aj, split_k=4)),
        ]
    if T <= 64:
        aj = replace(a, fp4_join=True)
        out += [
            ("asm_join", aj),
            ("asm_split2", _all(a, split_k=2)),
            ("asm_split4", _all(a, split_k=4)),
            ("asm_swap", _all(a, swap_ab=True)),
            ("asm_n32", _all(a, block_n=32)),
            ("asm_w8", _all(a, num_warps=8)),
            ("asm_s4", _all(a, num_stages=4)),
            ("asm_bk256_s2", _all(a, block_k=256, num_stages=2)),
            ("asm_join_split2_n32", _all(aj, split_k=2, block_n=32)),
            ("bits_join_split2", _all(replace(b, fp4_join=True), split_k=2)),
        ]
    else:
        j = replace(b, fp4_join=True)
        aj = replace(a, fp4_join=True)
        m128 = replace(aj, block_m=128, shared_block_m=128)
        out += [
            ("bits_join", j),
            ("asm_join", aj),
            ("asm_join_n128_s2", _all(aj, block_n=128, num_stages=2)),
            ("asm_join_m128_n128_w8_s2", _all(m128, block_n=128, num_warps=8, num_stages=2)),
            ("asm_join_n128_w8_g8_s2", _all(aj, block_n=128, num_warps=8, group_m=8, num_stages=2)),
            ("asm_join_m128_n64_w8", _all(m128, block_n=64, num_warps=8)),
            ("asm_join_bk64_n128_s3", _all(aj, block_n=128, block_k=64, num_stages=3)),
            ("asm", a),
        ]
    return out
    if T <= 64:
        out += [
            ("bits_split2", _all(b, split_k=2)),
            ("bits_split4", _all(b, split_k=4)),
            ("bits_n32_split2", _all(b, block_n=32, split_k=2)),
            ("bits_join_split2", _all(replace(b, fp4_join=True), split_k=2)),
            ("bits_swap_split2", _all(b, split_k=2, swap_ab=True)),
            ("bits_n128_s4_split4", _all(b, block_n=128, num_stages=4, split_k=4)),
            ("bits_n32_split4_w8", _all(b, block_n=32, split_k=4, num_warps=8)),
            ("bits_bk64_split2", _all(b, block_k=64, split_k=2)),
        ]
    else:
        j = replace(b, fp4_join=True)
        m128 = replace(j, block_m=128, shared_block_m=128)
        out += [
            ("bits_join", j),
            ("bits_join_n128", _all(j, block_n=128)),
            ("bits_join_m128_n128_w8", _all(m128, block_n=128, num_warps=8)),
            ("bits_join_n128_w8_g8", _all(j, block_n=128, num_warps=8, group_m=8)),
            ("bits_join_m128_n256_k64_w8", _all(m128, block_n=256, block_k=64, num_warps=8)),
            ("bits_join_n256_k64_w8", _all(j, block_n=256, block_k=64, num_warps=8)),
            ("bits_join_m32_n128", _all(replace(j, block_m=32, shared_block_m=32), block_n=128)),
            ("bits_join_n128_s4", _all(j, block_n=128, num_stages=4)),
        ]
    return out


# ------------------------------------------------------------------------------ parts
def part_calls(
    pack: MoEPack, x: torch.Tensor, cfg: Any, s: MoESchedule
) -> dict[str, Callable[[], Any]]:
    """Zero-argument calls of each part of one moe call under ``s`` (inputs of the later parts
    computed once here, so each part runs alone)."""
    T, D = x.shape
    K = cfg.num_experts_per_tok
    inter = pack.intermediate_size
    e_loc = pack.num_local_experts
    w, ids = route(x, pack.gate_weight, pack.gate_bias, cfg)
    srt, blk = moe_align_triton(
        ids, pack.expert_map, e_loc, s.block_m, chunk=s.align_chunk, num_warps=s.align_warps
    )
    nb = blk.numel()
    h = torch.zeros((nb * s.block_m, inter), dtype=x.dtype, device=x.device)
    code = _FMT[pack.fmt]
    common = dict(
        num_m_blocks=nb, block_m=s.block_m, decode=s.decode, fp4_join=s.fp4_join,
        tiled=pack.layout == "tiles", fold=pack.mx_fold,
    )  # fmt: skip
    ws = moe_down_triton(
        h, pack.w2, pack.s2, pack.gscale, srt, blk, fmt=code, T=T, D=D, inter=inter,
        rows_out=T * K, tile=s.down, **common,
    )  # fmt: skip
    out = torch.empty_like(x)
    limit = float(cfg.swiglu_limit)
    return {
        "route": lambda: route(x, pack.gate_weight, pack.gate_bias, cfg),
        "align": lambda: moe_align_triton(
            ids, pack.expert_map, e_loc, s.block_m, chunk=s.align_chunk, num_warps=s.align_warps
        ),
        "gate_up": lambda: moe_gate_up_triton(
            x,
            pack.w13,
            pack.s13,
            pack.gscale,
            srt,
            blk,
            w,
            h,
            fmt=code,
            inter=inter,
            top_k=K,
            limit=limit,
            tile=s.gate_up,
            **common,
        ),
        "down": lambda: moe_down_triton(
            h,
            pack.w2,
            pack.s2,
            pack.gscale,
            srt,
            blk,
            fmt=code,
            T=T,
            D=D,
            inter=inter,
            rows_out=T * K,
            tile=s.down,
            **common,
        ),
        "reduce": lambda: moe_reduce_triton(
            ws, ids, pack.expert_map, None, out, e_loc, pack.gscale
        ),
        # the operator's own shared-expert path (optimized/_ops.py)
        "shared": lambda: _ops._shared_expert(
            x,
            pack.shared_w13,
            pack.shared_s13,
            pack.shared_w2,
            pack.shared_s2,
            pack.shared_op_fmt,
            limit,
            False,
            s,
            False,
        ),
    }


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    if not bool(torch.isfinite(a64).all()):
        return float("inf")
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-300))


# ------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--cap-s", type=float, default=480.0, help="global time cap (seconds)")
    p.add_argument("--weight-copies", type=int, default=2)
    p.add_argument("--input-sets", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-rel", type=float, default=2e-3, help="rel. error bound vs the default")
    p.add_argument("--no-parts", action="store_true", help="skip the per-part times")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shape, wall clock")
    p.add_argument(
        "--mxdot", action="store_true", help="the default, then the mxdot candidates only"
    )
    p.add_argument("--names", default="", help="only the candidates of these names (a,b,...)")
    p.add_argument(
        "--swiglu-pass",
        action="store_true",
        help="the wgmma gate/up's fp32 partials and the separate SwiGLU pass (kernels/"
        "moe_gemm.py, WGMMA_SWIGLU_EPILOGUE off) instead of its SwiGLU epilogue",
    )
    p.add_argument(
        "--parts-of",
        default="",
        help="time the parts of this candidate (by name) beside the default's, not the best's",
    )
    p.add_argument(
        "--layouts",
        default="",
        help="MXFP4 only: compare pack_moe's layouts (e.g. rows,tiles) with layout_candidates",
    )
    a = p.parse_args(argv)
    if a.swiglu_pass:
        from dsv4mtp.optimized.kernels import moe_gemm

        moe_gemm.WGMMA_SWIGLU_EPILOGUE = False
    t_start = time.time()
    cuda = not a.dry_run
    if cuda and not torch.cuda.is_available():
        p.error("needs a CUDA device (or --dry-run)")
    shape = "flash" if cuda else "tiny"
    tokens = [int(t) for t in a.tokens.split(",")]
    if a.dry_run:
        tokens = [t for t in tokens if t <= 8][:1]
        a.weight_copies, a.input_sets, a.reps = 2, 1, 1
    dev = torch.device("cuda" if cuda else "cpu")
    clock = Clock(cuda)
    cfg = MOE_SHAPES[shape]
    bw = copy_bandwidth(clock, dev, (1 << 30) if cuda else (1 << 22))
    flops_peak = gemm_peak(clock, dev, 8192 if cuda else 256)
    print(f"copy {bw / 1e12:.3f} TB/s, bf16 GEMM {flops_peak / 1e12:.1f} TFLOP/s", flush=True)
    rows: list[dict[str, Any]] = []
    best: dict[tuple[str, int], tuple[float, str, MoESchedule]] = {}
    capped = False

    def over() -> bool:
        return time.time() - t_start > a.cap_s

    layouts = [x for x in a.layouts.split(",") if x]
    runs = [(f, "rows") for f in a.formats.split(",")] if not layouts else []
    runs += [("mxfp4", layout) for layout in layouts]
    cross: dict[int, torch.Tensor] = {}
    for fmt, layout in runs:
        if capped:
            break
        weights = [moe_params(shape, fmt, dev, weight_seed=w)[0] for w in range(a.weight_copies)]
        # "tiles_nofold": the tiles pack with its scales applied in fp32 (MoEPack.mx_fold off)
        pack_layout = "tiles" if layout == "tiles_nofold" else layout
        packs = [
            pack_moe(w, dev, max_tokens=max(tokens), mxfp4_layout=pack_layout) for w in weights
        ]
        if layout == "tiles_nofold":
            packs = [replace(p, mx_fold=False) for p in packs]
        tag = f"{fmt}/{layout}" if layouts else fmt
        kfmt = packs[0].kernel_fmt
        for T in tokens:
            xs = [
                moe_inputs("moe", T, 100 + i, shape=shape, fmt=fmt, device=dev)[0][0]
                for i in range(a.input_sets)
            ]
            distinct, slots = routing_stats(cfg, weights[0], xs)
            floor_us = (
                max(
                    call_bytes(cfg, weights[0], T, distinct) / bw,
                    call_flops(cfg, T, slots) / flops_peak,
                )
                * 1e6
            )
            outs = [torch.empty_like(x) for x in xs]
            n_calls = len(xs) * len(packs)
            if cuda:
                n_calls = max(n_calls, 8 if T <= 64 else 4)
            want = moe(xs[0], packs[0], cfg)
            if layouts:  # the layouts' defaults agree (same weights, different byte order)
                first = cross.setdefault(T, want)
                if first is not want:
                    print(
                        f"{tag} T={T}: default vs {layouts[0]}'s default rel {rel(want, first):.1e}"
                    )
                cands = layout_candidates(T, pack_layout, a.dry_run, kfmt)
            elif a.mxdot:
                cands = [candidates(T, a.dry_run)[0], *mxdot_candidates(T, a.dry_run)]
            else:
                cands = candidates(T, a.dry_run)
            if a.names:
                cands = [c for c in cands if c[0] in a.names.split(",")]
            for name, s in cands:
                if over():
                    capped = True
                    break
                t0 = time.time()
                row: dict[str, Any] = dict(fmt=tag, T=T, name=name, floor_us=floor_us)
                try:
                    err = rel(moe(xs[0], packs[0], cfg, schedule=s), want)
                    row["rel_vs_default"] = err
                    if err > a.max_rel:
                        raise ValueError(f"rel. error {err:.2e} vs the default > {a.max_rel}")
                    calls = [
                        (lambda x=x, o=o, pk=pk, s=s: moe(x, pk, cfg, out=o, schedule=s))
                        for pk in packs
                        for x, o in zip(xs, outs, strict=True)
                    ]
                    us = clock.graph_us(calls, n_calls, a.reps)
                    row.update(time_us=us, x_floor=us / floor_us)
                    if (tag, T) not in best or us < best[tag, T][0]:
                        best[tag, T] = (us, name, s)
                except Exception as exc:  # reported in the table; the sweep goes on
                    row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                row["wall_s"] = round(time.time() - t0, 1)
                rows.append(row)
                shown = (
                    f"{row['time_us']:10.1f} us {row['x_floor']:6.2f}x  rel {row['rel_vs_default']:.1e}"
                    if "time_us" in row
                    else "FAILED " + row["error"]
                )
                print(f"{tag:6s} T={T:5d} {name:28s} {shown}  ({row['wall_s']} s)", flush=True)
            if a.no_parts or (tag, T) not in best:
                continue
            other = dict(cands).get(a.parts_of) if a.parts_of else None
            if a.parts_of and other is None:
                raise SystemExit(f"--parts-of: no candidate {a.parts_of!r} at T {T}")
            both = [
                ("default", moe_config(T, batch_invariant=False, fmt=kfmt)),
                (a.parts_of, other) if other is not None else ("best", best[tag, T][2]),
            ]
            for label, s in both if both[1][1] != both[0][1] else both[:1]:
                if over():
                    capped = True
                    break
                per_pack = [part_calls(pk, xs[0], cfg, s) for pk in packs]
                parts = {}
                for part in per_pack[0]:
                    parts[part] = clock.graph_us(
                        [pc[part] for pc in per_pack], len(packs) * (2 if cuda else 1), a.reps
                    )
                rows.append(dict(fmt=tag, T=T, name=f"parts:{label}", parts=parts))
                print(
                    f"{tag:6s} T={T:5d} parts of {label:7s} "
                    + "  ".join(f"{k} {v:.1f}" for k, v in parts.items())
                    + " (us)",
                    flush=True,
                )
        del weights, packs
        if cuda:
            torch.cuda.empty_cache()

    print(f"\n# MoE schedule sweep ({shape}; copy {bw / 1e12:.3f} TB/s)"
          + (" -- time cap reached" if capped else ""))  # fmt: skip
    print("| format | T | schedule | us | time/floor | rel vs default |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "parts" in r:
            continue
        cell = (
            f"{r['time_us']:.1f} | {r['x_floor']:.2f}"
            if "time_us" in r
            else f"fail: {r['error'][:60]} | -"
        )
        err = f"{r['rel_vs_default']:.1e}" if "rel_vs_default" in r else "-"
        print(f"| {r['fmt']} | {r['T']} | {r['name']} | {cell} | {err} |")
    print("\nBest schedule per (format, T):")
    for (fmt, T), (us, name, s) in sorted(best.items()):
        print(f"{fmt} T={T}: {name} {us:.1f} us\n    {s!r}")
    if a.json is not None:
        a.json.write_text(json.dumps(dict(copy_bw=bw, gemm_flops=flops_peak, rows=rows), indent=1))
    print(f"total {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
