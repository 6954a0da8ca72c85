"""What every MTP layer implementation shares: its public API, argument checks and draft loop.

``docs/semantics.md``, "The MTP layer end to end".  :class:`MTPLayerAPI` holds the checked
entry points (:meth:`~MTPLayerAPI.forward`, :meth:`~MTPLayerAPI.compute_logits`,
:meth:`~MTPLayerAPI.draft`, :meth:`~MTPLayerAPI.new_kv_cache`); an implementation
(``dsv4mtp.reference.MTPLayer``, ``dsv4mtp.optimized.MTPLayer``) supplies the ops the layer
composes (:class:`LayerOps`) and the head (``_logits``), and builds itself with the construction
checks below; the layer's order (``_run``) is written once here.  So both compute the same
composition, raise the same errors for the same bad input and draft with the same bookkeeping.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal, NamedTuple, overload

import torch

from dsv4mtp.checkpoint.weights import MTPCheckpoint
from dsv4mtp.checks import (
    FLOAT_DTYPES,
    check_device_arg,
    check_dtype_arg,
    check_finite_at,
    check_int,
    check_step,
)
from dsv4mtp.config import DSV4Config
from dsv4mtp.errors import ConfigError, InputError
from dsv4mtp.kv_cache import KVCache
from dsv4mtp.semantics import PRESETS, Semantics, resolve_semantics

__all__ = [
    "LayerOps",
    "MTPLayerAPI",
    "check_batch_invariant",
    "check_layer_args",
    "check_loaded",
    "load_checked",
    "loaded_info",
]


# ---------------------------------------------------------------------- construction checks
def check_layer_args(
    config: object,
    layers: Sequence[object],
    layer_type: type | tuple[type, ...],
    embed: object,
    semantics: object,
    dtype: object,
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
) -> Semantics:
    """The constructor's arguments -> the semantics to run (``math`` when None).

    ``layers``: one ``layer_type`` (or one of a tuple of types) per MTP layer; ``embed`` (vocab_size, hidden_size)."""
    check_dtype_arg("dtype", dtype, dtypes, ConfigError)
    if not isinstance(config, DSV4Config):
        raise ConfigError(f"config: expected a DSV4Config, got {type(config).__name__}")
    if not isinstance(embed, torch.Tensor):
        raise ConfigError(f"embed: expected a torch.Tensor, got {type(embed).__name__}")
    if semantics is not None and not isinstance(semantics, Semantics):
        raise ConfigError(
            f"semantics: expected a Semantics (see resolve_semantics), got "
            f"{type(semantics).__name__}"
        )
    if not all(isinstance(p, layer_type) for p in layers):
        types = layer_type if isinstance(layer_type, tuple) else (layer_type,)
        names = " or ".join(t.__name__ for t in types)
        raise ConfigError(f"layers: expected a sequence of {names}")
    if len(layers) != config.num_nextn_predict_layers:
        raise ConfigError(
            f"layers: expected num_nextn_predict_layers={config.num_nextn_predict_layers}, got {len(layers)}"
        )
    if embed.shape != (config.vocab_size, config.hidden_size):
        raise ConfigError(
            f"embed: expected shape {(config.vocab_size, config.hidden_size)}, got {tuple(embed.shape)}"
        )
    return semantics or PRESETS["math"]


def check_batch_invariant(v: object) -> bool:
    """The layer's ``batch_invariant`` switch: a bool (a ConfigError otherwise)."""
    if not isinstance(v, bool):
        raise ConfigError(f"batch_invariant: expected a bool, got {type(v).__name__}")
    return v


def check_loaded(
    checkpoint: object,
    preset: str,
    dtype: object,
    device: object,
    switches: dict[str, Any],
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
) -> tuple[torch.device, Semantics]:
    """``from_loaded``'s arguments -> (device, semantics)."""
    if not isinstance(checkpoint, MTPCheckpoint):
        raise ConfigError(
            f"checkpoint: expected an MTPCheckpoint (load_mtp_checkpoint's result), got "
            f"{type(checkpoint).__name__}"
        )
    check_dtype_arg("dtype", dtype, dtypes, ConfigError)
    dev = check_device_arg("device", device, ConfigError)
    if checkpoint.tp_size != 1:
        raise ConfigError(
            f"tp_size: the MTP layer runs every head on one device, got {checkpoint.tp_size}"
        )
    return dev, resolve_semantics(preset, **switches)


