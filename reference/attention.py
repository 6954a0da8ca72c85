"""Attention of the MTP layer: pure sliding-window MQA with attention sinks.

The math, precisions and reasons: ``docs/semantics.md``, "Attention with sinks".

The MTP layer has compress ratio 0: no compressor, no indexer.  One shared latent ``kv (Dh,)``
per token is both key and value; queries go through a low-rank path with an unweighted per-head
RMS norm; RoPE touches the last ``qk_rope_head_dim`` dims of q and kv; each head has a sink logit
that enters the softmax denominator only; the output's rope dims are rotated back by the query
position before the grouped ``wo_a`` and ``wo_b``.

Visibility: key j is visible to query t iff both are in the same sequence, ``pos_j <= pos_t``
and ``pos_t - pos_j < sliding_window``.  We gather, for each query, the window slot of offset
``d = pos_t - pos_j`` in ``[0, W)`` (missing keys masked), so every query reduces over the same
W slots in the same order whether its keys came from a :class:`KVCache` or from the same call;
incremental decoding then reproduces full recomputation bit for bit.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from dsv4mtp.checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_eps,
    check_instance,
    check_int,
    check_number,
    check_positions,
    check_shape,
    compute_dtype,
)
from dsv4mtp.config import DSV4Config
from dsv4mtp.errors import InputError
from dsv4mtp.kv_cache import KVCache
from dsv4mtp.params import AttentionParams
from dsv4mtp.quant import KV_QUANT_BLOCK
from dsv4mtp.semantics import NormOrder, RopeMode

from .linear import grouped_linear, linear
from .norm import rms_norm
from .quant_sim import fp8_block_roundtrip
from .rope import _written, apply_rope, rope_frequencies

__all__ = [
    "AttentionParams",
    "KVCache",
    "attention",
    "kv_norm_rope",
    "q_head_norm_rope",
    "sink_attention",
    "sink_attention_cache",
    "sink_attention_varlen",
]


def _window_slots(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each query and offset d in [0, W): the key row at position ``q_pos - d`` if present.

    q_pos (Tq,), k_pos (Tk,) strictly increasing.  Returns ``index (Tq, W)`` into the keys
    (0 where absent) and ``present (Tq, W)`` bool.
    """
    wanted = q_pos[:, None] - torch.arange(window, device=q_pos.device)[None, :]  # (Tq, W)
    if k_pos.numel() == 0:
        return torch.zeros_like(wanted), torch.zeros_like(wanted, dtype=torch.bool)
    index = torch.searchsorted(k_pos, wanted).clamp(max=k_pos.numel() - 1)
    present = k_pos[index] == wanted
    return torch.where(present, index, 0), present


