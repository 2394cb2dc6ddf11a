"""examples/clusters/slurm/train.sbatch through a real Slurm: slurmctld and slurmd on this machine
(ringattn/testing/slurm.py), one node of 2 CPUs, `torchrun` with 2 ranks at cp 2.

- a SIGTERM to the job's steps (`scancel --signal=TERM JOB`: torchrun and the ranks, srun
  launching them) preempts it: the ranks checkpoint and exit 75, torchrun exits 1, the script
  tells that from a failure by the run's log, requeues the job, and the requeued job resumes to
  the losses of an uninterrupted run;
- a SIGTERM to the whole job (`scancel --signal=TERM --full JOB`, what Slurm's preemption with a
  grace time sends: the batch shell, torchrun and every rank, seconds apart on a loaded node)
  does the same;
- a failed run (a rank killed) is not requeued: the job fails.

Needs root and the packages slurm-wlm and munge (scripts/setup.sh installs them as root): the
tests skip otherwise, with the reason.
"""

from __future__ import annotations

import os
import pathlib
import socket
import sys

import pytest
import torch

from patience import wait_until
from ringattn.runtime import checkpoint as ckpt
from ringattn.testing.slurm import LocalSlurm, unavailable
from ringattn.train.progress import read_log

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "clusters" / "slurm" / "train.sbatch")
STEPS = 150  # a SIGTERM sent at step 5 lands mid-run: at step 14 here, 33 ms a step
TINY = {"model": "tiny", "dim": 32, "seq_len": 64, "keys": 3, "copies": 2, "warmup": 1,
        "lr": 1e-2, "quiet": True, "cp": 2, "steps": STEPS, "checkpoint_every": 0}  # fmt: skip
FLAGS = ["--model", "tiny", "--dim", "32", "--seq-len", "64", "--keys", "3", "--copies", "2",
         "--warmup", "1", "--lr", "1e-2", "--quiet", "--cp", "2", "--steps", str(STEPS),
         "--checkpoint-every", "0"]  # fmt: skip
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


@pytest.fixture(scope="module")
def slurm():
    why = unavailable()
    if why:
        pytest.skip(f"a local Slurm cluster: {why}")
    with LocalSlurm(cpus=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(pools, tmp_path_factory):
    """The uninterrupted run's losses: the same flags on 2 ranks of a worker pool."""
    out = str(tmp_path_factory.mktemp("slurm-reference"))
    return [r["loss"] for r in pools(2).run("workers_cluster:train_outcome",
                                            {**TINY, "out_dir": out})[0]["history"]]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _submit(slurm: LocalSlurm, tmp_path: pathlib.Path, flags: list[str], **env: str) -> str:
    bin_dir = os.path.dirname(sys.executable)  # torchrun and python of this environment
    job_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT / "src"),
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "RINGATTN_NPROC_PER_NODE": "2", "RINGATTN_PORT": str(_free_port()),
               "RINGATTN_OUT": str(tmp_path / "run"), **env}  # fmt: skip
    return slurm.submit(SCRIPT, *flags, env=job_env,
                        options=("--output", str(tmp_path / "job.out"), "--chdir",
                                 str(tmp_path)))  # fmt: skip


def _wait_for_step(slurm: LocalSlurm, log: pathlib.Path, step: int, job: str) -> None:
    def reached() -> bool:
        if slurm.state(job) in TERMINAL:
            raise AssertionError(f"job {job} ended before step {step}: {slurm.job(job)}")
        return log.exists() and any(r.get("step", 0) >= step for r in read_log(str(log)))

    wait_until(reached, slurm.pids, f"step {step} of job {job}")


def _wait_for_end(slurm: LocalSlurm, job: str) -> dict[str, str]:
    wait_until(lambda: slurm.state(job) in TERMINAL, slurm.pids, f"job {job} to end")
    return slurm.job(job)


def _losses_by_step(path: pathlib.Path) -> list[float]:
    """The loss of every step, the last record of a step winning (a requeued run repeats the
    steps after its checkpoint)."""
    by_step = {r["step"]: r["loss"] for r in read_log(str(path)) if "loss" in r}
    return [by_step[s] for s in sorted(by_step)]


@pytest.mark.parametrize("how", ["steps", "full"])
@pytest.mark.slow
def test_a_sigterm_preempts_the_job_which_is_requeued_and_resumes(slurm, reference, tmp_path,
                                                                   how):  # fmt: skip
    """steps: `scancel --signal=TERM` (the steps only), the ranks started by srun; full:
    `scancel --signal=TERM --full`, the batch shell too, torchrun started by the script."""
    job = _submit(slurm, tmp_path, FLAGS, **({"RINGATTN_LAUNCH": "srun"} if how == "steps" else {}))
    log = tmp_path / "run" / "train_log.jsonl"
    _wait_for_step(slurm, log, 5, job)
    slurm.run("scancel", "--signal=TERM", *(["--full"] if how == "full" else []), job)
    info = _wait_for_end(slurm, job)
    output = (tmp_path / "job.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, output[-4000:])
    assert "[sbatch] preempted" in output and "[sbatch] trained" in output, output[-4000:]
    assert "preempted: SIGTERM" in output, output[-4000:]  # the trainer's line, exit 75
    assert "exiting at once" not in output, output[-4000:]  # no hard exit on a second copy
    starts = [r for r in read_log(str(log)) if r.get("event") == "start"]
    assert len(starts) == 2 and starts[1]["step"] > 0  # the requeued run resumed
    assert ckpt.latest(str(tmp_path / "run" / "checkpoints")).endswith(f"step-{STEPS:08d}")
    torch.testing.assert_close(_losses_by_step(log), reference, rtol=1e-6, atol=0)


@pytest.mark.slow
def test_a_failed_run_is_not_requeued(slurm, tmp_path):
    """A rank killed at step 3: torchrun exits 1 like a preemption's, but the log says the run
    did not stop for a preemption, so the job fails and stays failed."""
    flags = [*FLAGS, "--fail-at-step", "3", "--fail-rank", "1", "--fail-signal", "kill"]
    job = _submit(slurm, tmp_path, flags)
    info = _wait_for_end(slurm, job)
    output = (tmp_path / "job.out").read_text()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", (info, output[-4000:])
    assert "[sbatch] failed" in output and "[sbatch] preempted" not in output, output[-4000:]
