"""The DeepSeek-V4 MTP draft layer (``docs/semantics.md``, "The MTP layer end to end").

``MTPLayer.forward`` maps (shifted token ids, target positions, the target's flat pre-hc_head
residual) to the MTP's own flat pre-hc_head residual ``(T, hc_mult * D)``; ``compute_logits``
applies ``hc_head`` -> the MTP's ``norm`` -> the shared LM head; ``draft`` runs k-step
speculation, re-feeding its own residual, the drafted token and position + 1.

Every documented divergence between DeepSeek's release and vLLM is a :class:`Semantics` switch;
a preset bundles them.  The table of presets and what each switch changes in the math are in
``docs/semantics.md`` ("Presets and switches").  ``math`` (the default) is the exact math on
dequantized weights: the oracle other implementations are compared against in float64.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import torch

from dsv4mtp.checkpoint.weights import MTPCheckpoint
from dsv4mtp.checks import (
    FLOAT_DTYPES,
    check_device_arg,
    check_dtype_arg,
    check_finite_at,
    check_int,
    check_step,
    compute_dtype,
)
from dsv4mtp.config import DSV4Config
from dsv4mtp.errors import ConfigError, InputError
from dsv4mtp.kv_cache import KVCache
from dsv4mtp.params import MTPLayerParams, build_layer_params
from dsv4mtp.semantics import PRESETS, Semantics, resolve_semantics

from .attention import attention
from .linear import linear
from .mhc import hc_head, hc_post, hc_pre
from .moe import moe
from .norm import rms_norm

__all__ = ["PRESETS", "MTPLayer", "MTPLayerParams", "Semantics", "resolve_semantics"]


class MTPLayer:
    """The MTP draft layer(s) of a DeepSeek-V4 checkpoint, in one activation dtype.

    Build with :meth:`from_checkpoint` (a directory), :meth:`from_loaded` (an already loaded
    :class:`MTPCheckpoint`) or the constructor (dense :class:`MTPLayerParams`, e.g. in tests).
    ``layers[i]`` is ``mtp.{i}``; speculative step k uses ``layers[k % num_nextn_predict_layers]``.
    """

    def __init__(
        self,
        config: DSV4Config,
        layers: Sequence[MTPLayerParams],
        embed: torch.Tensor,
        *,
        semantics: Semantics | None = None,
        dtype: torch.dtype = torch.bfloat16,
        info: dict[str, Any] | None = None,
    ) -> None:
        check_dtype_arg("dtype", dtype, FLOAT_DTYPES, ConfigError)
        if not isinstance(config, DSV4Config):
            raise ConfigError(f"config: expected a DSV4Config, got {type(config).__name__}")
        if not isinstance(embed, torch.Tensor):
            raise ConfigError(f"embed: expected a torch.Tensor, got {type(embed).__name__}")
        if semantics is not None and not isinstance(semantics, Semantics):
            raise ConfigError(
                f"semantics: expected a Semantics (see resolve_semantics), got "
                f"{type(semantics).__name__}"
            )
        if not all(isinstance(p, MTPLayerParams) for p in layers):
            raise ConfigError("layers: expected a sequence of MTPLayerParams")
        if len(layers) != config.num_nextn_predict_layers:
            raise ConfigError(
                f"layers: expected num_nextn_predict_layers={config.num_nextn_predict_layers}, got {len(layers)}"
            )
        if embed.shape != (config.vocab_size, config.hidden_size):
            raise ConfigError(
                f"embed: expected shape {(config.vocab_size, config.hidden_size)}, got {tuple(embed.shape)}"
            )
        self.config = config
        self.layers = list(layers)
        self.embed = embed.to(dtype)
        self.semantics = semantics or PRESETS["math"]
        self.dtype = dtype
        self.device = embed.device
        self.info: dict[str, Any] = dict(info or {})

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_loaded(
        cls,
        checkpoint: MTPCheckpoint,
        *,
        preset: str = "math",
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        **switches: Any,
    ) -> MTPLayer:
        """From :func:`load_mtp_checkpoint`'s result: dense weights are dequantized once into
        ``dtype``; routed experts stay packed and are decoded per selected expert."""
        if not isinstance(checkpoint, MTPCheckpoint):
            raise ConfigError(
                f"checkpoint: expected an MTPCheckpoint (load_mtp_checkpoint's result), got "
                f"{type(checkpoint).__name__}"
            )
        check_dtype_arg("dtype", dtype, FLOAT_DTYPES, ConfigError)
        device = check_device_arg("device", device, ConfigError)
        if checkpoint.tp_size != 1:
            raise ConfigError(
                f"tp_size: the reference runs every head on one device, got {checkpoint.tp_size}"
            )
        semantics = resolve_semantics(preset, **switches)
        cache: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        layers = [build_layer_params(w, dtype, device, cache) for w in checkpoint.layers]
        info = {
            "path": checkpoint.path,
            "expert_formats": checkpoint.expert_formats,
            "dense_formats": sorted({w.e_proj.format for w in checkpoint.layers}),
            "tensors_loaded": len(checkpoint.loaded),
            "embed_source": checkpoint.embed_source,
            "head_source": checkpoint.layers[0].head_source if checkpoint.layers else None,
            "warnings": checkpoint.warnings,
            "preset": preset,
        }
        embed = checkpoint.embed_tokens.to(device=device, dtype=dtype)
        return cls(checkpoint.config, layers, embed, semantics=semantics, dtype=dtype, info=info)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str],
        *,
        preset: str = "math",
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        **switches: Any,
    ) -> MTPLayer:
        """Load ``mtp.*`` (+ the shared embedding and head) from a checkpoint directory."""
        from dsv4mtp.checkpoint.load import load_mtp_checkpoint

        # Fail on a bad argument before reading gigabytes.
        resolve_semantics(preset, **switches)
        check_dtype_arg("dtype", dtype, FLOAT_DTYPES, ConfigError)
        check_device_arg("device", device, ConfigError)
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError(
                f"path: expected a checkpoint directory (str or os.PathLike), got "
                f"{type(path).__name__}"
            )
        return cls.from_loaded(
            load_mtp_checkpoint(os.fspath(path)),
            preset=preset,
            dtype=dtype,
            device=device,
            **switches,
        )

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
                got = (
                    f"{t.dtype} shape {tuple(t.shape)}"
                    if isinstance(t, torch.Tensor)
                    else type(t).__name__
                )
                raise InputError(f"{name}: expected a 1-D int64 tensor, got {got}")
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
        # A NaN / inf row would flow silently into argmax (token 0) or the KL of compare.
        check_finite_at("prev_hidden", prev_hidden)
        if T and (int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size):
            bad = input_ids[(input_ids < 0) | (input_ids >= cfg.vocab_size)][0]
            raise InputError(
                f"input_ids: expected ids in [0, vocab_size={cfg.vocab_size}), got {int(bad)}"
            )
        if T and int(positions.min()) < 0:
            raise InputError(
                f"positions: expected non-negative positions, got {int(positions.min())}"
            )
        if T and int(positions.max()) >= cfg.max_position_embeddings:
            raise InputError(
                f"positions: expected positions < max_position_embeddings="
                f"{cfg.max_position_embeddings}, got {int(positions.max())}"
            )
        if seq_lens is None:
            return [T]
        if (
            not isinstance(seq_lens, torch.Tensor)
            or seq_lens.dtype != torch.int64
            or seq_lens.dim() != 1
        ):
            got = (
                f"{seq_lens.dtype} shape {tuple(seq_lens.shape)}"
                if isinstance(seq_lens, torch.Tensor)
                else type(seq_lens).__name__
            )
            raise InputError(f"seq_lens: expected a 1-D int64 tensor, got {got}")
        lens = [int(n) for n in seq_lens.tolist()]
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

    def _run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        prev_hidden: torch.Tensor,
        lens: list[int],
        caches: Sequence[KVCache] | None,
        spec_step: int,
    ) -> torch.Tensor:
        """:meth:`forward` on checked arguments."""
        cfg, sem = self.config, self.semantics
        p = self.layers[spec_step % len(self.layers)]
        T, n, D, eps = input_ids.shape[0], cfg.hc_mult, cfg.hidden_size, cfg.rms_norm_eps
        if T == 0:
            return prev_hidden.new_zeros(0, n * D)
        hc: dict[str, Any] = dict(
            rms_norm_eps=eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters
        )
        q_dense = sem.act_quant and p.dense_quantized

        e = self.embed[input_ids]  # (T, D)
        if sem.mask_pos0:
            e = torch.where(positions[:, None] == 0, torch.zeros_like(e), e)
        e = rms_norm(e, p.enorm, eps, order=sem.norm_order)
        h = rms_norm(prev_hidden.view(T, n, D), p.hnorm, eps, order=sem.norm_order)  # per stream
        x = (
            linear(h, p.h_proj, act_quant=q_dense)
            + linear(e, p.e_proj, act_quant=q_dense)[:, None, :]
        )

        # attention sublayer: hc_pre -> attn_norm -> attention -> hc_post (the MoE one alike)
        a_in, post, comb = hc_pre(x, p.hc_attn_fn, p.hc_attn_scale, p.hc_attn_base, **hc)
        a = attention(
            rms_norm(a_in, p.attn_norm, eps, order=sem.norm_order),
            positions,
            p.attn,
            cfg,
            seq_lens=lens,
            kv_cache=caches,
            rope_mode=sem.rope_mode,
            fp8_kv=sem.fp8_kv,
            act_quant=q_dense,
            norm_order=sem.norm_order,
        )
        x = hc_post(a, x, post, comb)  # (T, n, D)

        # MoE sublayer
        f_in, post, comb = hc_pre(x, p.hc_ffn_fn, p.hc_ffn_scale, p.hc_ffn_base, **hc)
        f = moe(
            rms_norm(f_in, p.ffn_norm, eps, order=sem.norm_order),
            p.ffn,
            cfg,
            shared_clamp=sem.shared_clamp,
            act_quant=sem.act_quant,
        )
        x = hc_post(f, x, post, comb)
        return x.reshape(T, n * D)

    def compute_logits(self, hidden: torch.Tensor, *, spec_step: int = 0) -> torch.Tensor:
        """hidden (T, hc_mult*D) -> logits (T, vocab).

        hc_head with the MTP's own ``hc_head_*``, the MTP's ``norm``, then the shared head in
        fp32 as the official ``ParallelHead`` (float64 when the layer runs in float64, so the
        oracle stays exact).  The head is applied in vocab chunks to bound temporary memory.
        spec_step picks the layer as in :meth:`forward`.
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

    def _logits(self, hidden: torch.Tensor, spec_step: int) -> torch.Tensor:
        """:meth:`compute_logits` on a checked ``hidden``."""
        cfg = self.config
        p = self.layers[spec_step % len(self.layers)]
        T = hidden.shape[0]
        cd = compute_dtype(self.dtype)
        y = hc_head(
            hidden.view(T, cfg.hc_mult, cfg.hidden_size),
            p.hc_head_fn,
            p.hc_head_scale,
            p.hc_head_base,
            rms_norm_eps=cfg.rms_norm_eps,
            hc_eps=cfg.hc_eps,
        )  # (T, D)
        y = rms_norm(y, p.norm, cfg.rms_norm_eps, order=self.semantics.norm_order).to(cd)
        chunk = 16384
        parts = [y @ p.head[v : v + chunk].to(cd).T for v in range(0, cfg.vocab_size, chunk)]
        return torch.cat(parts, dim=1)  # (T, V)

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
        if forced_tokens is not None:
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
        caches = [[self.new_kv_cache() for _ in range(B)] for _ in self.layers]
        last = torch.tensor(lens, device=self.device).cumsum(0) - 1  # (B,) last row per sequence
        ids, pos, prev = input_ids, positions, prev_hidden
        step_lens = lens
        drafted, step_logits = [], []
        for k in range(num_tokens):
            layer = k % len(self.layers)
            # Every argument, forced token and fed position was checked above.
            hidden = self._run(ids, pos, prev, step_lens, caches[layer], k)
            if k == 0:
                hidden, pos = hidden[last], pos[last]
            logits = self._logits(hidden, k)  # (B, V)
            if forced_tokens is not None:
                token = forced_tokens[:, k].to(self.device)
            elif greedy:
                token = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = torch.multinomial(probs, 1, generator=generator)[:, 0]
            drafted.append(token)
            step_logits.append(logits)
            ids, pos, prev = token, pos + 1, hidden
            step_lens = [1] * B
        tokens = torch.stack(drafted, dim=1)  # (B, num_tokens)
        if return_logits:
            return tokens, torch.stack(step_logits, dim=1)
        return tokens
