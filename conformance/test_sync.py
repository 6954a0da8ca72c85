"""In-kernel waits that cannot hang: the mHC one-launch kernels finish while another stream's
kernel holds all SMs but two (conformance/_occupy.py runs the check; the rule that makes
it hold is in optimized/kernels/_sync.py).

The check runs in a subprocess with a watchdog: a kernel that does hang is killed with its
process, and the test fails naming it, instead of hanging the suite.  The bitwise agreement of
the one-launch and split forms, and the counters' reset, are tested in test_mhc.py on the CPU
(interpreter) and the GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

WATCHDOG_S = 240


@pytest.mark.gpu
def test_one_launch_kernels_finish_while_other_work_holds_the_sms() -> None:
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "dsv4mtp.conformance._occupy"],
            capture_output=True,
            text=True,
            timeout=WATCHDOG_S,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung: no answer within {WATCHDOG_S} s (partial output: {e.stdout!r})")
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    setup = json.dumps(r)
    # The setup is what it claims: every blocker program resident, one per SM, each holding
    # the SM's whole register file, and two SMs free.
    assert r["blocker_resident"] == r["blocker_programs"] == r["sms"] - 2, setup
    assert r["blocker_registers"] == 64, setup
    assert r["blocker_sms_with_1"] == r["sms"] - 2 and r["blocker_sms_with_more"] == 0, setup
    # The canary (co-residency assumed) is starved while the blocker runs, and is correct.
    assert not r["canary_completed_while_blocked"], setup
    assert r["blocker_running_after_canary_wait"], setup
    assert r["canary_completed_after_release_s"] is not None, setup
    # Every one-launch kernel finished, while the blocker still ran, with the idle GPU's bits.
    assert set(r["kernels"]) == {"hc_pre", "hc_head", "hc_head_fma"}, setup
    for name, k in r["kernels"].items():
        assert k["completed_s"] is not None, f"{name} did not finish beside the blocker: {setup}"
        assert k["blocker_still_running"], f"{name}: the blocker ended first: {setup}"
        assert k["equal_to_idle"], f"{name}: output differs from the idle GPU's: {setup}"
