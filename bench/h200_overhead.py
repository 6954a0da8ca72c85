"""Eager host overhead of the optimized ops per call, and hc_head's FMA / MMA crossover in T.

Part 1, host overhead at T = 1 (D 4096, n 4, bf16, CUDA), for every backend of every op that
applies there.  Four callables per (op, backend), each called ``--calls`` times after a warm-up
and timed call by call with ``time.perf_counter_ns`` (median reported; the device is synchronized
every ``--block`` calls, outside the timed calls, so the launch queue never fills):

* public:   ``dsv4mtp.optimized.<op>(..., backend=b)`` (validation, backend choice, operator);
* pub.out:  the same with preallocated ``out=`` buffers (no output allocation in the call);
* op:       ``torch.ops.dsv4mtp.<op>(..., b)`` (dispatcher, our kernel's Python launcher);
* launcher: the Python launcher the operator runs, called directly (workspace allocation,
            schedule arithmetic, the launches);
* bare:     the same compiled kernels launched alone at the cheapest the host can: each
            CompiledKernel's launcher called directly (``kernel.run(grid, stream, function,
            packed metadata, no hooks, *args)``, what optimized/kernels/_launch.py's
            TritonLaunch does after its first call) with the very arguments and workspaces the
            launcher passed (recorded on one call), on the current stream, and FlashInfer's raw
            module functions with the arguments the adapter passed.  Replayed workspaces are
            not re-zeroed, so the bare launches compute nothing meaningful: only their host
            cost is measured.
* jit.run:  the same launches through Triton's ``kernel[grid](*args, **meta)``
            (``JITFunction.run``: argument binding, specialization and cache key per call), the
            previous definition of "bare", for comparison.

The table gives public - bare and op - bare (the per-call cost above a bare launch, aim <= 5 us),
and splits it: public - op (validation and backend choice), op - launcher (the registration:
``torch.library`` dispatch into the Python kernel) and launcher - bare (allocation and launch
arithmetic).  A second table times one no-op in three registrations: a plain Python call,
``torch.library.Library`` define/impl (what optimized/_ops.py uses) and
``torch.library.custom_op``.

Part 2, hc_head crossover: ``triton_fma`` vs ``triton_mma`` for T in {1, 8, 32, 64, 128, 256,
512, 1024, 4096} at D 4096 and 7168 (``triton.testing.do_bench``, median ms, operator with
preallocated ``out``), and the smallest T from which MMA stays faster at both D: the value for
``optimized/_dispatch.py::HEAD_MMA_MIN_T``.

Usage (one GPU): python bench/h200_overhead.py --out DIR   (writes DIR/overhead-h200.json)

``--mock`` (no GPU, CPU only, ``TRITON_INTERPRET`` unset): the Python cost of each Triton
launcher with Triton's CUDA driver mocked and every compiled kernel replaced by a recorder whose
launcher does nothing, so the time is the launcher's own host work (schedule and plan lookups,
workspaces, the launch keys) on top of a free launch.  It also counts the launches that went
through ``JITFunction.run`` on a repeated identical call (0 means TritonLaunch's direct path).
CPU tensors stand in for CUDA ones, so the CUDA-only calls (current stream, capture state)
are not in these numbers, and fused schedules allocate fresh counters (CPU rule of
optimized/kernels/_sync.py::counters): one ``torch.zeros`` per call.
Usage: env -u TRITON_INTERPRET python bench/h200_overhead.py --mock
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

N, EPS = 4, 1e-6
DEV = "cuda"  # --device cpu (with TRITON_INTERPRET=1 and a small --dim) checks the script itself
CROSS_T = (1, 8, 32, 64, 128, 256, 512, 1024, 4096)
CROSS_D = (4096, 7168)
_KERNELS = (
    ("mhc_collapse", "mhc_collapse_kernel"),
    ("mhc_head", "mhc_head_fma_kernel"),
    ("mhc_mix", "mhc_mix_kernel"),
    ("mhc_post", "mhc_post_kernel"),
    ("rms_norm", "rms_norm_kernel"),
)


# ------------------------------------------------------------------------------ timing
def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def host_us(fn: Callable[[], Any], calls: int, block: int) -> float:
    """Median host time of one call, in us."""
    for _ in range(min(50, calls)):
        fn()
    _sync()
    times: list[int] = []
    while len(times) < calls:
        for _ in range(min(block, calls - len(times))):
            t0 = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t0)
        _sync()
    return statistics.median(times) / 1e3


# ------------------------------------------------------------------------------ recording
def _direct(kernel: Any, grid: Any, full_args: tuple[Any, ...]) -> Callable[[], None]:
    """A compiled kernel's launcher called directly on the current stream (the cheapest launch)."""
    from dsv4mtp.optimized.kernels._launch import _runtime

    grid = (*grid, 1, 1)
    g0, g1, g2 = grid[0], grid[1], grid[2]
    dev_fn, stream_fn, _ = _runtime()  # Triton's device and stream functions, as TritonLaunch
    run, function, packed = kernel.run, kernel.function, kernel.packed_metadata

    def launch() -> None:
        run(g0, g1, g2, stream_fn(dev_fn()), function, packed, None, None, None, *full_args)

    return launch


