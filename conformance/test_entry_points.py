"""Hardening of the public entry points: bad input becomes a :class:`DSV4Error` subclass whose
message names the argument, file or tensor; nothing out of range is accepted silently."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from dsv4mtp.conformance._mtp_random import random_mtp_layer
from dsv4mtp.reference import ConfigError, DSV4Config, InputError, MTPLayer

F32 = torch.float32
CFG = DSV4Config.tiny()
_LAYER: dict[str, MTPLayer] = {}


# The optimized ops run on CUDA, or on the CPU under TRITON_INTERPRET=1 (the CPU tier).
OPT_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def layer() -> MTPLayer:
    if "f32" not in _LAYER:
        _LAYER["f32"] = random_mtp_layer(CFG, dtype=F32, seed=0)
    return _LAYER["f32"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: Any) -> str:
    from dsv4mtp.checkpoint.synthetic import make_synthetic_checkpoint

    return make_synthetic_checkpoint(str(tmp_path_factory.mktemp("ck") / "ck"), CFG)


def inputs(T: int = 4, start: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG.vocab_size, (T,), generator=g)
    return ids, torch.arange(start, start + T), torch.randn(T, CFG.hc_dim, generator=g)


# ------------------------------------------------------------------ non-finite prev_hidden
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_prev_hidden_names_the_first_bad_row(bad: float) -> None:
    L = layer()
    ids, pos, prev = inputs()
    prev[2, 17] = bad
    prev[3, 0] = bad
    pattern = rf"prev_hidden: expected finite values, found {bad} at row 2, column 17 \(2 non"
    with pytest.raises(InputError, match=pattern):
        L.draft(ids, pos, prev, num_tokens=2)
    with pytest.raises(InputError, match=pattern):
        L.forward(ids, pos, prev)
    with pytest.raises(InputError, match=r"hidden: expected finite values, found .* at row 2"):
        L.compute_logits(prev)


# ------------------------------------------------------------------ spec_step
@pytest.mark.parametrize("step", [-1, -3, 1.0, True, "0", None])
def test_spec_step_must_be_a_non_negative_int(step: object) -> None:
    L = layer()
    ids, pos, prev = inputs()
    with pytest.raises(InputError, match=rf"spec_step: expected an int >= 0, got {step!r}"):
        L.forward(ids, pos, prev, spec_step=step)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"spec_step: expected an int >= 0"):
        L.compute_logits(prev, spec_step=step)  # type: ignore[arg-type]


def test_spec_step_past_the_last_layer_wraps() -> None:
    """Documented: step k runs layer k % num_nextn_predict_layers (one layer here)."""
    L = layer()
    ids, pos, prev = inputs()
    assert torch.equal(L.forward(ids, pos, prev, spec_step=5), L.forward(ids, pos, prev))


# ------------------------------------------------------------------ positions
def test_positions_must_be_below_max_position_embeddings() -> None:
    L = layer()
    top = CFG.max_position_embeddings
    ids, pos, prev = inputs(start=top - 3)  # positions top-3 .. top
    with pytest.raises(
        InputError,
        match=rf"positions: expected positions < max_position_embeddings={top}, got {top}",
    ):
        L.forward(ids, pos, prev)
    ids, pos, prev = inputs(start=top - 4)  # the last row is at top - 1: valid for forward
    L.forward(ids, pos, prev)
    L.draft(ids, pos, prev, num_tokens=1)
    # draft feeds position + k for k < num_tokens: top - 1 + 1 is out of range
    with pytest.raises(
        InputError,
        match=rf"positions: drafting 2 token\(s\) from position {top - 1} feeds position {top}",
    ):
        L.draft(ids, pos, prev, num_tokens=2)


# ------------------------------------------------------------------ forced tokens
@pytest.mark.parametrize("num_tokens", [1, 2])
def test_forced_tokens_must_be_int64_ids_in_the_vocab(num_tokens: int) -> None:
    L = layer()
    ids, pos, prev = inputs()
    ok = torch.zeros(1, num_tokens, dtype=torch.int64)
    for bad, value in ((CFG.vocab_size, CFG.vocab_size), (10**6, 10**6), (-1, -1)):
        forced = ok.clone()
        forced[0, -1] = bad
        pattern = (
            rf"forced_tokens: expected ids in \[0, vocab_size={CFG.vocab_size}\), got {value} "
            rf"at row 0, step {num_tokens - 1}"
        )
        with pytest.raises(InputError, match=pattern):
            L.draft(ids, pos, prev, num_tokens=num_tokens, forced_tokens=forced)
    with pytest.raises(
        InputError, match=r"forced_tokens: expected an int64 tensor, got torch.float32"
    ):
        L.draft(ids, pos, prev, num_tokens=num_tokens, forced_tokens=ok.float())
    with pytest.raises(InputError, match=r"forced_tokens: expected an int64 tensor, got list"):
        L.draft(ids, pos, prev, num_tokens=num_tokens, forced_tokens=[[0] * num_tokens])  # type: ignore[arg-type]


# ------------------------------------------------------------------ temperature
@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), 0.0, -1.0, "1", True])
def test_sampling_temperature_must_be_finite_and_positive(temperature: object) -> None:
    L = layer()
    ids, pos, prev = inputs()
    with pytest.raises(InputError, match=r"temperature: expected a finite number > 0 for sampling"):
        L.draft(ids, pos, prev, num_tokens=1, greedy=False, temperature=temperature)  # type: ignore[arg-type]
    L.draft(ids, pos, prev, num_tokens=1, greedy=True, temperature=temperature)  # type: ignore[arg-type]


# ------------------------------------------------------------------ eps arguments
BAD_EPS = [-1e-6, float("nan"), float("inf"), "1e-6", True, None]


def _mhc_args(n: int = 4, D: int = 32, rows: int | None = None, scales: int = 3):
    g = torch.Generator().manual_seed(0)
    rows = rows if rows is not None else (2 + n) * n
    x = torch.randn(3, n, D, generator=g)
    return x, 0.02 * torch.randn(rows, n * D, generator=g), torch.ones(scales), torch.zeros(rows)


@pytest.mark.parametrize("impl", ["reference", "optimized"])
@pytest.mark.parametrize("eps", BAD_EPS)
def test_negative_or_non_finite_eps_is_refused(impl: str, eps: object) -> None:
    import importlib

    mod = importlib.import_module(f"dsv4mtp.{impl}")
    x = torch.randn(3, 32)
    with pytest.raises(InputError, match=rf"eps: expected a finite number >= 0, got {eps!r}"):
        mod.rms_norm(x, None, eps)
    pre = _mhc_args()
    head = _mhc_args(rows=4, scales=1)
    for name in ("rms_norm_eps", "hc_eps"):
        kw: dict[str, object] = {"rms_norm_eps": 1e-6, "hc_eps": 1e-6, name: eps}
        with pytest.raises(InputError, match=rf"{name}: expected a finite number >= 0"):
            mod.hc_pre(*pre, sinkhorn_iters=3, **kw)
        with pytest.raises(InputError, match=rf"{name}: expected a finite number >= 0"):
            mod.hc_head(*head, **kw)
    if impl == "reference":
        with pytest.raises(InputError, match=r"eps: expected a finite number >= 0"):
            mod.sinkhorn(torch.zeros(2, 4, 4), iters=3, eps=eps)


@pytest.mark.parametrize("impl", ["reference", "optimized"])
@pytest.mark.parametrize("iters", [0, 2.0, True, "3"])
def test_sinkhorn_iters_must_be_a_positive_int(impl: str, iters: object) -> None:
    import importlib

    mod = importlib.import_module(f"dsv4mtp.{impl}")
    with pytest.raises(InputError, match=rf"sinkhorn_iters: expected an int >= 1, got {iters!r}"):
        mod.hc_pre(*_mhc_args(), rms_norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=iters)


def test_zero_eps_is_allowed() -> None:
    from dsv4mtp import optimized, reference

    x = torch.randn(3, 32)
    got = optimized.rms_norm(x.to(OPT_DEVICE), None, 0.0).cpu()
    torch.testing.assert_close(reference.rms_norm(x, None, 0.0), got)


# ------------------------------------------------------------------ kv_cache
@pytest.mark.parametrize(
    ("cache", "pattern"),
    [
        ("a", r"kv_cache: expected a KVCache or a list of KVCache \(one per sequence\), got str"),
        ({}, r"kv_cache: expected a KVCache or a list of KVCache \(one per sequence\), got dict"),
        ([None], r"kv_cache\[0\]: expected a KVCache \(layer.new_kv_cache\(\)\), got NoneType"),
        (["abc"], r"kv_cache\[0\]: expected a KVCache \(layer.new_kv_cache\(\)\), got str"),
    ],
)
def test_kv_cache_must_be_kv_caches(cache: object, pattern: str) -> None:
    L = layer()
    ids, pos, prev = inputs()
    with pytest.raises(InputError, match=pattern):
        L.forward(ids, pos, prev, kv_cache=cache)  # type: ignore[arg-type]


def test_kv_cache_window_must_match_the_config() -> None:
    from dsv4mtp.reference import KVCache

    L = layer()
    ids, pos, prev = inputs()
    with pytest.raises(
        InputError,
        match=rf"kv_cache\[0\]: expected window sliding_window={CFG.sliding_window}, got 3",
    ):
        L.forward(ids, pos, prev, kv_cache=KVCache(3))
    for w in (0, 2.0, True):
        with pytest.raises(InputError, match=rf"window: expected an int >= 1, got {w!r}"):
            KVCache(w)  # type: ignore[arg-type]


# ------------------------------------------------------------------ dtype and device arguments
NO_CUDA = "CUDA is not available on this machine"
BAD_DEVICES = [
    ("junk", r"device: expected 'cpu', 'cuda' or 'cuda:N', got 'junk'"),
    ("", r"device: expected 'cpu', 'cuda' or 'cuda:N', got ''"),
    ("meta", r"device: expected a cpu or cuda device, got 'meta'"),
    (3, r"device: expected 'cpu', 'cuda', 'cuda:N' or a torch.device, got int 3"),
]
if not torch.cuda.is_available():
    BAD_DEVICES += [
        ("cuda", rf"device: 'cuda' requested but {NO_CUDA}"),
        ("cuda:1", rf"device: 'cuda:1' requested but {NO_CUDA}"),
        (torch.device("cuda"), rf"device: 'cuda' requested but {NO_CUDA}"),
    ]


@pytest.mark.parametrize(("device", "pattern"), BAD_DEVICES)
def test_bad_device_is_a_config_error(checkpoint: str, device: object, pattern: str) -> None:
    from dsv4mtp.checkpoint.load import load_mtp_checkpoint

    with pytest.raises(ConfigError, match=pattern):
        MTPLayer.from_checkpoint(checkpoint, device=device)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=pattern):
        MTPLayer.from_loaded(load_mtp_checkpoint(checkpoint), device=device)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("dtype", "pattern"),
    [
        ("bfloat16", r"got str 'bfloat16'; pass torch.bfloat16"),
        ("fp32", r"got str 'fp32'$"),
        (torch.int8, r"got int8$"),
        (None, r"got NoneType None$"),
    ],
)
def test_bad_dtype_is_a_config_error(checkpoint: str, dtype: object, pattern: str) -> None:
    from dsv4mtp.checkpoint.load import load_mtp_checkpoint

    prefix = r"dtype: expected a torch.dtype in \(float64, float32, bfloat16, float16\), "
    with pytest.raises(ConfigError, match=prefix + pattern):
        MTPLayer.from_checkpoint(checkpoint, dtype=dtype)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=prefix + pattern):
        MTPLayer.from_loaded(load_mtp_checkpoint(checkpoint), dtype=dtype)  # type: ignore[arg-type]
    L = layer()
    with pytest.raises(ConfigError, match=prefix + pattern):
        MTPLayer(CFG, L.layers, L.embed, dtype=dtype)  # type: ignore[arg-type]


def test_constructors_name_a_wrong_object() -> None:
    L = layer()
    with pytest.raises(ConfigError, match=r"checkpoint: expected an MTPCheckpoint .*got str"):
        MTPLayer.from_loaded("dir")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"path: expected a checkpoint directory .*got int"):
        MTPLayer.from_checkpoint(3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"config: expected a DSV4Config, got dict"):
        MTPLayer({}, L.layers, L.embed)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"embed: expected a torch.Tensor, got list"):
        MTPLayer(CFG, L.layers, [])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"layers: expected a sequence of MTPLayerParams"):
        MTPLayer(CFG, [None], L.embed)  # type: ignore[list-item]
    with pytest.raises(ConfigError, match=r"semantics: expected a Semantics .*got str"):
        MTPLayer(CFG, L.layers, L.embed, semantics="math")  # type: ignore[arg-type]


# ------------------------------------------------------------------ optimized kernels' launchers
def test_collapse_launcher_errors_are_typed() -> None:
    """The launcher's own refusals are DSV4Errors naming the argument."""
    from dsv4mtp.optimized.kernels.mhc_collapse import collapse_config, mhc_collapse

    x, fn, scale, base = _mhc_args()
    out = torch.empty(3, 32)
    trace = torch.zeros(1, 1, dtype=torch.int64)
    cfg = dataclasses.replace(collapse_config(4, 32), fused=False)
    with pytest.raises(InputError, match=r"trace: expected a fused schedule .*got fused=False"):
        mhc_collapse(x, fn[:4], scale[:1], base[:4], out, rms_norm_eps=1e-6, hc_eps=1e-6,
                     cfg=cfg, trace=trace)  # fmt: skip


