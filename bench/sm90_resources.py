"""Registers, spills and shared memory of our Triton kernels for sm_90, without a GPU.

Compiles each kernel (at its default schedule and V4's shapes) for an H200 target with the
ptxas that ships in the triton wheel, then reads the cubin's resource usage with cuobjdump.
Registers per thread bound how many programs an SM holds (65536 registers per SM); a non-zero
STACK is spilled registers, i.e. local-memory traffic.  Useful before spending GPU time: it
explains a kernel that streams well alone but slowly inside a fused kernel.

    python bench/sm90_resources.py            # prints one line per kernel variant
"""

from __future__ import annotations

import glob
import os
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dsv4mtp.optimized.kernels.mhc_collapse import mhc_collapse_kernel
from dsv4mtp.optimized.kernels.mhc_head import mhc_head_fma_kernel
from dsv4mtp.optimized.kernels.mhc_mix import mhc_mix_kernel

TARGET = GPUTarget("cuda", 90, 32)
REGISTERS_PER_SM = 65536


def _cuobjdump() -> str:
    base = os.path.dirname(triton.__file__)
    found = glob.glob(os.path.join(base, "backends", "nvidia", "bin", "cuobjdump"))
    if not found:
        raise SystemExit("cuobjdump not found in the triton wheel")
    return found[0]


def resources(fn: Any, signature: dict[str, str], consts: dict[str, Any], **options: Any) -> str:
    """One line: shared memory, registers, stack (spills) and the register-bound occupancy."""
    sig = {**signature, **{c: "constexpr" for c in consts}}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=TARGET,
                       options=options)  # fmt: skip
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        out = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True)
    fields = dict(
        kv.split(":") for line in out.stdout.splitlines() if "REG:" in line for kv in line.split()
    )
    regs, stack = int(fields["REG"]), int(fields["STACK"])
    threads = 32 * options["num_warps"]
    ctas = REGISTERS_PER_SM // (regs * threads)
    return (
        f"regs {regs:3d}  stack(spill) {stack:5d} B  smem {k.metadata.shared:6d} B  "
        f"<= {ctas} programs/SM by registers ({ctas * options['num_warps']} warps of 64)"
    )


def main() -> None:
    f32 = "*fp32"
    collapse_sig = dict(
        x_ptr="*bf16", fn_ptr=f32, scale_ptr=f32, base_ptr=f32, part_ptr=f32, sq_ptr=f32,
        gate_ptr=f32, count_ptr="*i32", out_ptr="*bf16", post_ptr=f32, comb_ptr=f32,
        T="i32", D="i32", rms_eps="fp32", hc_eps="fp32", post_mult="fp32",
    )  # fmt: skip
    phases = {
        "fused": (True, True, True, True),
        "mix": (True, False, False, False),
        "reduce": (False, True, False, False),
        "apply": (False, False, True, False),
    }
    for op, M, MP in (("hc_head", 4, 16), ("hc_pre", 24, 32)):
        for phase, (mix, red, app, fused) in phases.items():
            consts = dict(
                S=16, D_SLICE=256, SINKHORN_ITERS=20, N=4, NP=4, M=M, MP=MP, BLOCK_T=64,
                BLOCK_K=64, APPLY_D=64, DO_MIX=mix, DO_REDUCE=red, DO_APPLY=app, FUSED=fused,
                WITH_POST_COMB=op == "hc_pre", X_IS_BF16=True, INTERP=False,
            )  # fmt: skip
            line = resources(mhc_collapse_kernel, collapse_sig, consts, num_warps=4, num_stages=3)
            print(f"collapse {op:7s} {phase:6s} (64 x 256, 4 warps): {line}", flush=True)
    mix_sig = dict(x_ptr="*bf16", fn_ptr=f32, mix_ptr=f32, sq_ptr=f32, T="i32", K="i32")
    consts = dict(K_PER_SPLIT=1024, M=24, MP=32, BLOCK_T=128, BLOCK_K=64, X_IS_BF16=True,
                  UPCAST=False)  # fmt: skip
    line = resources(mhc_mix_kernel, mix_sig, consts, num_warps=8, num_stages=4)
    print(f"mix producer M=24 (128 x 64, 8 warps): {line}", flush=True)
    head_sig = dict(
        x_ptr="*bf16", fn_ptr=f32, scale_ptr=f32, base_ptr=f32, part_ptr=f32, sq_ptr=f32,
        count_ptr="*i32", out_ptr="*bf16", T="i32", D="i32", rms_eps="fp32", hc_eps="fp32",
    )  # fmt: skip
    consts = dict(S=16, N=4, NP=4, MP=16, BLOCK_T=4, BLOCK_D=256, DO_MIX=True, DO_APPLY=True,
                  INTERP=False)  # fmt: skip
    line = resources(mhc_head_fma_kernel, head_sig, consts, num_warps=4)
    print(f"hc_head fma (4 x 256, 4 warps): {line}", flush=True)


if __name__ == "__main__":
    main()
