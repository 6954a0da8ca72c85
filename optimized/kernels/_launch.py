"""Shared plumbing of the Triton launchers and the optimized entry points (no kernels here).

``INTERPRET`` is read once, when this module is imported: Triton decides at decoration time
whether a kernel runs compiled or in its CPU interpreter, so the flag cannot change later.
Every check below reads tensor metadata only (no host sync), so the entry points stay
CUDA-graph capturable.

Nothing here imports triton: it is the optional ``gpu`` extra, and ``import dsv4mtp.optimized``
works without it.  The entry points reach their kernels through :func:`triton_kernel`, which
imports the kernel's module on the first call, or raises :data:`TRITON_MISSING` as an InputError.

:class:`TritonLaunch` is the one way the launchers start a compiled kernel: it skips
``JITFunction.run``'s per-call argument binding and cache-key arithmetic on repeat calls (see
its docstring for the rule that keeps that exact).  :func:`plan` keeps what a launcher derives
from its shapes (grid, launches, workspace views) per stream, so that a repeated call costs a
dictionary lookup, the launch keys and the launches.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from types import ModuleType
from typing import Any, TypeVar

import torch

from dsv4mtp.checks import check_instance, check_shape
from dsv4mtp.errors import InputError

__all__ = [
    "INTERPRET",
    "KERNEL_DTYPES",
    "TRITON_MISSING",
    "TritonLaunch",
    "arena_piece",
    "capture_arena",
    "cdiv",
    "check_device",
    "check_kernel_dtype",
    "check_out",
    "check_row_mask",
    "device_ints",
    "flashinfer_mhc",
    "flashinfer_norm",
    "launch_each",
    "next_pow2",
    "plan",
    "stream_key",
    "triton_available",
    "triton_kernel",
    "triton_launch",
    "workspace",
    "workspaces",
]

# Under TRITON_INTERPRET=1 every kernel runs program by program, in launch order, on the CPU
# (kernels whose programs wait for each other only wait on earlier ones: kernels/_sync.py).
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1); Triton's ``tl.arange`` needs power-of-two extents."""
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints.  ``triton.cdiv`` computes the same, but as a ``constexpr_function``
    it costs ~1.5 us per call on the host, more than the arithmetic of a whole launcher."""
    return -(-a // b)


# The optimized kernels are built for these; anything else is the reference's job.
KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def check_kernel_dtype(name: str, t: torch.Tensor) -> None:
    """bf16 / fp32 only; float64, float16 and the rest get an InputError naming the reference."""
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in KERNEL_DTYPES:
        raise InputError(
            f"{name}: expected dtype in (bfloat16, float32) for the optimized kernels, got "
            f"{str(t.dtype).removeprefix('torch.')}; use dsv4mtp.reference for other dtypes"
        )


def check_device(named: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    """All tensors on the first one's device, which must be CUDA (or CPU under the interpreter)."""
    first_name, first = named[0]
    dev = first.device
    for name, t in named[1:]:
        if t.device != dev:
            raise InputError(f"{name}: expected device {dev} (as {first_name}), got {t.device}")
    if dev.type != "cuda" and not triton_available():
        raise InputError(TRITON_MISSING)
    if dev.type != "cuda" and not (dev.type == "cpu" and INTERPRET):
        raise InputError(
            f"{first_name}: the optimized kernels need a CUDA tensor (CPU runs only under "
            f"TRITON_INTERPRET=1), got device {dev}; use dsv4mtp.reference on CPU"
        )
    return dev


def check_row_mask(row_mask: object, rows: int, ref_name: str, ref: torch.Tensor) -> None:
    """An optional per-row mask (a CUDA-graph step's padding and bad rows): a (rows,) bool
    tensor on ``ref``'s device; None passes."""
    if row_mask is None:
        return
    check_instance("row_mask", row_mask, torch.Tensor)
    assert isinstance(row_mask, torch.Tensor)
    if row_mask.dtype != torch.bool:
        raise InputError(f"row_mask: expected dtype torch.bool, got {row_mask.dtype}")
    check_shape("row_mask", row_mask, (rows,))
    check_device([(ref_name, ref), ("row_mask", row_mask)])


