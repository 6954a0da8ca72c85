"""The eager optimized MTP layer (``dsv4mtp.optimized.MTPLayer``, the optimized ops composed in
the reference's order) against the reference layer, on synthetic checkpoints of the tiny config.

Both layers are built from the same loaded checkpoint (mxfp4 experts with the ``math`` preset,
fp8 experts with ``official``), in bf16, and fed the same inputs: a prefill of two sequences
with KV caches then decode steps (residual and logits compared at every step, each layer with its
own caches; rows whose expert selection moved excused and counted, conformance/_routing.py); ``draft``
teacher-forced with the reference's greedy tokens (logits per step, top-1 mismatches only at the
reference's near-ties, counted) and free-running greedy; the dense
constructor path; bad inputs (the reference's InputError) and the max_num_tokens / max_batch
bounds.  Inputs are drawn on the CPU; the optimized layer lives on the suite's ``device`` (CUDA
in the GPU tier, else the CPU, where the Triton kernels run in the interpreter) behind
:class:`OnDevice`, which moves arguments there and results back.
"""

from __future__ import annotations

import pytest
import torch

from dsv4mtp.checkpoint.load import load_mtp_checkpoint
from dsv4mtp.checkpoint.synthetic import make_synthetic_checkpoint
from dsv4mtp.config import DSV4Config
from dsv4mtp.conformance._routing import Excuses, draft_steps_kept, record_moe_inputs
from dsv4mtp.errors import ConfigError, InputError
from dsv4mtp.layer import LayerOps
from dsv4mtp.optimized import MTPLayer as OptLayer
from dsv4mtp.params import build_layer_params
from dsv4mtp.reference import MTPLayer as RefLayer

BF16 = torch.bfloat16
CFG = DSV4Config.tiny()

# Tolerances: relative Frobenius error vs the bf16 reference, per preset, for the residual
# (T, nD) and the logits (T, V).  Both compute the same math in fp32 with the same bf16
# roundings; they differ in fp32 summation order (tiled GEMMs, the online softmax, the MoE's
# slot-order reduce), so a bf16 rounding (2^-9) lands on the other side for a few elements after
# each of ~15 ops and propagates through two sublayers and the routing (a near-tie may pick
# another expert).  The LM head differs only in fp32 summation order on identical bf16 inputs
# (cuBLAS on the GPU vs the reference's 16384-column chunks; on the CPU the same matmul).
# On the CPU the logits of the same residual are bit for bit the reference's (one chunk, same matmul).
#   math:     measured <= 4.5e-3 (residual), <= 5.3e-3 (logits), 6.5e-4 (cached KV rows); bound 2e-2.
#   official: act_quant and fp8_kv add e4m3 rounding boundaries, where such a flipped element
#             moves by one e4m3 step (2^-4) and is spread over its row by the next GEMM;
#             measured <= 2.5e-2 (residual and logits; KV rows equal); bound 6e-2.
TOL = {"math": 2e-2, "official": 6e-2}
CASES = [("mxfp4", "math"), ("fp8", "official")]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), "NaN/inf in the optimized output"
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        fmt: load_mtp_checkpoint(make_synthetic_checkpoint(root / fmt, CFG, expert_format=fmt))
        for fmt in ("mxfp4", "fp8")
    }


class OnDevice:
    """An optimized layer used from CPU tensors: tensor arguments (and a generator's seed) go to
    the layer's device, tensor results come back; every other attribute is the layer's.  Its
    KV caches hold device tensors (compare them with ``.cpu()``)."""

    def __init__(self, layer: OptLayer) -> None:
        self.layer = layer

    def __getattr__(self, name: str):
        return getattr(self.layer, name)

    def _call(self, name: str, *args, **kwargs):
        dev = self.layer.device

        def move(v):
            if isinstance(v, torch.Tensor):
                return v.to(dev)
            if isinstance(v, torch.Generator) and v.device != dev:
                return torch.Generator(device=dev).manual_seed(v.initial_seed())
            return v

        out = getattr(self.layer, name)(*map(move, args), **{k: move(v) for k, v in kwargs.items()})
        if isinstance(out, tuple):
            return tuple(t.cpu() for t in out)
        return out.cpu()

    def forward(self, *args, **kwargs):
        return self._call("forward", *args, **kwargs)

    def compute_logits(self, *args, **kwargs):
        return self._call("compute_logits", *args, **kwargs)

    def draft(self, *args, **kwargs):
        return self._call("draft", *args, **kwargs)


