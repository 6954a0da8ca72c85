"""GPU check that the mHC kernels' in-kernel waits finish when other work holds the SMs.

Run as ``python -m dsv4mtp.conformance._occupy`` (conformance/test_sync.py does, in a subprocess
with a watchdog, so that a hang fails the test instead of hanging the suite).  Prints one JSON
object on stdout.

Setup.  A *blocker* kernel on its own stream puts one 1024-thread program holding 64 registers
per thread (the whole 64K register file) on every SM but ``FREE_SMS``, so nothing else fits
beside them.  Its programs spin on the global timer until a device flag is set (by a
copy-engine write, which needs no SM) or a bound of several seconds passes.  While it runs:

1. every one-launch kernel with in-kernel waits (hc_pre's collapse, hc_head's tensor-core
   collapse, hc_head's FMA kernel in its one-launch form) runs on another stream, at T large
   enough for many token blocks of S = 16 programs each (more than the free SMs can hold at
   once), and must complete while the blocker still runs; its output must equal the same call
   made on an idle GPU bitwise;
2. a *canary* with the pattern the kernels used to have (each program of a 64-program group
   waits for the whole group, so the group must be resident at once) must NOT complete while
   the blocker runs (it proves that the blocker leaves too few slots for a co-residency
   assumption to hold), and must complete once the blocker is released (the canary is correct,
   it was only starved).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import triton
import triton.language as tl

# Seconds the blocker holds its SMs at most (it is released earlier once the checks are done).
HOLD_S = 20.0
HOLD_NS = int(HOLD_S * 1e9)  # one int64 value for the warm-up and the real launch
# A kernel "completes while the blocker runs" if it finishes within this many seconds.
COMPLETE_S = 5.0
# The canary must still be waiting after this many seconds.
STARVED_S = 1.0
CANARY_GROUP = 64
# SMs the blocker leaves free: 2 x 16 canary programs of 128 threads fit there, fewer than 64.
FREE_SMS = 2
# The blocker's live tile: 64 fp32 values per thread of 1024, more than 64 registers can hold,
# so with the 64-register cap ptxas allocates all 64 (and spills the rest).
BLOCKER_TILE = 64 * 1024


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _blocker_kernel(flag_ptr, started_ptr, smid_ptr, info_ptr, sink_ptr, hold_ns,
                    TILE: tl.constexpr):  # fmt: skip
    """Spin until ``*flag_ptr`` != 0 or ``hold_ns`` passed, keeping a TILE-wide fp32 tile live
    (register pressure); record the SM, count the program as started, and on exit record how
    long it spun and the flag it saw."""
    pid = tl.program_id(0)
    sm = tl.inline_asm_elementwise(
        "mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )
    tl.store(smid_ptr + pid, sm)
    tl.atomic_add(started_ptr, 1, sem="relaxed", scope="gpu")
    acc = tl.arange(0, TILE).to(tl.float32)
    start = _globaltimer()
    elapsed = start - start
    flag = tl.load(flag_ptr, volatile=True)
    while (flag == 0) & (elapsed < hold_ns):
        acc = acc * 0.5 + 1.0
        flag = tl.load(flag_ptr, volatile=True)
        elapsed = _globaltimer() - start
    tl.store(info_ptr + 2 * pid, elapsed)
    tl.store(info_ptr + 2 * pid + 1, flag.to(tl.int64))
    tl.store(sink_ptr + pid * TILE + tl.arange(0, TILE), acc)


@triton.jit
def _canary_kernel(count_ptr, out_ptr, G: tl.constexpr):
    """The co-residency assumption: every program waits until all G programs have arrived."""
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
    ready = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    while ready < G:
        ready = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    tl.store(out_ptr + tl.program_id(0), ready)


def _wait(event: torch.cuda.Event, seconds: float) -> float | None:
    """Poll ``event`` for up to ``seconds``; the elapsed seconds when it completed, else None."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if event.query():
            return time.perf_counter() - t0
        time.sleep(0.001)
    return None


def _cases() -> list[tuple[str, object]]:
    """(name, thunk) for each one-launch kernel; each thunk returns its outputs."""
    from dsv4mtp.conformance.inputs import op_inputs
    from dsv4mtp.optimized.kernels.mhc_collapse import collapse_config, mhc_collapse
    from dsv4mtp.optimized.kernels.mhc_head import mhc_head_fma

    cases = []
    for op, T in (("hc_pre", 256), ("hc_head", 256), ("hc_head_fma", 64)):
        base_op = "hc_pre" if op == "hc_pre" else "hc_head"
        (x, fn, scale, base), kw = op_inputs(base_op, T, 4096, 7, n=4, device="cuda")
        scale, base = scale.float(), base.float()
        eps = dict(rms_norm_eps=kw["rms_norm_eps"], hc_eps=kw["hc_eps"])

        def run(op=op, x=x, fn=fn, scale=scale, base=base, eps=eps, kw=kw, T=T):
            out = torch.full((T, 4096), float("nan"), dtype=x.dtype, device="cuda")
            if op == "hc_head_fma":
                mhc_head_fma(x, fn, scale, base, out, one_launch=True, **eps)
                return [out]
            pc: dict = {}
            if op == "hc_pre":
                pc = dict(post=torch.full((T, 4), float("nan"), device="cuda"),
                          comb=torch.full((T, 4, 4), float("nan"), device="cuda"),
                          post_mult=kw["post_mult"], sinkhorn_iters=kw["sinkhorn_iters"])  # fmt: skip
            cfg = collapse_config(4, 4096, with_post_comb=op == "hc_pre")
            assert cfg.fused
            mhc_collapse(x, fn, scale, base, out, cfg=cfg, **eps, **pc)
            return [out] + ([pc["post"], pc["comb"]] if pc else [])

        cases.append((op, run))
    return cases


