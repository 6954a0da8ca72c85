"""The MoE kernels' schedule: every tile, launch and decode choice as one validated object.

:class:`MoESchedule` (with one :class:`GemmTile` per GEMM) is what the operators run;
:func:`moe_config` holds the measured defaults.  Nothing here imports triton, so the public
functions can validate a schedule without loading the kernels.

What each knob changes (optimized/kernels/moe_gemm.py, module doc, "Schedule"):

* ``block_m``: rows (token, expert slots) per M block (8 to 128); the align kernel pads every
  expert's rows to whole blocks, so it is also the padding granularity.  ``shared_block_m``
  for the shared expert (its rows are the tokens, no sort).  The shared expert's fields
  (``shared_block_m``, ``shared_gate_up``, ``shared_down``) apply to its Triton kernels only:
  from 256 rows, not batch invariant, with bf16 activations and bf16 or exact-bf16 FP8
  weights it runs on cuBLAS instead (kernels/moe_gemm.py, ``shared_mm_selected``).
* per GEMM (``gate_up``, ``down``, ``shared_gate_up``, ``shared_down``): ``block_n`` output
  columns and ``block_k`` reduction columns per step, ``num_warps``, ``num_stages``; ``split_k``
  programs share one tile's K range, each writing an fp32 partial that a later pass sums in the
  fixed order 0..split_k-1 (no atomics: deterministic); ``group_m`` > 0 launches a 1-D grid
  ordered in groups of ``group_m`` M blocks (all N tiles of a group before the next group),
  0 the 2-D grid with the M block fastest; ``swap_ab`` computes ``w @ x^T`` (the weight tile
  as the dot's M side: at decode sizes the 8- or 16-row token tile is then the N side).
* ``decode``: how FP4 / FP8 codes become bf16 dot operands.  ``"f16"``: an fp16 bit pattern,
  converted to fp32, times the scale, converted to bf16 (two float conversions per element);
  ``"bits"``: the fp32 bit pattern built with integer ops, times the scale in fp32, and the
  bf16 taken as the high half of the (exact) product: no float conversion; ``"asm"``: inline
  PTX building bf16 bit patterns four codes at a time with integer ops and exact ``bf16x2``
  multiplies (kernels/moe_gemm.py, "decode"; the interpreter runs the same values through
  integer ops).  All give the same bf16 operands bit for bit (every decoded value is exact in
  bf16).  ``"mxdot"`` (MXFP4 codes, bf16 activations, ``block_k`` 128; other GEMMs of the
  schedule fall back to ``"asm"``): one ``tl.dot_scaled`` per 32-column scale group on the
  unscaled e2m1 values, the e8m0 scale applied to the fp32 partial (kernels/moe_gemm.py,
  ``_mx_groups_step``); not value-preserving against the others (the fp32 sums are grouped).
  ``"mxstep"``: the same dots with a K step's codes in one load (the same bits as
  ``"mxdot"``; what the tiles layout runs in Triton).  ``"gluon"`` (MXFP4 in the tiles
  layout, 8-, 16- or 32-row blocks, or 64- and 128-row blocks with foldable scales,
  compiled launches; else it runs as ``"mxstep"``): the routed GEMMs as the Gluon kernels of
  kernels/moe_gemm_gluon.py, writing fp32 partials that the SwiGLU and reduce kernels
  finish.  Up to 32 rows the mma_v2 kernel (register-level decode, one MMA per scale group,
  the scale on the group's fp32 result, or folded into the bf16 decode for a pack whose scale
  bytes are <= 128; not value-preserving against the others: another fp32 summation order);
  at 64 and 128 rows the wgmma kernel (folded scales only; every MMA of the K slice in one
  chain, which at V4-Flash shapes gives the PTX decode's values bit for bit).
* ``fp4_join``: FP4 only.  False: the low and high nibbles feed two dots of half the K step
  against x's even and odd columns (strided loads of x); True: the decoded halves are
  interleaved back in registers (``tl.join``) and one dot reads x contiguously.
* ``shared_stream`` (``moe`` only): the shared expert runs on a side CUDA stream beside the
  routed GEMMs (forked after the sort up to T 8, after the router above: optimized/_ops.py,
  ``shared_fork``), joined before the reduce (False: first, in order); no value changes
  either way.  Ignored on the CPU.
* ``align_chunk``: the sort's slot chunk (optimized/kernels/moe_align.py): S = T*K slots up to
  min(``align_chunk``, 128) are sorted by one program, more by ``cdiv(S, align_chunk)``
  programs of that many slots (a chunk x chunk rank compare each, hence <= 256);
  ``align_warps``: warps per program of the chunked sort (the single program takes its own,
  ``moe_align._small_warps``, by its slot tile).

Numerics: for a fixed schedule every row is computed the same way whatever T is (batch
invariant).  ``split_k`` and ``block_k`` change the fp32 summation order (allowed: within the
pairs' tolerance); ``block_m``, ``block_n``, ``num_warps`` and ``swap_ab`` pick the tile and
so may change the tensor-core instruction (mma.sync below 64 rows, wgmma above) and its internal
order, and so may ``fp4_join`` (one dot over K where there were two), ``"mxdot"`` (per-group
fp32 partials) and ``"gluon"`` (its own MMA order; with a pack's ``mx_fold`` a step's four
groups in one MMA chain in the mma_v2 kernel, the whole K slice in the wgmma kernel);
``group_m``, ``num_stages``, the other decodes, the align knobs and ``shared_stream`` change
no value (tested bitwise on the CPU; the stream on the GPU).  The Gluon kernels ignore
``swap_ab`` and ``group_m`` (the wgmma kernel's grid has its N tiles fastest); the mma_v2
kernel ignores ``num_stages``, the wgmma kernel takes 3 or more (its copies run
``num_stages - 2`` steps ahead).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import astuple, dataclass, fields

from dsv4mtp.errors import ConfigError

from ._launch import INTERPRET

__all__ = [
    "DECODES",
    "TILES_FMTS",
    "WGMMA_M32_MIN_T",
    "GemmTile",
    "MoESchedule",
    "check_schedule_shapes",
    "moe_config",
    "schedule_from_fields",
    "schedule_to_fields",
]

DECODES = ("f16", "bits", "asm", "mxdot", "mxstep", "gluon")
# From here to T 1024, with folded scales, the routed GEMMs run the wgmma kernel on 32-row
# blocks (moe_config); below, the mma_v2 kernel on 16-row blocks (at T 512 it took 1017 / 521
# us for gate/up / down against 1160 / 636 for wgmma on 32-row blocks: moe-h200.md)
WGMMA_M32_MIN_T = 768
# MXFP4 experts in MoEPack's tiles layout, as the operators name them: "mxfp4_tiles_fold" when
# every e8m0 scale byte is <= 128 (optimized/moe.py, ``MoEPack.mx_fold``)
TILES_FMTS = ("mxfp4_tiles", "mxfp4_tiles_fold")
_BLOCK_M = (8, 16, 32, 64, 128)


def _pow2(name: str, v: object, lo: int, hi: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or v > hi or v & (v - 1):
        raise ConfigError(f"{name}: expected a power of two in [{lo}, {hi}], got {v!r}")


@dataclass(frozen=True)
class GemmTile:
    """One grouped GEMM's launch: N and K tile, warps, pipeline stages, K split, M grouping,
    and whether the dot runs as ``w @ x^T`` (see the module doc)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    group_m: int = 0
    swap_ab: bool = False

    def __post_init__(self) -> None:
        _pow2("GemmTile.block_n", self.block_n, 16, 256)
        # >= 32: an FP4 step splits K into even and odd columns, each a dot of >= 16
        _pow2("GemmTile.block_k", self.block_k, 32, 256)
        _pow2("GemmTile.num_warps", self.num_warps, 1, 16)
        if isinstance(self.num_stages, bool) or self.num_stages not in range(1, 7):
            raise ConfigError(f"GemmTile.num_stages: expected 1..6, got {self.num_stages!r}")
        _pow2("GemmTile.split_k", self.split_k, 1, 64)
        if isinstance(self.group_m, bool) or not isinstance(self.group_m, int) or self.group_m < 0:
            raise ConfigError(f"GemmTile.group_m: expected an int >= 0, got {self.group_m!r}")
        if not isinstance(self.swap_ab, bool):
            raise ConfigError(f"GemmTile.swap_ab: expected a bool, got {self.swap_ab!r}")