_PAIRS: dict[tuple[str, str, str], tuple[RefLayer, OnDevice]] = {}


def pair(loaded, fmt: str, preset: str, device: str) -> tuple[RefLayer, OnDevice]:
    if (fmt, preset, device) not in _PAIRS:
        ref = RefLayer.from_loaded(loaded[fmt], preset=preset, dtype=BF16)
        opt = OptLayer.from_loaded(
            loaded[fmt], preset=preset, dtype=BF16, device=device, max_num_tokens=32, max_batch=4
        )
        _PAIRS[fmt, preset, device] = ref, OnDevice(opt)
    return _PAIRS[fmt, preset, device]


def inputs(T: int, seed: int = 1, start: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (T,), generator=g)
    prev = torch.randn(T, CFG.hc_dim, generator=g).to(BF16)
    return ids, torch.arange(start, start + T), prev


# ------------------------------------------------------------------ forward and logits
@pytest.mark.parametrize(("fmt", "preset"), CASES)
def test_prefill_then_decode_matches_reference(loaded, fmt, preset, device) -> None:
    """Two sequences (one starting at position 0, for mask_pos0), then two decode steps of one
    row each, every layer with its own caches: residual and logits at every step."""
    ref, opt = pair(loaded, fmt, preset, device)
    assert opt.info == ref.info and opt.semantics == ref.semantics
    ids, _, prev = inputs(14)
    pos = torch.cat([torch.arange(0, 6), torch.arange(20, 28)])
    lens = torch.tensor([6, 8])
    caches = {k: [L.new_kv_cache(), L.new_kv_cache()] for k, L in (("r", ref), ("o", opt))}
    excuses = Excuses()
    with record_moe_inputs(ref, opt.layer) as moe_in:
        hr = ref.forward(ids, pos, prev, seq_lens=lens, kv_cache=caches["r"])
        ho = opt.forward(ids, pos, prev, seq_lens=lens, kv_cache=caches["o"])
    last = torch.tensor([5, 13])
    for step in range(3):
        assert ho.shape == hr.shape and ho.dtype == BF16
        keep = excuses.keep(moe_in.moved(0))  # a near-tie may move the expert selection
        assert rel_err(ho[keep], hr[keep]) < TOL[preset], (step, rel_err(ho[keep], hr[keep]))
        lr, lo = ref.compute_logits(hr), opt.compute_logits(hr)
        assert lo.dtype == lr.dtype == torch.float32
        assert rel_err(lo, lr) < TOL[preset]
        for cr, co in zip(caches["r"], caches["o"], strict=True):
            assert torch.equal(cr.positions, co.positions.cpu())
            assert rel_err(co.kv.cpu(), cr.kv) < TOL[preset]
        # the next step: both layers fed the reference's residual of each sequence's last row
        tok, pos, h = lr[last].argmax(-1), pos[last] + 1, hr[last]
        with record_moe_inputs(ref, opt.layer) as moe_in:
            hr = ref.forward(tok, pos, h, seq_lens=torch.tensor([1, 1]), kv_cache=caches["r"])
            ho = opt.forward(tok, pos, h, seq_lens=torch.tensor([1, 1]), kv_cache=caches["o"])
        last = torch.tensor([0, 1])
    excuses.check()


def test_moved_selections_are_found_by_routing_both_inputs() -> None:
    """``MoEInputs.moved``: a row is excused where the two inputs' top-k sets differ or either
    sits within ROUTER_TIE of a tie, and only there (identity router, 3 experts, top 1)."""
    from dsv4mtp.conformance._routing import ROUTER_TIE, MoEInputs

    eye, zero = torch.eye(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    x_ref = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.5], [0.3, 0.3 + 1e-6, 0.0]])
    x_opt = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.4], [0.3, 0.3 + 1e-6, 0.0]])
    moved = MoEInputs([x_ref.double()], [x_opt.double()], [(eye, zero, 1)]).moved(0)
    assert moved.tolist() == [True, False, True]
    apart = x_ref.double().clone()
    apart[2, 1] += 100 * ROUTER_TIE
    assert not MoEInputs([apart], [apart], [(eye, zero, 1)]).moved(0).any()


