"""One MTP layer's KV rows of many sequences, preallocated on the device: :class:`DeviceKVCache`
(a ring per sequence) and :class:`PagedKVCache` (an engine's block pool, vLLM's convention).

The host :class:`~dsv4mtp.kv_cache.KVCache` concatenates and slices tensors per call and its
owner reads positions on the host, so a decode step that uses it cannot be captured in a CUDA
graph.  This cache is two fixed tensors that every call reads and writes in place, through
device-side indices only: ``kv (S, C, Dh)`` and ``pos (S, C)`` int32.  The math of what is
visible: docs/semantics.md, "Attention with sinks", "KV cache", "The device ring cache" and
"The paged cache".
"""

from __future__ import annotations

import torch

from dsv4mtp.checks import (
    check_device_arg,
    check_dtype_arg,
    check_instance,
    check_int,
    check_positions,
)
from dsv4mtp.config import DSV4Config
from dsv4mtp.errors import ConfigError, InputError
from dsv4mtp.kv_cache import KVCache

from . import _ops  # noqa: F401  (defines the torch.ops.dsv4mtp operators)
from .kernels._launch import KERNEL_DTYPES

__all__ = ["RING_ALIGN", "DeviceKVCache", "PagedKVCache", "check_block_table", "ring_capacity"]

_write_out = torch.ops.dsv4mtp.kv_cache_write_out.default

#: The ring capacity is rounded up to a multiple of this many rows.
RING_ALIGN = 16


