"""The MTP layer's sliding-window KV cache of one sequence.

What it holds and when rows are dropped: ``docs/semantics.md``, "Attention with sinks".

One type for both implementations: the reference reads and extends it row by row; the optimized
layer keeps its own preallocated buffers and converts from / to this type at its boundary.
"""

from __future__ import annotations

import torch

from dsv4mtp.errors import InputError

__all__ = ["KVCache"]


class KVCache:
    """The MTP layer's KV rows of ONE sequence, bounded to the sliding window.

    Holds the latent rows exactly as attended (after kv_norm, RoPE and optional FP8 rounding) and
    their positions.  :func:`attention` reads it and appends the new rows; rows that no later
    query can see (``pos <= newest - W + 1``) are dropped, so at most ``W - 1`` rows are kept.
    """

    def __init__(self, window: int) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise InputError(f"window: expected an int >= 1, got {window!r}")
        self.window = window
        self.kv: torch.Tensor | None = None  # (N, Dh)
        self.positions: torch.Tensor | None = None  # (N,) int64, strictly increasing

    def __len__(self) -> int:
        return 0 if self.positions is None else int(self.positions.shape[0])

    @property
    def last_position(self) -> int | None:
        return None if not len(self) else int(self.positions[-1])  # type: ignore[index]

    def keys(
        self, new_kv: torch.Tensor, new_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached rows followed by ``new_kv``: ``((N + t, Dh), (N + t,))``."""
        if self.kv is None or self.positions is None:
            return new_kv, new_positions
        if self.kv.shape[1:] != new_kv.shape[1:] or self.kv.dtype != new_kv.dtype:
            raise InputError(
                f"kv_cache: holds rows {tuple(self.kv.shape[1:])} {self.kv.dtype}, "
                f"got new rows {tuple(new_kv.shape[1:])} {new_kv.dtype}"
            )
        return torch.cat([self.kv, new_kv]), torch.cat([self.positions, new_positions])

    def append(self, new_kv: torch.Tensor, new_positions: torch.Tensor) -> None:
        kv, pos = self.keys(new_kv, new_positions)
        if pos.numel():
            keep = pos > pos[-1] - self.window + 1  # visible to the next position
            kv, pos = kv[keep], pos[keep]
        self.kv, self.positions = kv, pos