def loaded_info(checkpoint: MTPCheckpoint, preset: str) -> dict[str, Any]:
    """What a layer built from ``checkpoint`` reports in its ``info``."""
    return {
        "path": checkpoint.path,
        "expert_formats": checkpoint.expert_formats,
        "dense_formats": sorted({w.e_proj.format for w in checkpoint.layers}),
        "tensors_loaded": len(checkpoint.loaded),
        "embed_source": checkpoint.embed_source,
        "head_source": checkpoint.layers[0].head_source if checkpoint.layers else None,
        "warnings": checkpoint.warnings,
        "preset": preset,
    }


def load_checked(
    path: object,
    preset: str,
    dtype: object,
    device: object,
    switches: dict[str, Any],
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
) -> MTPCheckpoint:
    """``from_checkpoint``: every argument checked before reading gigabytes, then the load."""
    from dsv4mtp.checkpoint.load import load_mtp_checkpoint

    resolve_semantics(preset, **switches)
    check_dtype_arg("dtype", dtype, dtypes, ConfigError)
    check_device_arg("device", device, ConfigError)
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(
            f"path: expected a checkpoint directory (str or os.PathLike), got {type(path).__name__}"
        )
    return load_mtp_checkpoint(os.fspath(path))


def _describe(t: object) -> str:
    return f"{t.dtype} shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


# ---------------------------------------------------------------------- the ops a layer composes
class LayerOps(NamedTuple):
    """The ops an implementation's layer runs, each with the op pairs' one signature: the
    reference's (float64-exact PyTorch) or the optimized ones (Triton kernels).

    ``hc_post_pre`` (the attention sublayer's hc_post, then the MoE sublayer's hc_pre),
    ``hc_post_head`` (the layer's last hc_post, then hc_head), ``embed_norms`` (the
    embedding gather through enorm beside hnorm over the previous hidden streams) and
    ``eh_proj`` (h_proj per stream plus e_proj broadcast to every stream) are the op pairs
    the layer runs back to back: the reference's are the plain compositions of its ops,
    the optimized ones fuse where it pays."""

    hc_pre: Callable[..., Any]
    hc_post: Callable[..., torch.Tensor]
    attention: Callable[..., torch.Tensor]
    moe: Callable[..., torch.Tensor]
    hc_post_pre: Callable[..., Any]
    hc_post_head: Callable[..., Any]
    embed_norms: Callable[..., Any]
    eh_proj: Callable[..., torch.Tensor]