def ring_capacity(window: int, max_draft: int) -> int:
    """C = window + max_draft rounded up to a multiple of :data:`RING_ALIGN`."""
    return -(-(window + max_draft) // RING_ALIGN) * RING_ALIGN


def _empty_rows(
    config: DSV4Config, A: int, R: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A store of A x R empty rows for ``config``'s attention: kv (A, R, head_dim) zeros in
    ``dtype``, pos (A, R) int32 -1, and the sliding window; the constructors' shared checks."""
    dt = check_dtype_arg("dtype", dtype, KERNEL_DTYPES)
    dev = check_device_arg("device", device)
    Dh, window = config.head_dim, config.sliding_window
    if Dh % 16:
        raise ConfigError(f"head_dim: expected a multiple of 16 (the kernels' tiles), got {Dh}")
    if window < 1:
        raise ConfigError(f"sliding_window: expected an int >= 1, got {window}")
    kv = torch.zeros((A, R, Dh), dtype=dt, device=dev)
    return kv, torch.full((A, R), -1, dtype=torch.int32, device=dev), window


def _check_store_tensors(kv: object, pos: object, layout: str) -> tuple[int, int, int]:
    """An engine's store: ``kv`` (A, B, Dh) bf16 / fp32 and ``pos`` (A, B) int32, contiguous,
    on kv's device (``layout`` names the dims in the messages) -> (A, B, Dh)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 3 or kv.dtype not in KERNEL_DTYPES:
        got = f"{kv.dtype} {tuple(kv.shape)}" if isinstance(kv, torch.Tensor) else type(kv)
        raise InputError(f"kv: expected a {layout} bfloat16 / float32 tensor, got {got}")
    A, B, Dh = kv.shape
    if not isinstance(pos, torch.Tensor) or pos.dtype != torch.int32:
        got = f"{pos.dtype}" if isinstance(pos, torch.Tensor) else type(pos).__name__
        raise InputError(f"pos: expected an int32 tensor, got {got}")
    if tuple(pos.shape) != (A, B):
        raise InputError(f"pos: expected shape ({A}, {B}) (as kv), got {tuple(pos.shape)}")
    if pos.device != kv.device:
        raise InputError(f"pos: expected device {kv.device} (as kv), got {pos.device}")
    for name, t in (("kv", kv), ("pos", pos)):
        if not t.is_contiguous():
            raise InputError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
    return A, B, Dh


class _RowStore:
    """What both caches are: ``kv (A, R, Dh)`` rows, ``pos (A, R)`` int32 positions (-1 empty)
    and the sliding ``window`` they serve (A x R: rings x capacity, or blocks x block size)."""

    kv: torch.Tensor
    pos: torch.Tensor
    window: int

    @property
    def head_dim(self) -> int:
        return int(self.kv.shape[2])

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def nbytes(self) -> int:
        """Device bytes held: ``A * R * (Dh * itemsize + 4)``."""
        return self.kv.numel() * self.kv.element_size() + self.pos.numel() * 4


class DeviceKVCache(_RowStore):
    """The KV rows of one MTP layer for up to ``num_seqs`` sequences, preallocated on the device.

    ``kv (num_seqs, C, Dh)`` in the layer dtype (bf16 / fp32): the rows exactly as attended
    (after kv_norm, RoPE and, with ``fp8_kv``, the FP8 rounding, stored rounded in that dtype as
    the reference stores them); ``pos (num_seqs, C)`` int32, -1 for an empty row.  Sequence slot
    s is a ring: the row of position p lives at ``kv[s, p % C]`` and ``pos[s, p % C] == p``, so
    writing position p overwrites position ``p - C``.  A query at position q sees the rows with
    ``q - window < pos <= q`` (docs/semantics.md, "Visibility and the sink softmax"): one never
    reads a row that is empty, out of its window or overwritten, so stale data cannot leak.

    Capacity.  ``C >= window + max_draft`` (rounded up to a multiple of 16).  Speculative
    decoding writes up to ``max_draft`` draft positions past the last accepted one, L; a
    rejected draft is undone by :meth:`rollback`, which empties the rows with ``pos > L``.
    Those draft writes overwrote positions ``<= L + max_draft - C <= L - window``, and the next
    query (at L + 1) sees only positions ``> L + 1 - window``: no row it needs was overwritten,
    so decoding after a rollback gives the bits of decoding as if the draft never ran
    ("rollback equals recomputation").  Drafting more than ``max_draft`` positions past the last
    kept one before rolling back breaks that guarantee.

    Device only and capturable: :meth:`write`, :meth:`rollback` and :meth:`reset` take device
    tensors and never read them on the host (an eager call checks slot indices with one host
    read; a call during CUDA-graph capture trusts them).  :meth:`load` and :meth:`to_host`
    convert from / to the host :class:`~dsv4mtp.kv_cache.KVCache` of one sequence (tests,
    engine interop).

    Integration point: an engine that owns its memory hands its own tensors to
    :meth:`from_tensors`; the layer then reads and writes them in place.
    """

    def __init__(
        self,
        config: DSV4Config,
        *,
        num_seqs: int,
        max_draft: int = 8,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        check_instance("config", config, DSV4Config)
        check_int("num_seqs", num_seqs, 1)
        check_int("max_draft", max_draft, 0)
        C = ring_capacity(config.sliding_window, max_draft)
        self._init(*_empty_rows(config, num_seqs, C, dtype, device))

    @classmethod
    def from_tensors(cls, kv: torch.Tensor, pos: torch.Tensor, window: int) -> DeviceKVCache:
        """A cache over an engine's own tensors (read and written in place, never copied):
        ``kv (S, C, Dh)`` bf16 / fp32 and ``pos (S, C)`` int32, both contiguous on one device,
        Dh a multiple of 16, ``C >= window`` (``C >= window + max_draft`` for the rollback
        guarantee); ``pos`` -1 in empty rows and p in row ``p % C`` otherwise."""
        check_int("window", window, 1)
        S, C, Dh = _check_store_tensors(kv, pos, "(S, C, Dh)")
        if S < 1 or Dh < 16 or Dh % 16:
            raise InputError(
                f"kv: expected S >= 1 sequences and Dh a multiple of 16, got {tuple(kv.shape)}"
            )
        if window > C:
            raise InputError(f"kv: expected a capacity C >= window={window} rows, got C={C}")
        obj = cls.__new__(cls)
        obj._init(kv, pos, window)
        return obj

    def _init(self, kv: torch.Tensor, pos: torch.Tensor, window: int) -> None:
        self.kv, self.pos, self.window = kv, pos, window

    # ------------------------------------------------------------------ properties
    @property
    def num_seqs(self) -> int:
        return int(self.kv.shape[0])

    @property
    def capacity(self) -> int:
        """C, the ring's rows per sequence."""
        return int(self.kv.shape[1])

    @property
    def max_draft(self) -> int:
        """Draft positions past the last kept one that a rollback can undo: C - window."""
        return self.capacity - self.window

    def __repr__(self) -> str:
        return (
            f"DeviceKVCache(num_seqs={self.num_seqs}, capacity={self.capacity}, "
            f"window={self.window}, head_dim={self.head_dim}, dtype={self.dtype}, "
            f"device={self.device})"
        )

    # ------------------------------------------------------------------ device-side updates
    def _slots(self, name: str, slots: object, length: int | None = None) -> torch.Tensor:
        check_positions(name, slots, length)
        assert isinstance(slots, torch.Tensor)
        if slots.device != self.device:
            raise InputError(
                f"{name}: expected device {self.device} (the cache's), got {slots.device}"
            )
        return slots

    def check_slots(self, name: str, slots: torch.Tensor) -> None:
        """Eager only (one host read; nothing while a CUDA graph is captured): every slot is
        < num_seqs (a negative slot is padding)."""
        if _capturing(slots):
            return
        if slots.numel() and int(slots.max()) >= self.num_seqs:
            raise InputError(
                f"{name}: expected slot indices < num_seqs={self.num_seqs} (negative: padding), "
                f"got {[int(s) for s in slots.tolist()]}"
            )

    def write(self, kv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Row t of ``kv (T, Dh)`` at ``positions[t]`` into the ring of ``slots[t]`` (device
        tensors, T each); rows with a negative slot (padding) or position write nothing.  The
        rows' (slot, position % C) must be distinct; the caller keeps positions increasing.
        One launch (``torch.ops.dsv4mtp.kv_cache_write_out``) moving T * (2 * Dh * itemsize
        + 4) bytes plus the slots and positions, capturable."""
        if not isinstance(kv, torch.Tensor) or kv.dim() != 2 or kv.shape[1] != self.head_dim:
            got = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
            raise InputError(f"kv: expected shape (T, {self.head_dim}), got {got}")
        if kv.dtype != self.dtype or kv.device != self.device:
            raise InputError(
                f"kv: expected {self.dtype} on {self.device} (the cache's), got {kv.dtype} on "
                f"{kv.device}"
            )
        T = kv.shape[0]
        check_positions("positions", positions, T)
        slots = self._slots("slots", slots, T)
        if positions.device != self.device:
            raise InputError(f"positions: expected device {self.device}, got {positions.device}")
        self.check_slots("slots", slots)
        if T:
            _write_out(kv, positions, slots, cache_kv=self.kv, cache_pos=self.pos)

    def rollback(self, slots: torch.Tensor, last_kept: torch.Tensor) -> None:
        """Empty, in the ring of each ``slots[b]``, the rows with ``pos > last_kept[b]``
        (device tensors (B,); a negative slot is padding; ``last_kept < 0`` empties the slot;
        a slot listed twice keeps the smaller bound).  No host read, capturable."""
        slots = self._slots("slots", slots)
        last_kept = self._slots("last_kept", last_kept, slots.shape[0])
        self.check_slots("slots", slots)
        S = self.num_seqs
        index = torch.where(slots >= 0, slots.long(), S)  # padding -> the spare entry S
        limit = torch.full((S + 1,), 2**31 - 1, dtype=torch.int64, device=self.device)
        limit.scatter_reduce_(0, index, last_kept.long(), reduce="amin")
        self.pos.masked_fill_(self.pos > limit[:S, None], -1)

    def reset(self, slots: torch.Tensor | None = None) -> None:
        """Empty every row (``slots`` None) or the rings of ``slots`` (a device tensor (B,),
        negative entries ignored).  Device only, capturable."""
        if slots is None:
            self.pos.fill_(-1)
            return
        slots = self._slots("slots", slots)
        self.rollback(slots, torch.full_like(slots, -1))

    # ------------------------------------------------------------------ host interop
    def _slot_index(self, slot: object) -> int:
        s = check_int("slot", slot, 0)
        if s >= self.num_seqs:
            raise InputError(f"slot: expected an int < num_seqs={self.num_seqs}, got {s}")
        return s

    def load(self, slot: int, host: KVCache) -> None:
        """Replace ring ``slot`` with the rows of a host :class:`KVCache` (eager: host reads)."""
        s = self._slot_index(slot)
        check_instance("host", host, KVCache)
        if host.window != self.window:
            raise InputError(f"host: expected a KVCache of window {self.window}, got {host.window}")
        self.pos[s] = -1
        if host.kv is None or host.positions is None or not len(host):
            return
        kv, positions = host.kv.to(self.device), host.positions.to(self.device)
        if kv.dtype != self.dtype:
            raise InputError(f"host: expected rows in {self.dtype} (the cache's), got {kv.dtype}")
        keep = positions > positions[-1] - self.capacity  # distinct rows p % C
        kv, positions = kv[keep].contiguous(), positions[keep]
        self.write(kv, positions, torch.full_like(positions, s))

    def to_host(self, slot: int) -> KVCache:
        """Ring ``slot`` as a host :class:`KVCache`: its rows ordered by position, only those
        the next position can see (``pos > newest - window + 1``), as KVCache keeps them.
        The tensors stay on the cache's device."""
        s = self._slot_index(slot)
        out = KVCache(self.window)
        pos = self.pos[s].long()  # (C,)
        present = pos >= 0
        if not bool(present.any()):
            return out
        newest = int(pos.max())
        order = torch.argsort(torch.where(present, pos, newest + 1))
        keep = order[: int(present.sum())]
        keep = keep[pos[keep] > newest - self.window + 1]
        out.kv, out.positions = self.kv[s, keep].clone(), pos[keep].clone()
        return out


class PagedKVCache(_RowStore):
    """The KV rows of one MTP layer in an engine's block pool, addressed as vLLM addresses them.

    ``kv (num_blocks, block_size, Dh)`` in the layer dtype (the rows exactly as attended, as
    :class:`DeviceKVCache` stores them) and ``pos (num_blocks, block_size)`` int32, -1 for an
    empty row.  A call names each sequence's blocks with a block table ``(B, max_blocks)``
    int32 (entry j: the block of the sequence's positions ``[j * bs, (j + 1) * bs)``, -1 for
    none) and where each new row goes with a slot mapping ``(T,)`` int64: the flat row
    ``block * bs + offset``, -1 to write nothing.  Under vLLM's convention the row of position p
    is the slot ``block_table[b, p // bs] * bs + p % bs``, and ``pos`` there holds p.

    Visibility (docs/semantics.md, "The paged cache"): a query at position q sees position k,
    ``q - window < k <= q``, when k's slot holds k.  The stored position is what makes a row
    visible, so a row that is empty, belongs to a rejected draft (a position past the query's)
    or to an earlier owner of the block at other positions is never read.  Speculative decoding
    needs no rollback: a rejected draft at position p stays invisible to every query before p
    and is overwritten when p is decoded again.  Prefix sharing: two sequences may list the same
    block at the same index (read-only for both; the engine copies a block before writing it).
    A block handed to a sequence must not hold rows of another sequence at positions the new
    owner will query before writing them: :meth:`reset` empties blocks (capturable).  Entries
    of blocks out of the window may be -1 or point at a block never written (all -1, as vLLM's
    null block): either reads nothing.

    Device only: :meth:`write` and :meth:`reset` take device tensors and never read them on the
    host during CUDA-graph capture (an eager call checks indices with one host read).
    ``window`` is the layer's sliding window; a sequence needs ``ceil(window / bs) + 1`` blocks
    (plus its draft rows') listed to see its whole window.
    """

    def __init__(
        self,
        config: DSV4Config,
        *,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        check_instance("config", config, DSV4Config)
        check_int("num_blocks", num_blocks, 1)
        check_int("block_size", block_size, 1)
        self.kv, self.pos, self.window = _empty_rows(config, num_blocks, block_size, dtype, device)

    @classmethod
    def from_tensors(cls, kv: torch.Tensor, pos: torch.Tensor, window: int) -> PagedKVCache:
        """A cache over an engine's own pool (read and written in place, never copied):
        ``kv (N, bs, Dh)`` bf16 / fp32 and ``pos (N, bs)`` int32, both contiguous on one
        device, Dh a multiple of 16; ``pos`` -1 in empty rows and a position p with
        ``p % bs`` its offset otherwise."""
        check_int("window", window, 1)
        N, bs, Dh = _check_store_tensors(kv, pos, "(N, bs, Dh)")
        if N < 1 or bs < 1 or Dh < 16 or Dh % 16:
            raise InputError(
                f"kv: expected N >= 1 blocks of bs >= 1 rows and Dh a multiple of 16, got "
                f"{tuple(kv.shape)}"
            )
        obj = cls.__new__(cls)
        obj.kv, obj.pos, obj.window = kv, pos, window
        return obj

    # ------------------------------------------------------------------ properties
    @property
    def num_blocks(self) -> int:
        return int(self.kv.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.kv.shape[1])

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"window={self.window}, head_dim={self.head_dim}, dtype={self.dtype}, "
            f"device={self.device})"
        )

    # ------------------------------------------------------------------ device-side updates
    def slots(self, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """vLLM's slot mapping of ``positions (T,)`` through ``block_table (T, M)`` (one table
        row per position): ``block_table[t, p // bs] * bs + p % bs`` int64, -1 where the entry
        is -1 or past the table.  Device ops only, capturable."""
        check_positions("positions", positions)
        check_block_table("block_table", block_table, positions.shape[0])
        bs, M = self.block_size, block_table.shape[1]
        p = positions.long()
        j = (p // bs).clamp(max=max(M - 1, 0))[:, None]
        block = block_table.long().gather(1, j)[:, 0] if M else torch.full_like(p, -1)
        ok = (p >= 0) & (p // bs < M) & (block >= 0)
        return torch.where(ok, block * bs + p % bs, -1)

    def check_slot_mapping(self, name: str, slot_mapping: torch.Tensor) -> None:
        """Eager only (one host read; nothing while a CUDA graph is captured): every slot is
        < num_blocks * block_size and the non-negative ones distinct."""
        if _capturing(slot_mapping):
            return
        rows = self.num_blocks * self.block_size
        used = slot_mapping[slot_mapping >= 0]
        if used.numel() and (int(used.max()) >= rows or used.unique().numel() != used.numel()):
            raise InputError(
                f"{name}: expected distinct slots < num_blocks * block_size = {rows} (-1: none), "
                f"got {[int(s) for s in slot_mapping.tolist()]}"
            )

    def write(self, kv: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Row t of ``kv (T, Dh)`` with its position into pool row ``slot_mapping[t]`` (device
        tensors, T each; slot -1 or a negative position writes nothing; the slots distinct).
        One launch of ``torch.ops.dsv4mtp.kv_cache_write_out`` over the pool viewed as
        N * bs rings of one row (the slot is the ring), moving T * (2 * Dh * itemsize + 4) bytes
        plus the slots and positions, capturable."""
        if not isinstance(kv, torch.Tensor) or kv.dim() != 2 or kv.shape[1] != self.head_dim:
            got = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
            raise InputError(f"kv: expected shape (T, {self.head_dim}), got {got}")
        if kv.dtype != self.dtype or kv.device != self.device:
            raise InputError(
                f"kv: expected {self.dtype} on {self.device} (the cache's), got {kv.dtype} on "
                f"{kv.device}"
            )
        T = kv.shape[0]
        check_positions("positions", positions, T)
        check_positions("slot_mapping", slot_mapping, T)
        for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
            if t.device != self.device:
                raise InputError(f"{name}: expected device {self.device}, got {t.device}")
        self.check_slot_mapping("slot_mapping", slot_mapping)
        if T:
            self._write(kv, positions, slot_mapping)

    def _write(self, kv: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        rows = self.num_blocks * self.block_size
        _write_out(
            kv, positions, slot_mapping,
            cache_kv=self.kv.view(rows, 1, self.head_dim), cache_pos=self.pos.view(rows, 1),
        )  # fmt: skip

    def reset(self, blocks: torch.Tensor | None = None) -> None:
        """Empty every row (``blocks`` None) or the rows of ``blocks`` (a device tensor (n,) of
        block indices, -1 entries ignored), e.g. blocks just handed to a sequence.  Device only,
        capturable."""
        if blocks is None:
            self.pos.fill_(-1)
            return
        check_positions("blocks", blocks)
        if blocks.device != self.device:
            raise InputError(f"blocks: expected device {self.device}, got {blocks.device}")
        if not _capturing(blocks) and blocks.numel() and int(blocks.max()) >= self.num_blocks:
            raise InputError(
                f"blocks: expected block indices < num_blocks={self.num_blocks} (-1: none), "
                f"got {[int(b) for b in blocks.tolist()]}"
            )
        N = self.num_blocks
        index = torch.where(blocks >= 0, blocks.long(), N)  # -1 -> the spare entry N
        empty = torch.zeros(N + 1, dtype=torch.bool, device=self.device)
        empty.index_fill_(0, index, True)
        self.pos.masked_fill_(empty[:N, None], -1)


def check_block_table(name: str, t: object, rows: int) -> None:
    """A (rows, M) int32 / int64 tensor: a block table, one row per sequence or query."""
    if (
        not isinstance(t, torch.Tensor)
        or t.dtype not in (torch.int32, torch.int64)
        or t.dim() != 2
        or t.shape[0] != rows
    ):
        what = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise InputError(f"{name}: expected a ({rows}, M) int32 / int64 tensor, got {what}")


def _capturing(t: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return True
    return t.is_cuda and torch.cuda.is_current_stream_capturing()