def sink_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    kv: torch.Tensor,
    k_pos: torch.Tensor,
    attn_sink: torch.Tensor,
    *,
    window: int,
    scale: float,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sliding-window attention of one sequence with per-head sinks.

    q (Tq, H, Dh); q_pos (Tq,) int; kv (Tk, Dh) used as key and value; k_pos (Tk,) int, strictly
    increasing; attn_sink (H,) a logit in the scaled score space that joins the softmax as a
    virtual key with a zero value (docs/semantics.md, "Visibility and the sink softmax").
    Query t sees key j iff ``0 <= q_pos[t] - k_pos[j] < window``; a query that sees no key
    returns 0 (all the weight on the sink).  Returns o (Tq, H, Dh) in q.dtype; math in
    promote(q.dtype, float32).  ``batch_invariant`` changes nothing here (each query is computed
    on its own); ``out`` (Tq, H, Dh) in q.dtype, when given, receives the result.
    """
    for name, t in (("q", q), ("kv", kv), ("attn_sink", attn_sink)):
        check_dtype(name, t, FLOAT_DTYPES)
    if q.dim() != 3:
        raise InputError(f"q: expected shape (Tq, H, Dh), got {tuple(q.shape)}")
    Tq, H, Dh = q.shape
    check_shape("kv", kv, (None, Dh))
    check_shape("attn_sink", attn_sink, (H,))
    check_positions("q_pos", q_pos, Tq)
    check_positions("k_pos", k_pos, kv.shape[0])
    check_int("window", window, 1)
    check_number("scale", scale)
    check_instance("batch_invariant", batch_invariant, bool)
    _check_increasing(k_pos, "k_pos")
    cd = compute_dtype(q.dtype)
    index, present = _window_slots(q_pos, k_pos, window)  # (Tq, W)
    keys = kv.to(cd)[index] if kv.shape[0] else kv.new_zeros((Tq, window, Dh), dtype=cd)
    keys = keys.masked_fill(~present[..., None], 0.0)  # (Tq, W, Dh); absent slots hold no key
    scores = torch.bmm(q.to(cd), keys.transpose(1, 2)) * scale  # (Tq, H, W)
    scores = scores.masked_fill(~present[:, None, :], float("-inf"))
    sink = attn_sink.to(cd)[None, :, None]  # (1, H, 1)
    m = torch.maximum(scores.amax(-1, keepdim=True), sink)  # (Tq, H, 1); the sink is a logit too
    p = torch.exp(scores - m)  # masked slots -> 0
    denom = p.sum(-1, keepdim=True) + torch.exp(sink - m)
    o = torch.bmm(p / denom, keys).to(q.dtype)  # (Tq, H, Dh)
    return _written(out, o)


def sink_attention_varlen(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    kv: torch.Tensor,
    k_pos: torch.Tensor,
    attn_sink: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    *,
    window: int,
    scale: float,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`sink_attention` over B sequences concatenated.

    cu_q, cu_k (B+1,) int prefix offsets: sequence b has the queries ``q[cu_q[b]:cu_q[b+1]]``
    (positions ``q_pos`` alike) and the keys ``kv[cu_k[b]:cu_k[b+1]]`` (positions ``k_pos``
    alike, strictly increasing within the sequence).  A query sees only its own sequence's keys.
    Returns o (Tq, H, Dh) in q.dtype, each sequence computed on its own (so ``batch_invariant``
    changes nothing); ``out`` as in :func:`sink_attention`.
    """
    check_dtype("q", q, FLOAT_DTYPES)
    if q.dim() != 3:
        raise InputError(f"q: expected shape (Tq, H, Dh), got {tuple(q.shape)}")
    check_positions("q_pos", q_pos, q.shape[0])
    check_dtype("kv", kv, FLOAT_DTYPES)
    check_positions("k_pos", k_pos, kv.shape[0])
    check_positions("cu_q", cu_q)
    check_positions("cu_k", cu_k, cu_q.shape[0])
    check_instance("batch_invariant", batch_invariant, bool)
    bq = _check_offsets("cu_q", cu_q, q.shape[0])
    bk = _check_offsets("cu_k", cu_k, kv.shape[0])
    outs = []
    for b in range(len(bq) - 1):
        rows, keys = slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])
        o_b = sink_attention(
            q[rows], q_pos[rows], kv[keys], k_pos[keys], attn_sink, window=window, scale=scale
        )
        outs.append(o_b)  # (Tq_b, H, Dh)
    if not outs:  # B = 0: no queries; the call still checks the other arguments
        outs.append(
            sink_attention(q, q_pos, kv[:0], k_pos[:0], attn_sink, window=window, scale=scale)
        )
    o = torch.cat(outs)
    return _written(out, o)


