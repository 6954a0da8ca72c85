"""Waiting on other programs of the same grid without relying on co-residency (Triton).

The mHC collapse kernels (:mod:`.mhc_collapse`, :mod:`.mhc_head`) need the partial sums of all
S programs of a token block before any of them can form the block's gates.  Waiting for the
other programs of one's own block only terminates if they are all resident at once, which
nothing guarantees: another stream's kernel, an NCCL kernel waiting on a peer, MPS or a small
MIG slice can hold all but a few SMs, and then the waiting programs hold the only free slots
while the programs they wait for can never start.

The rule used here makes every wait safe by construction: **a program only ever waits on
programs that took a lower ticket.**  A program's role (which token block it works on in which
phase) is not its ``program_id`` but a ticket it takes from an atomic counter when it starts, so
a lower ticket belongs to a program that has already started, i.e. is resident or finished; and
by induction the program it waits on itself only waits on lower tickets, so the chain ends.
Resident programs always make progress, hence no wait can block forever, however few SMs the
grid gets.  (This is the tile-ordering rule of decoupled look-back scans.)  The kernels are
pipelined by phase: the program with ticket ``q*S + s`` mixes slice s of block q, then does the
next phase for block q-1 (whose mixes hold lower tickets), and so on; the grid has one extra
block of programs per phase after the first.  Because a sequential executor hands out tickets
in launch order, the same kernels run under ``TRITON_INTERPRET=1``.

Fencing rule (one for every wait): before signalling, a thread barrier orders all of the
program's stores before the release increment (cumulativity makes them visible at gpu scope to
any program that acquires the count); after the acquiring spin, a thread barrier orders every
later load of every thread after it.  Readers of data published this way load it with
``.cg`` (L2, bypassing the possibly stale L1).

Counter layout (int32, zero before the launch): ``[ticket, finished, block 0, block 1, ...]``.
The last program to finish sets the whole layout back to zero, so a buffer can be reused by the
next launch on the same stream without a memset (:func:`counters`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import arena_piece, stream_key

__all__ = [
    "COUNTER_HEADER",
    "block_count",
    "counters",
    "finish",
    "signal",
    "take_ticket",
    "wait_until",
]

#: Entries before the per-block counts: the ticket dispenser and the finished-program count.
COUNTER_HEADER = 2
_HEADER = tl.constexpr(COUNTER_HEADER)  # the same, readable inside kernels


@triton.jit
def block_count(count_ptr, blk):
    """Pointer to token block ``blk``'s arrival count."""
    return count_ptr + _HEADER + blk


@triton.jit
def take_ticket(count_ptr):
    """This program's ticket: the number of programs of the grid that started before it."""
    return tl.atomic_add(count_ptr, 1, sem="relaxed", scope="gpu")


@triton.jit
def signal(flag_ptr):
    """Publish this program's stores and count it as arrived on ``flag_ptr``."""
    tl.debug_barrier()
    tl.atomic_add(flag_ptr, 1, sem="release", scope="gpu")


@triton.jit
def wait_until(flag_ptr, target):
    """Spin until ``target`` programs have signalled ``flag_ptr``.  Callers only wait on
    counts that lower tickets raise (module docstring)."""
    ready = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    while ready < target:
        ready = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def finish(count_ptr, grid_size, blocks, RESET_BLOCK: tl.constexpr):
    """Count this program as finished; the last one zeroes the header and ``blocks`` counts.

    Every program calls this after its last access to the counters, so when the finished count
    reaches ``grid_size`` nobody reads them any more."""
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == grid_size - 1:
        n_counts = _HEADER + blocks
        start = 0
        while start < n_counts:  # a while loop: the interpreter cannot range over a tensor bound
            offs = start + tl.arange(0, RESET_BLOCK)
            tl.store(count_ptr + offs, tl.zeros((RESET_BLOCK,), tl.int32), mask=offs < n_counts)
            start += RESET_BLOCK


# Zeroed counter buffers kept per (device, stream): every launch leaves its buffer zeroed
# (``finish``), so the next launch on the same stream reuses it without a memset launch.  A
# buffer replaced by a larger one goes back to the caching allocator, which hands its memory out
# again only to work ordered after the launches still using it (same stream).
_CACHE: dict[tuple[torch.device, object], torch.Tensor] = {}


def counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` entries for one launch on the current stream.

    During CUDA-graph capture: a piece of the capture's arena when one is open (_launch.py,
    ``capture_arena``), else a fresh ``torch.zeros`` (the memset becomes part of the graph);
    either way the buffer belongs to the graphs, so a replay never shares counters with eager
    launches or another capture's graphs (the graphs of one capture may share pieces: they are
    replayed one at a time).  On the CPU (interpreter) always fresh."""
    stream = stream_key(device)  # None on the CPU, False while capturing
    if stream is False:
        piece = arena_piece(device, n)
        if piece is not None:
            return piece
    if stream is None or stream is False:
        return torch.zeros((n,), dtype=torch.int32, device=device)
    key = (device, stream)
    buf = _CACHE.get(key)
    if buf is None or buf.numel() < n:
        grown = max(n, 64, 2 * buf.numel() if buf is not None else 0)
        buf = _CACHE[key] = torch.zeros((grown,), dtype=torch.int32, device=device)
    return buf