@contextlib.contextmanager
def recording(calls: list[Callable[[], Any]], jit_calls: list[Callable[[], Any]]) -> Iterator[None]:
    """Record every Triton launch and raw FlashInfer call made inside, as replayable closures:
    ``calls`` gets the direct launcher calls (and FlashInfer's), ``jit_calls`` the same launches
    through ``JITFunction.run`` (and FlashInfer's)."""
    import dsv4mtp.optimized.kernels._flashinfer as fa
    from dsv4mtp.optimized.kernels._launch import INTERPRET, TritonLaunch, _runtime

    jits = []
    for module, name in _KERNELS:
        jit = getattr(importlib.import_module(f"dsv4mtp.optimized.kernels.{module}"), name)
        orig = jit.run

        def run(*args: Any, _orig: Any = orig, _jit: Any = jit, **kwargs: Any) -> Any:
            # a launcher that calls kernel[grid](...) itself (not through TritonLaunch)
            kernel = _orig(*args, **kwargs)
            jit_calls.append(lambda: _orig(*args, **kwargs))
            if INTERPRET:  # no compiled kernel: the script's CPU check replays run() twice
                calls.append(jit_calls[-1])
                return kernel
            tail = tuple(kwargs[p.name] for p in _jit.params[len(args) :])
            calls.append(_direct(kernel, kwargs["grid"], (*args, *tail)))
            return kernel

        jit.run = run
        jits.append(jit)
    launch_call = TritonLaunch.__call__

    def launch_rec(self: Any, grid: tuple[int, ...], *args: Any) -> None:
        # a hit of TritonLaunch: its launch is replayed both ways
        if INTERPRET:  # plain path: recorded by run() above
            launch_call(self, grid, *args)
            return
        entry = self._kernels.get(self.key(_runtime()[0](), args))
        assert entry is not None, "warm the launcher before recording"
        run, function, packed = entry
        kernel = type("K", (), dict(run=run, function=function, packed_metadata=packed))
        calls.append(_direct(kernel, grid, (*args, *self._tail)))
        jit_calls.append(lambda: self.jit[grid](*args, **self.meta))
        launch_call(self, grid, *args)

    TritonLaunch.__call__ = launch_rec  # type: ignore[method-assign]

    def each(launches: Any, grid: tuple[int, ...], args: tuple[Any, ...]) -> None:
        # the launchers' launch_each, one recorded launch at a time
        for launch in launches:
            launch(grid, *args)

    # the launcher modules that bound launch_each at import
    eachers = [importlib.import_module(f"dsv4mtp.optimized.kernels.{m}") for m, _ in _KERNELS]
    eachers = [m for m in eachers if hasattr(m, "launch_each")]
    saved = [m.launch_each for m in eachers]
    for m in eachers:
        m.launch_each = each

    class Proxy:
        def __init__(self, real: Any) -> None:
            self.real = real

        def __getattr__(self, attr: str) -> Any:
            fn = getattr(self.real, attr)

            def call(*args: Any, **kwargs: Any) -> Any:
                calls.append(lambda: fn(*args, **kwargs))
                jit_calls.append(lambda: fn(*args, **kwargs))
                return fn(*args, **kwargs)

            return call

    mhc_module, norm_module = fa._mhc_module, fa._norm_module
    fa._mhc_module = lambda: Proxy(mhc_module())  # type: ignore[assignment]
    fa._norm_module = lambda: Proxy(norm_module())  # type: ignore[assignment]
    try:
        yield
    finally:
        fa._mhc_module, fa._norm_module = mhc_module, norm_module  # type: ignore[assignment]
        TritonLaunch.__call__ = launch_call  # type: ignore[method-assign]
        for m, f in zip(eachers, saved, strict=True):
            m.launch_each = f
        for jit in jits:
            del jit.run


