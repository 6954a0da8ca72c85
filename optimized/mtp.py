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

Eager: each call runs the ops one by one with Python in between; the KV caches are the host-side
:class:`KVCache` s the attention op extends; ``draft`` is a host loop over the steps.  Not yet
here (later work): CUDA-graph capture of a decode step, a preallocated device KV cache, an FP8
LM head, device-side non-finite flags instead of the host-syncing input checks, and a greedy
argmax that does not materialise the (T, vocab) logits.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dsv4mtp.checkpoint.weights import MTPCheckpoint, MTPLayerWeights
from dsv4mtp.checks import check_device_arg, check_int
from dsv4mtp.config import DSV4Config
from dsv4mtp.errors import ConfigError, InputError
from dsv4mtp.layer import (
    LayerOps,
    MTPLayerAPI,
    check_layer_args,
    check_loaded,
    load_checked,
    loaded_info,
)
from dsv4mtp.params import MTPLayerParams, build_layer_params
from dsv4mtp.semantics import Semantics

from .attention import AttentionPack, attention, pack_attention, pack_attention_weights
from .kernels._launch import check_device
from .linear import LinearPack, linear, pack_linear
from .mhc import hc_head, hc_post, hc_pre
from .moe import MoEPack, moe, pack_moe
from .norm import rms_norm

__all__ = ["MTPLayer", "MTPLayerPack"]

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
) -> MTPLayerPack:
    """Pack one layer's dense :class:`MTPLayerParams` (once; it allocates).  With the loaded
    ``weights`` it came from, e_proj, h_proj and the attention linears are packed from the
    checkpoint's own weights instead (FP8 stays FP8)."""
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
        ffn=pack_moe(params.ffn, device, max_tokens=max_tokens),
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
        rms_norm=rms_norm, linear=linear, hc_pre=hc_pre, hc_post=hc_post, attention=attention,
        moe=moe,
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
    ) -> None:
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
        **switches: Any,
    ) -> MTPLayer:
        """From :func:`load_mtp_checkpoint`'s result, packed once: the dense linears and the
        attention from the checkpoint's stored weights (FP8 codes and block scales), the routed
        experts in their stored format, the shared expert's FP8 codes.  (The dense copies
        :func:`build_layer_params` makes on the way are dropped once packed.)"""
        dev, semantics = check_loaded(checkpoint, preset, dtype, device, switches, _DTYPES)
        cache: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        bound = _check_bound("max_num_tokens", max_num_tokens)
        layers = [
            pack_layer(build_layer_params(w, dtype, dev, cache), dev, max_tokens=bound, weights=w)
            for w in checkpoint.layers
        ]
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
        **switches: Any,
    ) -> MTPLayer:
        """Load ``mtp.*`` (+ the shared embedding and head) from a checkpoint directory."""
        _check_bound("max_num_tokens", max_num_tokens)
        _check_bound("max_batch", max_batch)
        checkpoint = load_checked(path, preset, dtype, device, switches, _DTYPES)
        return cls.from_loaded(
            checkpoint,
            preset=preset,
            dtype=dtype,
            device=device,
            max_num_tokens=max_num_tokens,
            max_batch=max_batch,
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

    def _logits(self, hidden: torch.Tensor, spec_step: int) -> torch.Tensor:
        """:meth:`compute_logits` on a checked ``hidden`` -> (T, V) fp32.

        ``hc_head`` and ``rms_norm`` (norm) are the optimized ops; the LM head is one cuBLAS
        GEMM of the normed rows (T, D) in the layer dtype and the head (V, D), accumulated in
        fp32 and written in fp32 (``torch.mm(..., out_dtype=float32)`` for bf16 on CUDA: it
        reads the bf16 head once, V*D*2 bytes, 1 GiB at V4-Flash, instead of an fp32 copy).
        Off CUDA, and for an fp32 head, the same products in an fp32 matmul.  The reference
        multiplies the same bf16 values in fp32 in 16384-column chunks, so the two differ only
        in fp32 summation order (conformance/test_mtp_optimized.py declares the tolerance).
        """
        cfg = self.config
        p = self.layers[spec_step % len(self.layers)]
        T = hidden.shape[0]
        y = hc_head(
            hidden.view(T, cfg.hc_mult, cfg.hidden_size),
            p.hc_head_fn,
            p.hc_head_scale,
            p.hc_head_base,
            rms_norm_eps=cfg.rms_norm_eps,
            hc_eps=cfg.hc_eps,
        )  # (T, D)
        y = rms_norm(y, p.norm, cfg.rms_norm_eps, order=self.semantics.norm_order)
        f32 = torch.float32
        if y.is_cuda and y.dtype == p.head.dtype == torch.bfloat16:
            return torch.mm(y, p.head.T, out_dtype=f32)  # (T, V)
        return torch.matmul(y.to(f32), p.head.to(f32).T)  # (T, V)


def _check_bound(name: str, v: object) -> int:
    try:
        return check_int(name, v, 1)
    except InputError as e:
        raise ConfigError(str(e)) from None
