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

import os
from collections.abc import Sequence
from typing import Any

import torch

from dsv4mtp.checkpoint.weights import MTPCheckpoint
from dsv4mtp.checks import compute_dtype
from dsv4mtp.config import DSV4Config
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
from dsv4mtp.semantics import PRESETS, Semantics, resolve_semantics

from .attention import attention
from .linear import eh_proj
from .mhc import hc_head, hc_post, hc_post_head, hc_post_pre, hc_pre
from .moe import moe
from .norm import embed_norms

__all__ = ["PRESETS", "MTPLayer", "MTPLayerParams", "Semantics", "resolve_semantics"]


class MTPLayer(MTPLayerAPI):
    """The MTP draft layer(s) of a DeepSeek-V4 checkpoint, in one activation dtype.

    Build with :meth:`from_checkpoint` (a directory), :meth:`from_loaded` (an already loaded
    :class:`MTPCheckpoint`) or the constructor (dense :class:`MTPLayerParams`, e.g. in tests).
    ``layers[i]`` is ``mtp.{i}``; speculative step k uses ``layers[k % num_nextn_predict_layers]``.
    The checked API (``forward``, ``compute_logits``, ``draft``, ``new_kv_cache``) is
    :class:`~dsv4mtp.layer.MTPLayerAPI`'s, and so is the layer's order (``_run``, one
    definition for both implementations); this class supplies the ops it composes
    (:attr:`ops`: this package's float64-exact ones) and the head (:meth:`_logits`).
    """

    ops = LayerOps(
        hc_pre=hc_pre, hc_post=hc_post, attention=attention,
        moe=moe, hc_post_pre=hc_post_pre, hc_post_head=hc_post_head,
        embed_norms=embed_norms, eh_proj=eh_proj,
    )  # fmt: skip

    def __init__(
        self,
        config: DSV4Config,
        layers: Sequence[MTPLayerParams],
        embed: torch.Tensor,
        *,
        semantics: Semantics | None = None,
        dtype: torch.dtype = torch.bfloat16,
        info: dict[str, Any] | None = None,
        batch_invariant: bool = False,
    ) -> None:
        self.semantics = check_layer_args(config, layers, MTPLayerParams, embed, semantics, dtype)
        self.batch_invariant = check_batch_invariant(batch_invariant)
        self.config = config
        self.layers = list(layers)
        self.embed = embed.to(dtype)
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
        batch_invariant: bool = False,
        **switches: Any,
    ) -> MTPLayer:
        """From :func:`load_mtp_checkpoint`'s result: dense weights are dequantized once into
        ``dtype``; routed experts stay packed and are decoded per selected expert."""
        device, semantics = check_loaded(checkpoint, preset, dtype, device, switches)
        cache: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        layers = [build_layer_params(w, dtype, device, cache) for w in checkpoint.layers]
        embed = checkpoint.embed_tokens.to(device=device, dtype=dtype)
        info = loaded_info(checkpoint, preset)
        return cls(
            checkpoint.config, layers, embed, semantics=semantics, dtype=dtype, info=info,
            batch_invariant=batch_invariant,
        )  # fmt: skip

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str],
        *,
        preset: str = "math",
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        batch_invariant: bool = False,
        **switches: Any,
    ) -> MTPLayer:
        """Load ``mtp.*`` (+ the shared embedding and head) from a checkpoint directory."""
        check_batch_invariant(batch_invariant)
        checkpoint = load_checked(path, preset, dtype, device, switches)
        return cls.from_loaded(
            checkpoint, preset=preset, dtype=dtype, device=device,
            batch_invariant=batch_invariant, **switches,
        )  # fmt: skip

    def _logits(
        self, hidden: torch.Tensor, spec_step: int, head_input: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`compute_logits` on a checked ``hidden``: the shared head in fp32 as the
        official ``ParallelHead`` (float64 when the layer runs in float64, so the oracle stays
        exact), in vocab chunks to bound temporary memory.  ``head_input``: hc_head of
        ``hidden`` through the head's norm from ``_run(head=True)`` (the same functions), else
        computed here."""
        cfg = self.config
        p = self.layers[spec_step % len(self.layers)]
        T = hidden.shape[0]
        cd = compute_dtype(self.dtype)
        y = head_input
        if y is None:
            y = hc_head(
                hidden.view(T, cfg.hc_mult, cfg.hidden_size),
                p.hc_head_fn,
                p.hc_head_scale,
                p.hc_head_base,
                rms_norm_eps=cfg.rms_norm_eps,
                hc_eps=cfg.hc_eps,
                batch_invariant=self.batch_invariant,
                norm_weight=p.norm,
                norm_order=self.semantics.norm_order,
            )  # (T, D): hc_head, then the head's norm
        y = y.to(cd)
        chunk = 16384
        parts = [y @ p.head[v : v + chunk].to(cd).T for v in range(0, cfg.vocab_size, chunk)]
        return torch.cat(parts, dim=1)  # (T, V)
