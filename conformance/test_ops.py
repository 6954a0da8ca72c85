"""The optimized ops as PyTorch operators (optimized/_ops.py): schemas under ``torch.ops.dsv4mtp``,
``torch.library.opcheck`` for every operator and backend that applies on this machine,
``torch.compile(fullgraph=True)`` over the public functions without graph breaks, and
``batch_invariant=True`` giving a token the same bits alone as inside a batch.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (small shapes); on CUDA the same tests run
in bf16 and take in the FlashInfer backends where they apply.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

import dsv4mtp.optimized as opt
from dsv4mtp.errors import InputError
from dsv4mtp.optimized._dispatch import Facts, backend_names, requirement
from dsv4mtp.optimized._ops import NAMESPACE, OPS, SCHEMAS, schedule_fields

EPS = 1e-6
N, D, T = 4, 32, 5  # D a multiple of 8 (FlashInfer's mHC kernels on CUDA); n = 4 streams


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def _inputs(op: str, device: str, T: int = T, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Tensor arguments of ``op`` (V4-like magnitudes): x, fn, scale, base or f, residual, post,
    comb, or x, weight."""
    g = torch.Generator().manual_seed(seed)
    dt = _dtype(device)

    def rnd(*shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * std + mean).to(device)

    x = rnd(T, N, D).to(dt)
    if op == "rms_norm":
        return rnd(T, D).to(dt), rnd(D, std=0.2, mean=1.0).to(dt)
    if op == "hc_pre":
        M = (2 + N) * N
        return x, rnd(M, N * D, std=0.02), rnd(3, std=0.3, mean=1.0), rnd(M, std=0.5)
    if op == "hc_head":
        return x, rnd(N, N * D, std=0.02), rnd(1, std=0.3, mean=1.0), rnd(N, std=0.5)
    post = (2 * torch.rand(T, N, generator=g)).to(device)
    comb = torch.softmax(rnd(T, N, N), dim=-2)
    return rnd(T, D).to(dt), x, post, comb


def _facts(op: str, tensors: tuple[torch.Tensor, ...]) -> Facts:
    dev = tensors[0].device
    if op == "rms_norm":
        return Facts(dev, (tensors[0].dtype, tensors[1].dtype), eps=(EPS,))
    if op == "hc_post":
        f, residual = tensors[:2]
        return Facts(dev, (f.dtype, residual.dtype), n=N, D=D)
    return Facts(dev, (tensors[0].dtype,), n=N, D=D, eps=(EPS, EPS))


def _op_call(
    op: str, backend: str, tensors: tuple[torch.Tensor, ...], norm: bool = False
) -> tuple[Any, ...]:
    """The operator's non-tensor arguments after the tensors, as the public function passes them;
    with ``norm`` hc_pre / hc_head end in the next RMSNorm (on "triton_fma" in its launch, on
    the others after it)."""
    nothing: list[int] = []
    if op == "rms_norm":
        return (*tensors, EPS, "official", backend)
    x = tensors[0]
    norm_args = (torch.linspace(0.5, 1.5, D).to(x), "vllm") if norm else (None, "")
    if op == "hc_pre":
        return (*tensors, EPS, EPS, 3, 2.0, backend, nothing, nothing, False, *norm_args)
    if op == "hc_head":
        return (*tensors, EPS, EPS, backend, nothing, *norm_args)
    return (*tensors, backend)