# ------------------------------------------------------------------------------ the ops at T = 1
def cases(T: int, D: int) -> list[dict[str, Any]]:
    """Per (op, backend): the public call, the operator call and the launcher call."""
    import dsv4mtp.optimized as opt
    from dsv4mtp.optimized import _ops
    from dsv4mtp.optimized._dispatch import Facts, backend_names, requirement

    g = torch.Generator(device=DEV).manual_seed(0)
    bf = torch.bfloat16 if DEV == "cuda" else torch.float32

    def rnd(*shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=DEV) * std + mean

    x = rnd(T, N, D).to(bf)
    M = (2 + N) * N
    pre = (x, rnd(M, N * D, std=0.02), rnd(3, std=0.3, mean=1.0), rnd(M, std=0.5))
    head = (x, rnd(N, N * D, std=0.02), rnd(1, std=0.3, mean=1.0), rnd(N, std=0.5))
    post_args = (rnd(T, D).to(bf), x, 2 * torch.rand(T, N, device=DEV),
                 torch.softmax(rnd(T, N, N), dim=-2))  # fmt: skip
    norm = (rnd(T, D).to(bf), rnd(D, std=0.2, mean=1.0).to(bf))
    ops = torch.ops.dsv4mtp
    # preallocated outputs for the public out= calls (no allocation in the timed call)
    o_norm = torch.empty_like(norm[0])
    o_pre = (torch.empty((T, D), dtype=bf, device=DEV), torch.empty((T, N), device=DEV),
             torch.empty((T, N, N), device=DEV))  # fmt: skip
    o_post = torch.empty_like(x)
    o_head = torch.empty((T, D), dtype=bf, device=DEV)
    out: list[dict[str, Any]] = []
    dev = torch.device(DEV)
    for b in backend_names("rms_norm"):
        if requirement("rms_norm", b, Facts(dev, (bf, bf), eps=(EPS,))) is None:
            out.append(dict(
                op="rms_norm", backend=b,
                public=lambda b=b: opt.rms_norm(*norm, EPS, backend=b),
                public_out=lambda b=b: opt.rms_norm(*norm, EPS, backend=b, out=o_norm),
                operator=lambda b=b: ops.rms_norm.default(*norm, EPS, "official", b),
                launcher=lambda b=b: _ops._rms_norm(*norm, EPS, "official", b),
            ))  # fmt: skip
    pkw = dict(rms_norm_eps=EPS, hc_eps=EPS, sinkhorn_iters=20)
    facts = Facts(dev, (bf,), n=N, D=D, eps=(EPS, EPS))
    nothing: list[int] = []
    for b in backend_names("hc_pre"):
        if requirement("hc_pre", b, facts) is None:
            out.append(dict(
                op="hc_pre", backend=b,
                public=lambda b=b: opt.hc_pre(*pre, **pkw, backend=b),
                public_out=lambda b=b: opt.hc_pre(*pre, **pkw, backend=b, out=o_pre),
                operator=lambda b=b: ops.hc_pre.default(
                    *pre, EPS, EPS, 20, 2.0, b, nothing, nothing, False, None, "official"),
                launcher=lambda b=b: _ops._hc_pre(
                    *pre, EPS, EPS, 20, 2.0, b, nothing, nothing, False, None, "official"),
            ))  # fmt: skip
    for b in backend_names("hc_post"):
        if requirement("hc_post", b, Facts(dev, (bf, bf), n=N, D=D)) is None:
            out.append(dict(
                op="hc_post", backend=b,
                public=lambda b=b: opt.hc_post(*post_args, backend=b),
                public_out=lambda b=b: opt.hc_post(*post_args, backend=b, out=o_post),
                operator=lambda b=b: ops.hc_post.default(*post_args, b),
                launcher=lambda b=b: _ops._hc_post(*post_args, b),
            ))  # fmt: skip
    for b in backend_names("hc_head"):
        if requirement("hc_head", b, facts) is None:
            out.append(dict(
                op="hc_head", backend=b,
                public=lambda b=b: opt.hc_head(*head, rms_norm_eps=EPS, hc_eps=EPS, backend=b),
                public_out=lambda b=b: opt.hc_head(
                    *head, rms_norm_eps=EPS, hc_eps=EPS, backend=b, out=o_head),
                operator=lambda b=b: ops.hc_head.default(
                    *head, EPS, EPS, b, nothing, None, "official"),
                launcher=lambda b=b: _ops._hc_head(*head, EPS, EPS, b, nothing, None, "official"),
            ))  # fmt: skip
    return out


