"""Do the optimized layer's fused op pairs, its latency-first step guard, its in-place
inverse rotation, its in-place q / kv rows, hc_pre's token block by T, the kv path on a side
stream, the ids masked in the argmax's reduce, the SwiGLU in the gate/up GEMM's launch, the
slots' sort in the router's program, the one-warp top-k and the graphs' counter arena shorten
the whole draft step?
(H200)

The layer runs its fused op pairs through :attr:`MTPLayer.ops` (``dsv4mtp/layer.py``,
``LayerOps``).  A fused pair is bitwise its composition, so its only possible effect is time,
and the time that counts is the whole step's: a launch saved on the step's dependent chain of
~40 small kernels is worth its launch gap and ramp, a few microseconds, which a kernel's own
timing does not show.  This script captures the V4-Flash-shaped greedy decode step of
``bench/h200_mtp.py`` (random checkpoint written on the GPU, MXFP4 experts) once per setting,
in one process, and times the replays in rounds that alternate the settings (A B A B ...), so
machine-to-machine spread cancels; each cell is the median over rounds of the median of 20
CUDA-event timed replays.  The outputs (ids and hidden) are compared bitwise between settings.

The settings (each leaves out with its ``--no-*`` flag):

* "shipped": the layer as it is;
* "composed: <pair>", one per pair in :data:`COMPOSED`: the layer with that pair run as the
  ops it replaces;
* "guard in 4096 pieces" (:data:`guard_in_pieces`): the step guard's kernel and schedule
  before it read the row in one piece (kernels/step_guard.py);
* "rope copied back": the attention output's inverse rotation into a new tensor, then copied
  into o (``attention.INVERSE_ROPE_IN_PLACE``);
* "q / kv rows copied": the fused wq_a + wkv output's two column slices copied to contiguous
  tensors before rms_norm and kv_norm_rope;
* "hc_pre 16-token blocks": the small-batch hc_pre and hc_post_pre kernels on their
  T-independent 16-token block at every T (kernels/mhc_pre_small.py ``pre_fma_config``);
* "kv path in line": the attention's kv norm + RoPE and ring write on the step's stream after
  the q path instead of on a side stream beside it (``attention.KV_SIDE_STREAM``);
* "ids masked by torch.where": the greedy ids' -1s for bad and padding rows by ``torch.where``
  after the head (two launches) instead of in the argmax's reduce launch;
* "SwiGLU pass launched": the routed gate/up's SwiGLU as ``moe_swiglu_kernel`` after the
  mma_v2 GEMM instead of by each tile's last K split in the GEMM's launch
  (``moe_gemm.GLUON_SWIGLU_TAIL``);
* "slots sorted in their own launch": the MoE's sort of the slots by expert as
  ``moe_align_triton``'s launch instead of in the router's top-k program
  (``moe_route.FUSED_ALIGN_MAX_T`` 0);
* "route top-k on 4 warps": the router's one-token top-k program on 4 warps instead of one
  (``moe_route.TOPK_SCORES_PER_WARP``);
* "counters zeroed in the graph": the captured launches' ticket counters as a fresh
  ``torch.zeros`` each (a memset in every replay) instead of pieces of the capture's arena
  (``mtp.GRAPH_COUNTERS`` 0);
* "e / h products in two launches": eh_proj's e_proj and h_proj products as two launches of
  ``linear_kernel`` (h's adding e's rows) instead of one ``eh_linear_kernel`` launch over both
  weights (``kernels/linear.py``, ``EH_ONE_LAUNCH``; T <= 16);
* "norms launched": attn_norm, ffn_norm and the head's norm as ``rms_norm_kernel`` launches
  after hc_pre's, hc_post_pre's and hc_post_head's apply launches (at their 4 warps: the same
  bits) instead of in those launches' whole-row programs (``_ops.FUSE_NORM``).

Probes, each a setting when its flag is given:

* ``--prefetch-mb N,...``: "head prefetch <N> MB <mode>", the first N MB of the LM head's
  weight prefetched into the L2 on a side stream right after the MoE (bench/diag/
  l2_prefetch_probe.py's kernel: "bulk" = its mode 1, bulk prefetches with an evict-last
  policy; "lines" = mode 2, one ``prefetch.global.L2::evict_last`` per line), beside
  hc_post_head and the head's norm, whose few microseconds leave the HBM idle; the head then
  streams those bytes from the L2;
* ``--align-warps W,...``: "align on <W> warps", the one-program sort of the slots (T 2-21) on
  W warps instead of ``moe_align._small_warps`` (16 at T 8's 64-slot tile);
* ``--align-chunked C:W,...``: "sort in C-slot chunks on W warps", the three-launch sort at
  T 22-64 with C slots per program and W warps (default 128:8);
* ``--moe-split t1:S[:D],t8:S[:D]``: "moe split <S>[/<D>] at T <range>", the routed gate/up's
  K split S and the down's D (default S) at T 1-2 (``t1``; 4 by default) or T 3-8 (``t8``; 2);
* ``--head-sched V:K:W:S,...``: "head <V>x<K> w<W> s<S>", the greedy head's argmax kernel up
  to T 32 on V head rows per program, K-wide steps, W warps, S stages (default 128:128:4:4);
* ``--linear-split-x F,...``: "decode linears' K split x<F>", the dense linears' decode schedules
  (``kernels/linear.py``, ``linear_schedule``) aiming their K split at F times the programs
  (about 256 per call by default; eh_proj's one launch twice that), wq_b's unsplit 128-wide
  tiles unchanged (the sums' order changes with the split, so the outputs differ; the
  batch-invariant schedules, which the step does not use, would change too);
* ``--fp8-head``: the layer with the FP8 head (``head_format="fp8"``) in every setting, and
  the setting "FP8 ids from logits + torch.argmax": its greedy ids from the FP8 linear
  kernel's logits and ``torch.argmax`` (``mtp.FP8_GREEDY_ARGMAX`` False) instead of the
  logit-free argmax kernel;
* ``--logits``: every setting's steps write logits (the sampling / ``return_logits`` graphs,
  ``DecodeGraphs(logits=True)``), and the setting "ids by torch.argmax": their greedy ids by
  ``torch.argmax`` and a ``torch.where`` (``mtp.LOGITS_ARGMAX`` False) instead of
  ``logits_argmax``'s two launches;
* ``--priorities``: stream priorities (a captured kernel node keeps its capturing stream's
  priority; torch instantiates graphs with ``cudaGraphInstantiateFlagUseNodePriority``): "step
  at high priority" (the step captured on a high-priority stream, the side streams at the
  default), "kv side at high priority" (only the attention's kv path), "step and kv at high
  priority" (the shared expert alone at the default).

Each setting is swapped in only while its graphs are captured (the graphs keep what they
captured).

Run (GPU machine, repository root, after the README's install):
``python3 bench/diag/fusion_ab.py [--rounds 7] [--pairs embed_norms,eh_proj] [--no-guard]
[--no-rope] [--no-qkv] [--no-mhc] [--no-kv] [--no-mask] [--no-topk] [--no-swiglu] [--no-align]
[--no-arena] [--no-eh] [--no-norm] [--prefetch-mb 32,48] [--align-warps 8,16]
[--moe-split t1:8,t8:1] [--head-sched 256:64:8:4] [--align-chunked 64:8,128:16] [--priorities] [--linear-split-x 2] [--fp8-head] [--logits]``
(about two minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from h200_mtp import DECODE_T
from moe_stream_ab import decode_table

from dsv4mtp.checkpoint.fullsize import make_fullsize_checkpoint
from dsv4mtp.errors import DSV4Error
from dsv4mtp.optimized import MTPLayer, _ops, linear, rms_norm
from dsv4mtp.optimized.kernels import linear as linear_kernels
from dsv4mtp.optimized.kernels import mhc_pre_small, moe_align, moe_gemm, moe_route
from dsv4mtp.optimized.kernels import step_guard as guard_kernels
from dsv4mtp.optimized.kernels.moe_common import jit_loop_bounds
from dsv4mtp.optimized.mtp import DecodeGraphs

mtp_module = importlib.import_module("dsv4mtp.optimized.mtp")

# the module (the package exports its function ``attention`` under the same name)
attention_module = importlib.import_module("dsv4mtp.optimized.attention")


def composed_embed_norms(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    embed: torch.Tensor,
    prev_hidden: torch.Tensor,
    enorm: torch.Tensor,
    hnorm: torch.Tensor,
    eps: float,
    *,
    order: Any = "official",
    mask_pos0: bool = False,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The launches embed_norms replaces: the gather, the mask's where, two rms_norm calls."""
    e = embed[input_ids]
    if mask_pos0:
        e = torch.where(positions[:, None] == 0, torch.zeros_like(e), e)
    bi = {"order": order, "batch_invariant": batch_invariant}
    return rms_norm(e, enorm, eps, **bi), rms_norm(prev_hidden, hnorm, eps, **bi)