@dataclass(frozen=True)
class MoESchedule:
    """The whole MoE schedule (routed and shared expert GEMMs, decode, sort); see the module
    doc.  :func:`moe_config` gives the defaults."""

    block_m: int
    gate_up: GemmTile
    down: GemmTile
    shared_block_m: int
    shared_gate_up: GemmTile
    shared_down: GemmTile
    decode: str = "f16"
    fp4_join: bool = False
    align_chunk: int = 128
    align_warps: int = 8
    shared_stream: bool = True

    def __post_init__(self) -> None:
        for name in ("block_m", "shared_block_m"):
            v = getattr(self, name)
            if isinstance(v, bool) or v not in _BLOCK_M:
                raise ConfigError(f"MoESchedule.{name}: expected one of {_BLOCK_M}, got {v!r}")
        for name in ("gate_up", "down", "shared_gate_up", "shared_down"):
            if not isinstance(getattr(self, name), GemmTile):
                raise ConfigError(f"MoESchedule.{name}: expected a GemmTile")
        if self.decode not in DECODES:
            raise ConfigError(f"MoESchedule.decode: expected one of {DECODES}, got {self.decode!r}")
        if not isinstance(self.fp4_join, bool):
            raise ConfigError(f"MoESchedule.fp4_join: expected a bool, got {self.fp4_join!r}")
        if not isinstance(self.shared_stream, bool):
            raise ConfigError(
                f"MoESchedule.shared_stream: expected a bool, got {self.shared_stream!r}"
            )
        _pow2("MoESchedule.align_chunk", self.align_chunk, 16, 256)
        _pow2("MoESchedule.align_warps", self.align_warps, 1, 32)


