"""H200 (sm_90) implementations of the ``dsv4mtp.reference`` public functions.

Same names, same signatures.  FlashInfer kernels where FlashInfer has sm_90 ones, Triton kernels
where it does not; every Triton kernel also runs under ``TRITON_INTERPRET=1`` on CPU tensors.
Triton is optional (the ``gpu`` extra): without it this module imports, and calling an op raises
an :class:`~dsv4mtp.errors.InputError` that says what to install.
"""

__all__: list[str] = []

from .attention import (
    AttentionPack,
    attention,
    pack_attention,
    pack_attention_weights,
    sink_attention,
    sink_attention_cache,
    sink_attention_varlen,
)
from .kv_cache import DeviceKVCache
from .linear import LinearPack, eh_proj, grouped_linear, linear, pack_linear
from .mhc import CollapseSchedule, hc_head, hc_post, hc_post_head, hc_post_pre, hc_pre
from .moe import MoEPack, fused_experts, moe, pack_moe, route
from .mtp import MTPLayer, MTPLayerPack
from .norm import embed_norms, rms_norm
from .rope import apply_rope, kv_norm_rope, q_head_norm_rope

__all__ += ["CollapseSchedule", "hc_head", "hc_post", "hc_post_head", "hc_post_pre", "hc_pre"]
__all__ += ["embed_norms", "rms_norm"]

__all__ += ["MoEPack", "fused_experts", "moe", "pack_moe", "route"]

__all__ += ["AttentionPack", "attention", "pack_attention", "pack_attention_weights"]
__all__ += ["sink_attention", "sink_attention_varlen"]

__all__ += ["LinearPack", "eh_proj", "grouped_linear", "linear", "pack_linear"]
__all__ += ["apply_rope", "kv_norm_rope", "q_head_norm_rope"]
__all__ += ["MTPLayer", "MTPLayerPack"]
__all__ += ["DeviceKVCache", "sink_attention_cache"]

from .lm_head import HeadPack, lm_head_argmax, lm_head_logits, pack_head  # noqa: E402

__all__ += ["HeadPack", "lm_head_argmax", "lm_head_logits", "pack_head"]

from .attention import sink_attention_paged  # noqa: E402
from .kv_cache import PagedKVCache  # noqa: E402

__all__ += ["PagedKVCache", "sink_attention_paged"]

from .step_guard import step_guard  # noqa: E402

__all__ += ["step_guard"]