def sink_attention_cache(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cache_kv: torch.Tensor,
    cache_pos: torch.Tensor,
    slots: torch.Tensor,
    attn_sink: torch.Tensor,
    *,
    window: int,
    scale: float,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`sink_attention` of B decode queries, each against one ring of a KV cache.

    q (B, H, Dh); q_pos (B,) int; cache_kv (S, C, Dh) and cache_pos (S, C) int: ring s holds
    the row of position p at index ``p % C`` (``cache_pos[s, p % C] == p``), -1 where empty
    (docs/semantics.md, "The device ring cache"); slots (B,) int: the ring of each query,
    negative for padding (output 0).  Query b sees the rows of its ring with position k,
    ``q_pos[b] - window < k <= q_pos[b]``.  Returns o (B, H, Dh) in q.dtype; ``batch_invariant``
    changes nothing (every query is computed on its own); ``out`` as in :func:`sink_attention`.
    """
    check_dtype("q", q, FLOAT_DTYPES)
    if q.dim() != 3:
        raise InputError(f"q: expected shape (B, H, Dh), got {tuple(q.shape)}")
    B, H, Dh = q.shape
    check_positions("q_pos", q_pos, B)
    check_dtype("cache_kv", cache_kv, FLOAT_DTYPES)
    check_shape("cache_kv", cache_kv, (None, None, Dh))
    S, C = cache_kv.shape[:2]
    check_positions("slots", slots, B)
    check_dtype("attn_sink", attn_sink, FLOAT_DTYPES)
    check_shape("attn_sink", attn_sink, (H,))
    check_instance("batch_invariant", batch_invariant, bool)
    _check_rings(cache_pos, S, C, slots)
    outs = []
    for b, s in enumerate(int(v) for v in slots.tolist()):
        if s < 0:  # padding: no keys, no sink weight either
            outs.append(q.new_zeros(1, H, Dh))
            continue
        present = cache_pos[s] >= 0  # (C,)
        order = torch.argsort(cache_pos[s][present])  # position order
        keys, key_pos = cache_kv[s][present][order], cache_pos[s][present][order]  # (N, Dh), (N,)
        rows = slice(b, b + 1)
        outs.append(
            sink_attention(
                q[rows], q_pos[rows], keys, key_pos, attn_sink, window=window, scale=scale
            )
        )
    o = torch.cat(outs) if outs else q.new_zeros(0, H, Dh)  # (B, H, Dh)
    return _written(out, o)


def _check_rings(cache_pos: torch.Tensor, S: int, C: int, slots: torch.Tensor) -> None:
    """The ring layout: cache_pos (S, C) int, each row -1 or a position p at index p % C; and
    the slot indices < S."""
    if not isinstance(cache_pos, torch.Tensor) or cache_pos.dtype not in (torch.int32, torch.int64):
        got = cache_pos.dtype if isinstance(cache_pos, torch.Tensor) else type(cache_pos).__name__
        raise InputError(f"cache_pos: expected an int32 / int64 tensor, got {got}")
    check_shape("cache_pos", cache_pos, (S, C))
    if slots.numel() and int(slots.max()) >= S:
        raise InputError(
            f"slots: expected ring indices < S={S} (negative: padding), got {slots.tolist()}"
        )
    rows = torch.arange(C, device=cache_pos.device)
    bad = (cache_pos < -1) | ((cache_pos >= 0) & (cache_pos % C != rows))
    if bool(bad.any()):
        s, r = (int(v) for v in bad.nonzero()[0].tolist())
        raise InputError(
            f"cache_pos: expected -1 (empty) or the position p held at row p % C (C={C}), got "
            f"{int(cache_pos[s, r])} at slot {s}, row {r}"
        )


def sink_attention_paged(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cache_kv: torch.Tensor,
    cache_pos: torch.Tensor,
    block_table: torch.Tensor,
    attn_sink: torch.Tensor,
    *,
    window: int,
    scale: float,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`sink_attention` of B queries, each against its block-table row of a paged cache.

    q (B, H, Dh); q_pos (B,) int; cache_kv (N, bs, Dh) and cache_pos (N, bs) int: a pool of N
    blocks of bs rows, -1 where empty, a row at offset o holding a position p with
    ``p % bs == o``; block_table (B, M) int: query b's blocks, entry j the block of its positions
    ``[j * bs, (j + 1) * bs)``, -1 for none (docs/semantics.md, "The paged cache").  Query b
    sees position k, ``q_pos[b] - window < k <= q_pos[b]``, where the row of k's slot,
    ``block_table[b, k // bs] * bs + k % bs``, holds k.  A query that sees nothing (a padding
    row: all -1) returns 0.  ``batch_invariant`` changes nothing; ``out`` as in
    :func:`sink_attention`.
    """
    check_dtype("q", q, FLOAT_DTYPES)
    if q.dim() != 3:
        raise InputError(f"q: expected shape (B, H, Dh), got {tuple(q.shape)}")
    B, H, Dh = q.shape
    check_positions("q_pos", q_pos, B)
    check_dtype("cache_kv", cache_kv, FLOAT_DTYPES)
    check_shape("cache_kv", cache_kv, (None, None, Dh))
    N, bs = cache_kv.shape[:2]
    check_dtype("attn_sink", attn_sink, FLOAT_DTYPES)
    check_shape("attn_sink", attn_sink, (H,))
    check_instance("batch_invariant", batch_invariant, bool)
    check_int("window", window, 1)
    _check_blocks(cache_pos, N, bs, block_table, B)
    M = block_table.shape[1]
    flat_kv, flat_pos = cache_kv.reshape(N * bs, Dh), cache_pos.reshape(N * bs).long()
    outs = []
    for b in range(B):
        k = q_pos[b].long() - torch.arange(window - 1, -1, -1, device=q.device)  # (W,) ascending
        k = k[k >= 0]
        j = k // bs  # logical block of each position
        block = torch.full_like(k, -1)
        block[j < M] = block_table[b].long()[j[j < M]]
        slot = block.clamp(min=0) * bs + k % bs  # (W',) the rows that would hold k
        held = (block >= 0) & (flat_pos[slot] == k)
        keys, key_pos = flat_kv[slot[held]], k[held]  # (n, Dh), (n,) in position order
        rows = slice(b, b + 1)
        outs.append(
            sink_attention(
                q[rows], q_pos[rows], keys, key_pos, attn_sink, window=window, scale=scale
            )
        )
    o = torch.cat(outs) if outs else q.new_zeros(0, H, Dh)  # (B, H, Dh)
    return _written(out, o)


def _check_blocks(
    cache_pos: torch.Tensor, N: int, bs: int, block_table: torch.Tensor, B: int
) -> None:
    """The paged layout: cache_pos (N, bs) int, each row -1 or a position p at offset p % bs;
    block_table (B, M) int with entries in [-1, N)."""
    if not isinstance(cache_pos, torch.Tensor) or cache_pos.dtype not in (torch.int32, torch.int64):
        got = cache_pos.dtype if isinstance(cache_pos, torch.Tensor) else type(cache_pos).__name__
        raise InputError(f"cache_pos: expected an int32 / int64 tensor, got {got}")
    check_shape("cache_pos", cache_pos, (N, bs))
    if (
        not isinstance(block_table, torch.Tensor)
        or block_table.dtype not in (torch.int32, torch.int64)
        or block_table.dim() != 2
        or block_table.shape[0] != B
    ):
        what = (
            f"{block_table.dtype} {tuple(block_table.shape)}"
            if isinstance(block_table, torch.Tensor)
            else type(block_table).__name__
        )
        raise InputError(f"block_table: expected a ({B}, M) int32 / int64 tensor, got {what}")
    if block_table.numel() and (int(block_table.min()) < -1 or int(block_table.max()) >= N):
        raise InputError(
            f"block_table: expected block indices in [-1, N={N}) (-1: no block), got "
            f"{block_table.tolist()}"
        )
    offsets = torch.arange(bs, device=cache_pos.device)
    bad = (cache_pos < -1) | ((cache_pos >= 0) & (cache_pos % bs != offsets))
    if bool(bad.any()):
        n, o = (int(v) for v in bad.nonzero()[0].tolist())
        raise InputError(
            f"cache_pos: expected -1 (empty) or a position p held at offset p % block_size "
            f"(block_size={bs}), got {int(cache_pos[n, o])} at block {n}, offset {o}"
        )


def _check_offsets(name: str, cu: torch.Tensor, total: int) -> list[int]:
    """Prefix offsets (B+1,): start at 0, never decrease, end at ``total``."""
    bounds = [int(v) for v in cu.tolist()]
    if (
        not bounds
        or bounds[0] != 0
        or bounds[-1] != total
        or any(a > b for a, b in itertools.pairwise(bounds))
    ):
        raise InputError(
            f"{name}: expected non-decreasing prefix offsets from 0 to {total}, got {bounds}"
        )
    return bounds


def _check_increasing(pos: torch.Tensor, name: str, what: str = "") -> None:
    if pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all()):
        raise InputError(
            f"{name}: expected strictly increasing positions{what}, got {pos.tolist()}"
        )