def check_schedule_shapes(
    s: MoESchedule, fmt: str, shared_fmt: str, hidden: int, inter: int
) -> None:
    """The shape rules a schedule must meet for one pack: each GEMM's K (D for gate/up, I for
    down) a multiple of block_k * split_k (the K loops have no tail mask), and block_k <= 128
    where the weights are FP8 (one 128x128 scale block per K step) or MXFP4 in the tiles
    layout (``fmt`` "mxfp4_tiles": a step inside one 128-column block)."""
    gemms = (
        ("gate_up", s.gate_up, fmt, hidden),
        ("down", s.down, fmt, inter),
        ("shared_gate_up", s.shared_gate_up, shared_fmt, hidden),
        ("shared_down", s.shared_down, shared_fmt, inter),
    )
    for name, g, f, k in gemms:
        if k % (g.block_k * g.split_k):
            raise ConfigError(
                f"schedule.{name}: K = {k} is not a multiple of block_k x split_k = "
                f"{g.block_k} x {g.split_k}"
            )
        if f == "fp8" and g.block_k > 128:
            raise ConfigError(
                f"schedule.{name}: FP8 weights need block_k <= 128 (one scale block per step), "
                f"got {g.block_k}"
            )
        if f in TILES_FMTS and g.block_k > 128:
            raise ConfigError(
                f"schedule.{name}: MXFP4 experts in the tiles layout need block_k <= 128 (a "
                f"step inside one 128-column block), got {g.block_k}"
            )


# The operators carry a schedule as a flat int list (a MoEPack-free schema): GemmTile as 7 ints,
# MoESchedule as block_m, 4 tiles, shared_block_m, decode index, fp4_join, align chunk
# and warps, shared_stream.
_TILE_LEN = len(fields(GemmTile))
FIELDS_LEN = 7 + 4 * _TILE_LEN


def _tile_ints(g: GemmTile) -> list[int]:
    return [int(v) for v in astuple(g)]


def schedule_to_fields(s: MoESchedule) -> list[int]:
    """The operators' int list of a schedule (inverse: :func:`schedule_from_fields`)."""
    return [
        s.block_m, *_tile_ints(s.gate_up), *_tile_ints(s.down), s.shared_block_m,
        *_tile_ints(s.shared_gate_up), *_tile_ints(s.shared_down), DECODES.index(s.decode),
        int(s.fp4_join), s.align_chunk, s.align_warps, int(s.shared_stream),
    ]  # fmt: skip