def test_moe_inputs_are_recorded_call_by_call_and_the_ops_restored(loaded, device) -> None:
    """record_moe_inputs sees each layer's MoE input once per forward (the optimized one on its
    device too) and leaves both layers' ops as they were."""
    ref, opt = pair(loaded, "mxfp4", "math", device)
    ids, pos, prev = inputs(3, seed=5)
    with record_moe_inputs(ref, opt.layer) as moe_in:
        ref.forward(ids, pos, prev)
        opt.forward(ids, pos, prev)
    assert len(moe_in.ref) == len(moe_in.opt) == len(moe_in.routers) == 1
    assert moe_in.ref[0].shape == moe_in.opt[0].shape == (3, CFG.hidden_size)
    assert rel_err(moe_in.opt[0], moe_in.ref[0]) < TOL["math"]
    assert ref.ops is RefLayer.ops and opt.layer.ops is OptLayer.ops


def test_dense_constructor_matches_from_loaded(loaded, device) -> None:
    """Packing the dense MTPLayerParams (the constructor path) gives the layer from_loaded
    packs from the stored FP8 weights: the synthetic dense weights have power-of-two scales, so
    the dequantized bf16 weights are the same values and the outputs agree closely."""
    _, opt = pair(loaded, "mxfp4", "math", device)
    ck = loaded["mxfp4"]
    params = [build_layer_params(w, BF16, torch.device("cpu")) for w in ck.layers]
    embed = ck.embed_tokens.to(device)
    dense = OnDevice(OptLayer(ck.config, params, embed, dtype=BF16, max_num_tokens=32))
    assert dense.device == embed.device and dense.max_batch == 256
    ids, pos, prev = inputs(6, seed=4, start=3)
    h1, h2 = opt.forward(ids, pos, prev), dense.forward(ids, pos, prev)
    assert rel_err(h2, h1) < TOL["math"]
    assert rel_err(dense.compute_logits(h1), opt.compute_logits(h1)) < 1e-6


# ------------------------------------------------------------------ drafting
def test_draft_teacher_forced_and_greedy(loaded, device) -> None:
    """Teacher forcing with the reference's own greedy picks: both layers see the same tokens at
    every step, so the logits compare step by step.  A top-1 mismatch is excused only where the
    reference's logits of the two picks are within the tolerance (a near-tie), and counted.
    Free-running greedy drafts then agree wherever no near-tie came earlier."""
    ref, opt = pair(loaded, "mxfp4", "math", device)
    ids, _, prev = inputs(10, seed=2)
    pos = torch.cat([torch.arange(2, 6), torch.arange(0, 6)])
    lens = torch.tensor([4, 6])
    k = 3
    with record_moe_inputs(ref, opt.layer) as moe_in:
        tr, lr = ref.draft(ids, pos, prev, seq_lens=lens, num_tokens=k, return_logits=True)
        to, lo = opt.draft(
            ids, pos, prev, seq_lens=lens, num_tokens=k, return_logits=True, forced_tokens=tr
        )
    clear = draft_steps_kept(moe_in, lens.cumsum(0) - 1)
    assert torch.equal(to, tr) and lo.shape == lr.shape == (2, k, CFG.vocab_size)
    near_ties, first_tie = 0, [k] * 2
    for b in range(2):
        for s in range(k):
            if not clear[b, s]:
                continue  # the expert selection moved at or before this step (_routing)
            assert rel_err(lo[b, s], lr[b, s]) < TOL["math"], (b, s)
            i, j = int(lr[b, s].argmax()), int(lo[b, s].argmax())
            if i != j:
                gap = float(lr[b, s, i] - lr[b, s, j])
                bound = TOL["math"] * float(lr[b, s].norm()) / CFG.vocab_size**0.5
                assert gap <= bound, (b, s, gap, bound)
                near_ties += 1
                first_tie[b] = min(first_tie[b], s)
    assert near_ties <= 1, near_ties
    greedy = opt.draft(ids, pos, prev, seq_lens=lens, num_tokens=k)
    assert isinstance(greedy, torch.Tensor)
    for b in range(2):
        n = min(first_tie[b], int(clear[b].long().sum()))
        assert torch.equal(greedy[b, :n], tr[b, :n]), b
    sampled = [
        opt.draft(
            ids, pos, prev, seq_lens=lens, num_tokens=1, greedy=False, temperature=0.8,
            generator=torch.Generator().manual_seed(5),
        )
        for _ in range(2)
    ]  # fmt: skip
    assert torch.equal(sampled[0], sampled[1])
    assert isinstance(sampled[0], torch.Tensor) and sampled[0].shape == (2, 1)


