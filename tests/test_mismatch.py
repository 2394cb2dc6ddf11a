"""A rank that changes its attention arguments after the ranks agreed is named within seconds.

The changed rank waits in a new agreement while its peers, on the agreed fast path, wait inside
the call for it (ringattn/inflight.py publishes both in the heartbeats; runtime/mismatch.py
judges). Pure cases of the judgement first, then the real thing on 2 ranks under our launcher
and under an external torchrun, each against a process-group timeout of 120 s.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from ringattn.runtime.launch import LaunchError, launch
from ringattn.runtime.mismatch import MismatchWatch, suspect
from ringattn.runtime.outcome import EXIT_MISMATCH
from workers_mismatch import change_on_second_call

WANT = "rank 1 changed its attention arguments after the ranks had agreed on them"
SHAPE = "q.shape=(1, 2, 16, 8) where rank 0 passes (1, 2, 32, 8)"


def _entry(state: str, call: int, calls: int, for_s: float, q: tuple = (1, 2, 32, 8),
           error: str | None = None) -> dict:  # fmt: skip
    signature = [["q.shape", list(q)], ["causal", True]]
    return {"group": "0", "calls": calls, "state": state, "call": call, "for_s": for_s,
            "signature": signature, "error": error}  # fmt: skip


def test_a_rank_that_passed_the_agreement_without_another_is_a_mismatch():
    changed = _entry("agreeing", 5, 5, 3.0, q=(1, 2, 16, 8))
    found = suspect({0: [_entry("forward", 5, 5, 3.0)], 1: [changed]})
    assert found is not None and found[0] == 1 and found[2] == [0]
    # a rank that started a later call is past it too; one still in an earlier call is slow
    assert suspect({0: [_entry("backward", 4, 6, 0.5)], 1: [changed]}) is not None
    assert suspect({0: [_entry("forward", 4, 4, 30.0)], 1: [changed]}) is None
    # in an agreement too (the all-gathers meet; counts that drifted apart are resynced there),
    # or not waiting long enough yet
    assert suspect({0: [_entry("agreeing", 5, 5, 3.0)], 1: [changed]}) is None
    assert suspect({0: [_entry("agreeing", 6, 6, 3.0)], 1: [changed]}) is None
    assert suspect({0: [_entry("forward", 5, 5, 3.0)], 1: [{**changed, "for_s": 1.0}]}) is None
    # another group's calls say nothing about this one
    assert suspect({0: [{**_entry("forward", 5, 5, 3.0), "group": "7"}], 1: [changed]}) is None


def test_a_suspicion_becomes_a_verdict_only_when_a_later_beat_confirms_it():
    watch = MismatchWatch(min_s=2.0, confirm_s=1.0)
    ahead = [_entry("forward", 5, 5, 3.0)]
    assert watch.observe({0: ahead, 1: [_entry("agreeing", 5, 5, 2.5, q=(1, 2, 16, 8))]}) is None
    # the agreement completed in between (rank 0 had only just joined): the suspicion is dropped
    assert watch.observe({0: ahead, 1: [_entry("forward", 5, 5, 0.1)]}) is None
    assert watch.observe({0: ahead, 1: [_entry("agreeing", 5, 5, 2.5, q=(1, 2, 16, 8))]}) is None
    rank, message = watch.observe({0: ahead, 1: [_entry("agreeing", 5, 5, 3.6, q=(1, 2, 16, 8))]})
    assert rank == 1 and WANT in message and SHAPE in message, message
    assert "attention call 5" in message and "waited 4 s" in message, message


def test_a_local_error_after_the_agreement_is_named_with_the_error():
    error = "ValueError: local sequence lengths differ"
    records = {0: [_entry("forward", 5, 5, 9.0)], 1: [_entry("agreeing", 5, 5, 3.0, error=error)],
               2: [_entry("forward", 5, 5, 9.0)]}  # fmt: skip
    _, _, ahead, theirs = suspect(records)
    from ringattn.runtime.mismatch import describe

    message = describe(1, records[1][0], ahead, theirs)
    assert f"its local checks failed there ({error}), where ranks 0, 2 passed them" in message


@pytest.mark.slow
def test_changed_arguments_are_named_under_our_launcher():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(change_on_second_call, 2)
    message = str(info.value)
    assert WANT in message and SHAPE in message, message
    assert "the ranks were killed to end the job" in message, message
    assert time.monotonic() - start < 60  # start-up + a few seconds, not the 120 s timeout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_changed_arguments_are_named_under_torchrun():
    script = os.path.join(os.path.dirname(__file__), "workers_mismatch.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{_free_port()}", "--local-addr", "127.0.0.1", script]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    start = time.monotonic()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=200,
                          check=False)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for rank in (0, 1):  # the same message on every rank
        assert f"[rank {rank}] {WANT}" in output, output[-4000:]
    assert SHAPE in output and f"exits with code {EXIT_MISMATCH}" in output, output[-4000:]
    assert time.monotonic() - start < 100  # not the 120 s process-group timeout