# ------------------------------------------------------------------ every public op, garbage in
GARBAGE = ["x", None, 1.5, torch.zeros(2, dtype=torch.int8), torch.zeros(0)]


def _public_calls() -> dict[str, tuple[Any, tuple, dict]]:
    """name -> (function, valid positional args, valid keyword args) for every public function
    of dsv4mtp.reference / dsv4mtp.optimized that takes tensors, and the MTPLayer methods."""
    from dsv4mtp import optimized as O
    from dsv4mtp import reference as R
    from dsv4mtp.conformance._mtp_random import random_attention_params, random_moe_params

    g = torch.Generator().manual_seed(0)
    L = layer()
    T, n, D = 3, 4, 32
    x3 = torch.randn(T, n, D)
    pre = (x3, 0.02 * torch.randn(24, n * D), torch.ones(3), torch.zeros(24))
    head = (x3, 0.02 * torch.randn(4, n * D), torch.ones(1), torch.zeros(4))
    post = (torch.randn(T, D), x3, torch.rand(T, n), torch.rand(T, n, n))
    ids, pos, prev = inputs()
    xa = torch.randn(4, CFG.hidden_size, dtype=torch.float64)
    ap, mp = random_attention_params(CFG, g), random_moe_params(CFG, g)
    eps = {"rms_norm_eps": 1e-6, "hc_eps": 1e-6}
    calls: dict[str, tuple[Any, tuple, dict]] = {}
    for impl, M, dev in (("reference", R, "cpu"), ("optimized", O, OPT_DEVICE)):

        def on(*ts: torch.Tensor, dev: str = dev) -> tuple[torch.Tensor, ...]:
            return tuple(t.to(dev) for t in ts)

        calls[f"{impl}.rms_norm"] = (M.rms_norm, (*on(torch.randn(3, 8), torch.ones(8)), 1e-6), {})
        calls[f"{impl}.hc_pre"] = (M.hc_pre, on(*pre), {**eps, "sinkhorn_iters": 3})
        calls[f"{impl}.hc_head"] = (M.hc_head, on(*head), eps)
        calls[f"{impl}.hc_post"] = (M.hc_post, on(*post), {})
    sink = (torch.randn(3, 4, 16), torch.arange(3), torch.randn(3, 16), torch.arange(3))
    calls |= {
        "sinkhorn": (R.sinkhorn, (torch.randn(2, 4, 4),), {"iters": 3, "eps": 1e-6}),
        "apply_rope": (R.apply_rope, (torch.randn(3, 2, 8), torch.arange(3), torch.rand(4)), {}),
        "rope_frequencies": (R.rope_frequencies, (8, 10000.0), {}),
        "fp8_block_roundtrip": (R.fp8_block_roundtrip, (torch.randn(3, 256), 128), {}),
        "attention": (R.attention, (xa, pos, ap, CFG), {}),
        "sink_attention": (R.sink_attention, (*sink, torch.randn(4)), {"window": 4, "scale": 0.25}),
        "moe": (R.moe, (xa, mp, CFG), {}),
        "route": (R.route, (xa, mp.gate_weight, mp.gate_bias, CFG), {}),
        "swiglu_expert": (
            R.swiglu_expert,
            (xa, mp.shared_w1, mp.shared_w3, mp.shared_w2),
            {"limit": 10.0},
        ),
        "MTPLayer.forward": (L.forward, (ids, pos, prev), {"kv_cache": None, "spec_step": 0}),
        "MTPLayer.compute_logits": (L.compute_logits, (prev,), {"spec_step": 0}),
        "MTPLayer.draft": (
            L.draft,
            (ids, pos, prev),
            {"num_tokens": 2, "greedy": False, "temperature": 1.0, "generator": None},
        ),
    }
    return calls


