"""The optimized layer against the reference on a random checkpoint of the real shapes.

GPU tier (README shard 6; the CPU tier runs the same flows at the tiny config in
test_mtp_optimized.py and test_mtp_graphs.py).  ``make_fullsize_checkpoint`` writes a random
checkpoint of V4-Flash's shapes on the GPU, MXFP4 experts under the ``math`` preset and FP8
experts under ``official``; both layers load it and are compared on

* a prefill of two sequences (residual rows, and the logits of the same residual);
* a teacher-forced draft of three tokens (the reference's greedy picks fed to both) through
  the eager decode steps, against the reference's host loop: logits per step; then the same
  draft through the captured graphs, equal to the eager one bit for bit.

Rows whose expert selection moved between the two layers' MoE inputs, and draft steps from a
sequence's first such row on, are excused and counted (conformance/_routing.py: at 256 experts
a third of the rows of this random checkpoint have their 6th and 7th router scores within 1e-2,
so the selection, not a score threshold, decides).  Tolerances: test_mtp_optimized.py's ``TOL``
(the same math and the same roundings at every size).
"""

from __future__ import annotations

import pytest
import torch

from dsv4mtp.checkpoint.fullsize import make_fullsize_checkpoint
from dsv4mtp.checkpoint.load import load_mtp_checkpoint
from dsv4mtp.conformance._routing import Excuses, draft_steps_kept, record_moe_inputs
from dsv4mtp.conformance.test_mtp_graphs import eager_graphs
from dsv4mtp.conformance.test_mtp_optimized import TOL, rel_err
from dsv4mtp.optimized import MTPLayer as OptLayer
from dsv4mtp.reference import MTPLayer as RefLayer

BF16 = torch.bfloat16
CASES = [("mxfp4", "math"), ("fp8", "official")]
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def layers(tmp_path_factory):
    """(fmt, preset) -> (reference, optimized), both on CUDA, built once per format."""
    device, config = "cuda", "flash"
    out = {}
    for fmt, preset in CASES:
        path = tmp_path_factory.mktemp(f"fullsize-{fmt}")
        make_fullsize_checkpoint(path, config, expert_format=fmt, device=device, seed=5)
        ck = load_mtp_checkpoint(path)
        ref = RefLayer.from_loaded(ck, preset=preset, dtype=BF16, device=device)
        opt = OptLayer.from_loaded(
            ck, preset=preset, dtype=BF16, device=device, max_num_tokens=128, max_batch=4
        )
        out[fmt, preset] = ref, opt
        del ck
    return out


def _inputs(cfg, lens: list[int], device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    prev = torch.randn(T, cfg.hc_dim, generator=g).to(BF16)
    pos = torch.cat([torch.arange(7 * b, 7 * b + n) for b, n in enumerate(lens)])
    return ids.to(device), pos.to(device), prev.to(device), torch.tensor(lens, device=device)


@pytest.mark.parametrize(("fmt", "preset"), CASES)
def test_prefill_matches_the_reference(layers, fmt, preset, device) -> None:
    ref, opt = layers[fmt, preset]
    ids, pos, prev, lens = _inputs(opt.config, [24, 40], device, seed=1)
    excuses = Excuses()
    with record_moe_inputs(ref, opt) as moe_in:
        hr = ref.forward(ids, pos, prev, seq_lens=lens)
        ho = opt.forward(ids, pos, prev, seq_lens=lens)
    keep = excuses.keep(moe_in.moved(0)).to(hr.device)
    assert rel_err(ho[keep], hr[keep]) < TOL[preset], rel_err(ho[keep], hr[keep])
    assert rel_err(opt.compute_logits(hr), ref.compute_logits(hr)) < TOL[preset]
    excuses.check()


@pytest.mark.parametrize(("fmt", "preset"), CASES)
def test_graph_draft_matches_the_reference(layers, fmt, preset, device) -> None:
    ref, opt = layers[fmt, preset]
    ids, pos, prev, lens = _inputs(opt.config, [9, 16], device, seed=2)
    k = 3
    forced = dict(seq_lens=lens, num_tokens=k, return_logits=True)
    opt.graphs = eager_graphs(opt, buckets=(2,))  # the captured step's code, run eagerly
    with record_moe_inputs(ref, opt) as moe_in:
        tr, lr = ref.draft(ids, pos, prev, **forced)
        to, lo = opt.draft(ids, pos, prev, **forced, forced_tokens=tr)
    clear = draft_steps_kept(moe_in, lens.cpu().cumsum(0) - 1)
    opt.capture_decode(buckets=(2,))
    tc, lc = opt.draft(ids, pos, prev, **forced, forced_tokens=tr)
    assert torch.equal(tc, to) and torch.equal(lc, lo)  # replay is the eager step, bitwise
    assert torch.equal(to, tr)
    for s in range(k):
        kept = clear[:, s].to(lr.device)
        if kept.any():
            assert rel_err(lo[kept, s], lr[kept, s]) < TOL[preset], s