# ------------------------------------------------------------------ errors and bounds
BAD = [
    (lambda i, p, h: (torch.tensor([0, CFG.vocab_size, 1]), p, h), "input_ids"),
    (lambda i, p, h: (i, p - 5, h), "positions"),
    (lambda i, p, h: (i, p, h[:, :-1]), "prev_hidden"),
    (lambda i, p, h: (i, p, h.float()), "prev_hidden"),
    (lambda i, p, h: (i.int(), p, h), "input_ids"),
    (lambda i, p, h: (i, p[:2], h), "positions"),
    (lambda i, p, h: (i, p, h.clone().index_fill_(0, torch.tensor([1]), float("nan"))), "prev"),
]


def test_bad_inputs_raise_the_reference_errors(loaded, device) -> None:
    ref, opt = pair(loaded, "mxfp4", "math", device)
    good = inputs(3)
    for change, argument in BAD:
        args = change(*good)
        with pytest.raises(InputError, match=argument) as want:
            ref.forward(*args)
        with pytest.raises(InputError) as got:
            opt.forward(*args)
        assert str(got.value) == str(want.value)
    ids, pos, prev = good
    for kwargs in (
        dict(seq_lens=torch.tensor([1, 1])),
        dict(kv_cache=[ref.new_kv_cache(), ref.new_kv_cache()]),
        dict(spec_step=-1),
    ):
        with pytest.raises(InputError) as want:
            ref.forward(ids, pos, prev, **kwargs)
        with pytest.raises(InputError) as got:
            opt.forward(ids, pos, prev, **kwargs)
        assert str(got.value) == str(want.value)
    for call in (
        lambda L: L.compute_logits(prev.float()),
        lambda L: L.draft(ids, pos, prev, num_tokens=0),
        lambda L: L.draft(ids, pos, prev, num_tokens=2, forced_tokens=torch.zeros(1, 3).long()),
        lambda L: L.draft(ids, pos, prev, num_tokens=1, greedy=False, temperature=0.0),
    ):
        with pytest.raises(InputError) as want:
            call(ref)
        with pytest.raises(InputError) as got:
            call(opt)
        assert str(got.value) == str(want.value)


def test_bounds_and_construction_errors(loaded, device) -> None:
    _, opt = pair(loaded, "mxfp4", "math", device)  # max_num_tokens 32, max_batch 4
    ids, pos, prev = inputs(33)
    with pytest.raises(InputError, match=r"input_ids: 33 rows exceed .*max_num_tokens=32"):
        opt.forward(ids, pos, prev)
    with pytest.raises(InputError, match="max_num_tokens=32"):
        opt.draft(ids, pos, prev, num_tokens=1)
    ids, pos, prev = inputs(5)
    with pytest.raises(InputError, match=r"seq_lens: 5 sequences exceed .*max_batch=4"):
        opt.forward(ids, pos, prev, seq_lens=torch.ones(5, dtype=torch.int64))
    ck = loaded["mxfp4"]
    with pytest.raises(ConfigError, match="max_batch"):
        OptLayer.from_loaded(ck, device=device, max_batch=0)
    with pytest.raises(ConfigError, match="dtype"):
        OptLayer.from_loaded(ck, device=device, dtype=torch.float64)
    with pytest.raises(ConfigError, match="fp8kv"):
        OptLayer.from_loaded(ck, device=device, fp8kv=True)
    with pytest.raises(ConfigError, match="layers"):
        OptLayer(ck.config, [], ck.embed_tokens)