def check_out(
    name: str,
    t: object,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    *,
    contiguous: bool = True,
) -> torch.Tensor:
    """A preallocated output must match exactly and be contiguous (kernels write it in place);
    ``contiguous=False`` for a kernel that writes through the output's strides."""
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise InputError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise InputError(
            f"{name}: expected dtype {str(dtype).removeprefix('torch.')}, "
            f"got {str(t.dtype).removeprefix('torch.')}"
        )
    if t.device != device:
        raise InputError(f"{name}: expected device {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise InputError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
    return t


@functools.cache
def _import(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except Exception:  # not installed, or no CUDA toolchain: the Triton paths take over
        return None


def flashinfer_mhc() -> ModuleType | None:
    """``flashinfer.mhc`` if importable (its kernels JIT-build on first use), else None."""
    return None if INTERPRET else _import("flashinfer.mhc")


def flashinfer_norm() -> ModuleType | None:
    """``flashinfer.norm`` if importable, else None."""
    return None if INTERPRET else _import("flashinfer.norm")


TRITON_MISSING = (
    "dsv4mtp.optimized needs triton for this call, and triton is not installed: "
    "pip install 'dsv4-mtp[gpu]' (or pip install triton), or use dsv4mtp.reference, which runs "
    "on the CPU without it"
)


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@torch.compiler.assume_constant_result
def triton_available() -> bool:
    """Whether triton imports (the ``gpu`` extra; a CUDA build of torch brings it too).

    torch.compile evaluates it once while tracing and keeps the answer as a constant: the
    import behind it would otherwise break the graph."""
    return _triton_importable()


@functools.cache
def _kernel_module(module: str) -> ModuleType:
    if not triton_available():
        raise InputError(TRITON_MISSING)
    return importlib.import_module(f"{__package__}.{module}")


def triton_kernel(module: str, name: str) -> Callable[..., Any]:
    """``kernels/<module>.py``'s ``name``, imported on the first call (which raises an InputError
    saying what to install when triton is missing)."""

    resolved: Callable[..., Any] | None = None

    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal resolved
        if resolved is None:
            resolved = getattr(_kernel_module(module), name)
        return resolved(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


# ------------------------------------------------------------------------------ launches
def _arg_key(a: object) -> object:
    """What Triton's specialization of one runtime argument depends on, or something finer.

    A tensor: dtype and 16-byte alignment of its data pointer.  An int: == 1 (Triton makes it a
    constant), divisible by 16, and its integer type (i32 / i64 / u64 ranges).  A bool: its
    type (``u1``, never a constant).  A float: fp32, nothing specialized.  Anything else (None,
    a dtype): its value.  Finer than Triton only costs a cache miss; coarser would launch a
    kernel compiled for another alignment, so conformance/test_fastpath.py checks this against
    Triton's own ``native_specialize_impl``.
    """
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    t = type(a)
    if t is int:
        assert isinstance(a, int)
        return (a == 1, a % 16 == 0, -0x80000000 <= a <= 0x7FFFFFFF, a <= 0x7FFFFFFFFFFFFFFF)
    if t is float or t is bool:
        return t
    return (t, a)


# Source of the per-argument key expressions of _key_function, by argument kind: each is
# _arg_key(a) inlined for that kind, with _arg_key itself for any other type.
_KEY_EXPRS = {
    "t": "({a}.dtype, {a}.data_ptr() % 16 == 0) if isinstance({a}, _Tensor) else _arg_key({a})",
    "i": "({a} == 1, {a} % 16 == 0, -0x80000000 <= {a} <= 0x7FFFFFFF, {a} <= 0x7FFFFFFFFFFFFFFF) "
    "if type({a}) is int else _arg_key({a})",
    "f": "float if type({a}) is float else _arg_key({a})",
    "o": "_arg_key({a})",
}
_KEY_FUNCTIONS: dict[tuple[str, ...], Callable[..., tuple[object, ...]]] = {}


def _kind(a: object) -> str:
    return "t" if isinstance(a, torch.Tensor) else {int: "i", float: "f"}.get(type(a), "o")


def _key_function(args: Sequence[object]) -> Callable[..., tuple[object, ...]]:
    """``f(device, *args) == (device, *map(_arg_key, args))`` for any arguments of this count,
    with each _arg_key inlined for the kind of argument ``args`` has at that position: a launch
    key costs half of the generic loop (one tuple display, no per-argument call)."""
    kinds = tuple(_kind(a) for a in args)
    fn = _KEY_FUNCTIONS.get(kinds)
    if fn is None:
        names = [f"a{i}" for i in range(len(kinds))]
        exprs = "".join(
            f"({_KEY_EXPRS[k].format(a=a)}), " for k, a in zip(kinds, names, strict=True)
        )
        src = f"def key(dev, {', '.join(names)}):\n    return (dev, {exprs})\n"
        scope: dict[str, Any] = {"_Tensor": torch.Tensor, "_arg_key": _arg_key}
        exec(src, scope)  # the source: fixed templates above, argument names a0, a1, ...
        fn = _KEY_FUNCTIONS[kinds] = scope["key"]
    return fn


@functools.cache
def _runtime() -> tuple[Callable[[], int], Callable[[int], int], Any]:
    """Triton's current-device and current-stream functions (the raw torch ones where Triton
    uses them: ``torch.cuda.current_device`` re-checks lazy initialization on every call), and
    its launch-hook chains.  Read once: the first launch of every kernel goes through
    ``JITFunction.run``, which has initialized CUDA by the time these are used."""
    from triton import knobs
    from triton.runtime.driver import driver

    active = driver.active
    device: Callable[[], int] = active.get_current_device
    if device is torch.cuda.current_device and hasattr(torch._C, "_cuda_getDevice"):
        device = torch._C._cuda_getDevice
    return device, active.get_current_stream, knobs.runtime


def _hooks_idle(runtime: Any) -> bool:
    """No launch hook is installed (a profiler such as proton adds them): the direct call may
    skip building launch metadata and pass no hooks."""
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter is None or not getattr(enter, "calls", True)) and (
        exit_ is None or not getattr(exit_, "calls", True)
    )


class TritonLaunch:
    """One Triton kernel with its constexprs and launch options fixed: ``launch(grid, *args)``.

    ``args`` are the kernel's runtime (non-constexpr) parameters, in signature order, all
    positional; ``meta`` (given once) holds every constexpr and the options (``num_warps``,
    ``num_stages``, ``maxnreg``).  The first call per (current device, specialization of args)
    goes through ``kernel[grid](*args, **meta)``, i.e. ``JITFunction.run``, which compiles or
    finds the kernel, checks the kernel's globals and launches it; the CompiledKernel it returns
    is kept under that key.  Later calls compute only the key (:func:`_arg_key` per argument:
    dtype and alignment of each tensor, the integer class of each int; evaluated by a function
    compiled for the argument kinds, :func:`_key_function`) and call the compiled kernel's
    launcher directly on the current stream, which is what ``JITFunction.run`` ends in: it
    spends ~10-20 us per call re-binding keyword arguments, re-deriving the specialization and
    the cache key string, and building launch metadata for hooks.  :func:`launch_each` runs the
    launches of a multi-phase schedule with one key.

    The plain path is kept where the direct call would differ: under ``TRITON_INTERPRET=1``
    (the interpreter has no compiled kernel), while a launch hook or a pre-run hook is
    installed (they see every launch with its metadata), and for a kernel whose constexprs are
    not all in ``meta`` after the runtime arguments.  Environment knobs that Triton reads at
    launch (``TRITON_DEBUG``, instrumentation mode) are those of the first launch per key.
    A CUDA graph capture records the direct call like any other launch on the capturing stream.
    """

    __slots__ = ("_direct", "_kernels", "_keyfn", "_tail", "jit", "meta")

    def __init__(self, jit: Any, meta: dict[str, Any]) -> None:
        self.jit = jit
        self.meta = meta
        self._kernels: dict[tuple[object, ...], tuple[Any, Any, Any]] = {}
        self._tail: tuple[Any, ...] = ()
        self._direct: bool | None = None  # decided on the first compiled launch
        self._keyfn: Callable[..., tuple[object, ...]] | None = None  # built on the first call

    def key(self, dev: int, args: tuple[Any, ...]) -> tuple[object, ...]:
        """``(dev, *map(_arg_key, args))``, through a key function compiled for the argument
        kinds of the first call (:func:`_key_function`)."""
        keyfn = self._keyfn
        if keyfn is None:
            keyfn = self._keyfn = _key_function(args)
        try:
            return keyfn(dev, *args)
        except TypeError:  # another argument count than the first call's
            return (dev, *[_arg_key(a) for a in args])

    def __call__(self, grid: tuple[int, ...], *args: Any) -> None:
        if INTERPRET:
            self.jit[grid](*args, **self.meta)
            return
        device, stream, runtime = _runtime()
        dev = device()
        key = self.key(dev, args)
        entry = self._kernels.get(key)
        if entry is None or self.jit.pre_run_hooks or not _hooks_idle(runtime):
            self._plain(key, grid, args)
            return
        run, function, packed = entry
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        run(grid[0], g1, g2, stream(dev), function, packed, None, None, None, *args, *self._tail)

    def _plain(self, key: tuple[object, ...], grid: tuple[int, ...], args: tuple[Any, ...]) -> None:
        kernel = self.jit[grid](*args, **self.meta)
        if self._direct is None:
            self._direct = self._bind_tail(len(args))
        if self._direct and kernel is not None:
            self._kernels[key] = (kernel.run, kernel.function, kernel.packed_metadata)

    def _bind_tail(self, n_args: int) -> bool:
        """The launcher takes every parameter in signature order: the runtime ones (``args``)
        then the constexprs, whose values are fixed in ``meta``.  False (plain path for good)
        when the signature is not laid out that way."""
        params = self.jit.params
        runtime = [p for p in params if not p.is_constexpr]
        if len(runtime) != n_args or any(p.is_constexpr for p in params[:n_args]):
            return False
        names = [p.name for p in params[n_args:]]
        if any(n not in self.meta for n in names):
            return False
        self._tail = tuple(self.meta[n] for n in names)
        return True


def launch_each(
    launches: Sequence[TritonLaunch], grid: tuple[int, ...], args: tuple[Any, ...]
) -> None:
    """``launch(grid, *args)`` for each launch in order (the phases of one schedule): the key
    depends on the arguments only (:func:`_arg_key`), so it is computed once for all of them,
    as are the device, the stream and the hook check."""
    if INTERPRET or len(launches) == 1:
        for launch in launches:
            launch(grid, *args)
        return
    device, stream, runtime = _runtime()
    dev = device()
    key = launches[0].key(dev, args)
    idle = _hooks_idle(runtime)
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    s = stream(dev)
    for launch in launches:
        entry = launch._kernels.get(key)
        if entry is None or launch.jit.pre_run_hooks or not idle:
            launch._plain(key, grid, args)
            continue
        run, function, packed = entry
        run(grid[0], g1, g2, s, function, packed, None, None, None, *args, *launch._tail)


_LAUNCHES: dict[tuple[object, ...], TritonLaunch] = {}


def triton_launch(jit: Any, **meta: Any) -> TritonLaunch:
    """The :class:`TritonLaunch` of ``jit`` with these constexprs and options (one object per
    distinct ``meta``, kept for the process: a launcher's schedules are few).  Launchers whose
    meta depends only on shapes keep the result in their own plan cache, which saves this
    lookup too."""
    key = (jit, *meta.items())
    launch = _LAUNCHES.get(key)
    if launch is None:
        launch = _LAUNCHES[key] = TritonLaunch(jit, meta)
    return launch


# ------------------------------------------------------------------------------ workspaces
# Scratch tensors a launcher hands its kernels (split-K partials), kept between calls instead of
# allocated per call.  Key: (name, shape, dtype, device, current stream, host thread).  The rule
# that makes reuse safe: every kernel that writes or reads a workspace runs on the stream that
# was current when it was handed out, so the next call's writes are ordered after this call's
# reads, also with several calls in flight.  Two streams, or two host threads sharing a stream
# (their launches could interleave between a producer and its consumer), get separate buffers.
# While the current stream captures a CUDA graph the workspace is allocated fresh, from the
# graph's private pool, so the graph owns it for as long as it lives and eager calls never
# write into memory a replay reads.  At most _MAX_WORKSPACES are kept (a serving loop sees few
# distinct T); past that the cache starts over, dropping only its own references (a tensor still
# used by a queued kernel stays alive through the caching allocator's stream ordering).
_MAX_WORKSPACES = 256
_WORKSPACES: dict[tuple[object, ...], torch.Tensor] = {}


def stream_key(device: torch.device) -> object:
    """What a workspace is kept under besides its name and shape: the current stream's handle on
    a CUDA device, None on the CPU (the interpreter: every launch completes before the next
    starts), False while the current stream captures a CUDA graph (nothing is kept then).
    Two C calls: ``torch.cuda.current_stream()`` would build a Stream object per call."""
    if device.type != "cuda":
        return None
    if torch._C._cuda_isCurrentStreamCapturing():  # type: ignore[attr-defined]
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch._C._cuda_getCurrentRawStream(index)  # type: ignore[attr-defined]


def _forget() -> None:
    """Past _MAX_WORKSPACES entries in either cache both start over (a plan holds views of
    workspaces: forgetting one without the other would keep up to twice the buffers)."""
    _WORKSPACES.clear()
    _PLANS.clear()


# While a graph is captured, the launches' counters come from an arena zeroed before the capture
# and owned by the graphs (capture_arena): each launch of one capture block gets its own piece,
# which it leaves zeroed like any other buffer here, so a replay finds it zeroed without a memset
# node (a fill kernel on the step's chain, ~2.4 us at decode sizes, if the counters were a fresh
# torch.zeros).  Launches that may run at once (side streams) hold different pieces; graphs
# captured in successive blocks over one arena reuse its pieces, which is safe as long as those
# graphs are never replayed concurrently (one graph per bucket of one step: they are not).
_ARENA = threading.local()
_ALIGN = 16  # pieces start on 64-byte boundaries (Triton specializes pointers on 16 bytes)


@contextlib.contextmanager
def capture_arena(arena: torch.Tensor) -> Iterator[None]:
    """Counters for the launches captured inside the block: pieces of ``arena`` (int32, 1-D,
    zeroed, on the capturing device), one per ``_sync.counters`` call, handed out in order.  The
    caller keeps ``arena`` alive as long as the graphs (they read and write it at every replay)
    and must not replay two of those graphs at once.  A call that no longer fits gets a fresh
    ``torch.zeros`` (a memset in the graph)."""
    if arena.dtype != torch.int32 or arena.dim() != 1 or not arena.is_contiguous():
        raise InputError(
            f"arena: expected a contiguous 1-D int32 tensor, got {arena.dtype} of shape "
            f"{tuple(arena.shape)}"
        )
    outer = getattr(_ARENA, "state", None)
    _ARENA.state = [arena, 0]
    try:
        yield
    finally:
        _ARENA.state = outer


def arena_piece(device: torch.device, n: int) -> torch.Tensor | None:
    """The next ``n`` entries of the open :func:`capture_arena` on ``device``; None when none
    is open or they do not fit."""
    state = getattr(_ARENA, "state", None)
    if state is None:
        return None
    arena, used = state
    if arena.device != device or used + n > arena.numel():
        return None
    state[1] = used + -(-n // _ALIGN) * _ALIGN
    return arena[used : used + n]  # type: ignore[no-any-return]


def workspace(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """An uninitialized scratch tensor ``name`` of this shape and dtype, reused by later calls
    on the same device, stream and host thread (the rule above); kernels must write it before
    they read it."""
    stream = stream_key(device)
    if stream is False:
        return torch.empty(shape, dtype=dtype, device=device)
    key = (name, shape, dtype, device, stream, threading.get_ident())
    t = _WORKSPACES.get(key)
    if t is None:
        if len(_WORKSPACES) >= _MAX_WORKSPACES:
            _forget()
        t = _WORKSPACES[key] = torch.empty(shape, dtype=dtype, device=device)
    return t


def workspaces(name: str, device: torch.device, *sizes: int) -> list[torch.Tensor]:
    """fp32 scratch buffers of the given element counts, carved from one :func:`workspace`.

    Each starts on a 64-byte boundary: Triton specializes pointer arguments on 16-byte
    alignment, and offsets that depend on T would otherwise compile new variants as T varies."""
    padded = [-(-n // 16) * 16 for n in sizes]
    flat = workspace(name, (sum(padded),), torch.float32, device)
    views, start = [], 0
    for n, p in zip(sizes, padded, strict=True):
        views.append(flat[start : start + n])
        start += p
    return views


# ------------------------------------------------------------------------------ plans
# A launcher's per-call state that depends only on its shapes and the stream: grid, launches,
# workspace views.  Kept under the workspace rule above (per device, current stream
# and host thread; never while capturing), so that a repeated call does no allocation, no
# schedule arithmetic and no view slicing.
_PLANS: dict[tuple[object, ...], Any] = {}
_P = TypeVar("_P")


def plan(build: Callable[..., _P], device: torch.device, *key: Hashable) -> _P:
    """``build(device, *key)``, kept per (build, key, device, current stream, host thread) and
    built afresh while the current stream captures a CUDA graph, so that the workspaces it
    hands out are the graph's own (:func:`workspace`).  ``key`` must determine everything
    ``build`` returns."""
    stream = stream_key(device)
    if stream is False:
        return build(device, *key)
    k = (build, *key, device, stream, threading.get_ident())
    p = _PLANS.get(k)
    if p is None:
        if len(_PLANS) >= _MAX_WORKSPACES:
            _forget()
        p = _PLANS[k] = build(device, *key)
    return p  # type: ignore[no-any-return]


def __getattr__(name: str) -> Any:
    # The kernels' shared @triton.jit device functions, for `from ._launch import sigmoid`.
    if name in ("rne_bf16_if_interpreted", "sigmoid"):
        from . import _jit

        value = getattr(_jit, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def device_ints(
    values: list[int], dev: torch.device, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """Host ints as a tensor on ``dev`` without a sync: a plain copy to a CUDA device waits for
    the stream's queued kernels (PyTorch synchronizes a blocking host-to-device copy), so the
    values go through pinned memory with a non-blocking copy (the caching host allocator keeps
    the pinned buffer until the copy has run)."""
    if dev.type != "cuda" or torch.compiler.is_compiling():
        # (dynamo cannot trace pin_memory; a traced call makes the ints a constant of the graph)
        return torch.tensor(values, dtype=dtype, device=dev)
    return torch.tensor(values, dtype=dtype).pin_memory().to(dev, non_blocking=True)
