"""Core parameter objects packed once per (object, device): the cache behind the ``params`` of
``moe`` and ``attention``, which accept a core params object or its pack.

A pack is built on the first call that sees the object on a device and reused while the object
lives (a weak reference: the entry goes with it).  Building one allocates and copies, which
cannot happen while a CUDA graph is being captured: such a call is refused with the way out.
An object changed in place after its first call is not re-packed; pass a fresh pack instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from dsv4mtp.errors import InputError

__all__ = ["PACKS", "packed_once"]

P = TypeVar("P")

#: (id(params), device) -> (weak reference to params, its pack)
PACKS: dict[tuple[int, torch.device], tuple[weakref.ref[Any], Any]] = {}


def packed_once(
    params: Any, device: torch.device, pack: Callable[[Any, torch.device], P], how: str
) -> P:
    """``pack(params, device)``, built on the first call and cached while ``params`` lives.
    ``how``: what to do instead during CUDA-graph capture (for the error message)."""
    key = (id(params), device)
    hit = PACKS.get(key)
    if hit is not None and hit[0]() is params:
        return hit[1]  # type: ignore[no-any-return]
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        name = type(params).__name__
        article = "an" if name[0] in "AEIOU" else "a"
        raise InputError(
            f"params: {article} {name} is packed on first use, which cannot happen during "
            f"CUDA-graph capture; {how}"
        )
    packed = pack(params, device)
    PACKS[key] = (weakref.ref(params), packed)
    weakref.finalize(params, PACKS.pop, key, None)
    return packed