def _outs(op: str, tensors: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    x = tensors[0]
    if op == "rms_norm":
        return {"out": torch.empty_like(x)}
    if op == "hc_pre":
        f32 = torch.float32
        return {
            "layer_input": x.new_empty((T, D)),
            "post": x.new_empty((T, N), dtype=f32),
            "comb": x.new_empty((T, N, N), dtype=f32),
        }
    if op == "hc_head":
        return {"out": x.new_empty((T, D))}
    return {"out": torch.empty_like(tensors[1])}


def _cases(device: str) -> list[tuple[str, str]]:
    cases = []
    for op in ("rms_norm", "hc_pre", "hc_post", "hc_head"):
        facts = _facts(op, _inputs(op, device, T=1))
        cases += [(op, b) for b in backend_names(op) if requirement(op, b, facts) is None]
    return cases


_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_every_operator_is_defined_with_its_schema() -> None:
    ns = getattr(torch.ops, NAMESPACE)
    ops = (
        "rms_norm", "hc_pre", "hc_post", "hc_head", "moe_route", "fused_experts", "moe",
        "sink_attention", "sink_attention_varlen", "linear", "grouped_linear",
        "apply_rope", "q_head_norm_rope", "kv_norm_rope", "sink_attention_cache",
        "kv_cache_write", "lm_head_argmax", "lm_head_logits", "sink_attention_paged",
        "step_guard", "embed_norms",
        "hc_post_pre", "hc_post_head", "eh_proj", "logits_argmax",
    )  # fmt: skip
    assert set(OPS) == {f"{b}{s}" for b in ops for s in ("", "_out")}
    for name, schema in SCHEMAS.items():
        parsed = getattr(ns, name).default._schema
        assert str(parsed) == f"{NAMESPACE}::{schema}", name
        written = [a.name for a in parsed.arguments if a.alias_info and a.alias_info.is_write]
        assert all(a.kwarg_only for a in parsed.arguments if a.name in written), name
        if name.endswith("_out"):
            assert written and not parsed.returns, name
        else:
            # A functional op writes nothing but a caller-owned workspace that it leaves as it
            # found it: the dense linears' split-K tile counters (zeros before and after).
            assert set(written) <= {"counters", "e_counters", "h_counters"}, name


def test_importing_twice_registers_once() -> None:
    """The repository root also imports optimized/ as ``optimized``: a second copy of _ops finds
    the operators defined and registers nothing."""
    import importlib.util
    import sys

    path = opt._ops.__file__  # type: ignore[attr-defined]
    spec = importlib.util.spec_from_file_location("_dsv4mtp_ops_copy", path)
    assert spec is not None and spec.loader is not None
    copy = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = copy
    try:
        copy.__package__ = "dsv4mtp.optimized"
        spec.loader.exec_module(copy)
        assert copy._LIB is None
    finally:
        del sys.modules[spec.name]


@pytest.mark.parametrize(("op", "backend"), _cases(_DEVICE))
@pytest.mark.parametrize("variant", ["", "_out"])
def test_opcheck(op: str, backend: str, variant: str, device: str) -> None:
    """Schema (no undeclared mutation or aliasing), fake kernel vs real outputs, and AOT dispatch
    with dynamic shapes, for the functional and the out variant of every applicable backend."""
    tensors = _inputs(op, device)
    args = _op_call(op, backend, tensors, norm=not variant)  # the functional one with the norm
    kwargs = _outs(op, tensors) if variant else {}
    operator = getattr(getattr(torch.ops, NAMESPACE), op + variant).default
    torch.library.opcheck(operator, args, kwargs)


def test_operator_rejects_auto_and_unknown_backends() -> None:
    tensors = _inputs("hc_post", _DEVICE)
    with pytest.raises(InputError, match="resolves 'auto'"):
        torch.ops.dsv4mtp.hc_post(*tensors, "auto")


def test_schedule_fields_round_trip() -> None:
    from dsv4mtp.optimized._ops import _collapse_cfg, _mix_cfg
    from dsv4mtp.optimized.kernels.mhc_collapse import CollapseConfig
    from dsv4mtp.optimized.kernels.mhc_mix import MixConfig

    c = CollapseConfig(16, 32, 16, 16, num_warps=4, num_stages=1, fused=False)
    m = MixConfig(block_t=16, block_k=32, num_splits=2, num_warps=4, num_stages=1)
    cf, mf = schedule_fields(c, m)
    assert _collapse_cfg(tuple(cf)) == c and _mix_cfg(tuple(mf)) == m
    assert schedule_fields(None, None) == ([], [])


class _Layer(torch.nn.Module):
    """hc_pre -> rms_norm -> hc_post -> hc_head through the public functions."""

    def __init__(self, device: str, out_buffers: bool) -> None:
        super().__init__()
        _, self.fn, self.scale, self.base = _inputs("hc_pre", device, seed=1)
        _, self.head_fn, self.head_scale, self.head_base = _inputs("hc_head", device, seed=2)
        self.w = _inputs("rms_norm", device, seed=3)[1]
        self.out_buffers = out_buffers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = dict(rms_norm_eps=EPS, hc_eps=EPS)
        li, post, comb = opt.hc_pre(x, self.fn, self.scale, self.base, **eps, sinkhorn_iters=3)
        if self.out_buffers:
            f = torch.empty_like(li)
            opt.rms_norm(li, self.w, EPS, out=f)
            y = torch.empty_like(x)
            opt.hc_post(f, x, post, comb, out=y)
            z = x.new_empty((x.shape[0], x.shape[2]))
            return opt.hc_head(y, self.head_fn, self.head_scale, self.head_base, **eps, out=z)
        f = opt.rms_norm(li, self.w, EPS)
        y = opt.hc_post(f, x, post, comb)
        return opt.hc_head(y, self.head_fn, self.head_scale, self.head_base, **eps)


@pytest.mark.parametrize("out_buffers", [False, True], ids=["functional", "out"])
def test_compiled_layer_has_no_graph_breaks(out_buffers: bool, device: str) -> None:
    """torch.compile(fullgraph=True) traces the public functions (validation, backend choice)
    into one graph of dsv4mtp operators; the compiled layer gives eager's bits."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    layer = _Layer(device, out_buffers)
    x = _inputs("hc_pre", device)[0]
    eager = layer(x)
    torch._dynamo.reset()
    counters.clear()
    backend = "aot_eager" if device == "cpu" else "inductor"
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    got = compiled(x)
    assert dict(counters["graph_break"]) == {}
    assert torch.equal(got, eager)
    torch._dynamo.reset()


@pytest.mark.parametrize("op", ["rms_norm", "hc_pre", "hc_post", "hc_head"])
def test_batch_invariant_rows_are_bitwise_the_same_alone_and_in_a_batch(
    op: str, device: str
) -> None:
    tensors = _inputs(op, device)
    kw: dict[str, Any] = {"batch_invariant": True}
    if op in ("hc_pre", "hc_head"):
        kw.update(rms_norm_eps=EPS, hc_eps=EPS)
    if op == "hc_pre":
        kw["sinkhorn_iters"] = 3
    fn = getattr(opt, op)

    def call(ts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        res = fn(ts[0], ts[1], EPS, **kw) if op == "rms_norm" else fn(*ts, **kw)
        return tuple(res) if isinstance(res, tuple) else (res,)

    def rows(t: int) -> tuple[torch.Tensor, ...]:
        if op == "hc_post":
            return tuple(a[t : t + 1] for a in tensors)
        return (tensors[0][t : t + 1], *tensors[1:])

    full = call(tensors)
    for t in (0, 2, T - 1):
        for i, (f, p) in enumerate(zip(full, call(rows(t)), strict=True)):
            assert torch.equal(f[t : t + 1], p), f"{op} output {i}: token {t} differs alone"