_CALLS: dict[str, tuple[Any, tuple, dict]] = {}


@pytest.mark.parametrize(
    "name",
    ["reference.rms_norm", "optimized.rms_norm", "reference.hc_pre", "optimized.hc_pre",
     "reference.hc_head", "optimized.hc_head", "reference.hc_post", "optimized.hc_post",
     "sinkhorn", "apply_rope", "rope_frequencies", "fp8_block_roundtrip", "attention",
     "sink_attention", "moe", "route", "swiglu_expert", "MTPLayer.forward",
     "MTPLayer.compute_logits", "MTPLayer.draft"],
)  # fmt: skip
def test_public_ops_turn_garbage_into_dsv4_errors(name: str) -> None:
    """Each argument in turn replaced by a str, None, a float, an int8 tensor, an empty tensor:
    the call either works or raises a DSV4Error, never a raw TypeError / AttributeError /
    RuntimeError from deep inside."""
    from dsv4mtp.reference import DSV4Error

    if not _CALLS:
        _CALLS.update(_public_calls())
    fn, args, kw = _CALLS[name]
    fn(*args, **kw)  # the valid call works
    slots = [(i, None) for i in range(len(args))] + [(None, k) for k in kw]
    for (i, k), bad in ((s, b) for s in slots for b in GARBAGE):
        a, kk = list(args), dict(kw)
        if k is None:
            a[i] = bad
        else:
            kk[k] = bad
        try:
            fn(*a, **kk)
        except DSV4Error:
            pass
        except Exception as e:  # the assertion names the argument and the garbage
            pytest.fail(f"{name}: argument {k or i} = {bad!r}: {type(e).__name__}: {e}")
