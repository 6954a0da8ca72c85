"""What the MoE kernels share: ``jit_loop_bounds``.

Triton 3.6's interpreter cannot run a ``range`` whose bound is a runtime argument (it converts
the argument's one-element array with ``int()``, which numpy 2 refuses), so under
``TRITON_INTERPRET=1`` the loop bounds of the MoE kernels become compile-time constants.  The
compiled GPU kernels keep them as runtime arguments: no recompilation per batch size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton

from ._launch import INTERPRET

__all__ = ["jit_loop_bounds"]


def jit_loop_bounds(
    *names: str, do_not_specialize: tuple[str, ...] = ()
) -> Callable[[Callable[..., Any]], Any]:
    """``triton.jit``, with the arguments ``names`` made constexpr under the interpreter
    (``do_not_specialize``: passed on to ``triton.jit``)."""

    def deco(fn: Callable[..., Any]) -> Any:
        kernel = triton.jit(fn, do_not_specialize=do_not_specialize or None)
        if INTERPRET:
            # The interpreter reads constexpr-ness off the annotations of the function it
            # re-creates from the source on each launch; mark the loop bounds there.
            rewrite = kernel.rewrite

            def rewrite_with_constexpr_bounds() -> Any:
                out = rewrite()
                for n in names:
                    out.__annotations__[n] = "constexpr"
                return out

            kernel.rewrite = rewrite_with_constexpr_bounds
        return kernel

    return deco
