"""The DeepSeek-V4 MTP draft layer on the H200, eager: the reference layer's API composed of the
optimized ops (docs/semantics.md, "The MTP layer end to end").

Same constructor, ``from_loaded`` / ``from_checkpoint``, ``forward``, ``compute_logits``,
``draft`` and ``new_kv_cache`` as :class:`dsv4mtp.reference.MTPLayer`, with the same checks and
errors (both inherit :class:`~dsv4mtp.layer.MTPLayerAPI`), plus ``device``, ``max_num_tokens``
(rows per call) and ``max_batch`` (sequences per call) bounds.

Construction packs every layer once (:class:`MTPLayerPack`): e_proj / h_proj as
:class:`LinearPack` s (FP8 codes and block scales as the checkpoint stores them in
:meth:`MTPLayer.from_loaded`), the attention sublayer as an :class:`AttentionPack` (the fused
wq_a + wkv FP8 weight from a checkpoint), the MoE as a :class:`MoEPack` (routed experts in their
stored format, the shared expert's FP8 codes), norms and ``hc_*`` in fp32 on the device.

Two ways to run it:

* eager: ``forward`` / ``compute_logits`` / ``draft`` run the ops one by one with Python in
  between, validating their inputs on the host; KV caches are the host-side :class:`KVCache` s
  of the reference, or a preallocated :class:`DeviceKVCache` (``new_device_cache``; ``forward``
  then takes ``cache_slots``, the cache slot of each sequence).
* CUDA graphs: :meth:`MTPLayer.capture_decode` captures one decode step (one row per sequence
  against its device-cache slot: forward, logits, greedy ids) per batch bucket
  (:data:`BUCKETS`) as a :class:`DecodeGraphs`; a call pads its B rows to the next bucket
  (filler rows touch no routed expert and write no KV).  :meth:`MTPLayer.capture_prefill`
  captures the prefill (up to ``max_seqs`` sequences, their row offsets on the device) per
  token bucket (:data:`PREFILL_TOKENS`) as a :class:`PrefillGraphs`.  Once captured, ``draft``
  runs step 0 into the device cache (a prefill graph's replay when the call fits one, else
  eagerly) and replays a decode graph for each later step, with no host sync between steps.
  Inputs inside a graph cannot be checked on the host: non-finite ``prev_hidden`` rows and
  out-of-range ids or positions are recorded on the device (flag and first bad row), their
  drafted ids are -1 and they write no KV (a prefill sequence with such a row writes none),
  and the error is raised at the next host read (``check``, which ``draft`` calls once at its
  end).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dsv4mtp.checkpoint.weights import MTPCheckpoint, MTPLayerWeights
from dsv4mtp.checks import check_device_arg, check_instance, check_int, check_step
from dsv4mtp.config import DSV4Config
from dsv4mtp.errors import ConfigError, InputError
from dsv4mtp.kv_cache import KVCache
from dsv4mtp.layer import (
    LayerOps,
    MTPLayerAPI,
    check_batch_invariant,
    check_layer_args,
    check_loaded,
    load_checked,
    loaded_info,
)
from dsv4mtp.params import MTPLayerParams, build_layer_params
from dsv4mtp.semantics import Semantics

from .attention import AttentionPack, attention, pack_attention, pack_attention_weights
from .kernels._launch import capture_arena, check_device, device_ints, triton_kernel
from .kv_cache import DeviceKVCache
from .linear import LinearPack, eh_proj, pack_linear
from .lm_head import HeadPack, lm_head_argmax, lm_head_logits, logits_argmax, pack_head
from .mhc import hc_head, hc_post, hc_post_head, hc_post_pre, hc_pre
from .moe import MoEPack, moe, pack_moe
from .norm import embed_norms
from .step_guard import NO_BAD_ROW, step_guard

if TYPE_CHECKING:
    from .kernels.step_inputs import stage_inputs_triton
else:  # loaded on the first step: triton is optional (the `gpu` extra)
    stage_inputs_triton = triton_kernel("step_inputs", "stage_inputs_triton")

__all__ = [
    "BUCKETS",
    "PREFILL_TOKENS",
    "DecodeGraphs",
    "MTPLayer",
    "MTPLayerPack",
    "PrefillGraphs",
]  # fmt: skip

#: The batch sizes a decode step is captured for (a call pads to the next one).
BUCKETS = (1, 2, 4, 8, 16, 32, 64)

#: The token counts a prefill is captured for (a call pads its rows to the next one).
PREFILL_TOKENS = (512, 4096)

#: int32 entries of the counter arena one capture (all its buckets) hands its launches' tickets
#: from (kernels/_launch.py, capture_arena; 256 KiB).  A step takes a few hundred; a launch that
#: no longer fits gets a fresh zeroed buffer.  0: every launch a fresh one (a memset each).
GRAPH_COUNTERS = 1 << 16

#: A captured step that writes logits takes its greedy ids from them with :func:`logits_argmax`
#: (True) or torch.argmax and a torch.where (False; the benchmarks' A/B switch).
LOGITS_ARGMAX = True

#: The FP8 head's greedy ids from :func:`lm_head_argmax` (True: no logits written) or from
#: its logits (the FP8 linear kernel) and torch.argmax (False; the benchmarks' A/B switch).
FP8_GREEDY_ARGMAX = True

# The kernels' activation dtypes (float64 and float16 stay the reference's).
_DTYPES = (torch.bfloat16, torch.float32)
_VECTORS = (
    "enorm", "hnorm", "norm", "attn_norm", "ffn_norm",
    "hc_head_fn", "hc_head_base", "hc_head_scale",
    "hc_attn_fn", "hc_attn_base", "hc_attn_scale",
    "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
)  # fmt: skip


@dataclass(frozen=True)
class MTPLayerPack:
    """One MTP layer in the kernels' layout: ``e_proj`` / ``h_proj`` (D, D) :class:`LinearPack` s,
    ``attn`` an :class:`AttentionPack`, ``ffn`` a :class:`MoEPack`; ``vectors`` the norms (D,)
    and ``hc_*`` params by checkpoint name, bf16 / fp32 (other floats widened to fp32);
    ``head`` (V, D) the shared LM head, bf16 / fp32.  ``dense_quantized``: the checkpoint's dense
    linears are FP8 (``act_quant`` applies to them)."""

    e_proj: LinearPack
    h_proj: LinearPack
    attn: AttentionPack
    ffn: MoEPack
    vectors: dict[str, torch.Tensor]
    head: torch.Tensor
    dense_quantized: bool

    def __getattr__(self, name: str) -> torch.Tensor:
        vectors = self.__dict__.get("vectors", {})
        if name in vectors:
            return vectors[name]  # type: ignore[no-any-return]
        raise AttributeError(name)


def _kernel_float(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """bf16 / fp32 kept, other floats widened to fp32 (what the kernels read), on ``device``."""
    if t.dtype not in _DTYPES:
        t = t.to(torch.float32)
    return t.to(device).contiguous()


def pack_layer(
    params: MTPLayerParams,
    device: torch.device,
    *,
    max_tokens: int,
    weights: MTPLayerWeights | None = None,
    reuse_expert_memory: bool = False,
) -> MTPLayerPack:
    """Pack one layer's dense :class:`MTPLayerParams` (once; it allocates).  With the loaded
    ``weights`` it came from, e_proj, h_proj and the attention linears are packed from the
    checkpoint's own weights instead (FP8 stays FP8).  ``reuse_expert_memory``: see
    :func:`pack_moe` (the params' MXFP4 experts reordered in place, for a caller that drops
    them)."""
    if weights is not None:
        e_src: Any = weights.e_proj
        h_src: Any = weights.h_proj
        attn = pack_attention_weights(weights, device)
    else:
        e_src, h_src = params.e_proj, params.h_proj
        attn = pack_attention(params.attn, device)
    return MTPLayerPack(
        e_proj=pack_linear(e_src, device),
        h_proj=pack_linear(h_src, device),
        attn=attn,
        ffn=pack_moe(
            params.ffn, device, max_tokens=max_tokens, reuse_expert_memory=reuse_expert_memory
        ),
        vectors={name: _kernel_float(getattr(params, name), device) for name in _VECTORS},
        head=_kernel_float(params.head, device),
        dense_quantized=params.dense_quantized,
    )


class MTPLayer(MTPLayerAPI):
    """The MTP draft layer(s) on the optimized ops, in one activation dtype (bf16 or fp32).

    Build with :meth:`from_checkpoint`, :meth:`from_loaded` or the constructor (dense
    :class:`MTPLayerParams`, packed here, or :class:`MTPLayerPack` s).  ``layers[i]`` is the
    pack of ``mtp.{i}``.  ``device``: where the packs live (default: ``embed``'s device); a CUDA
    device, or the CPU under ``TRITON_INTERPRET=1``.  ``max_num_tokens``: the most rows one call
    (or draft step 0) may pass, the MoE workspace bound; ``max_batch``: the most sequences.
    The layer's order is :class:`~dsv4mtp.layer.MTPLayerAPI`'s ``_run`` (the reference runs the
    same one) over :attr:`ops`, this package's kernels.
    """

    ops = LayerOps(
        hc_pre=hc_pre, hc_post=hc_post, attention=attention,
        moe=moe, hc_post_pre=hc_post_pre, hc_post_head=hc_post_head,
        embed_norms=embed_norms, eh_proj=eh_proj,
    )  # fmt: skip

    def __init__(
        self,
        config: DSV4Config,
        layers: Sequence[MTPLayerParams | MTPLayerPack],
        embed: torch.Tensor,
        *,
        semantics: Semantics | None = None,
        dtype: torch.dtype = torch.bfloat16,
        info: dict[str, Any] | None = None,
        device: str | torch.device | None = None,
        max_num_tokens: int = 8192,
        max_batch: int = 256,
        head_format: str = "bf16",
        batch_invariant: bool = False,
    ) -> None:
        self.batch_invariant = check_batch_invariant(batch_invariant)
        self.semantics = check_layer_args(
            config, layers, (MTPLayerParams, MTPLayerPack), embed, semantics, dtype, _DTYPES
        )
        self.max_num_tokens = _check_bound("max_num_tokens", max_num_tokens)
        self.max_batch = _check_bound("max_batch", max_batch)
        dev = embed.device if device is None else check_device_arg("device", device, ConfigError)
        self.config = config
        self.dtype = dtype
        self.embed = embed.to(device=dev, dtype=dtype).contiguous()
        self.device = check_device([("embed", self.embed)])
        self.layers = [
            p
            if isinstance(p, MTPLayerPack)
            else pack_layer(p, self.device, max_tokens=max_num_tokens)
            for p in layers
        ]
        for i, p in enumerate(self.layers):
            if p.ffn.max_tokens < max_num_tokens or p.e_proj.device != self.device:
                raise ConfigError(
                    f"layers[{i}]: expected a pack on {self.device} with MoE max_tokens >= "
                    f"max_num_tokens={max_num_tokens}, got {p.e_proj.device} and "
                    f"{p.ffn.max_tokens}"
                )
        self.info: dict[str, Any] = dict(info or {})
        # The LM head as its ops read it, packed once per distinct head tensor (the MTP layers
        # share the model's head): bf16 by default; "fp8" (e4m3, 128x128 ue8m0 blocks: half the
        # bytes, logits within ~3e-2 rel. of the bf16 head, bench/results/head-fp8.md) only on
        # request, never by default.
        if head_format not in ("bf16", "fp8"):
            raise ConfigError(f"head_format: expected 'bf16' or 'fp8', got {head_format!r}")
        self.head_format = head_format
        packs: dict[int, HeadPack] = {}
        self.heads = [
            packs.setdefault(id(p.head), pack_head(p.head, format=head_format))  # type: ignore[arg-type]
            for p in self.layers
        ]
        #: the captured decode steps, one per MTP layer (:meth:`capture_decode`)
        self.graphs: list[DecodeGraphs] = []
        self.prefill_graphs: PrefillGraphs | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_loaded(
        cls,
        checkpoint: MTPCheckpoint,
        *,
        preset: str = "math",
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cuda",
        max_num_tokens: int = 8192,
        max_batch: int = 256,
        head_format: str = "bf16",
        batch_invariant: bool = False,
        consume: bool = False,
        **switches: Any,
    ) -> MTPLayer:
        """From :func:`load_mtp_checkpoint`'s result, packed once: the dense linears and the
        attention from the checkpoint's stored weights (FP8 codes and block scales), the routed
        experts in their stored format (MXFP4 in :func:`pack_moe`'s tiles), the shared expert's
        FP8 codes.  (The dense copies :func:`build_layer_params` makes on the way are dropped
        once packed.)  ``consume=True``: the checkpoint is not used again, so the routed experts'
        MXFP4 tensors on the layer's device (the device copies :func:`build_layer_params`
        makes, or the checkpoint's own where it is already on that device) are reordered into
        the tiles in place instead of copied again: no second copy of the experts on the
        device while packing.  :meth:`from_checkpoint` does this with the checkpoint it
        loaded."""
        dev, semantics = check_loaded(checkpoint, preset, dtype, device, switches, _DTYPES)
        check_instance("consume", consume, bool)
        cache: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        bound = _check_bound("max_num_tokens", max_num_tokens)
        layers = []
        for w in checkpoint.layers:  # each layer's dense params dropped once packed
            layers.append(
                pack_layer(
                    build_layer_params(w, dtype, dev, cache),
                    dev,
                    max_tokens=bound,
                    weights=w,
                    reuse_expert_memory=consume,
                )
            )
        embed = checkpoint.embed_tokens.to(device=dev, dtype=dtype)
        return cls(
            checkpoint.config,
            layers,
            embed,
            semantics=semantics,
            dtype=dtype,
            info=loaded_info(checkpoint, preset),
            max_num_tokens=max_num_tokens,
            max_batch=max_batch,
            head_format=head_format,
            batch_invariant=batch_invariant,
        )

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str],
        *,
        preset: str = "math",
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cuda",
        max_num_tokens: int = 8192,
        max_batch: int = 256,
        head_format: str = "bf16",
        batch_invariant: bool = False,
        **switches: Any,
    ) -> MTPLayer:
        """Load ``mtp.*`` (+ the shared embedding and head) from a checkpoint directory."""
        _check_bound("max_num_tokens", max_num_tokens)
        _check_bound("max_batch", max_batch)
        check_batch_invariant(batch_invariant)
        checkpoint = load_checked(path, preset, dtype, device, switches, _DTYPES)
        return cls.from_loaded(
            checkpoint,
            preset=preset,
            dtype=dtype,
            device=device,
            max_num_tokens=max_num_tokens,
            max_batch=max_batch,
            head_format=head_format,
            batch_invariant=batch_invariant,
            consume=True,  # the checkpoint was loaded for this layer alone
            **switches,
        )

    # ------------------------------------------------------------------ validation
    def _check_inputs(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        prev_hidden: torch.Tensor,
        seq_lens: Any,
    ) -> list[int]:
        lens = super()._check_inputs(input_ids, positions, prev_hidden, seq_lens)
        if sum(lens) > self.max_num_tokens:
            raise InputError(
                f"input_ids: {sum(lens)} rows exceed the layer's max_num_tokens="
                f"{self.max_num_tokens} (MTPLayer(..., max_num_tokens=...))"
            )
        if len(lens) > self.max_batch:
            raise InputError(
                f"seq_lens: {len(lens)} sequences exceed the layer's max_batch={self.max_batch} "
                f"(MTPLayer(..., max_batch=...))"
            )
        return lens

    # ------------------------------------------------------------------ device caches
    def new_device_cache(self, num_seqs: int | None = None, *, max_draft: int = 8) -> DeviceKVCache:
        """A preallocated device KV cache of ``num_seqs`` sequence slots (default ``max_batch``)
        for ONE MTP layer; ``max_draft``: the most draft rows a verification may reject."""
        return DeviceKVCache(
            self.config,
            num_seqs=self.max_batch if num_seqs is None else num_seqs,
            max_draft=max_draft,
            dtype=self.dtype,
            device=self.device,
        )

    def _check_caches(self, kv_cache: object, B: int) -> Any:
        if isinstance(kv_cache, DeviceKVCache):
            return kv_cache
        return super()._check_caches(kv_cache, B)

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        prev_hidden: torch.Tensor,
        *,
        seq_lens: torch.Tensor | None = None,
        kv_cache: KVCache | Sequence[KVCache] | DeviceKVCache | None = None,
        spec_step: int = 0,
        cache_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The reference's ``forward``; ``kv_cache`` may also be a :class:`DeviceKVCache`, with
        ``cache_slots`` (B,) int64 on the device: the cache slot of each sequence (its rows are
        read from and written to that slot)."""
        check_step("spec_step", spec_step)
        lens = self._check_inputs(input_ids, positions, prev_hidden, seq_lens)
        caches = self._check_caches(kv_cache, len(lens))
        extra: dict[str, Any] = {}
        if isinstance(caches, DeviceKVCache):
            if not isinstance(cache_slots, torch.Tensor) or cache_slots.shape != (len(lens),):
                raise InputError(
                    f"cache_slots: expected a ({len(lens)},) int tensor (one slot per sequence) "
                    f"with a DeviceKVCache, got {cache_slots!r}"
                )
            extra["cache_slots"] = cache_slots
        elif cache_slots is not None:
            raise InputError("cache_slots: only with a DeviceKVCache as kv_cache")
        return self._run(
            input_ids, positions, prev_hidden, lens, caches, spec_step, attn_extra=extra
        )

    __call__ = forward  # type: ignore[assignment]

    # ------------------------------------------------------------------ CUDA graphs
    def capture_decode(
        self,
        buckets: Sequence[int] = BUCKETS,
        *,
        num_seqs: int | None = None,
        logits: bool = True,
    ) -> list[DecodeGraphs]:
        """Capture the decode step of every MTP layer for ``buckets`` (one :class:`DecodeGraphs`
        per layer, each with its own :class:`DeviceKVCache` of ``num_seqs`` slots, default
        ``max_batch``); ``draft`` uses them from then on.  CUDA only; allocates the graphs'
        memory pool once (a few hundred MB at V4-Flash for bucket 64: the logits and the MoE
        workspace).  ``logits=False``: the steps compute greedy ids only (:meth:`_greedy`, no
        (B, V) logits written), and ``draft`` uses them for drafts that need no logits (greedy
        or forced, without ``return_logits``).  ``draft`` resets and uses slots 0..B-1 of these
        caches (its caches are fresh per call, as the reference's): an engine that keeps its own
        sequences in them drives :meth:`DecodeGraphs.step` itself, or gives ``draft`` its own
        layer."""
        if self.device.type != "cuda":
            raise InputError(
                f"capture_decode: CUDA graphs need a CUDA layer, this one is on {self.device}"
            )
        self.graphs = [
            DecodeGraphs(
                self, self.new_device_cache(num_seqs), spec_step=i, buckets=buckets, logits=logits
            )
            for i in range(len(self.layers))
        ]
        return self.graphs

    def capture_prefill(
        self,
        tokens: Sequence[int] = PREFILL_TOKENS,
        *,
        max_seqs: int = 8,
        cache: DeviceKVCache | None = None,
        logits: bool = True,
    ) -> PrefillGraphs:
        """Capture the first MTP layer's prefill for the token counts ``tokens`` (up to
        ``max_seqs`` sequences per call) as a :class:`PrefillGraphs` over ``cache`` (default:
        the first decode graphs' cache when :meth:`capture_decode` ran, so a draft's decode
        steps continue from the prefilled rings, else a new one of ``max_batch`` slots), kept
        as :attr:`prefill_graphs`: ``draft`` then replays it for its step 0 when it is over
        the decode graphs' cache and the call fits (see :meth:`_draft`).  CUDA only; the
        graphs' memory pool holds the largest bucket's activations (0.59 GB at V4-Flash for
        the default buckets, bench/results/mtp-h200.md)."""
        if self.device.type != "cuda":
            raise InputError(
                f"capture_prefill: CUDA graphs need a CUDA layer, this one is on {self.device}"
            )
        if cache is None:
            cache = self.graphs[0].cache if self.graphs else self.new_device_cache()
        check_instance("cache", cache, DeviceKVCache)
        self.prefill_graphs = PrefillGraphs(
            self, cache, tokens=tokens, max_seqs=max_seqs, logits=logits
        )
        return self.prefill_graphs

    def _draft(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        prev_hidden: torch.Tensor,
        lens: list[int],
        num_tokens: int,
        greedy: bool,
        temperature: float,
        generator: torch.Generator | None,
        forced_tokens: torch.Tensor | None,
        return_logits: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """With captured graphs (and B within the largest bucket and every cache's slots):
        step 0 through layer 0 into its device cache, then one graph replay per step.  Step 0
        replays :attr:`prefill_graphs` when they are over that cache and the call fits (B <=
        ``max_seqs``, the rows within the largest token bucket, no empty sequence; logits
        captured if the draft needs them), else runs eagerly.  Otherwise the shared host
        loop."""
        B = len(lens)
        graphs = self.graphs
        needs_logits = return_logits or not (greedy or forced_tokens is not None)
        if (
            not graphs
            or min(graphs[0].max_batch, graphs[0].cache.num_seqs) < B
            or (needs_logits and not graphs[0].logits)
        ):
            return super()._draft(
                input_ids, positions, prev_hidden, lens, num_tokens, greedy, temperature,
                generator, forced_tokens, return_logits,
            )  # fmt: skip
        slots = torch.arange(B, device=self.device)
        for g in graphs:
            g.cache.reset(slots)
        last = device_ints(lens, self.device).cumsum(0) - 1  # (B,) last row per sequence
        pos = positions[last]
        pg = self.prefill_graphs
        if (
            pg is not None
            and pg.cache is graphs[0].cache
            and pg.spec_step == 0
            and pg.max_seqs >= B
            and pg.max_tokens >= sum(lens)
            and min(lens) >= 1
            and (pg.logits or not needs_logits)
        ):
            # step 0 by replay: what the host did not check (positions rising within a
            # sequence) is recorded by the graph and raised after the steps (below)
            tok0, out_hidden, logits = pg.step(input_ids, positions, prev_hidden, lens, slots)
            tok0, logits = tok0.clone(), logits.clone()
            hidden = out_hidden.index_select(0, last)  # (B, nD), a copy
            token = (
                tok0
                if greedy and forced_tokens is None
                else self._pick(logits, 0, greedy, temperature, generator, forced_tokens)
            )  # forced tokens need no logits; sampling has them (needs_logits)
        else:
            pg = None  # step 0 eagerly: it raises its errors itself
            hidden = self._run(
                input_ids, positions, prev_hidden, lens, graphs[0].cache, 0,
                attn_extra={"cache_slots": slots},
            )[last]  # fmt: skip
            logits = self._logits(hidden, 0)  # (B, V)
            token = self._pick(logits, 0, greedy, temperature, generator, forced_tokens)
        drafted, step_logits = [token], [logits]
        for k in range(1, num_tokens):
            # the step's outputs are views of its graph's buffers, overwritten by its next
            # replay: the step's inputs are copied in before that, and what is kept is cloned
            g = graphs[k % len(graphs)]
            ids, hidden, logits = g.step(token, pos + k, hidden, slots)
            token = (
                ids
                if greedy and forced_tokens is None
                else self._pick(logits, k, greedy, temperature, generator, forced_tokens)
            )
            drafted.append(token.clone())
            if return_logits:
                step_logits.append(logits.clone())
        # every record is read and cleared; the first step's error is the one raised (a bad
        # prefill sequence's id -1 is recorded again by the decode steps it feeds)
        errors = []
        records: list[PrefillGraphs | DecodeGraphs] = [*([pg] if pg is not None else []), *graphs]
        for checked in records:
            try:
                checked.check()
            except InputError as e:
                errors.append(e)
        if errors:
            raise errors[0]
        tokens = torch.stack(drafted, dim=1)  # (B, num_tokens)
        return tokens, torch.stack(step_logits, dim=1) if return_logits else None

    def _head_input(
        self, hidden: torch.Tensor, spec_step: int, head_input: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden (T, nD) -> the rows the LM head reads (T, D): ``hc_head`` with the layer's
        ``hc_head_*`` ending in its ``norm`` (one optimized op), or ``head_input``, those rows
        from ``_run(head=True)``'s fused ``hc_post_head``."""
        if head_input is not None:
            return head_input
        cfg = self.config
        p = self.layers[spec_step % len(self.layers)]
        T = hidden.shape[0]
        return hc_head(
            hidden.view(T, cfg.hc_mult, cfg.hidden_size),
            p.hc_head_fn,
            p.hc_head_scale,
            p.hc_head_base,
            rms_norm_eps=cfg.rms_norm_eps,
            hc_eps=cfg.hc_eps,
            batch_invariant=self.batch_invariant,
            norm_weight=p.norm,
            norm_order=self.semantics.norm_order,
        )  # (T, D)

    def _logits(
        self, hidden: torch.Tensor, spec_step: int, head_input: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`compute_logits` on a checked ``hidden`` -> (T, V) fp32 (``head_input``: see
        :meth:`_head_input`).

        :meth:`_head_input`, then :func:`lm_head_logits`: for the bf16 head one cuBLAS GEMM
        accumulated and written in fp32 (it reads the head once, V*D*2 bytes, 1.06 GB at
        V4-Flash); for the FP8 head (``head_format="fp8"``) the FP8 linear kernel.  The
        reference multiplies the same bf16 values in fp32 in 16384-column chunks, so the two
        differ only in fp32 summation order (conformance/test_mtp_optimized.py declares the
        tolerance).
        """
        y = self._head_input(hidden, spec_step, head_input)
        return lm_head_logits(
            y, self.heads[spec_step % len(self.heads)], batch_invariant=self.batch_invariant
        )

    def _greedy(
        self,
        hidden: torch.Tensor,
        spec_step: int,
        head_input: torch.Tensor | None = None,
        row_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Greedy ids (T,), torch.argmax's tie and NaN rules, from :func:`lm_head_argmax`
        without the (T, V) logits.  bf16 head: the argmax kernel (H200, V4-Flash head: 245 /
        243 / 266 us at T 1 / 8 / 64 against cuBLAS logits + argmax 281 / 286 / 329 us,
        bench/results/head-h200.json).  FP8 head: the FP8 linear kernel's tiles ending in the
        argmax's partials (``_ops.FP8_ARGMAX_ON_LINEAR``), the ids of its logits bit for bit
        without writing them.  With :data:`FP8_GREEDY_ARGMAX` off (the benchmarks' A/B), the FP8
        head's logits and torch.argmax instead.  ``head_input``: see :meth:`_head_input`.
        ``row_mask`` (T,) bool: -1 where false (written by the argmax's reduce launch; after
        torch.argmax by a ``torch.where``)."""
        y = self._head_input(hidden, spec_step, head_input)
        head = self.heads[spec_step % len(self.heads)]
        if head.format == "fp8" and not FP8_GREEDY_ARGMAX:
            ids = lm_head_logits(y, head, batch_invariant=self.batch_invariant).argmax(-1)
            return ids if row_mask is None else torch.where(row_mask, ids, -1)
        return lm_head_argmax(y, head, batch_invariant=self.batch_invariant, row_mask=row_mask)


def _capture(
    dev: torch.device, buckets: Sequence[int], body: Any
) -> tuple[dict[int, Any], dict[int, torch.cuda.CUDAGraph]]:
    """Run ``body(b)`` once per bucket on a side stream (its inputs hold filler rows only:
    Triton compiles and the plan caches fill, nothing is written to a cache), then capture it
    per bucket into one shared memory pool -> (outputs, graphs) by bucket."""
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for b in buckets:
            body(b)
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize(dev)
    pool = torch.cuda.graph_pool_handle()
    outputs, graphs = {}, {}
    # the launches' ticket counters: pieces of one zeroed arena that the graphs keep, instead of
    # a memset per launch in every replay (kernels/_launch.py, capture_arena).  Each bucket's
    # capture starts over at the arena's first piece: the buckets' graphs are replayed one at a
    # time (``step``), and every launch leaves its piece zeroed for the next.  Like the pool's
    # outputs, the arena must outlive any replay still in flight (keep the graphs until then).
    arena = torch.zeros(GRAPH_COUNTERS, dtype=torch.int32, device=dev)
    for b in buckets:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool), capture_arena(arena):
            outputs[b] = body(b)
        # the arena lives as long as the graph that reads and writes it
        graph.counters = arena  # type: ignore[attr-defined]
        graphs[b] = graph
    return outputs, graphs


def _check_step_inputs(
    layer: MTPLayer,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    prev_hidden: torch.Tensor,
    slots: torch.Tensor,
    T: int,
    B: int,
) -> None:
    """A captured step's inputs on the host (shapes, dtypes, devices; values are not read):
    ids and positions (T,) and slots (B,) int64 / int32, prev_hidden (T, hc_dim) in the
    layer dtype, all on the layer's device."""
    dev, H = layer.device, layer.config.hc_dim
    for name, t, shape in (
        ("input_ids", input_ids, (T,)),
        ("positions", positions, (T,)),
        ("slots", slots, (B,)),
        ("prev_hidden", prev_hidden, (T, H)),
    ):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.device != dev:
            raise InputError(f"{name}: expected shape {shape} on {dev}, got {t!r:.80}")
        want = (layer.dtype,) if name == "prev_hidden" else (torch.int64, torch.int32)
        if t.dtype not in want:
            raise InputError(f"{name}: expected {' or '.join(map(str, want))}, got {t.dtype}")


def _check_buckets(name: str, buckets: Sequence[int]) -> None:
    """Captured sizes: a non-empty sequence of ints >= 1."""
    if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets):
        raise InputError(f"{name}: expected ints >= 1, got {buckets!r}")


def _bucket(buckets: Sequence[int], n: int, what: str) -> int:
    """The smallest of the sorted ``buckets`` >= n rows."""
    for b in buckets:
        if b >= n:
            return b
    raise InputError(f"input_ids: {n} rows exceed the largest {what} {buckets[-1]}")


def _head(
    layer: MTPLayer,
    hidden: torch.Tensor,
    spec_step: int,
    logits: bool,
    row_mask: torch.Tensor,
    head_input: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A captured step's head over hidden (R, nD) -> (greedy ids (R,), -1 where ``row_mask``
    (R,) bool is false; logits (R, V) fp32): the logits and their argmax (:func:`logits_argmax`,
    which writes the -1s), or with ``logits=False`` the logit-free argmax (:meth:`MTPLayer._greedy`, whose reduce launch
    writes the -1s) and an empty (R, 0) in place of the logits."""
    if logits:
        out = layer._logits(hidden, spec_step, head_input)
        if LOGITS_ARGMAX:
            return logits_argmax(out, row_mask=row_mask), out
        return torch.where(row_mask, out.argmax(-1), -1), out
    empty = hidden.new_empty(hidden.shape[0], 0, dtype=torch.float32)  # none computed
    return layer._greedy(hidden, spec_step, head_input, row_mask), empty


def _check_bound(name: str, v: object) -> int:
    try:
        return check_int(name, v, 1)
    except InputError as e:
        raise ConfigError(str(e)) from None


class DecodeGraphs:
    """One MTP layer's decode step captured as CUDA graphs, one per batch bucket.

    A step takes, for B <= ``max(buckets)`` sequences, one row each: ``input_ids`` (B,) int64,
    ``positions`` (B,), ``prev_hidden`` (B, hc_mult*D) in the layer dtype and ``slots`` (B,)
    int64 (each sequence's slot of :attr:`cache`), and computes the layer's ``forward`` (its
    new KV row written to the slot), ``compute_logits`` and the greedy ids.  The B rows are
    padded to the next bucket: filler rows have slot -1 (no KV read or written) and a false
    MoE ``row_mask`` (no routed expert read), so a step moves the bytes of its B real rows.

    Capture (in the constructor) runs every bucket once eagerly with filler rows only (Triton
    compiles, plan caches fill; nothing is written to the cache), then captures each bucket into
    one shared memory pool.  :meth:`step` copies the inputs into the static buffers and pads
    the bucket in one launch (kernels/step_inputs.py), then replays; its results are views of
    the graph's outputs, overwritten by the next replay of the same bucket (clone what you
    keep).  Replay equals the same step run eagerly at the padded size bit for bit
    (``capture=False`` runs :meth:`step` eagerly, for that comparison).

    Bad input inside a graph (a non-finite ``prev_hidden`` row, an id outside [0, vocab), a
    position outside [0, max_position_embeddings)): the row is treated as filler (no KV write,
    no routed expert), its id is -1, and it is recorded on the device by :func:`step_guard`
    (one launch at the head of the step, docs/semantics.md, "The decode step's input guard"):
    the record holds ``row * 4 + reason`` of the lowest-indexed bad row among the steps since
    the last :meth:`check`, which reads it (one host sync), clears it and raises the
    :class:`InputError`.
    """

    _REASONS = ("", "prev_hidden: non-finite value", "input_ids: id outside [0, vocab_size)",
                "positions: position outside [0, max_position_embeddings)")  # fmt: skip

    def __init__(
        self,
        layer: MTPLayer,
        cache: DeviceKVCache,
        *,
        spec_step: int = 0,
        buckets: Sequence[int] = BUCKETS,
        capture: bool = True,
        logits: bool = True,
    ) -> None:
        _check_buckets("buckets", buckets)
        self.layer, self.cache, self.spec_step = layer, cache, check_step("spec_step", spec_step)
        self.buckets = tuple(sorted(set(buckets)))
        self.max_batch = self.buckets[-1]
        cfg, dev, n = layer.config, layer.device, self.buckets[-1]
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.prev = torch.zeros(n, cfg.hc_dim, dtype=layer.dtype, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.real = torch.zeros(n, dtype=torch.bool, device=dev)
        # the step_guard record: row * 4 + reason of the lowest bad row, NO_BAD_ROW when none
        self.bad = torch.full((1,), NO_BAD_ROW, dtype=torch.int64, device=dev)
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.captured = capture
        self.logits = logits
        if not capture:
            return
        self.outputs, self.graphs = _capture(dev, self.buckets, self._body)
        self.bad.fill_(NO_BAD_ROW)

    def _body(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The captured step at bucket b -> (ids (b,), hidden (b, nD), logits (b, V) fp32, or
        (b, 0) with ``logits=False``)."""
        L, cfg = self.layer, self.layer.config
        ids, pos, prev, slots, real = (
            self.ids[:b], self.pos[:b], self.prev[:b], self.slots[:b], self.real[:b]
        )  # fmt: skip
        # One launch: ok rows, their ids / positions / slots masked (0, 0, -1 where not ok),
        # and self.bad lowered to the lowest bad real row's key.  Outputs from the graph's pool.
        ok = torch.empty(b, dtype=torch.bool, device=ids.device)
        ids_ok, pos_ok, slots_ok = (torch.empty_like(ids) for _ in range(3))
        step_guard(
            ids, pos, prev, slots, real, cfg.vocab_size, cfg.max_position_embeddings,
            batch_invariant=L.batch_invariant, out=(ok, ids_ok, pos_ok, slots_ok, self.bad),
        )  # fmt: skip
        hidden, y = L._run(
            ids_ok,
            pos_ok,
            prev,
            [1] * b,
            self.cache,
            self.spec_step,
            attn_extra={"cache_slots": slots_ok},
            moe_extra={"row_mask": ok},
            head=True,
        )  # fmt: skip  (b, nD), hc_head's (b, D) from the fused hc_post_head
        tokens, logits = _head(L, hidden, self.spec_step, self.logits, ok, y)
        return tokens, hidden, logits

    def bucket(self, B: int) -> int:
        """The smallest captured bucket >= B."""
        return _bucket(self.buckets, B, "bucket")

    def step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        prev_hidden: torch.Tensor,
        slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decode step of B sequences -> (ids (B,) int64, -1 for a bad row; hidden (B, nD);
        logits (B, V) fp32), views of the graph's outputs.  Shapes, dtypes and devices are
        checked on the host; values are not read (see the class docstring)."""
        B = input_ids.shape[0] if isinstance(input_ids, torch.Tensor) else -1
        _check_step_inputs(self.layer, input_ids, positions, prev_hidden, slots, B, B)
        b = self.bucket(B)
        # rows B..b-1 are filler: zeros, slot -1, not real (one launch)
        stage_inputs_triton(
            input_ids, positions, prev_hidden, slots, self.ids, self.pos, self.prev, self.real,
            self.slots, b, b,
        )  # fmt: skip
        if self.captured:
            self.graphs[b].replay()
            out = self.outputs[b]
        else:
            out = self._body(b)
        return out[0][:B], out[1][:B], out[2][:B]

    def check(self) -> None:
        """One host read of the bad-input record: raise the :class:`InputError` of the lowest
        bad row since the last check (and clear the record)."""
        key = int(self.bad.item())
        if key == NO_BAD_ROW:
            return
        self.bad.fill_(NO_BAD_ROW)
        row, reason = divmod(key, 4)
        raise InputError(f"{self._REASONS[reason]} in row {row} (inside a CUDA-graph decode step)")


class PrefillGraphs:
    """One MTP layer's prefill captured as CUDA graphs, one per token bucket: up to
    ``max_seqs`` sequences of consecutive rows, T rows in all, each against its slot of
    :attr:`cache` (its visible ring rows, then its new rows; the last ``C`` rows written).

    A call takes ``input_ids`` (T,) int64, ``positions`` (T,), ``prev_hidden`` (T, hc_mult*D)
    in the layer dtype, ``seq_lens`` (B host ints, summing to T) and ``slots`` (B,) int64 on
    the device, and computes the layer's ``forward`` over the T rows, then ``compute_logits``
    and the greedy id of each sequence's last row (what a draft's first step needs).  The rows
    are padded to the next bucket: the filler rows form one more sequence with slot -1 (no KV
    read or written, output zero) and a false MoE ``row_mask`` (no routed expert read), and
    unused sequence entries have no rows.  The row offsets go to the device as
    ``query_start_loc`` (one small copy per call from a ring of pinned host buffers, no host
    read; the inputs and the padding are staged in one launch), and the attention's keys are
    sized from T, B and the ring's C (``attention``'s device-offset prefill), so a replay
    reads no host value.  Replay equals :meth:`step` run eagerly at the padded size
    (``capture=False``) bit for bit; the padded rows change no other row's bits where
    ``batch_invariant`` is set (the default schedules may pick by the padded T).

    Bad input inside a graph: a row with a non-finite ``prev_hidden`` row, an id outside
    [0, vocab) or a position outside [0, max_position_embeddings) is recorded by
    :func:`step_guard` (``row * 4 + reason``) and makes its whole sequence padding (no KV read
    or written: a sequence is cached whole or not at all); a sequence whose slot or positions
    fail the ring's checks (a slot >= num_seqs or repeated, positions not rising, or not past
    its ring's newest row) is padding too, recorded as ``sequence * 4 + flags``.  The greedy id
    of such a sequence is -1.  :meth:`check` reads both records (one host sync) and raises the
    :class:`InputError`.
    """

    _ROW_REASONS = DecodeGraphs._REASONS
    _SEQ_REASONS = ("", "a failed ring check (a slot >= num_seqs or repeated, positions not "
                    "rising or outside [0, 2^31), or not past its ring's newest row)",
                    "its ring holds a position twice", "a failed ring check")  # fmt: skip

    def __init__(
        self,
        layer: MTPLayer,
        cache: DeviceKVCache,
        *,
        spec_step: int = 0,
        tokens: Sequence[int] = PREFILL_TOKENS,
        max_seqs: int = 8,
        capture: bool = True,
        logits: bool = True,
    ) -> None:
        _check_buckets("tokens", tokens)
        check_int("max_seqs", max_seqs, 1)
        self.layer, self.cache, self.spec_step = layer, cache, check_step("spec_step", spec_step)
        self.buckets = tuple(sorted(set(tokens)))
        self.max_tokens, self.max_seqs = self.buckets[-1], max_seqs
        cfg, dev, n, S = layer.config, layer.device, self.buckets[-1], max_seqs + 1
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.prev = torch.zeros(n, cfg.hc_dim, dtype=layer.dtype, device=dev)
        self.real = torch.zeros(n, dtype=torch.bool, device=dev)
        self.rows = torch.arange(n, dtype=torch.int32, device=dev)
        # S = max_seqs + 1 sequence entries: the last one owns a bucket's filler rows
        self.cu = torch.zeros(len(self.buckets), S + 1, dtype=torch.int32, device=dev)
        self.slots = torch.full((S,), -1, dtype=torch.int64, device=dev)
        self.flags = torch.zeros(S, dtype=torch.int64, device=dev)
        self.bad = torch.full((1,), NO_BAD_ROW, dtype=torch.int64, device=dev)
        self.bad_seq = torch.full((1,), NO_BAD_ROW, dtype=torch.int64, device=dev)
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.captured, self.logits = capture, logits
        for i, b in enumerate(self.buckets):  # filler only: every row in the last sequence
            self.cu[i, -1] = b
        # pinned host buffers for the row offsets of a step (:meth:`_send_offsets`)
        self._ring: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        if dev.type == "cuda":
            self._ring = [
                (torch.zeros(S + 1, dtype=torch.int32, pin_memory=True), torch.cuda.Event())
                for _ in range(4)
            ]
        self._ring_next = 0
        if not capture:
            return
        if dev.type != "cuda":
            raise InputError(f"PrefillGraphs: CUDA graphs need a CUDA layer, got {dev}")
        self.outputs, self.graphs = _capture(dev, self.buckets, self._body)
        self.bad.fill_(NO_BAD_ROW)
        self.bad_seq.fill_(NO_BAD_ROW)

    def _body(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The captured prefill of bucket b -> (ids (S,), hidden (b, nD), logits (S, V) fp32
        or (S, 0)), S = max_seqs + 1 sequence entries."""
        L, cfg = self.layer, self.layer.config
        ids, pos, prev, real = self.ids[:b], self.pos[:b], self.prev[:b], self.real[:b]
        cu = self.cu[self.buckets.index(b)]  # (S+1,) int32 row offsets
        S = self.slots.shape[0]
        ok = torch.empty(b, dtype=torch.bool, device=ids.device)
        ids_ok, pos_ok, unused = (torch.empty_like(ids) for _ in range(3))
        step_guard(
            ids, pos, prev, torch.zeros_like(ids), real, cfg.vocab_size,
            cfg.max_position_embeddings, batch_invariant=L.batch_invariant,
            out=(ok, ids_ok, pos_ok, unused, self.bad),
        )  # fmt: skip
        # a sequence with a bad row is padding as a whole: its slot -1 (no KV read or written)
        seq = torch.searchsorted(cu[1:], self.rows[:b], right=True)  # (b,) sequence of a row
        dead = torch.zeros(S, dtype=torch.int32, device=ids.device)
        dead.scatter_reduce_(0, seq, (real & ~ok).to(torch.int32), "amax")
        slots = torch.where(dead.bool(), -1, self.slots)
        row_mask = ok & ~dead.bool()[seq]  # a dead sequence's rows read no routed expert
        hidden = L._run(
            ids_ok,
            pos_ok,
            prev,
            None,
            self.cache,
            self.spec_step,
            attn_extra={"cache_slots": slots, "query_start_loc": cu, "seq_flags": self.flags},
            moe_extra={"row_mask": row_mask},
        )  # (b, nD)
        failed = self.flags != 0
        key = torch.where(failed, torch.arange(S, device=ids.device) * 4 + self.flags, NO_BAD_ROW)
        torch.minimum(self.bad_seq, key.amin().view(1), out=self.bad_seq)
        last = (cu[1:].long() - 1).clamp_min(0)  # (S,) each sequence's last row
        h_last = hidden.index_select(0, last)  # (S, nD)
        live = (cu[1:] > cu[:-1]) & ~dead.bool() & ~failed & (self.slots >= 0)
        tokens, logits = _head(L, h_last, self.spec_step, self.logits, live)
        return tokens, hidden, logits

    def bucket(self, T: int) -> int:
        """The smallest captured token bucket >= T."""
        return _bucket(self.buckets, T, "token bucket")

    def step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        prev_hidden: torch.Tensor,
        seq_lens: Sequence[int],
        slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prefill B sequences of T rows in all -> (ids (B,) int64: each sequence's greedy id
        after its last row, -1 for a bad sequence; hidden (T, nD); logits (B, V) fp32, or
        (B, 0) with ``logits=False``), views of the graph's outputs (overwritten by the next
        replay of the bucket: clone what you keep).  ``seq_lens``: host ints (each >= 1);
        a negative slot makes its sequence padding on purpose (no KV read or written, id -1,
        nothing recorded); shapes, dtypes and devices are checked on the host, values are
        not read."""
        T = input_ids.shape[0] if isinstance(input_ids, torch.Tensor) else -1
        if isinstance(seq_lens, torch.Tensor) and seq_lens.device.type != "cpu":
            raise InputError("seq_lens: expected host ints (a list or a CPU tensor)")
        try:
            lens = [int(n) for n in seq_lens]
        except (TypeError, ValueError):
            raise InputError(f"seq_lens: expected host ints, got {seq_lens!r:.80}") from None
        B = len(lens)
        if not 1 <= B <= self.max_seqs or any(n < 1 for n in lens) or sum(lens) != T:
            raise InputError(
                f"seq_lens: expected 1..{self.max_seqs} lengths >= 1 summing to T={T}, got {lens}"
            )
        _check_step_inputs(self.layer, input_ids, positions, prev_hidden, slots, T, B)
        b = self.bucket(T)
        S = self.max_seqs + 1
        offsets = [0] * (S + 1)
        for i, n in enumerate(lens):
            offsets[i + 1] = offsets[i] + n
        for i in range(B + 1, S):
            offsets[i] = T
        offsets[S] = b  # the filler sequence: rows T..b
        self._send_offsets(self.cu[self.buckets.index(b)], offsets)
        # rows T..b-1 are the filler sequence's: zeros, not real; slots B..S-1 are -1
        stage_inputs_triton(
            input_ids, positions, prev_hidden, slots, self.ids, self.pos, self.prev, self.real,
            self.slots, b, S,
        )  # fmt: skip
        if self.captured:
            self.graphs[b].replay()
            out = self.outputs[b]
        else:
            out = self._body(b)
        return out[0][:B], out[1][:T], out[2][:B]

    def _send_offsets(self, cu: torch.Tensor, offsets: list[int]) -> None:
        """``cu`` (S+1,) int32 on the device = ``offsets``, without a sync: written into the
        next of four pinned host buffers and copied asynchronously on the current stream.  A
        buffer is rewritten only once the copy that last read it has run (the event recorded
        behind that copy), i.e. four calls later: a host more than four prefill steps ahead of
        the GPU waits there.  ``device_ints`` would pin a new buffer per call, 50-70 us of host
        time."""
        if cu.device.type != "cuda":
            cu.copy_(device_ints(offsets, cu.device, torch.int32))
            return
        i = self._ring_next = (self._ring_next + 1) % len(self._ring)
        buf, done = self._ring[i]
        done.synchronize()  # a no-op while never recorded
        buf.numpy()[:] = offsets
        cu.copy_(buf, non_blocking=True)
        done.record(torch.cuda.current_stream(cu.device))

    def check(self) -> None:
        """One host read of both bad-input records: raise the :class:`InputError` of the lowest
        bad row, else of the lowest failing sequence, since the last check (and clear them)."""
        row_key, seq_key = (int(v) for v in torch.cat([self.bad, self.bad_seq]).tolist())
        if row_key == NO_BAD_ROW and seq_key == NO_BAD_ROW:
            return
        self.bad.fill_(NO_BAD_ROW)
        self.bad_seq.fill_(NO_BAD_ROW)
        if row_key != NO_BAD_ROW:
            row, reason = divmod(row_key, 4)
            raise InputError(
                f"{self._ROW_REASONS[reason]} in row {row} (inside a CUDA-graph prefill; its "
                "sequence was not cached)"
            )
        seq, flags = divmod(seq_key, 4)
        raise InputError(
            f"positions / cache_slots: sequence {seq}: {self._SEQ_REASONS[flags]} (inside a "
            "CUDA-graph prefill; the sequence was not cached)"
        )