def main() -> dict:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    result: dict = {"sms": sms, "kernels": {}}
    cases = _cases()
    # Compile everything and take the idle-GPU answers first: the timed launches below must
    # not include a compilation.
    idle = {name: run() for name, run in cases}
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    started = torch.zeros(1, dtype=torch.int32, device=dev)
    programs = sms - FREE_SMS
    sink = torch.empty(programs * BLOCKER_TILE, dtype=torch.float32, device=dev)
    info = torch.zeros((programs, 2), dtype=torch.int64, device=dev)
    smid = torch.full((programs,), -1, dtype=torch.int32, device=dev)
    canary_count = torch.zeros(1, dtype=torch.int32, device=dev)
    canary_out = torch.zeros(CANARY_GROUP, dtype=torch.int32, device=dev)
    # Warm the blocker and the canary up (compile) on an idle GPU, with an immediate release.
    flag.fill_(1)
    compiled = _blocker_kernel[(1,)](
        flag, started, smid, info, sink, HOLD_NS, TILE=BLOCKER_TILE, num_warps=32, maxnreg=64
    )
    _canary_kernel[(CANARY_GROUP,)](canary_count, canary_out, G=CANARY_GROUP, num_warps=4)
    torch.cuda.synchronize()
    # 1024 threads x 64 registers: the SM's whole register file.
    result["blocker_registers"] = int(compiled.n_regs)
    flag.zero_(), started.zero_(), smid.fill_(-1), canary_count.zero_(), info.zero_()
    torch.cuda.synchronize()

    blocker_s, work_s, canary_s, copy_s = (torch.cuda.Stream(dev) for _ in range(4))
    host = torch.zeros(1, dtype=torch.int32).pin_memory()
    with torch.cuda.stream(blocker_s):
        _blocker_kernel[(programs,)](
            flag, started, smid, info, sink, HOLD_NS, TILE=BLOCKER_TILE, num_warps=32,
            maxnreg=64,
        )  # fmt: skip
        blocker_done = torch.cuda.Event()
        blocker_done.record(blocker_s)
    # Until every blocker program is resident (read through the copy engine, which needs no SM).
    t0 = time.perf_counter()
    while True:
        with torch.cuda.stream(copy_s):
            host.copy_(started, non_blocking=True)
        copy_s.synchronize()
        if int(host[0]) == programs or time.perf_counter() - t0 > 5:
            break
    result["blocker_programs"] = programs
    result["blocker_resident"] = int(host[0])

    # No host synchronization while the blocker runs (a device-to-host read waits for it):
    # completion is polled through events, outputs are compared after the release.
    blocked_outs = {}
    for name, run in cases:
        with torch.cuda.stream(work_s):
            blocked_outs[name] = run()
            done = torch.cuda.Event()
            done.record(work_s)
        took = _wait(done, COMPLETE_S)
        result["kernels"][name] = {
            "completed_s": took,
            "blocker_still_running": not blocker_done.query(),
        }
        if took is None:
            break  # it is stuck behind the blocker; the release below lets it finish

    with torch.cuda.stream(canary_s):  # its own stream: not queued behind a stuck kernel
        _canary_kernel[(CANARY_GROUP,)](canary_count, canary_out, G=CANARY_GROUP, num_warps=4)
        canary_done = torch.cuda.Event()
        canary_done.record(canary_s)
    result["canary_completed_while_blocked"] = _wait(canary_done, STARVED_S) is not None
    result["blocker_running_after_canary_wait"] = not blocker_done.query()

    with torch.cuda.stream(copy_s):  # release: a host-to-device copy, no SM needed
        flag.copy_(torch.ones(1, dtype=torch.int32).pin_memory(), non_blocking=True)
    result["canary_completed_after_release_s"] = _wait(canary_done, HOLD_S + 5)
    torch.cuda.synchronize()
    for name, outs in blocked_outs.items():
        same = all(torch.equal(a, b) for a, b in zip(outs, idle[name], strict=True))
        result["kernels"][name]["equal_to_idle"] = same
    ids = smid.cpu()
    per_sm = torch.bincount(ids[ids >= 0].long(), minlength=sms)
    result["blocker_sms_with_1"] = int((per_sm == 1).sum())
    result["blocker_sms_with_0"] = int((per_sm == 0).sum())
    result["blocker_sms_with_more"] = int((per_sm > 1).sum())
    spun = info.cpu()
    result["blocker_spun_s"] = [float(spun[:, 0].min()) / 1e9, float(spun[:, 0].max()) / 1e9]
    result["blocker_released_by_flag"] = int((spun[:, 1] != 0).sum())
    return result


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print(json.dumps({"error": "needs CUDA"}))
        sys.exit(2)
    print(json.dumps(main()))
