"""The shared LM head: greedy ids without the logits, the logits, the FP8 head (optimized/lm_head.py,
optimized/kernels/lm_head.py) against reference/lm_head.py.

The generated contract (test_contract.py: differential with near-ties excused as sets, T = 0,
out=, batch invariance, graph replay, typed errors) covers both ops on both head formats; here:
torch.argmax's tie and NaN rules on constructed logits, several T tiles and partial V chunks,
explicit schedules, the operators' opcheck, pack_head's FP8 codes against the core quantizer,
and bad inputs.  On CPU the kernels run under TRITON_INTERPRET=1 (V 1000 or less, D <= 256).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

import dsv4mtp.optimized as opt
import dsv4mtp.reference as ref
from dsv4mtp import formats
from dsv4mtp.checkpoint.weights import QuantizedWeight
from dsv4mtp.conformance.inputs import lm_head_inputs
from dsv4mtp.conformance.pairs import lm_head_near_ties
from dsv4mtp.errors import DSV4Error, InputError
from dsv4mtp.optimized import lm_head as lm_head_mod

BF16, FP32 = torch.bfloat16, torch.float32


def _inputs(
    T: int, D: int, V: int, dtype: torch.dtype, device: str, seed: int = 0, fmt: str = "bf16"
) -> tuple[torch.Tensor, Any]:
    (y, head), _ = lm_head_inputs(
        "lm_head_argmax", T, seed, D=D, V=V, fmt=fmt, dtype=dtype, device=device
    )
    return y, head


def _pack(head: Any, device: str) -> Any:
    return opt.pack_head(head, device=device) if isinstance(head, QuantizedWeight) else head


def _ref_ids(y: torch.Tensor, head: Any) -> torch.Tensor:
    return ref.lm_head_argmax(y.double().cpu(), _cpu(head))


def _cpu(head: Any) -> Any:
    if isinstance(head, QuantizedWeight):
        return QuantizedWeight(head.format, head.data.cpu(), head.scale.cpu(), head.shape)  # type: ignore[union-attr]
    return head.double().cpu()


# ------------------------------------------------------------------------------ against the reference
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("T", "V"), [(1, 1000), (70, 300)], ids=["T1", "T70-two-tiles"])
def test_ids_match_the_reference_up_to_near_ties(
    T: int, V: int, fmt: str, dtype: torch.dtype, device: str
) -> None:
    """Both formats, one token and two T tiles (T 70 > 64), partial V chunks (1000, 300 rows)."""
    y, head = _inputs(T, 128, V, dtype, device, seed=T, fmt=fmt)
    got = opt.lm_head_argmax(y, _pack(head, device))
    want = _ref_ids(y, head)
    assert got.dtype == torch.int64 and got.shape == (T,) and got.device == y.device
    near = lm_head_near_ties(y.cpu(), _cpu(head), got.cpu(), want)
    differ = (got.cpu() != want) & ~near
    assert not bool(differ.any()), f"rows {differ.nonzero()[:, 0].tolist()} differ"


def test_a_wrong_id_is_not_excused() -> None:
    """The near-tie excuse is narrow: the runner-up of a well-separated row is not excused."""
    y, head = _inputs(4, 64, 300, FP32, "cpu", seed=3)
    logits = ref.lm_head_logits(y.double(), head.double())
    top2 = logits.topk(2, -1).indices
    near = lm_head_near_ties(y, head, top2[:, 1], top2[:, 0])
    assert not bool(near.any())
    assert not bool(lm_head_near_ties(y, head, top2[:, 0], top2[:, 0]).any())


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_explicit_schedules_agree(fmt: str, device: str) -> None:
    """Other tiles (V chunk, T tile, K step) give the same ids here (no near-ties at these
    inputs), and the logits op agrees with the argmax."""
    from dsv4mtp.optimized.kernels.lm_head import LmHeadSchedule

    y, head = _inputs(20, 256, 1000, BF16, device, seed=5, fmt=fmt)
    h = _pack(head, device)
    base = opt.lm_head_argmax(y, h)
    for sched in (LmHeadSchedule(128, 16, 32, 4, 1), LmHeadSchedule(32, 32, 128, 4, 1)):
        assert torch.equal(opt.lm_head_argmax(y, h, schedule=sched), base), sched
    assert torch.equal(opt.lm_head_logits(y, h).argmax(-1), base)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's NaN products
@pytest.mark.parametrize(("T", "V"), [(1, 1000), (20, 300), (70, 257)])
def test_fp8_ids_through_the_linear_kernel(
    T: int, V: int, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The FP8 head's greedy ids run on the dense-linear kernel with its argmax epilogue
    (``_ops.FP8_ARGMAX_ON_LINEAR``, kernels/lm_head.py ``lm_head_argmax_linear``; counted):
    bitwise torch.argmax over the logits ``lm_head_logits`` writes, and the argmax kernel's ids,
    with a NaN row (id 0), an exact tie across two chunks (the lower index), partial chunks
    (V 257, 300) and two M blocks of the linear's schedule (T 70), unmasked and masked."""
    from dsv4mtp.optimized import _ops
    from dsv4mtp.optimized.kernels import lm_head as head_kernels

    calls: list[int] = []
    real = head_kernels.lm_head_argmax_linear

    def spy(y: torch.Tensor, *a: Any, **k: Any) -> None:
        calls.append(y.shape[0])
        real(y, *a, **k)

    monkeypatch.setattr(_ops, "lm_head_argmax_linear", spy)
    y, head = _inputs(T, 256, V, BF16, device, seed=T, fmt="fp8")
    y = y.clone()
    y[0, 3] = float("nan")
    h = _pack(head, device)
    # head row V - 1 (the last, partial chunk) a copy of row 2 (the first chunk): whatever
    # rows pick it, they must get 2
    h.weight[V - 1] = h.weight[2]
    h.scale[(V - 1) // 128] = h.scale[0]
    got = opt.lm_head_argmax(y, h)
    assert calls == [T]
    assert got[0].item() == 0
    assert bool((got != V - 1).all())
    assert torch.equal(got, opt.lm_head_logits(y, h).argmax(-1))
    mask = torch.arange(T, device=device) % 3 != 1
    assert torch.equal(opt.lm_head_argmax(y, h, row_mask=mask), torch.where(mask, got, -1))
    monkeypatch.setattr(_ops, "FP8_ARGMAX_ON_LINEAR", False)
    assert torch.equal(opt.lm_head_argmax(y, h), got)
    assert len(calls) == 2


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf - inf in the constructed rows
@pytest.mark.parametrize(("T", "V"), [(1, 129280), (5, 300), (70, 4097), (3, 1)])
def test_logits_argmax_is_torch_argmax(T: int, V: int, device: str) -> None:
    """``logits_argmax`` (the optimized layer's ids from written logits) is torch.argmax bit
    for bit: random rows, a row of equal maxima in two chunks (the lower index), a NaN after a
    NaN-free maximum and a second NaN (the first NaN), +inf and -inf rows, a column slice of a
    wider tensor (its row stride); -1 under a row mask; out=; opcheck; typed errors."""
    g = torch.Generator().manual_seed(T)
    wide = torch.randn(T, V + 3, generator=g)
    logits = wide[:, :V]
    if V > 4096 and T > 4:
        logits[1, V - 1] = logits[1, 7] = logits[1].max() + 1  # equal maxima, two chunks
        logits[2, 9], logits[2, V - 1] = float("nan"), float("nan")
        logits[3] = float("-inf")
        logits[4, V - 1], logits[4, 6] = float("inf"), float("inf")
    logits = logits.to(device)
    want = logits.argmax(-1)
    got = opt.lm_head.logits_argmax(logits)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    mask = torch.arange(T, device=device) % 2 == 0
    assert torch.equal(
        opt.lm_head.logits_argmax(logits, row_mask=mask), torch.where(mask, want, -1)
    )
    out = torch.full((T,), 7, dtype=torch.int64, device=device)
    assert opt.lm_head.logits_argmax(logits, out=out) is out and torch.equal(out, want)
    if V <= 4097:
        c = logits.contiguous()
        torch.library.opcheck(torch.ops.dsv4mtp.logits_argmax.default, (c, mask))
        torch.library.opcheck(torch.ops.dsv4mtp.logits_argmax_out.default, (c, None), {"out": out})
    with pytest.raises(InputError, match=r"^logits: expected dtype torch.float32"):
        opt.lm_head.logits_argmax(logits.double())
    with pytest.raises(InputError, match=r"^logits: expected \(T, V\)"):
        opt.lm_head.logits_argmax(logits[0])
    if V > 1:  # a column stride (of a size-1 dimension it is not one)
        with pytest.raises(InputError, match=r"^logits: expected \(T, V\)"):
            opt.lm_head.logits_argmax(torch.zeros(T, 2 * V, device=device)[:, ::2])
    with pytest.raises(InputError, match=r"^row_mask"):
        opt.lm_head.logits_argmax(logits, row_mask=mask[:0])


# ------------------------------------------------------------------------------ tie and NaN rules
def _tie_case(device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """y (4, 64) and a head (300, 64) whose maxima are exact ties: row t's best direction is
    copied into several head rows (one in an earlier chunk than the others, two in one chunk),
    so the logits there are bitwise equal; row 3 is zero (every logit 0)."""
    g = torch.Generator().manual_seed(11)
    V, D = 300, 64
    y = torch.randn(4, D, generator=g)
    head = torch.randn(V, D, generator=g) / 8
    copies = {0: [5, 77, 200], 1: [130, 131, 299], 2: [64, 63, 250]}  # first listed is not lowest
    for t, rows in copies.items():
        for v in rows:
            head[v] = y[t] / y[t].norm()  # the largest logit of row t, in several places
    y[3] = 0
    want = [min(copies[0]), min(copies[1]), min(copies[2]), 0]
    return y.to(dtype).to(device), head.to(dtype).to(device), want


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_equal_maxima_give_the_lowest_index(dtype: torch.dtype, device: str) -> None:
    y, head, want = _tie_case(device, dtype)
    logits = ref.lm_head_logits(y, head)
    assert logits.argmax(-1).tolist() == want  # torch's own rule on these logits
    assert opt.lm_head_argmax(y, head).tolist() == want
    assert opt.lm_head_argmax(y, head, batch_invariant=True).tolist() == want
    fp8 = opt.pack_head(head, format="fp8")  # duplicated rows quantize to the same codes
    assert opt.lm_head_argmax(y, fp8).tolist() == want


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's NaN / inf products
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_nan_logits_follow_torch_argmax(dtype: torch.dtype, device: str) -> None:
    """A NaN logit counts as the maximum: a NaN head row v gives every row the id v unless an
    earlier NaN exists (the first NaN wins over +inf and over a later NaN); a row of y holding
    a NaN has NaN logits everywhere: id 0.  Equal to ``logits.argmax(-1)`` of the fp32 logits."""
    g = torch.Generator().manual_seed(2)
    V, D = 300, 64
    y = torch.randn(5, D, generator=g)
    head = torch.randn(V, D, generator=g) / 8
    head[40] = 0
    head[40, 0] = float("inf")  # +-inf logits (the sign of y[:, 0]), below a NaN
    head[170, 3] = float("nan")  # NaN logit at 170 for every row
    head[290, 0] = float("nan")  # a later NaN: never chosen
    y[2, 7] = float("nan")  # row 2: NaN everywhere
    y, head = y.to(dtype).to(device), head.to(dtype).to(device)
    want = ref.lm_head_logits(y.float().cpu(), head.float().cpu()).argmax(-1)
    assert want.tolist() == [170, 170, 0, 170, 170]
    assert opt.lm_head_argmax(y, head).cpu().tolist() == want.tolist()
    assert opt.lm_head_argmax(y, head, batch_invariant=True).cpu().tolist() == want.tolist()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's inf * 0 products
def test_nan_free_rows_with_infinite_logits(device: str) -> None:
    """+inf logits: the first +inf wins; a row whose logits are all -inf gets 0 (torch)."""
    V, D = 200, 16
    head = torch.zeros(V, D)
    head[:, 0] = 1.0
    head[90, 0] = float("inf")
    head[150, 0] = float("inf")
    y = torch.zeros(2, D)
    y[0, 0] = 1.0  # logits 1, and +inf at 90 and 150
    y[1, 0] = float("-inf")  # logits -inf everywhere
    want = ref.lm_head_logits(y, head).argmax(-1)
    got = opt.lm_head_argmax(y.to(device), head.to(device)).cpu()
    assert got.tolist() == want.tolist() == [90, 0]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's NaN products
def test_fp8_head_nan_rule(device: str) -> None:
    """The FP8 head: a row of y holding a NaN gets 0, as torch.argmax of its NaN logits; e4m3
    NaN codes (0x7F / 0xFF) in a checkpoint head are refused by pack_head (the kernels' decode
    has no NaN), and pack_head(format="fp8") refuses a non-finite head (test below)."""
    y, head = _inputs(3, 128, 256, BF16, device, seed=1, fmt="fp8")
    y = y.clone()
    y[1, 9] = float("nan")
    got = opt.lm_head_argmax(y, opt.pack_head(head, device=device))
    want = ref.lm_head_argmax(y.cpu(), _cpu(head))
    assert got[1].item() == want[1].item() == 0
    codes = head.data.view(torch.uint8).clone()
    codes[33, 100] = 0xFF
    bad = QuantizedWeight("fp8_e8m0", codes.view(torch.float8_e4m3fn), head.scale, head.shape)
    with pytest.raises(InputError, match=r"^head.data: expected finite float8_e4m3fn"):
        opt.pack_head(bad)


# ------------------------------------------------------------------------------ batch invariance
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("op", ["lm_head_argmax", "lm_head_logits"])
def test_batch_invariant_rows_alone_and_in_two_tiles(op: str, fmt: str, device: str) -> None:
    """batch_invariant=True: rows of a 70-row batch (two T tiles) are bitwise the same alone."""
    y, head = _inputs(70, 64, 300, BF16, device, seed=9, fmt=fmt)
    h = _pack(head, device)
    fn = getattr(opt, op)
    full = fn(y, h, batch_invariant=True)
    for t in (0, 63, 64, 69):
        assert torch.equal(fn(y[t : t + 1], h, batch_invariant=True), full[t : t + 1]), t


# ------------------------------------------------------------------------------ operators
def _op_args(op: str, device: str, fmt: str) -> tuple[Any, ...]:
    """The operator's arguments as the public function passes them (schedule: the default)."""
    y, head = _inputs(5, 128, 300, BF16 if device == "cuda" else FP32, device, fmt=fmt)
    p = opt.pack_head(head, device=device)
    tail: tuple[Any, ...] = (False, []) if op == "lm_head_argmax" else (False,)
    return (y, p.weight, p.scale, p.format, *tail)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("op", ["lm_head_argmax", "lm_head_logits"])
@pytest.mark.parametrize("variant", ["", "_out"])
def test_opcheck(op: str, variant: str, fmt: str, device: str) -> None:
    """Schema, fake vs real outputs and AOT dispatch, functional and out= variants."""
    args = _op_args(op, device, fmt)
    y, head = args[0], args[1]
    kwargs: dict[str, torch.Tensor] = {}
    if variant:
        shape = (y.shape[0],) if op == "lm_head_argmax" else (y.shape[0], head.shape[0])
        dt = torch.int64 if op == "lm_head_argmax" else torch.float32
        kwargs["out"] = torch.empty(shape, dtype=dt, device=device)
    operator = getattr(torch.ops.dsv4mtp, op + variant).default
    torch.library.opcheck(operator, args, kwargs)


def test_out_buffers_are_written_and_returned(device: str) -> None:
    y, head = _inputs(6, 64, 300, BF16, device, seed=4)
    ids = torch.full((6,), -1, dtype=torch.int64, device=device)
    logits = torch.full((6, 300), float("nan"), device=device)
    assert opt.lm_head_argmax(y, head, out=ids) is ids
    assert opt.lm_head_logits(y, head, out=logits) is logits
    assert torch.equal(ids, opt.lm_head_argmax(y, head))
    assert torch.equal(logits, opt.lm_head_logits(y, head))


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_row_mask_writes_minus_one_in_its_false_rows(fmt: str, device: str) -> None:
    """row_mask: -1 where false, the unmasked call's ids elsewhere (functional and out=, one
    and several reduce programs); the operators with a mask pass opcheck."""
    y, head = _inputs(6, 64, 300, BF16, device, seed=9, fmt=fmt)
    h = _pack(head, device)
    base = opt.lm_head_argmax(y, h)
    assert bool((base >= 0).all())
    for keep in ([True, False, True, True, False, False], [False] * 6, [True] * 6):
        mask = torch.tensor(keep, device=device)
        want = torch.where(mask, base, -1)
        assert torch.equal(opt.lm_head_argmax(y, h, row_mask=mask), want), keep
        out = torch.full((6,), 7, dtype=torch.int64, device=device)
        assert opt.lm_head_argmax(y, h, row_mask=mask, out=out) is out
        assert torch.equal(out, want), keep
    one = torch.tensor([False], device=device)
    assert opt.lm_head_argmax(y[:1], h, row_mask=one).tolist() == [-1]
    args = _op_args("lm_head_argmax", device, fmt)
    margs = (*args, torch.arange(args[0].shape[0], device=device) % 2 == 0)
    torch.library.opcheck(torch.ops.dsv4mtp.lm_head_argmax.default, margs)
    out = torch.empty(args[0].shape[0], dtype=torch.int64, device=device)
    torch.library.opcheck(torch.ops.dsv4mtp.lm_head_argmax_out.default, margs, {"out": out})


# ------------------------------------------------------------------------------ pack_head
def test_fp8_pack_is_the_core_quantizer_and_decodes_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pack_head(format="fp8"): the codes and ue8m0 scales of formats.quantize_fp8_block on the
    whole head (also when packed in steps of 128 rows), and dequantize() is the core's decode;
    a checkpoint-format QuantizedWeight packs to the same tensors."""
    g = torch.Generator().manual_seed(7)
    head = (torch.randn(1000, 200, generator=g) / 14).to(BF16)
    q, s = formats.quantize_fp8_block(head, scale_fmt="e8m0")
    monkeypatch.setattr(lm_head_mod, "_PACK_ROWS", 128)
    p = opt.pack_head(head, format="fp8")
    assert p.format == "fp8" and p.weight.dtype == torch.uint8 and p.scale.dtype == FP32
    assert torch.equal(p.weight, q.view(torch.uint8))
    assert torch.equal(p.scale, formats.decode_e8m0(s))
    assert torch.equal(p.dequantize(), formats.dequantize_fp8_block(q, s))
    qw = QuantizedWeight("fp8_e8m0", q, s, (1000, 200), name="head")
    p2 = opt.pack_head(qw)
    assert torch.equal(p2.weight, p.weight) and torch.equal(p2.scale, p.scale)
    dense = opt.pack_head(head)
    assert dense.format == "bf16" and dense.weight.dtype == BF16 and torch.equal(dense.weight, head)
    assert (p.vocab_size, p.hidden_size) == (1000, 200)


# ------------------------------------------------------------------------------ bad inputs
def test_bad_inputs_are_typed_errors_naming_the_tensor(device: str) -> None:
    y, head = _inputs(3, 64, 300, BF16, device)
    fp8 = opt.pack_head(head, format="fp8")
    cases: list[tuple[Any, str]] = [
        (lambda: opt.lm_head_argmax(y[None], head), r"^y: expected shape \(T, D\)"),
        (lambda: opt.lm_head_argmax(y.double(), head), r"^y: expected dtype"),
        (lambda: opt.lm_head_argmax(y, head[:, :-1]), r"^head: expected shape"),
        (lambda: opt.lm_head_argmax(y, head.to(torch.int32)), r"^head: expected dtype"),
        (lambda: opt.lm_head_argmax(y[:, :32], fp8), r"^head: expected a pack of hidden size"),
        (lambda: opt.lm_head_argmax(y, "head"), r"^head: expected a HeadPack"),
        (lambda: opt.lm_head_argmax(y, head, batch_invariant=1), r"^batch_invariant"),
        (
            lambda: opt.lm_head_argmax(y, head, out=torch.empty(3, dtype=torch.int32)),
            r"^out: expected",
        ),
        (lambda: opt.lm_head_logits(y, head, out=torch.empty(3, 299)), r"^out: expected shape"),
        (lambda: opt.lm_head_argmax(y, head, row_mask=[True] * 3), r"^row_mask: expected"),
        (
            lambda: opt.lm_head_argmax(y, head, row_mask=torch.ones(3, dtype=torch.int64)),
            r"^row_mask: expected dtype torch.bool",
        ),
        (
            lambda: opt.lm_head_argmax(y, head, row_mask=torch.ones(4, dtype=torch.bool)),
            r"^row_mask: expected shape",
        ),
        (lambda: opt.pack_head(head, format="fp4"), r"^format: expected"),  # type: ignore[arg-type]
        (lambda: opt.pack_head(head[0]), r"^head: expected shape"),
        (lambda: opt.pack_head(torch.ones(2, 2, dtype=torch.int8)), r"^head: expected a floating"),
    ]
    bad_head = head.float().clone()
    bad_head[1, 1] = float("inf")
    cases.append((lambda: opt.pack_head(bad_head, format="fp8"), r"^head: expected finite"))
    qw = QuantizedWeight("fp8_e8m0", fp8.weight.view(torch.float8_e4m3fn), None, (300, 64))
    cases.append((lambda: opt.pack_head(qw), r"^head: .*has no block scales"))
    cases.append((lambda: opt.lm_head_argmax(y, qw), r"^head: a QuantizedWeight is packed"))
    for call, pattern in cases:
        with pytest.raises(DSV4Error, match=pattern):
            call()
    with pytest.raises(InputError, match=r"^y: expected"):
        ref.lm_head_argmax(y.to(torch.int64), head)