# ---------------------------------------------------------------------- the checked API
class MTPLayerAPI:
    """The checked public API of an MTP layer; subclasses supply ``_run`` and ``_logits``.

    A subclass sets ``config``, ``semantics``, ``dtype`` (the activation dtype), ``device``,
    ``info``, ``layers``, ``embed`` and the class attribute ``ops``.  Speculative step k uses
    MTP layer ``k % num_nextn_predict_layers``.
    """

    config: DSV4Config
    semantics: Semantics
    dtype: torch.dtype
    device: torch.device
    info: dict[str, Any]
    #: one parameter object per MTP layer, with the fields ``_run`` reads (``MTPLayerParams``
    #: in the reference, the optimized packs there); the embedding (vocab, hidden) in ``dtype``
    layers: list[Any]
    embed: torch.Tensor

    # ------------------------------------------------------------------ the layer
    #: the ops this implementation composes (set by each subclass)
    ops: ClassVar[LayerOps]
    #: every op runs its T-independent schedule (each op's ``batch_invariant``): a row's bits
    #: then do not depend on the other rows of the call, at some cost in speed
    batch_invariant: bool = False

    @overload
    def _run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        prev_hidden: torch.Tensor,
        lens: list[int] | None,
        caches: Sequence[KVCache] | Any,
        spec_step: int,
        *,
        attn_extra: dict[str, Any] | None = None,
        moe_extra: dict[str, Any] | None = None,
        head: Literal[False] = False,
    ) -> torch.Tensor: ...

    @overload
    def _run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        prev_hidden: torch.Tensor,
        lens: list[int] | None,
        caches: Sequence[KVCache] | Any,
        spec_step: int,
        *,
        attn_extra: dict[str, Any] | None = None,
        moe_extra: dict[str, Any] | None = None,
        head: Literal[True],
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def _run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        prev_hidden: torch.Tensor,
        lens: list[int] | None,
        caches: Sequence[KVCache] | Any,
        spec_step: int,
        *,
        attn_extra: dict[str, Any] | None = None,
        moe_extra: dict[str, Any] | None = None,
        head: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` on checked arguments: the layer's order (docs/semantics.md, "The MTP
        layer end to end") over the implementation's :attr:`ops`.  ``attn_extra`` /
        ``moe_extra``: keyword arguments an implementation adds to its own attention / MoE op
        (the optimized layer's device KV cache slots and padding-row mask).  ``head=True``
        returns ``(hidden (T, nD), head_input (T, D))``, head_input = hc_head of the output
        with the layer's ``hc_head_*`` through its ``norm`` (the rows the LM head reads), from
        the ``hc_post_head`` pair.  ``lens``: the sequences' lengths, passed to the attention as
        ``seq_lens`` (None where ``attn_extra`` gives the attention its offsets itself)."""
        cfg, sem, o = self.config, self.semantics, self.ops
        p = self.layers[spec_step % len(self.layers)]
        T, n, D, eps = input_ids.shape[0], cfg.hc_mult, cfg.hidden_size, cfg.rms_norm_eps
        if T == 0:
            empty = prev_hidden.new_zeros(0, n * D)
            return (empty, prev_hidden.new_zeros(0, D)) if head else empty
        bi = {"batch_invariant": self.batch_invariant}  # every op's schedule switch
        hc: dict[str, Any] = dict(
            rms_norm_eps=eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters, **bi
        )
        q_dense = sem.act_quant and p.dense_quantized

        # the embedding through enorm (zeroed at position 0 under mask_pos0), the previous
        # hidden streams through hnorm: one op pair
        e, h = o.embed_norms(
            input_ids,
            positions,
            self.embed,
            prev_hidden.view(T, n, D),
            p.enorm,
            p.hnorm,
            eps,
            order=sem.norm_order,
            mask_pos0=sem.mask_pos0,
            **bi,
        )  # fmt: skip  (T, D), (T, n, D)
        # h_proj per stream plus e_proj broadcast to every stream: one op pair
        x = o.eh_proj(e, h, p.e_proj, p.h_proj, act_quant=q_dense, **bi)  # (T, n, D)

        # attention sublayer: hc_pre -> attn_norm -> attention -> hc_post (the MoE one alike);
        # each collapse op ends in the norm that follows it (its norm_weight)
        a_in, post, comb = o.hc_pre(
            x,
            p.hc_attn_fn,
            p.hc_attn_scale,
            p.hc_attn_base,
            norm_weight=p.attn_norm,
            norm_order=sem.norm_order,
            **hc,
        )  # fmt: skip  (T, D) after attn_norm
        a = o.attention(
            a_in,
            positions,
            p.attn,
            cfg,
            seq_lens=lens,
            kv_cache=caches,
            rope_mode=sem.rope_mode,
            fp8_kv=sem.fp8_kv,
            act_quant=q_dense,
            norm_order=sem.norm_order,
            **bi,
            **(attn_extra or {}),
        )
        # attention's hc_post, then the MoE sublayer's hc_pre, as one op pair
        x, f_in, post, comb = o.hc_post_pre(
            a,
            x,
            post,
            comb,
            p.hc_ffn_fn,
            p.hc_ffn_scale,
            p.hc_ffn_base,
            norm_weight=p.ffn_norm,
            norm_order=sem.norm_order,
            **hc,
        )  # fmt: skip  (T, n, D), (T, D) after ffn_norm, (T, n), (T, n, n)

        # MoE sublayer
        f = o.moe(
            f_in,
            p.ffn,
            cfg,
            shared_clamp=sem.shared_clamp,
            act_quant=sem.act_quant,
            **bi,
            **(moe_extra or {}),
        )
        if not head:
            return o.hc_post(f, x, post, comb, **bi).reshape(T, n * D)
        # the last hc_post, then hc_head and the head's norm, as one op pair
        x, y = o.hc_post_head(
            f, x, post, comb, p.hc_head_fn, p.hc_head_scale, p.hc_head_base,
            rms_norm_eps=eps, hc_eps=cfg.hc_eps, norm_weight=p.norm, norm_order=sem.norm_order,
            **bi,
        )  # fmt: skip
        return x.reshape(T, n * D), y  # (T, nD), (T, D): the rows the LM head reads

    # ------------------------------------------------------------------ to implement
    def _logits(
        self, hidden: torch.Tensor, spec_step: int, head_input: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`compute_logits` on a checked ``hidden``; ``head_input`` (T, D): hc_head of
        ``hidden`` through the head's norm when the caller has it (``_run(head=True)``), else
        computed here."""
        raise NotImplementedError

    # ------------------------------------------------------------------ caches
    def new_kv_cache(self) -> KVCache:
        """An empty KV cache for one sequence (one per sequence and per MTP layer)."""
        return KVCache(self.config.sliding_window)

    # ------------------------------------------------------------------ validation
    def _check_inputs(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        prev_hidden: torch.Tensor,
        seq_lens: Any,
    ) -> list[int]:
        cfg = self.config
        for name, t in (("input_ids", input_ids), ("positions", positions)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
                raise InputError(f"{name}: expected a 1-D int64 tensor, got {_describe(t)}")
        T = input_ids.shape[0]
        if positions.shape[0] != T:
            raise InputError(
                f"positions: expected shape ({T},) like input_ids, got {tuple(positions.shape)}"
            )
        if not isinstance(prev_hidden, torch.Tensor) or prev_hidden.dtype != self.dtype:
            got = (
                str(prev_hidden.dtype)
                if isinstance(prev_hidden, torch.Tensor)
                else type(prev_hidden).__name__
            )
            raise InputError(
                f"prev_hidden: expected dtype {self.dtype} (the layer dtype), got {got}"
            )
        if tuple(prev_hidden.shape) != (T, cfg.hc_dim):
            raise InputError(
                f"prev_hidden: expected shape ({T}, {cfg.hc_dim}) = (T, hc_mult*hidden_size), "
                f"got {tuple(prev_hidden.shape)}"
            )
        for name, t in (
            ("input_ids", input_ids),
            ("positions", positions),
            ("prev_hidden", prev_hidden),
        ):
            if t.device != self.device:
                raise InputError(f"{name}: expected device {self.device}, got {t.device}")
        # The value checks read the device once: prev_hidden finite (a NaN / inf row would flow
        # silently into argmax (token 0) or the KL of compare), the ids' and the positions'
        # ranges and the lengths, as a few scalars; a message is built only on failure.
        lens_ok = (
            isinstance(seq_lens, torch.Tensor)
            and seq_lens.dtype == torch.int64
            and seq_lens.dim() == 1
        )
        parts = []
        if T:
            parts = [torch.isfinite(prev_hidden).all().long().view(1)]
            parts += [v.view(1) for v in (*torch.aminmax(input_ids), *torch.aminmax(positions))]
        lens_here = lens_ok and seq_lens.device == self.device
        if lens_here:
            parts.append(seq_lens)
        host = [int(v) for v in torch.cat(parts).tolist()] if parts else []
        if T:
            finite, id_lo, id_hi, pos_lo, pos_hi = host[:5]
            if not finite:
                check_finite_at("prev_hidden", prev_hidden)
            if id_lo < 0 or id_hi >= cfg.vocab_size:
                bad = input_ids[(input_ids < 0) | (input_ids >= cfg.vocab_size)][0]
                raise InputError(
                    f"input_ids: expected ids in [0, vocab_size={cfg.vocab_size}), got {int(bad)}"
                )
            if pos_lo < 0:
                raise InputError(f"positions: expected non-negative positions, got {pos_lo}")
            if pos_hi >= cfg.max_position_embeddings:
                raise InputError(
                    f"positions: expected positions < max_position_embeddings="
                    f"{cfg.max_position_embeddings}, got {pos_hi}"
                )
        if seq_lens is None:
            return [T]
        if not lens_ok:
            raise InputError(f"seq_lens: expected a 1-D int64 tensor, got {_describe(seq_lens)}")
        lens = host[5 if T else 0 :] if lens_here else [int(n) for n in seq_lens.tolist()]
        if any(n < 0 for n in lens) or sum(lens) != T:
            raise InputError(
                f"seq_lens: expected non-negative lengths summing to T={T}, got {lens}"
            )
        return lens

    def _check_caches(self, kv_cache: object, B: int) -> list[KVCache] | None:
        if kv_cache is None:
            return None
        if isinstance(kv_cache, KVCache):
            caches = [kv_cache]
        elif isinstance(kv_cache, (list, tuple)):
            caches = list(kv_cache)
        else:
            raise InputError(
                f"kv_cache: expected a KVCache or a list of KVCache (one per sequence), got "
                f"{type(kv_cache).__name__}"
            )
        if len(caches) != B:
            raise InputError(f"kv_cache: expected {B} caches (one per sequence), got {len(caches)}")
        W = self.config.sliding_window
        for b, c in enumerate(caches):
            if not isinstance(c, KVCache):
                raise InputError(
                    f"kv_cache[{b}]: expected a KVCache (layer.new_kv_cache()), got "
                    f"{type(c).__name__}"
                )
            if c.window != W:
                raise InputError(
                    f"kv_cache[{b}]: expected window sliding_window={W}, got {c.window}"
                )
        return caches

    # ------------------------------------------------------------------ the layer
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        prev_hidden: torch.Tensor,
        *,
        seq_lens: torch.Tensor | None = None,
        kv_cache: KVCache | Sequence[KVCache] | None = None,
        spec_step: int = 0,
    ) -> torch.Tensor:
        """One MTP pass -> the flat pre-hc_head residual ``(T, hc_mult*D)``.

        input_ids (T,) int64, already shifted: row p carries t_{p+1} (``docs/semantics.md``,
        "The MTP layer end to end"); positions (T,) int64, the target positions; prev_hidden
        (T, hc_mult*D) in the layer dtype; seq_lens (B,) int64 summing to T (default: one
        sequence); kv_cache: one :class:`KVCache` per sequence (a single cache for B = 1),
        extended in place.  spec_step: the speculative step, an int >= 0; it runs layer
        ``spec_step % num_nextn_predict_layers``, so steps past the last MTP layer reuse the
        layers in turn (vLLM's rule; :meth:`draft` relies on it).  A negative, bool or non-int
        step is an :class:`InputError` rather than a wrapped index.
        """
        check_step("spec_step", spec_step)
        lens = self._check_inputs(input_ids, positions, prev_hidden, seq_lens)
        caches = self._check_caches(kv_cache, len(lens))
        return self._run(input_ids, positions, prev_hidden, lens, caches, spec_step)

    __call__ = forward

    def compute_logits(self, hidden: torch.Tensor, *, spec_step: int = 0) -> torch.Tensor:
        """hidden (T, hc_mult*D) -> logits (T, vocab).

        hc_head with the MTP's own ``hc_head_*``, the MTP's ``norm``, then the shared LM head
        (the implementation's docstring of ``_logits`` says in which precision).  spec_step
        picks the layer as in :meth:`forward`.
        """
        check_step("spec_step", spec_step)
        cfg = self.config
        if not isinstance(hidden, torch.Tensor) or hidden.dtype != self.dtype:
            got = hidden.dtype if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise InputError(f"hidden: expected dtype {self.dtype} (the layer dtype), got {got}")
        if hidden.dim() != 2 or hidden.shape[1] != cfg.hc_dim:
            raise InputError(f"hidden: expected shape (T, {cfg.hc_dim}), got {tuple(hidden.shape)}")
        if hidden.device != self.device:
            raise InputError(f"hidden: expected device {self.device}, got {hidden.device}")
        check_finite_at("hidden", hidden)
        return self._logits(hidden, spec_step)

    def _check_draft(
        self,
        lens: list[int],
        positions: torch.Tensor,
        num_tokens: int,
        forced_tokens: torch.Tensor | None,
    ) -> None:
        """The draft-only checks, after :meth:`_check_inputs`."""
        cfg = self.config
        if any(n < 1 for n in lens):
            raise InputError(
                f"seq_lens: every sequence needs at least one row to draft from, got {lens}"
            )
        B = len(lens)
        # Step k feeds position + k of each sequence's last row.
        last_pos = int(positions[torch.tensor(lens).cumsum(0) - 1].max())
        if last_pos + num_tokens - 1 >= cfg.max_position_embeddings:
            raise InputError(
                f"positions: drafting {num_tokens} token(s) from position {last_pos} feeds "
                f"position {last_pos + num_tokens - 1}, expected < max_position_embeddings="
                f"{cfg.max_position_embeddings}"
            )
        if forced_tokens is None:
            return
        if not isinstance(forced_tokens, torch.Tensor) or forced_tokens.dtype != torch.int64:
            got = (
                str(forced_tokens.dtype)
                if isinstance(forced_tokens, torch.Tensor)
                else type(forced_tokens).__name__
            )
            raise InputError(f"forced_tokens: expected an int64 tensor, got {got}")
        if tuple(forced_tokens.shape) != (B, num_tokens):
            raise InputError(
                f"forced_tokens: expected shape ({B}, {num_tokens}), got {tuple(forced_tokens.shape)}"
            )
        out_of_vocab = (forced_tokens < 0) | (forced_tokens >= cfg.vocab_size)
        if bool(out_of_vocab.any()):
            b, k = out_of_vocab.nonzero()[0].tolist()
            raise InputError(
                f"forced_tokens: expected ids in [0, vocab_size={cfg.vocab_size}), got "
                f"{int(forced_tokens[b, k])} at row {b}, step {k}"
            )

    @torch.no_grad()
    def draft(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        prev_hidden: torch.Tensor,
        *,
        seq_lens: torch.Tensor | None = None,
        num_tokens: int,
        greedy: bool = True,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        return_logits: bool = False,
        forced_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """k-step speculation -> drafted ids (B, num_tokens) for the last row of each sequence
        (+ logits (B, num_tokens, vocab) with ``return_logits``).

        Step 0 runs all rows; step k >= 1 feeds, per sequence, the token drafted at step k-1,
        position + 1 and the MTP's own residual of that row, through layer
        ``k % num_nextn_predict_layers``.  Each layer has its own KV caches, fresh per call, holding
        the rows that layer processed: the whole prefix for layer 0, only its own earlier draft
        rows for a later layer.
        ``forced_tokens`` (B, num_tokens): teacher forcing, feed these instead of the layer's own
        picks (the returned ids are then these tokens; used to compare two layers step by step).
        """
        check_int("num_tokens", num_tokens, 1)
        for name, flag in (("greedy", greedy), ("return_logits", return_logits)):
            if not isinstance(flag, bool):
                raise InputError(f"{name}: expected a bool, got {type(flag).__name__} {flag!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise InputError(
                f"generator: expected a torch.Generator or None, got {type(generator).__name__}"
            )
        if not greedy and not (
            isinstance(temperature, (int, float))
            and not isinstance(temperature, bool)
            and math.isfinite(temperature)
            and temperature > 0
        ):
            raise InputError(
                f"temperature: expected a finite number > 0 for sampling, got {temperature!r}"
            )
        lens = self._check_inputs(input_ids, positions, prev_hidden, seq_lens)
        self._check_draft(lens, positions, num_tokens, forced_tokens)
        tokens, logits = self._draft(
            input_ids, positions, prev_hidden, lens, num_tokens, greedy, temperature, generator,
            forced_tokens, return_logits,
        )  # fmt: skip
        return (tokens, logits) if logits is not None else tokens

    def _pick(
        self,
        logits: torch.Tensor,
        k: int,
        greedy: bool,
        temperature: float,
        generator: torch.Generator | None,
        forced_tokens: torch.Tensor | None,
    ) -> torch.Tensor:
        """Step k's fed tokens (B,) from its logits (B, V): forced, greedy or sampled."""
        if forced_tokens is not None:
            return forced_tokens[:, k].to(self.device)
        if greedy:
            return logits.argmax(-1)
        probs = torch.softmax(logits / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

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
        """:meth:`draft` on checked arguments -> (tokens (B, k), logits (B, k, V) if
        ``return_logits`` else None): a host loop over the steps, each through :meth:`_run`
        with fresh host :class:`KVCache` s."""
        B, num_layers = len(lens), self.config.num_nextn_predict_layers
        caches = [[self.new_kv_cache() for _ in range(B)] for _ in range(num_layers)]
        last = torch.tensor(lens, device=self.device).cumsum(0) - 1  # (B,) last row per sequence
        ids, pos, prev = input_ids, positions, prev_hidden
        step_lens = lens
        drafted, step_logits = [], []
        for k in range(num_tokens):
            layer = k % num_layers
            # Every argument, forced token and fed position was checked above.
            if k == 0:  # the prompt rows: the head reads only the last of each sequence
                hidden = self._run(ids, pos, prev, step_lens, caches[layer], k)
                hidden, pos = hidden[last], pos[last]
                logits = self._logits(hidden, k)  # (B, V)
            else:  # one row per sequence: the layer's last hc_post and hc_head as one pair
                hidden, y = self._run(ids, pos, prev, step_lens, caches[layer], k, head=True)
                logits = self._logits(hidden, k, y)
            token = self._pick(logits, k, greedy, temperature, generator, forced_tokens)
            drafted.append(token)
            step_logits.append(logits)
            ids, pos, prev = token, pos + 1, hidden
            step_lens = [1] * B
        logits_out = torch.stack(step_logits, dim=1) if return_logits else None
        return torch.stack(drafted, dim=1), logits_out