def bare(case: dict[str, Any]) -> tuple[Callable[[], None], Callable[[], None]]:
    """The launches of one launcher call, replayed as direct launcher calls and through
    ``JITFunction.run``."""
    case["launcher"]()  # compiled and cached before recording
    case["launcher"]()  # a TritonLaunch keeps its compiled kernel on the first call
    _sync()
    calls: list[Callable[[], Any]] = []
    jit_calls: list[Callable[[], Any]] = []
    with recording(calls, jit_calls):
        case["launcher"]()
    _sync()

    def replay(cs: list[Callable[[], Any]]) -> Callable[[], None]:
        if len(cs) == 1:
            return cs[0]  # type: ignore[return-value]

        def run_all() -> None:
            for c in cs:
                c()

        return run_all

    return replay(calls), replay(jit_calls)


def overhead(a: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for case in cases(1, a.dim):
        row: dict[str, Any] = dict(op=case["op"], backend=case["backend"])
        direct, through_jit = bare(case)
        row["bare"] = host_us(direct, a.calls, a.block)
        row["jit_run"] = host_us(through_jit, a.calls, a.block)
        for level in ("public", "public_out", "operator", "launcher"):
            row[level] = host_us(case[level], a.calls, a.block)
        rows.append(row)
    return rows


def registration(a: argparse.Namespace) -> list[dict[str, Any]]:
    """One no-op (a tensor in, nothing out) through three registrations."""
    lib = torch.library.Library("dsv4mtp_bench", "DEF")
    lib.define("noop(Tensor x) -> ()")

    def noop(x: torch.Tensor) -> None:
        return None

    lib.impl("noop", noop, "CUDA" if DEV == "cuda" else "CPU")

    @torch.library.custom_op("dsv4mtp_bench::noop_custom", mutates_args=())
    def noop_custom(x: torch.Tensor) -> None:
        return None

    x = torch.empty(1, device=DEV)
    rows = [
        dict(mechanism="plain Python call", us=host_us(lambda: noop(x), a.calls, a.block)),
        dict(
            mechanism="Library define/impl (torch.ops.dsv4mtp_bench.noop)",
            us=host_us(lambda: torch.ops.dsv4mtp_bench.noop.default(x), a.calls, a.block),
        ),
        dict(
            mechanism="torch.library.custom_op",
            us=host_us(lambda: noop_custom(x), a.calls, a.block),
        ),
    ]
    del lib
    return rows


# ------------------------------------------------------------------------------ crossover
def crossover(a: argparse.Namespace) -> tuple[list[dict[str, Any]], int | None]:
    import triton

    rows = []
    suggest: list[int | None] = []
    for D in CROSS_D:
        wins: list[tuple[int, bool]] = []
        for T in CROSS_T:
            (x, fn, scale, base) = _head_inputs(T, D)
            out = torch.empty((T, D), dtype=x.dtype, device="cuda")
            ms = {}
            for b in ("triton_fma", "triton_mma"):
                args = (x, fn, scale, base, EPS, EPS, b, [], None, "official")
                ms[b] = triton.testing.do_bench(
                    lambda args=args, out=out: torch.ops.dsv4mtp.hc_head_out.default(
                        *args, out=out
                    ),
                    return_mode="median",
                )
            rows.append(
                dict(D=D, T=T, fma_us=ms["triton_fma"] * 1e3, mma_us=ms["triton_mma"] * 1e3)
            )
            wins.append((T, ms["triton_mma"] < ms["triton_fma"]))
        # the smallest T from which MMA wins at every larger measured T
        first = None
        for T, mma_wins in reversed(wins):
            if not mma_wins:
                break
            first = T
        suggest.append(first)
    both = None if any(s is None for s in suggest) else max(s for s in suggest if s is not None)
    return rows, both


def _head_inputs(T: int, D: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(T + D)
    x = torch.randn((T, N, D), generator=g, device="cuda").to(torch.bfloat16)
    fn = torch.randn((N, N * D), generator=g, device="cuda") * 0.02
    return x, fn, torch.ones(1, device="cuda"), torch.zeros(N, device="cuda")


# ------------------------------------------------------------------------------ mocked driver
def mock_driver() -> list[str]:
    """Install a CUDA driver that needs no GPU and a compile step that records instead of
    compiling (what conformance/test_fastpath.py does); returns the list that receives the
    name of every kernel launched through ``JITFunction.run``."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    class Mock(CudaDriver):
        def __init__(self) -> None:
            self.get_current_device = lambda: 0
            self.get_current_stream = lambda idx: 1234

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *args: Any) -> None:
            return None

        def launch_metadata(self, *args: Any) -> None:
            return None

    def do_compile(self: Any, key: Any, *args: Any) -> Compiled:
        kernel = self.device_caches[0][0][key] = Compiled()
        return kernel

    driver.set_active(Mock())
    JITFunction._do_compile = do_compile  # type: ignore[method-assign]
    plain: list[str] = []
    run = JITFunction.run

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        plain.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    JITFunction.run = counted  # type: ignore[method-assign]
    return plain


def mock_cases(T: int, D: int) -> dict[str, Callable[[], Any]]:
    """Every Triton launcher on CPU tensors, and the operator implementations that call them
    (the ``launcher`` column of the GPU table)."""
    from dsv4mtp.optimized import _ops
    from dsv4mtp.optimized.kernels import mhc_collapse as mc
    from dsv4mtp.optimized.kernels import mhc_head as mh
    from dsv4mtp.optimized.kernels import mhc_mix as mm
    from dsv4mtp.optimized.kernels import mhc_post as mp
    from dsv4mtp.optimized.kernels import rms_norm as rn
    from dsv4mtp.optimized.kernels._launch import workspace

    g = torch.Generator().manual_seed(0)
    bf, M, K = torch.bfloat16, (2 + N) * N, N * D
    x = torch.randn((T, N, D), generator=g).to(bf)
    fn_pre, fn_head = torch.randn((M, K), generator=g), torch.randn((N, K), generator=g)
    s3, s1, b_pre, b_head = torch.ones(3), torch.ones(1), torch.zeros(M), torch.zeros(N)
    out, post, comb = torch.empty((T, D), dtype=bf), torch.empty((T, N)), torch.empty((T, N, N))
    x2, w = torch.randn((T, D), generator=g).to(bf), torch.ones(D, dtype=bf)
    o2, o3 = torch.empty_like(x2), torch.empty_like(x)
    pm, cm = torch.rand((T, N), generator=g), torch.softmax(torch.randn((T, N, N)), dim=-2)
    split = mc.CollapseConfig(64, 256, 64, 64, num_warps=4, num_stages=3, fused=False)
    mcfg = mm.mix_config(M, K)
    S = mcfg.num_splits
    kw = dict(rms_norm_eps=EPS, hc_eps=EPS)
    return {
        "rms_norm_triton": lambda: rn.rms_norm_triton(x2, w, EPS, o2, False),
        "mhc_post_triton": lambda: mp.mhc_post_triton(x2, x, pm, cm, o3),
        "mhc_mix_splitk": lambda: mm.mhc_mix_splitk(
            x.view(T, K), fn_pre, mcfg, workspace("hc_pre.mix", (S, T, M), torch.float32, x.device),
            workspace("hc_pre.sqsum", (S, T), torch.float32, x.device)),
        "mhc_collapse hc_pre": lambda: mc.mhc_collapse(
            x, fn_pre, s3, b_pre, out, **kw, post=post, comb=comb, sinkhorn_iters=20),
        "mhc_collapse hc_head": lambda: mc.mhc_collapse(x, fn_head, s1, b_head, out, **kw,
                                                        post_mult=1.0),
        "mhc_collapse hc_head split": lambda: mc.mhc_collapse(
            x, fn_head, s1, b_head, out, **kw, post_mult=1.0, cfg=split),
        "mhc_head_fma": lambda: mh.mhc_head_fma(x, fn_head, s1, b_head, out, **kw),
        "mhc_head_fma one_launch": lambda: mh.mhc_head_fma(
            x, fn_head, s1, b_head, out, **kw, one_launch=True),
        "op impl rms_norm": lambda: _ops._rms_norm(x2, w, EPS, "official", "triton"),
        "op impl hc_post": lambda: _ops._hc_post(x2, x, pm, cm, "triton"),
        "op impl hc_pre": lambda: _ops._hc_pre(x, fn_pre, s3, b_pre, EPS, EPS, 20, 2.0,
                                               "triton", [], [], False, None, "official"),
        "op impl hc_head fma": lambda: _ops._hc_head(x, fn_head, s1, b_head, EPS, EPS,
                                                     "triton_fma", [], None, "official"),
        "op impl hc_head mma": lambda: _ops._hc_head(x, fn_head, s1, b_head, EPS, EPS,
                                                     "triton_mma", [], None, "official"),
    }  # fmt: skip


def mock(a: argparse.Namespace) -> None:
    from dsv4mtp.optimized.kernels._launch import INTERPRET

    if INTERPRET:
        sys.exit("bench/h200_overhead.py --mock: unset TRITON_INTERPRET")
    plain = mock_driver()
    print(f"Launcher host time with a mocked driver, T = 1, D {a.dim}, n {N}, CPU tensors "
          f"(median of {a.calls}, us); plain = launches through JITFunction.run on a repeat")  # fmt: skip
    for name, fn in mock_cases(1, a.dim).items():
        fn()
        plain.clear()
        fn()
        repeat = len(plain)
        print(f"{name:<30}{host_us(fn, a.calls, a.block):>8.2f}   plain {repeat}")


# ------------------------------------------------------------------------------ main
def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=None, help="write overhead-h200.json here")
    p.add_argument("--calls", type=int, default=2000, help="timed calls per callable")
    p.add_argument("--block", type=int, default=100, help="calls between device syncs")
    p.add_argument("--no-crossover", action="store_true", help="skip the hc_head T sweep")
    p.add_argument("--dim", type=int, default=4096, help="D of the T = 1 overhead cases")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--mock", action="store_true", help="launchers' host time, mocked driver, CPU")
    a = p.parse_args()
    global DEV
    DEV = "cpu" if a.mock else a.device
    if a.mock:
        mock(a)
        return
    if DEV == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/h200_overhead.py: needs a CUDA device")

    import triton

    rows = overhead(a)
    print(f"\nHost time per eager call, T = 1, D {a.dim}, n {N}, {DEV} (median of {a.calls}, us)")
    head = ("op", "backend", "public", "pub.out", "op", "launcher", "bare", "jit.run",
            "pub-bare", "out-bare", "op-bare", "valid.", "regist.", "launch.")  # fmt: skip
    print(f"{head[0]:<9}{head[1]:<20}" + "".join(f"{h:>10}" for h in head[2:]))
    for r in rows:
        vals = (r["public"], r["public_out"], r["operator"], r["launcher"], r["bare"],
                r["jit_run"], r["public"] - r["bare"], r["public_out"] - r["bare"],
                r["operator"] - r["bare"], r["public"] - r["operator"],
                r["operator"] - r["launcher"], r["launcher"] - r["bare"])  # fmt: skip
        print(f"{r['op']:<9}{r['backend']:<20}" + "".join(f"{v:>10.2f}" for v in vals))
    print(
        "bare = the compiled kernels' launchers called directly; jit.run = the same launches "
        "through kernel[grid](...); pub.out = the public call with out= (no output "
        "allocation).  valid. = public - op (validation, backend choice); "
        "regist. = op - launcher (torch.library dispatch); launch. = launcher - bare "
        "(allocation, launch arithmetic)"
    )

    reg = registration(a)
    print("\nOne no-op through each registration (median host us per call)")
    for r in reg:
        print(f"{r['mechanism']:<56}{r['us']:>8.2f}")

    cross: list[dict[str, Any]] = []
    min_t = None
    if not a.no_crossover and DEV == "cuda":
        cross, min_t = crossover(a)
        print("\nhc_head: triton_fma vs triton_mma (triton.testing.do_bench median, us)")
        print(f"{'D':>6}{'T':>7}{'fma':>10}{'mma':>10}  faster")
        for r in cross:
            faster = "mma" if r["mma_us"] < r["fma_us"] else "fma"
            print(f"{r['D']:>6}{r['T']:>7}{r['fma_us']:>10.2f}{r['mma_us']:>10.2f}  {faster}")
        print(
            f"crossover: MMA faster from T = {min_t} on at every D "
            f"(HEAD_MMA_MIN_T = {min_t}; None: FMA stays the default at every T)"
        )

    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        meta = dict(
            gpu=torch.cuda.get_device_name() if DEV == "cuda" else DEV, torch=torch.__version__,
            triton=triton.__version__, python=platform.python_version(), calls=a.calls,
        )  # fmt: skip
        doc = dict(meta=meta, overhead=rows, registration=reg, crossover=cross,
                   head_mma_min_t=min_t)  # fmt: skip
        (a.out / "overhead-h200.json").write_text(json.dumps(doc, indent=1))
        print(f"\nwrote {a.out / 'overhead-h200.json'}")


if __name__ == "__main__":
    main()
