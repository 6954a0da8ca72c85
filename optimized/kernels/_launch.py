"""Shared plumbing of the Triton launchers and the optimized entry points (no kernels here).

``INTERPRET`` is read once, when this module is imported: Triton decides at decoration time
whether a kernel runs compiled or in its CPU interpreter, so the flag cannot change later.
Every check below reads tensor metadata only (no host sync), so the entry points stay
CUDA-graph capturable.

Nothing here imports triton: it is the optional ``gpu`` extra, and ``import dsv4mtp.optimized``
works without it.  The entry points reach their kernels through :func:`triton_kernel`, which
imports the kernel's module on the first call, or raises :data:`TRITON_MISSING` as an InputError.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

from dsv4mtp.errors import InputError

__all__ = [
    "INTERPRET",
    "KERNEL_DTYPES",
    "TRITON_MISSING",
    "check_device",
    "check_kernel_dtype",
    "check_out",
    "flashinfer_mhc",
    "flashinfer_norm",
    "next_pow2",
    "triton_available",
    "triton_kernel",
]

# Under TRITON_INTERPRET=1 every kernel runs program by program, in order, on the CPU.  Kernels
# whose programs wait for each other (the single-pass mHC collapse) must not be launched that
# way; the launchers pick their two-pass schedule instead.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1); Triton's ``tl.arange`` needs power-of-two extents."""
    return 1 << max(0, (int(n) - 1).bit_length())


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


def check_out(
    name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A preallocated output must match exactly and be contiguous (kernels write it in place)."""
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
    if not t.is_contiguous():
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

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(_kernel_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


def __getattr__(name: str) -> Any:
    # The kernels' shared @triton.jit device functions, for `from ._launch import sigmoid`.
    if name in ("rne_bf16_if_interpreted", "sigmoid"):
        from . import _jit

        value = getattr(_jit, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