@functools.cache
def schedule_from_fields(f: tuple[int, ...]) -> MoESchedule:
    if len(f) != FIELDS_LEN:
        raise ConfigError(f"schedule: expected {FIELDS_LEN} ints, got {len(f)}")

    def tile(i: int) -> GemmTile:
        n, k, warps, stages, split, group, swap = f[i : i + _TILE_LEN]
        return GemmTile(n, k, warps, stages, split, group, bool(swap))

    n = _TILE_LEN
    return MoESchedule(
        block_m=f[0], gate_up=tile(1), down=tile(1 + n), shared_block_m=f[1 + 2 * n],
        shared_gate_up=tile(2 + 2 * n), shared_down=tile(2 + 3 * n),
        decode=DECODES[f[2 + 4 * n]], fp4_join=bool(f[3 + 4 * n]), align_chunk=f[4 + 4 * n],
        align_warps=f[5 + 4 * n], shared_stream=bool(f[6 + 4 * n]),
    )  # fmt: skip


@functools.cache
def moe_config(T: int, *, batch_invariant: bool, fmt: str = "mxfp4") -> MoESchedule:
    """The default schedule of a call with T tokens whose routed experts are in ``fmt``
    (measured: bench/results/moe-h200.md, "Schedule", "The group-scaled dot" and "Gluon
    GEMMs on the tiles").

    Every GEMM: 128-column K steps (one FP8 scale block; four MXFP4 scale groups), 4 warps,
    3 stages, the 2-D grid, except the wgmma GEMMs (8 warps, 4 stages; last bullet).  By T:

    * T <= 64, MXFP4 experts: the routed GEMMs as ``decode="mxdot"`` (one ``dot_scaled`` per
      32-column scale group, the e8m0 scale on the fp32 partial) on 8-row M blocks with the
      weights on the MMA's M side (``swap_ab``) and 128-row weight tiles: 112 / 383 / 1329 us
      for the whole moe at T 1 / 8 / 64 against 122 / 420 / 1475 us with the PTX decode on
      16-row blocks.  fp32 activations fall back to the PTX decode (``"asm"``) on the same
      tiles.  The shared expert (FP8) keeps 16-row blocks and 64-column tiles, PTX decode.
    * T <= 64, other formats (FP8, NVFP4, bf16): 16-row M blocks, 64-column N tiles, the PTX
      decode everywhere.
    * K splits up to T 64: 4-way at T <= 2, 2-way at T <= 8 (measured with the PTX decode:
      MXFP4 149 vs 172 us unsplit at T 1, 416 vs 428 us at T 8), none above; the interleaved
      FP4 dot from T 3.
    * 64 < T <= 768, MXFP4 experts (an expert holds ~T * top_k / E rows, about 12 at T 512):
      the routed GEMMs as ``"mxdot"`` with 128-row weight tiles, no split, on 8-row swapped
      blocks up to T 256 and 16-row unswapped blocks above (whole moe against the 64-row
      PTX-decode tiles: 1795 vs 3300 us at T 128, 2402 vs 3710 at T 256, 3010 vs 3910 at
      T 512, but 4566 vs 4346 at T 1024); the shared expert on 64-row blocks, PTX decode,
      where it does not run on cuBLAS (from 256 rows: ``shared_mm_selected``).
    * above (where the scales do not fold: last bullet), other formats above T 64, and under
      ``batch_invariant=True`` for every T: 64-row M blocks, 64-column N tiles, the PTX
      decode, the interleaved FP4 dot, no split (the group-scaled dot was 1.3-4.0x slower at
      T 4096 on every tile tried).
    * the shared expert on the side stream (``shared_stream``) up to T 64 and under
      ``batch_invariant=True`` (one schedule for every T), in order above: in the whole
      step, captured, at T 1 / 8 / 64 475.3 / 730.2 / 1469.2 us against 485.2 / 733.2 /
      1496.8 us in order; the eager prefill of 512 / 4096 tokens 5606 / 13125 us against
      5484 / 13139 (``bench/diag/moe_stream_ab.py``, one process, H200).
    * ``fmt="mxfp4_tiles"`` / ``"mxfp4_tiles_fold"`` (``pack_moe``'s default layout for
      MXFP4): the routed GEMMs as the Gluon kernels (``decode="gluon"``,
      kernels/moe_gemm_gluon.py) up to T 1024, with the K splits above up to T 8, on 8-row
      blocks up to T 256 and 16-row blocks above (whole moe on the H200, fold, at T 1 / 8 / 64
      / 512 / 768 / 1024: 80.2 / 219.5 / 724.5 / 1902 / 2395 / 2880 us against 90.6 / 305.2
      / 1043.9 / 2625 / 3375 us for the Triton ``"mxstep"`` schedule and 3523 us for the PTX
      decode at T 1024; 16-row blocks lost up to T 256: 927.9 against 724.5 us at T 64, 1458
      against 1323 at T 256; 32-row blocks gained nothing; moe-h200.md, "Gluon GEMMs on the
      tiles"); 128-row gate/up tiles of interleaved gate and up rows everywhere.  With the
      scales foldable (``"mxfp4_tiles_fold"``), from :data:`WGMMA_M32_MIN_T` (768) to T 1024
      the Gluon wgmma GEMMs on 32-row blocks (gate/up on 8 warps, down on 4: the whole moe
      2268 / 2556 us at T 768 / 1024 against 2343 / 2796 on the mma_v2 16-row blocks), above
      T 1024 on 64-row blocks (kernels/moe_gemm_gluon.py, ``moe_mx_wgmma_kernel``; moe-h200.md,
      "wgmma GEMMs at prefill sizes"); otherwise the PTX decode with two stages
      (:func:`_gate_up`; 7328 us at T 4096 against 9766 for the Gluon GEMMs on 16-row
      blocks).  ``"mxstep"`` (a K step's codes in one load) is the
      tiles' Triton path: the interpreter's, and what ``"gluon"`` falls back to.

    The sort runs in one program up to 128 slots (T 21 at top-6), in 128-slot chunks above,
    8 warps.  Under the interpreter, for every T, the T <= 64 structure of the format at the
    tiny shape (MXFP4: mxdot routed GEMMs on 8-row swapped blocks, mxstep with 128-row gate/up
    tiles for the tiles layout), 64-column gate/up and 128-column down tiles, one stage, 64-slot
    sort chunks (small shapes, fewer programs).
    """
    mx = fmt == "mxfp4" or fmt in TILES_FMTS
    if INTERPRET:
        # the interpreter's cost is per program: two N tiles per GEMM at the tiny shape (I 128,
        # D 256) keep the tile indexing exercised at half the programs of 32-column tiles
        gu = GemmTile(block_n=64, block_k=128, num_warps=4, num_stages=1)
        dn = GemmTile(block_n=128, block_k=128, num_warps=4, num_stages=1)
        if not mx:
            return MoESchedule(
                16, gu, dn, 16, gu, dn, decode="asm", fp4_join=True, align_chunk=64, align_warps=4
            )
        gu_s, dn_s = dataclasses.replace(gu, swap_ab=True), dataclasses.replace(dn, swap_ab=True)
        return MoESchedule(
            8, _gate_up(gu_s, fmt), dn_s, 16, gu, dn, decode=_mx_decode(fmt), fp4_join=True,
            align_chunk=64, align_warps=4,
        )  # fmt: skip
    tiles = fmt in TILES_FMTS
    if batch_invariant or T > 64:
        t = GemmTile(block_n=64, block_k=128, num_warps=4, num_stages=3)
        group_scaled_max = 1024 if tiles else 768  # the last T of the group-scaled GEMMs
        if fmt == "mxfp4_tiles_fold" and not batch_invariant and WGMMA_M32_MIN_T <= T <= 1024:
            # the Gluon wgmma GEMMs on 32-row blocks (an expert holds ~18-24 rows): gate/up 128
            # weight rows on 8 warps, down 64 on 4, four stages (whole moe on the H200 at T 768 /
            # 1024: 2268 / 2556 us against 2343 / 2796 for the mma_v2 GEMMs on 16-row blocks;
            # moe-h200.md, "wgmma on 32-row blocks")
            gu32 = GemmTile(block_n=128, block_k=128, num_warps=8, num_stages=4)
            dn32 = GemmTile(block_n=64, block_k=128, num_warps=4, num_stages=4)
            return MoESchedule(
                32, gu32, dn32, 64, t, t, decode="gluon", fp4_join=True, align_chunk=128,
                align_warps=8, shared_stream=False,
            )  # fmt: skip
        if fmt == "mxfp4_tiles_fold" and not batch_invariant and group_scaled_max < T:
            # the Gluon wgmma GEMMs on 64-row blocks, 128 weight rows on two warpgroups, four
            # stages (whole moe on the H200 at T 2048 / 4096 against the PTX decode below:
            # moe-h200.md, "wgmma GEMMs at prefill sizes")
            w = GemmTile(block_n=128, block_k=128, num_warps=8, num_stages=4)
            return MoESchedule(
                64, w, w, 64, t, t, decode="gluon", fp4_join=True, align_chunk=128,
                align_warps=8, shared_stream=False,
            )  # fmt: skip
        if batch_invariant or not mx or group_scaled_max < T:
            # tiles: two stages (whole moe at T 4096 on the H200: 7316 us against 8139 with
            # three, and 8763 for the rows layout's default; moe-h200.md, "The tiles layout")
            r = dataclasses.replace(t, num_stages=2) if tiles else t
            return MoESchedule(
                64, _gate_up(r, fmt), r, 64, t, t, decode="asm", fp4_join=True, align_chunk=128,
                align_warps=8, shared_stream=batch_invariant,
            )  # fmt: skip
        # an expert holds ~T * top_k / E rows: a few up to T 256, ~12 at T 512, ~24 at T 1024;
        # 8-row blocks up to T 256, 16-row blocks above (the Gluon GEMMs on the tiles: whole
        # moe at T 512 / 1024 1902 / 2880 us against 1994 / 3485 with 8-row blocks)
        m8 = T <= 256
        r = dataclasses.replace(t, block_n=128, swap_ab=m8)
        return MoESchedule(
            8 if m8 else 16, _gate_up(r, fmt), r, 64, t, t, decode=_mx_decode(fmt),
            fp4_join=True, align_chunk=128, align_warps=8, shared_stream=False,
        )  # fmt: skip
    split = 4 if T <= 2 else (2 if T <= 8 else 1)
    shared = GemmTile(block_n=64, block_k=128, num_warps=4, num_stages=3, split_k=split)
    if not mx:
        return MoESchedule(
            16, shared, shared, 16, shared, shared, decode="asm", fp4_join=T > 2,
            align_chunk=128, align_warps=8,
        )  # fmt: skip
    routed = dataclasses.replace(shared, block_n=128, swap_ab=True)
    return MoESchedule(
        8, _gate_up(routed, fmt), routed, 16, shared, shared, decode=_mx_decode(fmt),
        fp4_join=T > 2, align_chunk=128, align_warps=8,
    )  # fmt: skip


