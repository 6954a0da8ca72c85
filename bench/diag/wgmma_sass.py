"""The wgmma MoE GEMM's K loop as compiled for sm_90a, without a GPU.

``moe_mx_wgmma_kernel`` (kernels/moe_gemm_gluon.py) is compiled offline for the given
constexprs (``triton.compile`` for sm_90, as the JIT builds it, the launcher's 16-byte
specializations marked; the cubin read with the ``cuobjdump`` in the triton wheel), and the
script prints:

* registers, stack (spills), shared memory and the programs per SM the registers allow
  (``bench/sm90_resources.py``'s line);
* the K loop in order, compressed: ``WARPGROUP.ARRIVE`` (the fence before a warpgroup's MMAs),
  each ``HGMMA`` with its A registers, ``WARPGROUP.DEPBAR`` (the wait for the MMAs), the
  barriers and the ``cp.async`` waits (``DEPBAR``), and the runs of the decode's ``HMUL2``
  between them: whether the next step's decode runs under the MMA or after its wait;
* a hazard scan: the instructions of the loop that write a register of an A fragment an
  ``HGMMA`` still in flight reads (the loop taken twice, for the back edge; each instruction
  counted once).  PTX leaves such a write undefined: a non-zero count means the results can
  be wrong.  Accumulators are not scanned (chained MMAs share them by design).

    python3 bench/diag/wgmma_sass.py [--block-t 64] [--warps 8] [--stages 4] [--gather 1]
        [--swiglu 1] [--split-k 1] [--dump FILE]

Runs on a CPU machine (``CUDA_VISIBLE_DEVICES=`` is fine); needs triton with its NVIDIA
backend.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sm90_resources import (
    BRANCH,
    WGMMA_INTS,
    WGMMA_SIGNATURE,
    compile_kernel,
    cuobjdump_out,
    resource_line,
    sass_instructions,
)

from dsv4mtp.optimized.kernels import moe_gemm_gluon as gluon_mod


def k_loop(ins: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The longest backward branch's body that holds HGMMAs (the K loop)."""
    index = {a: k for k, (a, _) in enumerate(ins)}
    best: list[tuple[int, str]] = []
    for k, (addr, text) in enumerate(ins):
        m = BRANCH.search(text)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
            body = ins[index[int(m.group(1), 16)] : k + 1]
            if any("HGMMA" in t for _, t in body) and len(body) > len(best):
                best = body
    if not best:
        raise SystemExit("no loop with HGMMA found")
    return best


def _op(text: str) -> str:
    """The instruction without its predicate guard."""
    return re.sub(r"^@!?U?P\w+\s+", "", text)


def summary(body: list[tuple[int, str]]) -> list[str]:
    """The loop compressed to its MMAs, waits, barriers and runs of the decode's HMUL2."""
    out: list[str] = []
    hmul = 0
    for _, text in body:
        op = _op(text)
        if op.startswith("HMUL2"):
            hmul += 1
            continue
        if op.startswith(("HGMMA", "WARPGROUP", "BAR.SYNC", "MEMBAR", "DEPBAR")):
            if hmul:
                out.append(f"  ({hmul} HMUL2: decode)")
                hmul = 0
            out.append("  " + (op.split(", gdesc")[0] if op.startswith("HGMMA") else op))
    if hmul:
        out.append(f"  ({hmul} HMUL2: decode)")
    return out


def _written(op: str) -> set[int]:
    """The registers an instruction writes (its first operand), by its width."""
    name, _, rest = op.partition(" ")
    m = re.match(r"\s*R(\d+)\b", rest)
    if not m or name.startswith(("ST", "LDGSTS", "RED", "ATOM", "BAR", "BRA", "MEMBAR")):
        return set()
    r = int(m.group(1))
    if ".128" in name or (name.startswith("LDSM") and name.endswith(".4")):
        width = 4
    elif ".64" in name or "WIDE" in name or (name.startswith("LDSM") and name.endswith(".2")):
        width = 2
    else:
        width = 1
    return set(range(r, r + width))


def hazards(body: list[tuple[int, str]]) -> list[str]:
    """The loop's instructions (each once) that write an A register of an in-flight HGMMA."""
    groups: list[set[int]] = []  # committed groups in flight, oldest first
    current: set[int] = set()  # issued since the last commit
    found: dict[int, str] = {}
    for addr, text in body + body:
        op = _op(text)
        if op.startswith("HGMMA"):
            a = re.match(r"HGMMA\S*\s+R\d+,\s*R(\d+),", op)
            if a:  # a register A fragment (64 x 16 bf16: four registers); else A is in smem
                current |= set(range(int(a.group(1)), int(a.group(1)) + 4))
            if "gsb0" in op:
                groups.append(current)
                current = set()
            continue
        if op.startswith("WARPGROUP.DEPBAR"):
            keep = int(re.search(r"0x([0-9a-f]+)", op).group(1), 16)
            groups = groups[max(0, len(groups) - keep) :] if keep else []
            continue
        if _written(op) & set().union(current, *groups):
            found[addr] = text
    return list(found.values())


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
    if a.swiglu and not (a.gather and a.split_k == 1):
        p.error("--swiglu 1 is the gate/up GEMM with one K split: --gather 1 --split-k 1")
    consts = dict(
        GATHER=bool(a.gather), BLOCK_T=a.block_t, SPLIT_K=a.split_k, STAGES=a.stages,
        NUM_WARPS=a.warps, SWIGLU=bool(a.swiglu),
    )  # fmt: skip
    print(consts)
    k = compile_kernel(
        gluon_mod.moe_mx_wgmma_kernel, WGMMA_SIGNATURE, consts, ints=WGMMA_INTS, gluon=True,
        num_warps=a.warps,
    )  # fmt: skip
    print(resource_line(k, a.warps))
    cubin = k.asm["cubin"]
    if a.dump:
        Path(a.dump).write_text(cuobjdump_out(cubin, "-sass"))
    body = k_loop(sass_instructions(cubin))
    print(f"K loop: {hex(body[0][0])} .. {hex(body[-1][0])}")
    print("\n".join(summary(body)))
    bad = hazards(body)
    print(f"writes to an in-flight MMA's A registers: {len(bad)}")
    for text in bad[:5]:
        print("  " + text)


if __name__ == "__main__":
    main()
