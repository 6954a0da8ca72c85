"""Registers, spills and shared memory of our Triton kernels for sm_90, without a GPU.

Compiles each kernel (at its default schedule and V4's shapes) for an H200 target with the
ptxas that ships in the triton wheel, then reads the cubin's resource usage with cuobjdump.
Registers per thread bound how many programs an SM holds (65536 registers per SM); a non-zero
STACK is spilled registers, i.e. local-memory traffic.  Useful before spending GPU time: it
explains a kernel that streams well alone but slowly inside a fused kernel.

    python bench/sm90_resources.py            # default schedules, one line per kernel phase
    python bench/sm90_resources.py --collapse '[[64, 256, 32, 16, 4, 3, true]]'  # candidates
    python bench/sm90_resources.py --rope     # the RoPE / q / kv path kernel only
    python bench/sm90_resources.py --moe      # the MoE's routed GEMMs (default vs PTX decode)
    python bench/sm90_resources.py --attention  # the attention cores and the ring write only
    python bench/sm90_resources.py --pre-fma  # hc_pre's small-batch FMA kernels only
    python bench/sm90_resources.py --pre-fma --pre-fma-tiles '[[8, 8, 64, 2, 4, 256, 4]]'
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dsv4mtp.optimized.kernels.linear import (
    BLOCK_K,
    FMT_DENSE,
    FMT_FP8,
    linear_kernel,
    linear_schedule,
)
from dsv4mtp.optimized.kernels.mhc_collapse import (
    CollapseConfig,
    collapse_config,
    mhc_collapse_kernel,
    tokens_per_reducer,
)
from dsv4mtp.optimized.kernels.mhc_head import _launches as head_fma_launches
from dsv4mtp.optimized.kernels.mhc_head import mhc_head_fma_kernel
from dsv4mtp.optimized.kernels.mhc_mix import mhc_mix_kernel, mix_config
from dsv4mtp.optimized.kernels.mhc_pre_small import PreFmaConfig, pre_fma_config
from dsv4mtp.optimized.kernels.mhc_pre_small import _launches as pre_fma_launches

TARGET = GPUTarget("cuda", 90, 32)
# kernels/moe_gemm_gluon.py's moe_mx_wgmma_kernel, its runtime arguments
WGMMA_SIGNATURE = dict(
    x_ptr="*bf16", w_ptr="*i32", s_ptr="*i32", sorted_ptr="*i32", block_expert_ptr="*i32",
    part_ptr="*fp32", gs_ptr="*fp32", topw_ptr="*fp32", h_ptr="*bf16", K="i32", N="i32",
    TOPK="i32", W_STRIDE_E="i32", S_STRIDE_E="i32", ROWS_PART="i32", limit="fp32",
)  # fmt: skip
# ...and the ints its launcher specializes as multiples of 16 at V4's shapes
WGMMA_INTS = ("K", "N", "W_STRIDE_E", "S_STRIDE_E", "ROWS_PART")
REGISTERS_PER_SM = 65536


def _cuobjdump() -> str:
    base = os.path.dirname(triton.__file__)
    found = glob.glob(os.path.join(base, "backends", "nvidia", "bin", "cuobjdump"))
    if not found:
        raise SystemExit("cuobjdump not found in the triton wheel")
    return found[0]


def programs_by_registers(regs: int, num_warps: int) -> int:
    """Programs of ``num_warps`` warps that fit one SM's register file at ``regs`` registers
    per thread: sm_90 allocates per warp, rounded up to 8 registers per thread."""
    warps = REGISTERS_PER_SM // (-(-regs // 8) * 8 * 32)
    return warps // num_warps


def compile_kernel(
    fn: Any,
    signature: dict[str, str],
    consts: dict[str, Any],
    ints: tuple[str, ...] | list[str] = (),
    gluon: bool = False,
    **options: Any,
) -> Any:
    """``triton.compile`` of ``fn`` for sm_90 with these constexprs and options, as the JIT
    builds it.  ``ints``: argument names (pointers or ints) the launcher specializes as
    divisible by 16 (V4's N and K), marked as the GPU JIT would specialize them."""
    sig = {**signature, **{c: "constexpr" for c in consts}}
    # The launcher marks 16-byte-aligned pointers (every torch allocation) divisible by 16;
    # without that mark the compiler cannot vectorize loads and the counts below are wrong.
    aligned = {
        (fn.arg_names.index(name),): [["tt.divisibility", 16]]
        for name, ty in signature.items()
        if ty.startswith("*") or name in ints
    }
    if gluon:  # a @gluon.jit kernel (its layouts are explicit: no layout passes)
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(fn, sig, constexprs=consts, attrs=aligned)
    else:
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=aligned)
    return triton.compile(src, target=TARGET, options=options)


