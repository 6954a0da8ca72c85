"""The wgmma MoE GEMM's main loop as ptxas compiles it for sm_90a, without a GPU.

``moe_mx_wgmma_kernel`` (kernels/moe_gemm_gluon.py) is compiled offline (Triton's bundled
``ptxas`` and ``cuobjdump``) for the given constexprs, and the script prints:

* ptxas's registers, spills and stack per thread (how many programs an SM holds);
* the loop body in order, compressed: ``HGMMA`` (with its A registers), ``WARPGROUP.ARRIVE`` /
  ``DEPBAR`` (the waits for the MMAs), barriers, and runs of the decode's ``HMUL2`` between
  them: whether the next step's decode runs under the MMA or after its wait;
* a hazard scan: every instruction of the loop (taken twice, for the back edge) that writes a
  register an in-flight ``HGMMA`` group reads (its A fragment).  PTX leaves such a write
  undefined; a non-zero count means wrong results are possible.

    python3 bench/diag/wgmma_sass.py [--block-t 64] [--warps 8] [--stages 4] [--gather 1]
        [--swiglu 1] [--split-k 1] [--dump FILE]

Runs on a CPU machine (``CUDA_VISIBLE_DEVICES=`` is fine); needs triton with its NVIDIA
backend, whose ``ptxas`` and ``cuobjdump`` it calls.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from dsv4mtp.optimized.kernels import moe_gemm_gluon as gluon_mod

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_SIG = dict(
    x_ptr="*bf16", w_ptr="*i32", s_ptr="*i32", sorted_ptr="*i32", block_expert_ptr="*i32",
    part_ptr="*fp32", gs_ptr="*fp32", topw_ptr="*fp32", h_ptr="*bf16", K="i32", N="i32",
    TOPK="i32", W_STRIDE_E="i32", S_STRIDE_E="i32", ROWS_PART="i32", limit="fp32",
)  # fmt: skip
# 16-byte aligned pointers and multiples of 16, as the launcher's specialization gives them
_ALIGNED = (
    "x_ptr", "w_ptr", "s_ptr", "sorted_ptr", "block_expert_ptr", "part_ptr", "gs_ptr",
    "topw_ptr", "h_ptr", "K", "N", "W_STRIDE_E", "S_STRIDE_E", "ROWS_PART",
)  # fmt: skip


def compile_sass(consts: dict[str, object], warps: int) -> tuple[str, str]:
    """(ptxas -v output, SASS) of the kernel with these constexprs."""
    kernel = gluon_mod.moe_mx_wgmma_kernel
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in _ALIGNED}
    sig = {**_SIG, **{c: "constexpr" for c in consts}}
    src = GluonASTSource(kernel, sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as d:
        ptx, obj = os.path.join(d, "k.ptx"), os.path.join(d, "k.o")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        info = subprocess.run(
            [os.path.join(_BIN, "ptxas"), "-arch=sm_90a", "-v", "-O3", ptx, "-o", obj],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        sass = subprocess.run(
            [os.path.join(_BIN, "cuobjdump"), "-sass", obj], capture_output=True, text=True,
            check=True,
        ).stdout  # fmt: skip
    return info.stdout + info.stderr, sass


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text without predicate guard's trailing ';') in order."""
    out = []
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def main_loop(ins: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The body of the backward branch that contains HGMMAs (the K loop)."""
    index = {a: k for k, (a, _) in enumerate(ins)}
    for k, (addr, text) in enumerate(ins):
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = ins[index[int(m.group(1), 16)] : k + 1]
            if any("HGMMA" in t for _, t in body):
                return body
    raise SystemExit("no loop with HGMMA found")


def _opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text)


def summary(body: list[tuple[int, str]]) -> list[str]:
    """The loop compressed to its MMAs, waits, barriers and runs of the decode's HMUL2."""
    out: list[str] = []
    hmul = 0
    for _, text in body:
        op = _opcode(text)
        if op.startswith("HMUL2"):
            hmul += 1
            continue
        keep = op.startswith(("HGMMA", "WARPGROUP", "BAR.SYNC", "MEMBAR", "DEPBAR"))
        if keep:
            if hmul:
                out.append(f"  ({hmul} HMUL2: decode)")
                hmul = 0
            out.append("  " + (op.split(", gdesc")[0] if op.startswith("HGMMA") else op))
    if hmul:
        out.append(f"  ({hmul} HMUL2: decode)")
    return out


def hazards(body: list[tuple[int, str]]) -> list[str]:
    """Writes to an in-flight HGMMA group's A registers, over two passes of the loop."""
    groups: list[set[int]] = []  # committed groups still in flight, oldest first
    current: set[int] = set()
    found = []
    for _, text in body + body:
        op = _opcode(text)
        name = op.split()[0]
        if name.startswith("HGMMA"):
            a = int(re.match(r"HGMMA\S*\s+R\d+,\s*R(\d+),", op).group(1))
            current |= set(range(a, a + 4))  # a 64 x 16 bf16 A fragment: four registers
            if "gsb0" in op:
                groups.append(current)
                current = set()
            continue
        if name.startswith("WARPGROUP.DEPBAR"):
            keep = int(re.search(r"0x([0-9a-f]+)", op).group(1), 16)
            groups = groups[len(groups) - keep :] if keep else []
            continue
        if name.startswith(("ST", "LDGSTS", "RED", "ATOM", "BAR", "BRA", "MEMBAR", "FENCE")):
            continue  # no register destination
        parts = op.split(None, 1)
        m = re.match(r"R(\d+)", parts[1].split(",")[0].strip()) if len(parts) > 1 else None
        if not m:
            continue
        r = int(m.group(1))
        width = 4 if ".128" in name else (2 if ".64" in name or "WIDE" in name else 1)
        if any(set(range(r, r + width)) & g for g in groups):
            found.append(text)
    return found


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--block-t", type=int, default=64)
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--gather", type=int, default=1)
    p.add_argument("--swiglu", type=int, default=1)
    p.add_argument("--split-k", type=int, default=1)
    p.add_argument("--dump", default="", help="write the whole SASS here")
    a = p.parse_args()
    consts = dict(
        GATHER=bool(a.gather), BLOCK_T=a.block_t, SPLIT_K=a.split_k, STAGES=a.stages,
        NUM_WARPS=a.warps, SWIGLU=bool(a.swiglu),
    )  # fmt: skip
    info, sass = compile_sass(consts, a.warps)
    if a.dump:
        with open(a.dump, "w") as f:
            f.write(sass)
    print(consts)
    print("\n".join(line for line in info.splitlines() if "registers" in line or "spill" in line))
    body = main_loop(instructions(sass))
    print(f"K loop: {hex(body[0][0])} .. {hex(body[-1][0])}")
    print("\n".join(summary(body)))
    bad = hazards(body)
    print(f"writes to an in-flight MMA's A registers: {len(bad)}")
    for text in bad[:5]:
        print("  " + text)


if __name__ == "__main__":
    main()