def _gate_up(tile: GemmTile, fmt: str) -> GemmTile:
    """The routed gate/up tile.  In the tiles layout a program's rows interleave gate and up,
    so ``block_n`` counts both: the group-scaled dots (T <= 768) keep 128 rows, half the rows
    layout's bytes per program and twice the programs (H200, whole moe at T 1 / 8 / 64 / 512:
    105.4 / 321.9 / 1059.1 / 2609.3 us against 105.8 / 336.4 / 1169.1 / 2853.3 us with 256
    rows, and 112.5 / 379.9 / 1323.0 / 2973.4 us for the rows layout's default;
    bench/results/moe-h200.md, "The tiles layout"); the PTX decode's 64-column tiles (above
    T 768, batch invariant) become 128 rows, the same bytes per program."""
    if fmt not in TILES_FMTS or tile.block_n >= 128:
        return tile
    return dataclasses.replace(tile, block_n=2 * tile.block_n)


def _mx_decode(fmt: str) -> str:
    """The MXFP4 routed GEMMs' decode: on the tiles layout the Gluon kernels (compiled
    launches), one load per K step from the contiguous blocks under the interpreter (Gluon has
    none); one load per scale group from the checkpoint's rows."""
    if fmt in TILES_FMTS:
        return "mxstep" if INTERPRET else "gluon"
    return "mxdot"