def cuobjdump_out(cubin: bytes, flag: str) -> str:
    """cuobjdump's output for a cubin (``-sass``, ``-res-usage``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_cuobjdump(), flag, f.name], capture_output=True, text=True).stdout


def resource_line(k: Any, num_warps: int, loop: bool = False) -> str:
    """One line of a compiled kernel: shared memory, registers, stack (spills) and the
    register-bound occupancy (with ``loop``, also the main loop's instruction count)."""
    out = cuobjdump_out(k.asm["cubin"], "-res-usage")
    fields = dict(
        kv.split(":") for line in out.splitlines() if "REG:" in line for kv in line.split()
    )
    regs, stack = int(fields["REG"]), int(fields["STACK"])
    ctas = programs_by_registers(regs, num_warps)
    line = (
        f"regs {regs:3d}  stack(spill) {stack:5d} B  smem {k.metadata.shared:6d} B  "
        f"<= {ctas} programs/SM by registers ({ctas * num_warps} warps of 64)"
    )
    if loop:
        line += f"  main loop {main_loop_instructions(k.asm['cubin'])} instructions"
    return line


def resources(
    fn: Any,
    signature: dict[str, str],
    consts: dict[str, Any],
    ints: tuple[str, ...] | list[str] = (),
    loop: bool = False,
    gluon: bool = False,
    **options: Any,
) -> str:
    """:func:`resource_line` of :func:`compile_kernel`'s kernel."""
    k = compile_kernel(fn, signature, consts, ints, gluon, **options)
    return resource_line(k, options["num_warps"], loop)


def sass_instructions(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction text without its ';') of the cubin's SASS, in order."""
    sass = cuobjdump_out(cubin, "-sass")
    return [
        (int(m.group(1), 16), m.group(2).strip())
        for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    ]


# a backward branch's target, as an address or a label
BRANCH = re.compile(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?(?:0x)?([0-9a-f]+)")


def main_loop_instructions(cubin: bytes) -> int:
    """SASS instructions of the kernel's longest loop (from the target of its longest backward
    branch to the branch): per-thread work of one K step in the GEMMs."""
    addrs = sass_instructions(cubin)
    best = 0
    for a, text in addrs:
        target = BRANCH.search(text)
        if target and int(target.group(1), 16) < a:
            t = int(target.group(1), 16)
            best = max(best, sum(1 for b, _ in addrs if t <= b <= a))
    return best


def collapse_lines(op: str, D: int, cfg: CollapseConfig, phases: tuple[str, ...]) -> list[str]:
    """One line per phase of the collapse kernel at (op, D, schedule)."""
    f32 = "*fp32"
    sig = dict(
        x_ptr="*bf16", fn_ptr=f32, scale_ptr=f32, base_ptr=f32, part_ptr=f32, sq_ptr=f32,
        gate_ptr=f32, count_ptr="*i32", out_ptr="*bf16", post_ptr=f32, comb_ptr=f32,
        trace_ptr="*i64", T="i32", rms_eps="fp32", hc_eps="fp32", post_mult="fp32",
    )  # fmt: skip
    flags = {
        "fused": (True, True, True, True),
        "mix": (True, False, False, False),
        "reduce": (False, True, False, False),
        "apply": (False, False, True, False),
    }
    M, MP = (4, 16) if op == "hc_head" else (24, 32)
    S = triton.cdiv(D, cfg.d_slice)
    lines = []
    for phase in phases:
        mix, red, app, fused = flags[phase]
        consts = dict(
            D=D, S=S, D_SLICE=cfg.d_slice, SINKHORN_ITERS=20, N=4, NP=4, M=M, MP=MP,
            BLOCK_T=cfg.block_t, BLOCK_K=cfg.block_k, APPLY_D=cfg.apply_d,
            TPP=tokens_per_reducer(cfg.block_t, S), DO_MIX=mix, DO_REDUCE=red, DO_APPLY=app,
            FUSED=fused, WITH_POST_COMB=op == "hc_pre", X_IS_BF16=True, INTERP=False, TRACE=False,
        )  # fmt: skip
        cap = {} if cfg.max_registers is None else dict(maxnreg=cfg.max_registers)
        line = resources(mhc_collapse_kernel, sig, consts, num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages, **cap)  # fmt: skip
        tile = tuple(dataclasses.astuple(cfg))
        lines.append(f"collapse {op:7s} D={D} {phase:6s} {tile}: {line}")
    return lines


# V4-Flash's dense linears (G, N, K) and the rows of the calls that pick each default schedule.
_LINEARS = {
    "e_proj": (1, 4096, 4096),
    "wqa_wkv": (1, 1536, 4096),
    "wq_b": (1, 32768, 1024),
    "wo_b": (1, 4096, 8192),
    "wo_a": (8, 1024, 4096),
}


def linear_lines() -> list[str]:
    """The dense-linear kernel at its default schedules (T 1, 64, 513 and batch-invariant), FP8
    codes with bf16 x (and the bf16-weight variant once); split schedules reduce in-kernel.
    e_proj's rows also with eh_proj's epilogue add (4 rows of h per row of e)."""
    sig = dict(
        x_ptr="*bf16", w_ptr="*u8", s_ptr="*fp32", y_ptr="*bf16", part_ptr="*fp32",
        count_ptr="*i32", add_ptr="*bf16", R="i32", G="i32", N="i32", K="i32",
        KB_PER_SPLIT="i32", add_row0="i32",
    )  # fmt: skip
    lines = []
    seen: set[tuple[object, ...]] = set()
    for name, (G, N, K) in _LINEARS.items():
        for rows, bi in ((1, False), (64, False), (513, False), (1, True)):
            sc = linear_schedule(rows, N, K, G, bi)
            adds = (0, 4) if name == "e_proj" else (0,)
            for fmt, add in [(f, a) for f in (FMT_FP8, FMT_DENSE) for a in adds]:
                key = (sc, fmt, add)
                if key in seen:
                    continue
                seen.add(key)
                s = dict(sig, w_ptr="*u8" if fmt == FMT_FP8 else "*bf16")
                consts = dict(
                    FMT=fmt, BLOCK_M=sc.block_m, BLOCK_N=sc.block_n, BLOCK_K=BLOCK_K,
                    SPLIT_K=sc.split_k, ADD_ROWS=add, USE_F32=False, INTERP=False,
                    ARGMAX=False,
                )  # fmt: skip
                line = resources(linear_kernel, s, consts, ints=("N", "K"),
                                 num_warps=sc.num_warps, num_stages=sc.num_stages)  # fmt: skip
                what = ("fp8 " if fmt == FMT_FP8 else "bf16") + (" +add" if add else "")
                tile = (sc.block_m, sc.block_n, sc.split_k, sc.num_warps, sc.num_stages)
                lines.append(f"linear {what} {name:7s} T={rows:<3d} bi={bi!s:5s} {tile}: {line}")
    return lines


def moe_lines() -> list[str]:
    """The MoE's routed gate/up and down Triton kernels (kernels/moe_gemm.py) for MXFP4 experts
    at V4-Flash (D 4096, I 2048), bf16 x: the default schedule at T 1, 8, 64, 512 and 4096 on
    the checkpoint's rows (``decode="mxdot"`` up to T 768), the same tiles as ``"mxstep"`` on
    the tiles layout (its Triton path: the tiles' default up to T 1024 is the Gluon kernels of
    kernels/moe_gemm_gluon.py, which ``bench/diag/gluon_mx_probe.py --sass`` reports),
    ``"mxstep"`` on rows, and, for comparison, the PTX decode on the 16-row, 64-column tiles
    the group-scaled dot replaced at decode sizes; then the Gluon wgmma kernel of the fold
    default above T 1024, on 64- and 128-row blocks."""
    from dataclasses import replace

    from dsv4mtp.optimized.kernels.moe_gemm import (
        FMT_MXFP4,
        moe_down_kernel,
        moe_gate_up_kernel,
    )
    from dsv4mtp.optimized.kernels.moe_schedule import DECODES, moe_config

    common = dict(
        w_ptr="*u8", s_ptr="*u8", gs_ptr="*fp32", sorted_ptr="*i32", block_expert_ptr="*i32",
        T="i32", D="i32", I="i32", W_STRIDE_E="i32", S_STRIDE_E="i32", NUM_M="i32",
    )  # fmt: skip
    gate_up = dict(x_ptr="*bf16", **common, topw_ptr="*fp32", h_ptr="*bf16", part_ptr="*fp32",
                   TOPK="i32", limit="fp32")  # fmt: skip
    down = dict(h_ptr="*bf16", **common, y_ptr="*bf16", ROWS_OUT="i32")
    ints = ("D", "I", "W_STRIDE_E", "S_STRIDE_E", "NUM_M")
    lines = []
    cases = []
    for T in (1, 8, 64, 512, 4096):
        rows = moe_config(T, batch_invariant=False)
        cases.append((f"T={T}", False, rows))
        tiles = moe_config(T, batch_invariant=False, fmt="mxfp4_tiles")
        if tiles.decode == "gluon":  # the Triton kernels run the tiles as "mxstep"
            tiles = replace(tiles, decode="mxstep")
        cases.append((f"T={T} tiles", True, tiles))
        if T == 64:  # the whole-step load on the rows (the tiles always load whole steps)
            cases.append((f"T={T}", False, replace(rows, decode="mxstep")))
    d64 = moe_config(64, batch_invariant=False)
    asm = replace(d64, decode="asm", block_m=16, gate_up=replace(d64.gate_up, block_n=64,
                  swap_ab=False), down=replace(d64.down, block_n=64, swap_ab=False))  # fmt: skip
    cases.append(("T=64 asm m16", False, asm))
    # the Gluon wgmma GEMMs (kernels/moe_gemm_gluon.py), the default from T 768 where the
    # scales fold: gate/up (its SwiGLU epilogue) and down at the defaults of T 1024 (32-row M
    # blocks) and 4096 (64-row), and 128-row M blocks
    from dsv4mtp.optimized.kernels.moe_gemm_gluon import moe_mx_wgmma_kernel

    wg_cases = [
        (1024, moe_config(1024, batch_invariant=False, fmt="mxfp4_tiles_fold")),
        (4096, moe_config(4096, batch_invariant=False, fmt="mxfp4_tiles_fold")),
    ]
    wg_cases.append((4096, replace(wg_cases[-1][1], block_m=128)))
    for T, fold in wg_cases:
        bm = fold.block_m
        for name, tile, gather in (("gate_up", fold.gate_up, True), ("down", fold.down, False)):
            consts = dict(
                GATHER=gather, BLOCK_T=bm, SPLIT_K=tile.split_k, STAGES=tile.num_stages,
                NUM_WARPS=tile.num_warps, SWIGLU=gather and tile.split_k == 1,
            )  # fmt: skip
            line = resources(
                moe_mx_wgmma_kernel, WGMMA_SIGNATURE, consts, loop=True, gluon=True,
                ints=WGMMA_INTS,
                num_warps=tile.num_warps,
            )  # fmt: skip
            per = tile.block_n * 128 / (32 * tile.num_warps)
            lines.append(
                f"moe {name:7s} T={T} wgmma  m{bm:<3d} {tile.block_n} x 128, "
                f"{tile.num_stages} stages: {line} ({per:.0f} weights per thread per step)"
            )
    for label, tiled, sc in cases:
        for name, fn, sig, tile in (
            ("gate_up", moe_gate_up_kernel, gate_up, sc.gate_up),
            ("down", moe_down_kernel, down, sc.down),
        ):
            consts = dict(
                IDENTITY=False, FMT=FMT_MXFP4, BLOCK_M=sc.block_m, BLOCK_N=tile.block_n,
                BLOCK_K=tile.block_k, SPLIT_K=tile.split_k, GROUP_M=tile.group_m,
                SWAP=tile.swap_ab, DECODE=DECODES.index(sc.decode), FP4_JOIN=sc.fp4_join,
                TILED=tiled, USE_F32=False, INTERP=False,
            )  # fmt: skip
            line = resources(fn, sig, consts, ints=ints, loop=True, num_warps=tile.num_warps,
                             num_stages=tile.num_stages)  # fmt: skip
            # weights decoded per thread per K step: gate/up streams 2 x block_n rows (block_n
            # interleaved gate and up rows in the tiles layout)
            rows = tile.block_n * (2 if name == "gate_up" and not tiled else 1)
            per = rows * tile.block_k / (32 * tile.num_warps)
            shape = (sc.block_m, tile.block_n, tile.block_k, tile.split_k, tile.swap_ab)
            lines.append(
                f"moe {name:7s} {label:12s} {sc.decode:6s} {shape}: {line} "
                f"({per:.0f} weights per thread per step)"
            )
    return lines


def pre_fma_lines(tiles: list[list[int]] | None = None) -> list[str]:
    """hc_pre's small-batch kernels (kernels/mhc_pre_small.py) at n = 4, D 4096 / 7168, bf16 x,
    20 Sinkhorn iterations: the mix and the reduce + apply launch, at the default schedule or
    at each PreFmaConfig 7-tuple of ``tiles``."""
    f32 = "*fp32"
    mix_sig = dict(
        x_ptr="*bf16", fn_ptr=f32, part_ptr=f32, sq_ptr=f32, a_ptr="*bf16", post_in_ptr=f32,
        comb_in_ptr=f32, xnew_ptr="*bf16", T="i32",
    )  # fmt: skip
    apply_sig = dict(
        x_ptr="*bf16", scale_ptr=f32, base_ptr=f32, part_ptr=f32, sq_ptr=f32, out_ptr="*bf16",
        post_ptr=f32, comb_ptr=f32, w_ptr="*bf16", T="i32", D_RT="i32", rms_eps="fp32",
        hc_eps="fp32", post_mult="fp32",
    )  # fmt: skip
    lines = []
    for D in (4096, 7168):
        cfgs = [PreFmaConfig(*t) for t in tiles] if tiles else [pre_fma_config(4, D)]
        for cfg in cfgs:
            _, mix, apply = pre_fma_launches(cfg, 4, D, 20)
            _, fused_mix, _ = pre_fma_launches(cfg, 4, D, 20, True)  # hc_post_pre's mix
            _, _, norm_apply = pre_fma_launches(cfg, 4, D, 20, False, "official")
            for what, launch, sig in (
                ("mix", mix, mix_sig), ("apply", apply, apply_sig),
                ("post+mix", fused_mix, mix_sig), ("apply+norm", norm_apply, apply_sig),
            ):  # fmt: skip
                meta = dict(launch.meta)
                warps = meta.pop("num_warps")
                line = resources(launch.jit, sig, meta, ("D_RT",), num_warps=warps)
                tile = tuple(dataclasses.astuple(cfg))
                lines.append(f"hc_pre fma D={D} {what:8s} {tile}: {line}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--collapse",
        default=None,
        help="JSON list of collapse 7-tuples (block_t, d_slice, block_k, apply_d, num_warps, "
        "num_stages, fused); default: collapse_config's schedules",
    )
    p.add_argument("--linear", action="store_true", help="the dense linears only")
    p.add_argument("--moe", action="store_true", help="the MoE's routed GEMMs only")
    p.add_argument("--rope", action="store_true", help="only the RoPE / q / kv path kernel")
    p.add_argument(
        "--attention", action="store_true", help="only the attention cores and the ring write"
    )
    p.add_argument("--pre-fma", action="store_true", help="only hc_pre's small-batch kernels")
    p.add_argument(
        "--pre-fma-tiles",
        default=None,
        help="JSON list of PreFmaConfig 7-tuples (rows, block_t, block_d, tpp, block_ta, "
        "block_da, num_warps) for --pre-fma; default: pre_fma_config's schedules",
    )
    args = p.parse_args()
    if args.pre_fma:
        tiles = json.loads(args.pre_fma_tiles) if args.pre_fma_tiles else None
        for line in pre_fma_lines(tiles):
            print(line, flush=True)
        return
    if args.moe:
        for line in moe_lines():
            print(line, flush=True)
        return
    if args.linear or args.rope or args.attention:
        lines = linear_lines if args.linear else rope_lines if args.rope else attention_lines
        for line in lines():
            print(line, flush=True)
        return
    for op in ("hc_head", "hc_pre"):
        for D in (4096, 7168):
            if args.collapse:
                cfgs = [CollapseConfig(*c) for c in json.loads(args.collapse)]
            else:
                cfgs = [collapse_config(4, D, with_post_comb=op == "hc_pre")]
            for cfg in cfgs:
                for line in collapse_lines(op, D, cfg, ("fused", "mix", "reduce", "apply")):
                    print(line, flush=True)
    f32 = "*fp32"
    mix_sig = dict(x_ptr="*bf16", fn_ptr=f32, mix_ptr=f32, sq_ptr=f32, T="i32", K="i32")
    mc = mix_config(24, 4 * 4096)
    consts = dict(K_PER_SPLIT=1024, M=24, MP=32, BLOCK_T=mc.block_t, BLOCK_K=mc.block_k,
                  X_IS_BF16=True, UPCAST=False)  # fmt: skip
    line = resources(mhc_mix_kernel, mix_sig, consts, num_warps=mc.num_warps,
                     num_stages=mc.num_stages)  # fmt: skip
    print(f"mix producer M=24 {tuple(dataclasses.astuple(mc))}: {line}", flush=True)
    head_sig = dict(
        x_ptr="*bf16", fn_ptr=f32, scale_ptr=f32, base_ptr=f32, part_ptr=f32, sq_ptr=f32,
        count_ptr="*i32", out_ptr="*bf16", f_ptr="*bf16", post_in_ptr=f32, comb_in_ptr=f32,
        xnew_ptr="*bf16", T="i32", D="i32", rms_eps="fp32", hc_eps="fp32",
    )  # fmt: skip
    consts = dict(S=16, N=4, NP=4, MP=16, BLOCK_T=4, BLOCK_D=256, DO_MIX=True, DO_APPLY=True,
                  FUSE_POST=False, INTERP=False)  # fmt: skip
    line = resources(mhc_head_fma_kernel, head_sig, consts, num_warps=4)
    print(f"hc_head fma (4 x 256, 4 warps): {line}", flush=True)
    consts = {**consts, "DO_APPLY": False, "FUSE_POST": True}
    line = resources(mhc_head_fma_kernel, head_sig, consts, num_warps=4)
    print(f"hc_post_head fused mix (4 x 256, 4 warps): {line}", flush=True)
    for D in (4096, 7168):
        launch = head_fma_launches(4, D, False, False, "official")[3][1]
        meta = dict(launch.meta)
        warps = meta.pop("num_warps")
        norm_sig = dict(
            x_ptr="*bf16", scale_ptr=f32, base_ptr=f32, part_ptr=f32, sq_ptr=f32,
            out_ptr="*bf16", w_ptr="*bf16", T="i32", D="i32", rms_eps="fp32", hc_eps="fp32",
        )  # fmt: skip
        line = resources(launch.jit, norm_sig, meta, ("D",), num_warps=warps)
        print(f"hc_head fma whole-row apply + norm D={D}: {line}", flush=True)
    for line in pre_fma_lines() + rope_lines() + attention_lines():
        print(line, flush=True)


def attention_lines() -> list[str]:
    """kernels/sink_attention.py at V4-Flash / V4-Pro (H 64 / 128, Dh 512, window 128), bf16,
    the default schedules (the narrow tiles, from WIDE_ROWS rows the 256-wide slices, from
    WHOLE_ROWS the whole row; the cached kernels' own stages): the varlen kernel, the
    ring-cache decode kernel (C = 144, the DeviceKVCache capacity for window 128 and 8 draft
    steps), the paged-cache kernel (vLLM's block size 16) and the ring write (also the paged
    write)."""
    from dsv4mtp.optimized.kernels.sink_attention import (
        WHOLE_ROWS,
        WIDE_ROWS,
        attention_schedule,
        ring_write_kernel,
        sink_attention_cache_kernel,
        sink_attention_kernel,
        sink_attention_paged_kernel,
    )
    from dsv4mtp.optimized.kv_cache import ring_capacity

    W = 128
    C = ring_capacity(W, 8)
    lines = []

    def tiled(rows: int | None, H: int, cached: bool) -> tuple[Any, dict[str, Any], dict[str, int]]:
        sc = attention_schedule(H, 512, W, rows=rows, cached=cached)
        tiles = dict(BLOCK_H=sc.block_h, BLOCK_N=sc.block_n, BLOCK_D=sc.block_d,
                     BLOCK_DV=sc.block_dv, IEEE=False, INTERP=False)  # fmt: skip
        return sc, tiles, dict(num_warps=sc.num_warps, num_stages=sc.num_stages)

    for rows in (None, WIDE_ROWS, WHOLE_ROWS):
        for H in (64, 128):
            sc, tiles, opts = tiled(rows, H, False)
            sig = dict(
                q_ptr="*bf16", qpos_ptr="*i64", kv_ptr="*bf16", kpos_ptr="*i64",
                sink_ptr="*fp32", cuq_ptr="*i32", cuk_ptr="*i32", out_ptr="*bf16", Tk="i32",
                B="i32", window="i32", qk_scale="fp32",
            )  # fmt: skip
            consts = dict(H=H, DH=512, VARLEN=True, SEARCH=sc.search, **tiles)
            line = resources(sink_attention_kernel, sig, consts, **opts)
            lines.append(f"sink_attention_varlen H={H} {tuple(sc.fields())}: {line}")
            sc, tiles, opts = tiled(rows, H, True)
            sig = dict(
                q_ptr="*bf16", qpos_ptr="*i64", kv_ptr="*bf16", kpos_ptr="*i32",
                slots_ptr="*i32", sink_ptr="*fp32", out_ptr="*bf16", window="i32",
                qk_scale="fp32",
            )  # fmt: skip
            consts = dict(H=H, DH=512, C=C, SCAN=min(256, 1 << (C - 1).bit_length()), **tiles)
            line = resources(sink_attention_cache_kernel, sig, consts, **opts)
            lines.append(f"sink_attention_cache H={H} C={C} {tuple(sc.fields())}: {line}")
            sig = dict(
                q_ptr="*bf16", qpos_ptr="*i64", kv_ptr="*bf16", kpos_ptr="*i32",
                table_ptr="*i32", sink_ptr="*fp32", out_ptr="*bf16", max_blocks="i32",
                window="i32", qk_scale="fp32",
            )  # fmt: skip
            consts = dict(H=H, DH=512, BS=16, SCAN=W, **tiles)
            line = resources(sink_attention_paged_kernel, sig, consts, **opts)
            lines.append(f"sink_attention_paged H={H} bs=16 {tuple(sc.fields())}: {line}")
    sig = dict(new_ptr="*bf16", pos_ptr="*i64", slots_ptr="*i32", kv_ptr="*bf16",
               kpos_ptr="*i32", C="i32")  # fmt: skip
    line = resources(ring_write_kernel, sig, dict(DH=512, BLOCK_D=512), num_warps=4, num_stages=1)
    lines.append(f"kv_cache_write Dh=512: {line}")
    return lines


def rope_lines() -> list[str]:
    """kernels/rope.py at V4-Flash (H 64, Dh 512, rope 64), bf16, default schedules.  Also
    marks H and the row strides divisible by 16, as the launcher's specialization does; the
    32-byte stack of every variant is libdevice's sinf / cosf range-reduction buffer for large
    angles, not a spill."""
    from dsv4mtp.optimized.kernels.rope import (
        NORM_HEAD,
        NORM_NONE,
        NORM_RMS,
        rope_launch,
        rope_schedule,
    )
    from dsv4mtp.optimized.kernels.rope import norm_rope_kernel as kernel

    sig = dict(
        x_ptr="*bf16", w_ptr="*bf16", pos_ptr="*i64", freq_ptr="*fp32", out_ptr="*bf16", T="i32",
        H="i32", stride_t="i32", stride_h="i32", ostride_t="i32", ostride_h="i32", eps="fp32",
    )  # fmt: skip
    cases = [  # name, D, DN, H, norm, fp8, vllm_order, inverse
        ("q_head_norm_rope", 512, 448, 64, NORM_HEAD, False, False, False),
        ("kv_norm_rope fp8_kv", 512, 448, 1, NORM_RMS, True, False, False),
        ("kv_norm_rope vllm order, fp8_kv", 512, 448, 1, NORM_RMS, True, True, False),
        ("kv_norm_rope", 512, 448, 1, NORM_RMS, False, False, False),
        ("apply_rope inverse, o[..., 448:]", 64, 0, 64, NORM_NONE, False, False, True),
    ]
    lines = []
    for name, D, DN, H, norm, fp8, vllm, inverse in cases:
        sched = rope_schedule(H, D)
        meta = dict(rope_launch(D, DN, fp8, norm, vllm, inverse, sched).meta)
        num_warps = meta.pop("num_warps")
        meta["INTERP"] = False
        aligned = ["x_ptr", "w_ptr", "pos_ptr", "freq_ptr", "out_ptr", "stride_t", "stride_h"]
        aligned += ["ostride_t", "ostride_h"]
        aligned += ["H"] if H % 16 == 0 else []
        line = resources(kernel, sig, meta, num_warps=num_warps, ints=aligned)
        lines.append(f"{name} (tile {sched.block_t} x {sched.block_h}): {line}")
    return lines


if __name__ == "__main__":
    main()