def q_head_norm_rope(
    q: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor,
    *,
    eps: float,
    rope_dim: int,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The query after ``wq_b``: unweighted per-head RMS norm, then RoPE on the last dims.

    q (T, H, Dh) float; positions (T,) int; freqs (rope_dim/2,) float (``rope_frequencies``).
    Returns (T, H, Dh) in q.dtype (docs/semantics.md, "Query" and "RoPE").  ``batch_invariant``
    changes nothing (every head of every token is computed on its own); ``out`` (T, H, Dh) in
    q.dtype, when given, receives the result.
    """
    check_dtype("q", q, FLOAT_DTYPES)
    if q.dim() != 3:
        raise InputError(f"q: expected shape (T, H, Dh), got {tuple(q.shape)}")
    check_positions("positions", positions, q.shape[0])
    Dn = _nope_dims(q.shape[-1], rope_dim, freqs)
    check_eps("eps", eps)
    check_instance("batch_invariant", batch_invariant, bool)
    # Rounded to the activation dtype after each op, as the official code does it in bf16.
    # rsqrt is evaluated in the compute dtype and rounded once: torch's CPU bf16 rsqrt rounds
    # differently in its vectorized body and its scalar tail, which would make a row's result
    # depend on how many rows share the call.
    mean_sq = q.square().mean(-1, keepdim=True)  # (T, H, 1)
    q = q * torch.rsqrt(mean_sq.to(compute_dtype(q.dtype)) + eps).to(q.dtype)
    q = torch.cat([q[..., :Dn], apply_rope(q[..., Dn:], positions, freqs)], dim=-1)
    return _written(out, q)  # (T, H, Dh)


def kv_norm_rope(
    kv: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor,
    *,
    eps: float,
    rope_dim: int,
    fp8_kv: bool = False,
    norm_order: NormOrder = "official",
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The key/value latent after ``wkv``: kv_norm, RoPE on the last dims, optional FP8 rounding.

    kv (T, Dh) float; kv_norm_weight (Dh,) float; positions (T,) int; freqs (rope_dim/2,) float.
    ``norm_order`` as :func:`rms_norm`'s ``order``; ``fp8_kv`` rounds the non-rope dims through
    e4m3 in blocks of ``KV_QUANT_BLOCK`` (docs/semantics.md, "Key/value latent", "Activation and
    KV quantization").  Returns (T, Dh) in kv.dtype: the rows attention reads and the cache
    keeps.  ``batch_invariant`` changes nothing (rows are independent); ``out`` (T, Dh) in
    kv.dtype, when given, receives the result.
    """
    check_dtype("kv", kv, FLOAT_DTYPES)
    if kv.dim() != 2:
        raise InputError(f"kv: expected shape (T, Dh), got {tuple(kv.shape)}")
    check_dtype("kv_norm_weight", kv_norm_weight, FLOAT_DTYPES)
    check_shape("kv_norm_weight", kv_norm_weight, (kv.shape[1],))
    check_positions("positions", positions, kv.shape[0])
    Dn = _nope_dims(kv.shape[1], rope_dim, freqs)
    check_instance("fp8_kv", fp8_kv, bool)
    if norm_order not in ("official", "vllm"):
        raise InputError(f"norm_order: expected 'official' or 'vllm', got {norm_order!r}")
    check_instance("batch_invariant", batch_invariant, bool)
    kv = rms_norm(kv, kv_norm_weight, eps, order=norm_order)
    kv_nope, kv_rope = kv[:, :Dn], apply_rope(kv[:, Dn:], positions, freqs)  # (T, Dn), (T, Dr)
    if fp8_kv:
        kv_nope = fp8_block_roundtrip(kv_nope, KV_QUANT_BLOCK)
    return _written(out, torch.cat([kv_nope, kv_rope], dim=-1))  # (T, Dh)


def _nope_dims(Dh: int, rope_dim: int, freqs: torch.Tensor) -> int:
    """Dn = Dh - rope_dim, after checking rope_dim (even, <= Dh) and freqs (rope_dim/2,)."""
    check_int("rope_dim", rope_dim, 2)
    if rope_dim % 2 or rope_dim > Dh:
        raise InputError(f"rope_dim: expected an even number <= {Dh}, got {rope_dim}")
    check_dtype("freqs", freqs, FLOAT_DTYPES)
    check_shape("freqs", freqs, (rope_dim // 2,))
    return Dh - rope_dim


def attention(
    x: torch.Tensor,
    positions: torch.Tensor,
    params: AttentionParams,
    config: DSV4Config,
    *,
    seq_lens: Sequence[int] | None = None,
    kv_cache: Sequence[KVCache] | None = None,
    rope_mode: RopeMode = "plain",
    fp8_kv: bool = False,
    act_quant: bool = False,
    norm_order: NormOrder = "official",
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MTP attention sublayer: x (T, D) (already ``attn_norm``-ed) -> (T, D) in x.dtype.

    positions (T,) int64; seq_lens: lengths of consecutive sequences (default: one sequence);
    kv_cache: one :class:`KVCache` per sequence, read and then extended with this call's rows.
    Positions must increase strictly within a sequence and continue past its cache.
    ``act_quant`` rounds the inputs of the FP8 linears (wq_a, wq_b, wkv, wo_b) through e4m3;
    ``wo_a`` is bf16 in the official code (its converter dequantizes it), so it is not.
    ``batch_invariant``: no effect (every row and sequence is computed on its own); the optimized
    op's keyword.  ``out`` (T, D) in x.dtype, when given, receives the result.
    """
    check_instance("config", config, DSV4Config)
    check_instance("batch_invariant", batch_invariant, bool)
    check_instance("params", params, AttentionParams)
    check_dtype("x", x, FLOAT_DTYPES)
    check_shape("x", x, (None, config.hidden_size))
    T = x.shape[0]
    check_positions("positions", positions, T)
    if kv_cache is not None and not all(isinstance(c, KVCache) for c in kv_cache):
        raise InputError("kv_cache: expected a sequence of KVCache (one per sequence)")
    if seq_lens is not None and not all(
        isinstance(n, (int, torch.Tensor)) and not isinstance(n, bool) for n in seq_lens
    ):
        raise InputError(f"seq_lens: expected a sequence of ints, got {seq_lens!r}")
    H, Dh, Dr = config.num_attention_heads, config.head_dim, config.qk_rope_head_dim
    Dn, G, W, eps = Dh - Dr, config.o_groups, config.sliding_window, config.rms_norm_eps
    lens = [T] if seq_lens is None else [int(n) for n in seq_lens]
    if sum(lens) != T:
        raise InputError(f"seq_lens: expected lengths summing to T={T}, got {lens}")
    if kv_cache is not None and len(kv_cache) != len(lens):
        raise InputError(
            f"kv_cache: expected one cache per sequence ({len(lens)}), got {len(kv_cache)}"
        )
    freqs = rope_frequencies(
        Dr,
        config.rope_theta,
        mode=rope_mode,
        rope_scaling=config.rope_scaling,
        dtype=compute_dtype(x.dtype),
        device=x.device,
    )

    # query path: low rank, q_norm, unweighted per-head norm, RoPE on the last Dr dims
    qr = rms_norm(linear(x, params.wq_a, act_quant=act_quant), params.q_norm, eps, order=norm_order)
    q = linear(qr, params.wq_b, act_quant=act_quant).view(T, H, Dh)  # (T, H, Dh)
    q = q_head_norm_rope(q, positions, freqs, eps=eps, rope_dim=Dr)

    # key/value latent: one (Dh,) row per token, the key and the value of every head
    kv = linear(x, params.wkv, act_quant=act_quant)  # (T, Dh)
    kv = kv_norm_rope(
        kv, params.kv_norm, positions, freqs, eps=eps, rope_dim=Dr, fp8_kv=fp8_kv,
        norm_order=norm_order,
    )  # fmt: skip

    # per-sequence sliding window with sinks
    outs, start = [], 0
    for b, n in enumerate(lens):
        rows = slice(start, start + n)
        start += n
        pos_b = positions[rows]
        _check_increasing(pos_b, "positions", f" within sequence {b}")
        cache = kv_cache[b] if kv_cache is not None else None
        if (
            cache is not None
            and n
            and cache.last_position is not None
            and int(pos_b[0]) <= cache.last_position
        ):
            raise InputError(
                f"positions: sequence {b} starts at {int(pos_b[0])} but its kv_cache already "
                f"holds position {cache.last_position}"
            )
        keys, key_pos = cache.keys(kv[rows], pos_b) if cache is not None else (kv[rows], pos_b)
        outs.append(
            sink_attention(
                q[rows], pos_b, keys, key_pos, params.attn_sink, window=W, scale=Dh**-0.5
            )
        )
        if cache is not None:
            cache.append(kv[rows], pos_b)
    o = torch.cat(outs) if outs else q.new_zeros(0, H, Dh)  # (T, H, Dh)

    # output path: undo the rotation the values carried (query position), then grouped wo_a, wo_b
    o = torch.cat([o[..., :Dn], apply_rope(o[..., Dn:], positions, freqs, inverse=True)], dim=-1)
    groups = o.reshape(T, G, (H // G) * Dh)  # group g = heads [g*H/G, (g+1)*H/G)
    wo_a = params.wo_a.view(G, config.o_lora_rank, (H // G) * Dh)
    z = grouped_linear(groups, wo_a)  # (T, G, Ro)
    y = linear(z.reshape(T, G * config.o_lora_rank), params.wo_b, act_quant=act_quant)  # (T, D)
    return _written(out, y)