# ------------------------------------------------------------------ batch-invariant mode
@pytest.mark.gpu
@pytest.mark.parametrize(("fmt", "preset"), CASES)
def test_batch_invariant_layer_rows_do_not_depend_on_the_batch(loaded, fmt, preset, device):
    """``batch_invariant=True``: every op runs its T-independent schedule, so a sequence's rows
    (residual, logits, greedy ids, drafted tokens) are bit for bit the same whether it is run
    alone or with other sequences around it; the default mode may pick schedules by T.  GPU
    tier: under the interpreter every dot is row-independent in either mode, so on the CPU this
    cannot tell the modes apart (the next test checks there that the switch reaches every op)."""
    ck = loaded[fmt]
    opt = OnDevice(
        OptLayer.from_loaded(
            ck, preset=preset, dtype=BF16, device=device, max_num_tokens=32, max_batch=4,
            batch_invariant=True,
        )
    )  # fmt: skip
    assert opt.batch_invariant and not pair(loaded, fmt, preset, device)[1].batch_invariant
    ids, _, prev = inputs(13, seed=7)
    pos = torch.cat([torch.arange(3, 8), torch.arange(0, 6), torch.arange(9, 11)])
    lens = torch.tensor([5, 6, 2])
    together = opt.forward(ids, pos, prev, seq_lens=lens)
    for b, (lo, hi) in enumerate([(0, 5), (5, 11), (11, 13)]):
        alone = opt.forward(ids[lo:hi], pos[lo:hi], prev[lo:hi])
        assert torch.equal(alone, together[lo:hi]), b
        assert torch.equal(opt.compute_logits(alone), opt.compute_logits(together)[lo:hi]), b
    drafts = opt.draft(ids, pos, prev, seq_lens=lens, num_tokens=2)
    second = opt.draft(ids[5:11], pos[5:11], prev[5:11], num_tokens=2)
    assert torch.equal(drafts[1:2], second)


def test_batch_invariant_layer_passes_the_switch_to_every_op(loaded, device, monkeypatch):
    """The switch reaches every op the layer and its head call (on the CPU the interpreter's
    dots are row-independent in either mode, so only this catches a dropped switch there)."""
    import dsv4mtp.optimized.mtp as opt_mtp

    seen: list[tuple[str, object]] = []

    def recording(name, fn):
        def call(*args, **kwargs):
            seen.append((name, kwargs.get("batch_invariant")))
            return fn(*args, **kwargs)

        return call

    layer = OptLayer.from_loaded(
        loaded["mxfp4"], dtype=BF16, device=device, max_num_tokens=32, batch_invariant=True
    )
    fields = zip(LayerOps._fields, OptLayer.ops, strict=True)
    layer.ops = LayerOps(*[recording(n, f) for n, f in fields])  # type: ignore[misc]
    for name in ("hc_head", "lm_head_logits", "lm_head_argmax", "step_guard"):
        monkeypatch.setattr(opt_mtp, name, recording(name, getattr(opt_mtp, name)))
    ids, pos, prev = inputs(4, seed=9)
    hidden = OnDevice(layer).forward(ids, pos, prev)
    OnDevice(layer).compute_logits(hidden)
    OnDevice(layer).draft(ids, pos, prev, num_tokens=2)
    step = opt_mtp.DecodeGraphs(layer, layer.new_device_cache(), buckets=(2,), capture=False,
                                logits=False)  # fmt: skip
    step.step(*(t.to(layer.device) for t in (ids[:2], pos[:2] + 40, prev[:2])),
              torch.arange(2, device=layer.device))  # fmt: skip
    names = {n for n, _ in seen}
    assert {"eh_proj", "hc_pre", "hc_post", "hc_post_pre", "hc_post_head",
            "attention", "moe", "hc_head", "lm_head_logits", "lm_head_argmax", "step_guard",
            "embed_norms"} <= names, names  # fmt: skip
    assert all(bi is True for _, bi in seen), [n for n, bi in seen if bi is not True]


def test_batch_invariant_switch_is_checked_and_the_reference_takes_it(loaded, device) -> None:
    ck = loaded["mxfp4"]
    with pytest.raises(ConfigError, match="batch_invariant"):
        OptLayer.from_loaded(ck, device=device, batch_invariant=1)
    with pytest.raises(ConfigError, match="batch_invariant"):
        RefLayer.from_loaded(ck, batch_invariant="yes")
    ref = RefLayer.from_loaded(ck, dtype=BF16, batch_invariant=True)
    ids, pos, prev = inputs(4, seed=8)
    assert ref.batch_invariant
    plain = RefLayer.from_loaded(ck, dtype=BF16)
    assert torch.equal(ref.forward(ids, pos, prev), plain.forward(ids, pos, prev))