def composed_eh_proj(
    e: torch.Tensor,
    h: torch.Tensor,
    e_proj: Any,
    h_proj: Any,
    *,
    act_quant: bool = False,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """The launches eh_proj replaces: the two linears and torch's broadcast add."""
    kw = {"act_quant": act_quant, "batch_invariant": batch_invariant}
    return linear(h, h_proj, **kw) + linear(e, e_proj, **kw)[:, None, :]


#: pair -> its composition from the optimized ops (what the layer ran before the pair)
COMPOSED: dict[str, Callable[..., Any]] = {
    "embed_norms": composed_embed_norms,
    "eh_proj": composed_eh_proj,
}

SHIPPED_GUARD = guard_kernels.guard_schedule, guard_kernels.step_guard_kernel


@jit_loop_bounds("H")
def pieces_step_guard_kernel(
    ids_ptr,
    pos_ptr,
    prev_ptr,
    slots_ptr,
    real_ptr,
    ok_ptr,
    ids_out_ptr,
    pos_out_ptr,
    slots_out_ptr,
    record_ptr,
    H,
    stride,
    vocab_size,
    max_positions,
    BLOCK_H: tl.constexpr,
):
    """The step guard as it was before it read its row in one piece: the row's 4096-wide
    pieces first, then the scalars (the same outputs)."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    row = prev_ptr + b * stride
    nonfinite = tl.zeros([BLOCK_H], dtype=tl.int32)
    for h0 in range(0, H, BLOCK_H):
        x = tl.load(row + h0 + offs, mask=h0 + offs < H, other=0.0).to(tl.float32)
        nonfinite = nonfinite | (tl.abs(x) < float("inf")).to(tl.int32) ^ 1
    finite = tl.max(nonfinite, 0) == 0
    real = tl.load(real_ptr + b) != 0
    token = tl.load(ids_ptr + b)
    pos = tl.load(pos_ptr + b)
    slot = tl.load(slots_ptr + b)
    id_ok = (token >= 0) & (token < vocab_size)
    pos_ok = (pos >= 0) & (pos < max_positions)
    ok = real & finite & id_ok & pos_ok
    tl.store(ok_ptr + b, ok)
    tl.store(ids_out_ptr + b, tl.where(ok, token, 0))
    tl.store(pos_out_ptr + b, tl.where(ok, pos, 0))
    tl.store(slots_out_ptr + b, tl.where(ok, slot, -1))
    reason = tl.where(finite, tl.where(id_ok, 3, 2), 1).to(tl.int64)
    tl.atomic_min(record_ptr, b * 4 + reason, mask=real & (ok == 0))


def pieces_schedule(H: int) -> tuple[int, int]:
    """Its schedule: 4096-wide pieces over 4 warps."""
    return min(4096, 1 << max(0, (H - 1).bit_length())), 4


guard_in_pieces = pieces_schedule, pieces_step_guard_kernel


def _copied_first(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` on a contiguous copy of its first argument (a copy launch before ``fn``)."""

    def wrapped(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return fn(x.contiguous(), *args, **kwargs)

    return wrapped


def _qkv_copied() -> list[tuple[Any, str, Any]]:
    """(module, attribute, value) swaps: the attention's q_norm and kv_norm_rope on contiguous
    copies of their rows."""
    return [
        (attention_module, "rms_norm", _copied_first(attention_module.rms_norm)),
        (attention_module, "kv_norm_rope", _copied_first(attention_module.kv_norm_rope)),
    ]


def _where_after_head(head: Callable[..., Any]) -> Callable[..., Any]:
    """The step's head with its row mask applied by ``torch.where`` after the greedy ids (a
    scalar fill and the where: two launches) rather than by the argmax's reduce."""

    def wrapped(layer: Any, hidden: torch.Tensor, spec_step: int, logits: bool,
                row_mask: torch.Tensor, head_input: Any = None) -> Any:  # fmt: skip
        if logits:
            return head(layer, hidden, spec_step, logits, row_mask, head_input)
        tokens = layer._greedy(hidden, spec_step, head_input)
        empty = hidden.new_empty(hidden.shape[0], 0, dtype=torch.float32)
        return torch.where(row_mask, tokens, -1), empty

    return wrapped


def _head_prefetch(
    layer: MTPLayer, shipped: Any, nbytes: int, mode: int
) -> tuple[Any, list[tuple[Any, str, Any]]]:
    """(ops, patches): the MoE op followed by a prefetch of the head's first ``nbytes`` on a
    side stream (forked after the MoE's kernels), joined after the step's head."""
    from l2_prefetch_probe import prefetch

    side = torch.cuda.Stream()
    w = layer.heads[0].weight.view(-1)[: nbytes // layer.heads[0].weight.element_size()]
    piece = 16384 if mode == 1 else 128
    moe, head = shipped.moe, mtp_module._head

    def moe_then_prefetch(*args: Any, **kwargs: Any) -> Any:
        f = moe(*args, **kwargs)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            prefetch(w, mode, piece)
        return f

    def head_then_join(*args: Any, **kwargs: Any) -> Any:
        out = head(*args, **kwargs)
        torch.cuda.current_stream().wait_stream(side)
        return out

    return shipped._replace(moe=moe_then_prefetch), [(mtp_module, "_head", head_then_join)]


def _align_warps(warps: int) -> list[tuple[Any, str, Any]]:
    """The one-program sort on ``warps`` warps whatever its slot tile."""
    return [(moe_align, "_small_warps", lambda sb: warps)]


def _capture_on(capture: Any) -> Any:
    """``mtp._capture`` with every bucket captured on a high-priority stream."""

    def on_high(dev: torch.device, buckets: Any, body: Any) -> Any:
        high = torch.cuda.Stream(device=dev, priority=-1)
        graph = torch.cuda.graph

        def graph_on_high(g: Any, pool: Any = None, **kw: Any) -> Any:
            return graph(g, pool=pool, stream=high, **kw)

        torch.cuda.graph = graph_on_high  # type: ignore[assignment,misc]
        try:
            return capture(dev, buckets, body)
        finally:
            torch.cuda.graph = graph  # type: ignore[misc]

    return on_high


def _kv_high() -> list[tuple[Any, str, Any]]:
    """The attention's kv side stream created at high priority (the others at the default)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    high = torch.cuda.Stream(device=dev, priority=-1)
    streams = dict(_ops._SIDE_STREAMS)
    for d in (dev, torch.device("cuda")):
        streams[("attention.kv", d)] = high
    return [(_ops, "_SIDE_STREAMS", streams)]


def _moe_config_edit(lo: int, hi: int, edit: Callable[[Any], Any]) -> list[tuple[Any, str, Any]]:
    """The moe's default schedule passed through ``edit`` at T lo..hi (not batch invariant)."""
    base = _ops.moe_config

    def config(T: int, *, batch_invariant: bool, fmt: str = "mxfp4") -> Any:
        s = base(T, batch_invariant=batch_invariant, fmt=fmt)
        return edit(s) if lo <= T <= hi and not batch_invariant else s

    return [(_ops, "moe_config", config)]


def _align_chunked(chunk: int, warps: int) -> list[tuple[Any, str, Any]]:
    """The three-launch sort's chunk and warps at T 22-64."""
    return _moe_config_edit(
        22, 64, lambda s: dataclasses.replace(s, align_chunk=chunk, align_warps=warps)
    )


def _head_sched(v: int, k: int, warps: int, stages: int) -> list[tuple[Any, str, Any]]:
    """The argmax kernel's default schedule with other tiles up to T 32."""
    base = _ops.lm_head_schedule

    def schedule(T: int, batch_invariant: bool, fp32: bool = False) -> Any:
        s = base(T, batch_invariant, fp32)
        if T > 32 or batch_invariant or fp32:
            return s
        return dataclasses.replace(s, block_v=v, block_k=k, num_warps=warps, num_stages=stages)

    return [(_ops, "lm_head_schedule", schedule)]


def _moe_split(split: int, down: int, lo: int, hi: int) -> list[tuple[Any, str, Any]]:
    """The routed gate/up's K split ``split`` and the down's ``down`` at T lo..hi."""
    return _moe_config_edit(
        lo,
        hi,
        lambda s: dataclasses.replace(
            s,
            gate_up=dataclasses.replace(s.gate_up, split_k=split),
            down=dataclasses.replace(s.down, split_k=down),
        ),
    )


def _linear_split(factor: int) -> list[tuple[Any, str, Any]]:
    """The dense linears' decode K split aimed at ``factor`` times its default program count
    (``linear_schedule``'s ``_split`` target)."""
    real = linear_kernels._split

    def split(n_tiles: int, kb: int, target: int) -> int:
        return real(n_tiles, kb, factor * target)

    return [(linear_kernels, "_split", split)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--pairs", default=",".join(COMPOSED), help="comma-separated")
    ap.add_argument("--no-guard", action="store_true", help="leave out the guard's setting")
    ap.add_argument("--no-rope", action="store_true", help="leave out the rotation's setting")
    ap.add_argument("--no-qkv", action="store_true", help="leave out the copied q / kv rows")
    ap.add_argument("--no-mhc", action="store_true", help="leave out hc_pre's fixed blocks")
    ap.add_argument("--no-kv", action="store_true", help="leave out the kv path in line")
    ap.add_argument("--no-mask", action="store_true", help="leave out the ids' torch.where")
    ap.add_argument("--no-topk", action="store_true", help="leave out the 4-warp top-k")
    ap.add_argument("--no-swiglu", action="store_true", help="leave out the SwiGLU pass")
    ap.add_argument("--no-align", action="store_true", help="leave out the sort's own launch")
    ap.add_argument("--no-arena", action="store_true", help="leave out the memset-per-replay form")
    ap.add_argument("--no-eh", action="store_true", help="leave out eh_proj's two launches")
    ap.add_argument("--no-norm", action="store_true", help="leave out the norms' own launches")
    ap.add_argument("--prefetch-mb", default="", help="head prefetch probes, e.g. 32,48")
    ap.add_argument("--align-warps", default="", help="one-program sort's warps, e.g. 8,16")
    ap.add_argument("--moe-split", default="", help="routed K splits, e.g. t1:8,t8:1")
    ap.add_argument("--head-sched", default="", help="argmax tiles V:K:W:S, e.g. 256:64:8:4")
    ap.add_argument("--align-chunked", default="", help="chunked sort C:W, e.g. 64:8,128:16")
    ap.add_argument("--priorities", action="store_true", help="stream priority probes")
    ap.add_argument("--fp8-head", action="store_true", help="the FP8 head, its greedy paths")
    ap.add_argument("--logits", action="store_true", help="steps that write logits, their ids")
    ap.add_argument("--linear-split-x", default="", help="decode linears' split target x F, e.g. 2")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    ckdir = tempfile.mkdtemp(prefix="v4flash-")
    make_fullsize_checkpoint(ckdir, "flash", expert_format="mxfp4", device="cuda")
    layer = MTPLayer.from_checkpoint(
        ckdir, device="cuda", max_num_tokens=4096, max_batch=64,
        head_format="fp8" if args.fp8_head else "bf16",
    )  # fmt: skip
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    shipped = MTPLayer.ops
    # name -> (the layer's ops, the guard's schedule, the inverse rotation in place, module
    # attribute swaps)
    settings = {"shipped": (shipped, SHIPPED_GUARD, True, [])}
    for name in filter(None, args.pairs.split(",")):
        ops = shipped._replace(**{name: COMPOSED[name]})
        settings[f"composed: {name}"] = (ops, SHIPPED_GUARD, True, [])
    if not args.no_guard:
        settings["guard in 4096 pieces"] = (shipped, guard_in_pieces, True, [])
    if not args.no_rope:
        settings["rope copied back"] = (shipped, SHIPPED_GUARD, False, [])
    if not args.no_qkv:
        settings["q / kv rows copied"] = (shipped, SHIPPED_GUARD, True, _qkv_copied())
    if not args.no_mhc:
        config = mhc_pre_small.pre_fma_config
        fixed_pre = [(mhc_pre_small, "pre_fma_config", lambda n, D, tokens=None: config(n, D))]
        settings["hc_pre 16-token blocks"] = (shipped, SHIPPED_GUARD, True, fixed_pre)
    if not args.no_kv:
        settings["kv path in line"] = (
            shipped, SHIPPED_GUARD, True, [(attention_module, "KV_SIDE_STREAM", False)]
        )  # fmt: skip
    if not args.no_mask:
        masked = [(mtp_module, "_head", _where_after_head(mtp_module._head))]
        settings["ids masked by torch.where"] = (shipped, SHIPPED_GUARD, True, masked)
    if not args.no_swiglu:
        pass_launched = [(moe_gemm, "GLUON_SWIGLU_TAIL", False)]
        settings["SwiGLU pass launched"] = (shipped, SHIPPED_GUARD, True, pass_launched)
    if not args.no_align:
        own = [(moe_route, "FUSED_ALIGN_MAX_T", 0)]
        settings["slots sorted in their own launch"] = (shipped, SHIPPED_GUARD, True, own)
    if not args.no_topk:
        four = [(moe_route, "TOPK_SCORES_PER_WARP", 64)]
        settings["route top-k on 4 warps"] = (shipped, SHIPPED_GUARD, True, four)
    if not args.no_arena:
        memsets = [(mtp_module, "GRAPH_COUNTERS", 0)]
        settings["counters zeroed in the graph"] = (shipped, SHIPPED_GUARD, True, memsets)
    if not args.no_eh:
        two = [(linear_kernels, "EH_ONE_LAUNCH", False)]
        settings["e / h products in two launches"] = (shipped, SHIPPED_GUARD, True, two)
    if not args.no_norm:
        launched = [(_ops, "FUSE_NORM", False)]
        settings["norms launched"] = (shipped, SHIPPED_GUARD, True, launched)
    for mb in filter(None, args.prefetch_mb.split(",")):
        for mode, how in ((1, "bulk"), (2, "lines")):
            ops, patches = _head_prefetch(layer, shipped, int(mb) << 20, mode)
            settings[f"head prefetch {mb} MB {how}"] = (ops, SHIPPED_GUARD, True, patches)
    for w in filter(None, args.align_warps.split(",")):
        settings[f"align on {w} warps"] = (shipped, SHIPPED_GUARD, True, _align_warps(int(w)))
    for entry in filter(None, args.moe_split.split(",")):
        at, sk, *dk = entry.split(":")
        if at not in ("t1", "t8"):
            ap.error(f"--moe-split: expected t1:S[:D] or t8:S[:D], got {entry!r}")
        lo, hi = (1, 2) if at == "t1" else (3, 8)
        name = f"moe split {sk}{'/' + dk[0] if dk else ''} at T {lo}-{hi}"
        split = _moe_split(int(sk), int(dk[0]) if dk else int(sk), lo, hi)
        settings[name] = (shipped, SHIPPED_GUARD, True, split)
    if args.priorities:
        step_high = [(mtp_module, "_capture", _capture_on(mtp_module._capture))]
        settings["step at high priority"] = (shipped, SHIPPED_GUARD, True, step_high)
        settings["kv side at high priority"] = (shipped, SHIPPED_GUARD, True, _kv_high())
        both = step_high + _kv_high()
        settings["step and kv at high priority"] = (shipped, SHIPPED_GUARD, True, both)
    if args.logits:
        by_torch = [(mtp_module, "LOGITS_ARGMAX", False)]
        settings["ids by torch.argmax"] = (shipped, SHIPPED_GUARD, True, by_torch)
    if args.fp8_head:
        via_logits = [(mtp_module, "FP8_GREEDY_ARGMAX", False)]
        settings["FP8 ids from logits + torch.argmax"] = (shipped, SHIPPED_GUARD, True, via_logits)
    for f in filter(None, args.linear_split_x.split(",")):
        settings[f"decode linears' K split x{f}"] = (
            shipped, SHIPPED_GUARD, True, _linear_split(int(f))
        )  # fmt: skip
    for entry in filter(None, args.align_chunked.split(",")):
        c, w = (int(a) for a in entry.split(":"))
        name = f"sort in {c}-slot chunks on {w} warps"
        settings[name] = (shipped, SHIPPED_GUARD, True, _align_chunked(c, w))
    for entry in filter(None, args.head_sched.split(",")):
        v, k, w, st = (int(a) for a in entry.split(":"))
        name = f"head {v}x{k} w{w} s{st}"
        settings[name] = (shipped, SHIPPED_GUARD, True, _head_sched(v, k, w, st))
    graphs: dict[str, DecodeGraphs] = {}
    cache = layer.new_device_cache(max(DECODE_T))
    # the guard's launches are cached by schedule: kept aside so that no setting reuses
    # another's kernel, and put back afterwards
    guard_launches = dict(guard_kernels._LAUNCHES)
    in_place = attention_module.INVERSE_ROPE_IN_PLACE
    try:
        for name, (ops, guard, rope_in_place, patches) in settings.items():
            MTPLayer.ops = ops  # type: ignore[misc]
            # the launcher looks both up when it first meets a schedule
            guard_kernels.guard_schedule, guard_kernels.step_guard_kernel = guard
            guard_kernels._LAUNCHES.clear()
            attention_module.INVERSE_ROPE_IN_PLACE = rope_in_place
            saved = [(m, a, getattr(m, a)) for m, a, _ in patches]
            for m, a, v in patches:
                setattr(m, a, v)
            try:
                graphs[name] = DecodeGraphs(layer, cache, buckets=DECODE_T, logits=args.logits)
            except DSV4Error as e:  # a probe the kernels refuse is left out, not fatal
                print(f"{name}: not captured: {e}")
            finally:
                for m, a, v in saved:
                    setattr(m, a, v)
    finally:
        MTPLayer.ops = shipped  # type: ignore[misc]
        guard_kernels.guard_schedule, guard_kernels.step_guard_kernel = SHIPPED_GUARD
        guard_kernels._LAUNCHES.clear()
        guard_kernels._LAUNCHES.update(guard_launches)
        attention_module.INVERSE_ROPE_IN_PLACE = in_place
    label = "decode (logits, graph)" if args.logits else "decode (greedy, graph)"
    decode_table(layer, cache, graphs, g, args.rounds, label)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
