"""The trainer under an external `torchrun` (loopback only, as tests/test_train_4d.py): a SIGTERM
to one rank checkpoints that step on every rank and resumes to the uninterrupted losses, and a
frozen rank is named by its neighbours' heartbeats within seconds (runtime/peer_heartbeat.py).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile

import pytest
import torch

from patience import wait_until
from ringattn.runtime import checkpoint as ckpt
from ringattn.runtime.outcome import EXIT_FROZEN_PEER, EXIT_PREEMPTED
from ringattn.train.progress import read_log

TINY = {"model": "tiny", "dim": 32, "seq_len": 64, "keys": 3, "copies": 2, "warmup": 1,
        "lr": 1e-2, "quiet": True}  # fmt: skip
FLAGS = ["--model", "tiny", "--dim", "32", "--seq-len", "64", "--keys", "3", "--copies", "2",
         "--warmup", "1", "--lr", "1e-2", "--quiet"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(flags: list[str]) -> tuple[int, str]:
    """`torchrun -m ringattn train FLAGS` on 2 local ranks: (exit code, output), however slowly
    the machine runs it (a hang, no CPU time used, fails: patience.py)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{_free_port()}", "--local-addr", "127.0.0.1", "-m", "ringattn",
               "train", *FLAGS, *flags]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            wait_until(lambda: proc.poll() is not None, lambda: [proc.pid], "torchrun to end")
        finally:
            proc.kill()
            proc.wait()
        log.seek(0)
        return proc.returncode, log.read()


@pytest.mark.slow
def test_sigterm_to_one_rank_under_torchrun_checkpoints_every_rank_and_resumes(pools, tmp_path):
    """SIGTERM to rank 1 only, in step 3: the flag travels in the step's all-reduce, both ranks
    checkpoint the same step and exit 75 (torchrun reports it); resuming from that checkpoint
    gives the uninterrupted run's losses."""
    out = str(tmp_path / "run")
    code, output = _torchrun(["--steps", "6", "--checkpoint-every", "0", "--out-dir", out,
                                 "--fail-at-step", "2", "--fail-rank", "1", "--fail-signal",
                                 "term"])  # fmt: skip
    assert code != 0, output
    assert f"exitcode: {EXIT_PREEMPTED}" in output, output[-3000:]
    assert "preempted: SIGTERM (rank 1); every rank finished step" in output, output[-3000:]
    stop_step = int(output.split("every rank finished step ")[1].split()[0])
    assert stop_step in (3, 4)  # the step in flight when the signal came, or the next
    assert ckpt.latest(os.path.join(out, "checkpoints")).endswith(f"step-{stop_step:08d}")
    options = {**TINY, "steps": 6, "checkpoint_every": -1}
    resumed = pools(2).run("workers_cluster:train_outcome", {**options, "out_dir": out})[0]
    reference = pools(2).run("workers_cluster:train_outcome",
                             {**options, "out_dir": str(tmp_path / "ref")})[0]  # fmt: skip
    assert resumed["start_step"] == stop_step
    logged = [r["loss"] for r in read_log(os.path.join(out, "train_log.jsonl")) if "loss" in r]
    want = [r["loss"] for r in reference["history"]]
    torch.testing.assert_close(logged, want, rtol=1e-6, atol=0)  # under torchrun, then resumed


@pytest.mark.slow
def test_a_frozen_rank_is_named_under_torchrun(tmp_path):
    """Rank 1 stops itself (SIGSTOP) at step 3: rank 0's heartbeat watcher names it within
    --stall-timeout, kills it (same host) and exits 70, and torchrun ends the job: no wait for
    the 600 s process-group timeout."""
    code, output = _torchrun(["--steps", "50", "--checkpoint-every", "0", "--out-dir",
                                       str(tmp_path / "run"), "--fail-at-step", "2",
                                       "--fail-rank", "1", "--fail-signal", "stop",
                                       "--stall-timeout", "4"])  # fmt: skip
    assert code != 0
    assert "rank 1 (pid" in output and "stopped responding: no heartbeat for 4 s" in output, output
    assert "it was killed to end the job" in output
    assert "last at attention" not in output, output[-3000:]
    # rank 0's code: in the agent's log line when it is the first failure it sees, in its table
    # ("exitcode  : 70") when the killed rank 1 is seen first
    assert re.search(rf"exitcode\s*: {EXIT_FROZEN_PEER}\b", output), output[-3000:]
    # the heartbeat ended the job at the frozen step, long before its 50 steps
    steps = [r["step"] for r in read_log(str(tmp_path / "run" / "train_log.jsonl")) if "loss" in r]
    assert steps and max(steps) < 50, steps
