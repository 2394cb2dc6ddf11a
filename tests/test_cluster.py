"""The trainer on a cluster: preemption (SIGTERM), divergence (non-finite steps), TensorBoard
metrics, and a checkpoint write that fails. Under our launcher here; torchrun in
test_cluster_torchrun.py.

SIGTERM cases run the CLI in this process (`main([...])`): the launcher is this process, and a
thread sends it SIGTERM once the JSON log shows step 2, as a scheduler would (the elastic agent
forwards it to every rank). The references are the same runs uninterrupted, in a worker pool.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from ringattn.cli.main import main
from ringattn.runtime import checkpoint as ckpt
from ringattn.runtime.outcome import EXIT_CHECKPOINT, EXIT_DIVERGED, EXIT_HARD, EXIT_PREEMPTED
from ringattn.train.progress import read_log

TINY = {
    "model": "tiny",
    "dim": 32,
    "seq_len": 64,
    "keys": 3,
    "copies": 2,
    "warmup": 1,
    "lr": 1e-2,
    "quiet": True,
}
FLAGS = [
    "train",
    "--nproc",
    "2",
    "--model",
    "tiny",
    "--dim",
    "32",
    "--seq-len",
    "64",
    "--keys",
    "3",
    "--copies",
    "2",
    "--warmup",
    "1",
    "--lr",
    "1e-2",
    "--quiet",
]


def _losses(out_dir) -> dict[int, float]:
    """{step: loss} of a run's JSON log (a resumed run's steps once each)."""
    return {
        r["step"]: r["loss"]
        for r in read_log(os.path.join(out_dir, "train_log.jsonl"))
        if "loss" in r
    }


def _when_step_logged(out_dir: str, step: int, action, stop: threading.Event) -> list:
    """Run `action()` from a thread as soon as the run's JSON log holds `step`, however long
    that takes (until `stop` is set); the list gets the newest step logged at that moment
    (empty if the run ended first)."""
    done: list[int] = []
    path = os.path.join(out_dir, "train_log.jsonl")

    def watch() -> None:
        while not stop.is_set():
            steps = (
                [r["step"] for r in read_log(path) if "loss" in r] if os.path.exists(path) else []
            )
            if step in steps:
                done.append(max(steps))
                action()
                return
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()
    return done


@pytest.mark.slow
def test_sigterm_to_the_launcher_checkpoints_that_step_and_the_same_command_resumes(
    pools, tmp_path, capfd
):
    """SIGTERM to the launcher (this process) after step 2: the agent forwards it to every rank;
    each finishes its step, they agree on one stop step, checkpoint it, and the command exits 75
    within 30 s of the signal; the same command ends with the uninterrupted run's losses."""
    out = str(tmp_path / "run")
    flags = [*FLAGS, "--steps", "12", "--checkpoint-every", "0", "--out-dir", out]
    # a child of this process that is not one of the launch's ranks (as a test pool's workers
    # are): the forwarded SIGTERM must leave it alone
    bystander = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(300,))
    bystander.start()
    stop = threading.Event()
    signalled = _when_step_logged(out, 2, lambda: os.kill(os.getpid(), signal.SIGTERM), stop)
    try:
        code = main(flags)
    finally:
        stop.set()
    alive = bystander.is_alive()
    bystander.kill()
    assert alive, "the launcher's SIGTERM reached a child that is not one of its ranks"
    assert signalled, "the run ended before step 2 was logged"
    assert code == EXIT_PREEMPTED
    err = capfd.readouterr().err
    assert "SIGTERM: finishing this step, then checkpointing" in err
    assert "preempted: SIGTERM (rank" in err and "run the same command again" in err
    stopped = read_log(os.path.join(out, "train_log.jsonl"))[-1]["stopped"]
    stop_step = stopped["step"]
    # the step in flight when the signal came, or the next (they agree on one): counted in
    # steps, not seconds, so a loaded machine cannot fail it
    assert stopped["reason"] == "preempted" and 3 <= stop_step <= signalled[0] + 2
    assert ckpt.latest(os.path.join(out, "checkpoints")).endswith(f"step-{stop_step:08d}")
    assert main(flags) == 0  # the same command: resumes there and finishes
    reference = pools(2).run(
        "workers_cluster:train_outcome",
        {**TINY, "steps": 12, "checkpoint_every": -1, "out_dir": str(tmp_path / "ref")},
    )[0]
    got = _losses(out)
    assert sorted(got) == list(range(1, 13))
    torch.testing.assert_close(
        [got[s] for s in range(1, 13)], [r["loss"] for r in reference["history"]], rtol=1e-6, atol=0
    )
    starts = [
        r["step"]
        for r in read_log(os.path.join(out, "train_log.jsonl"))
        if r.get("event") == "start"
    ]
    assert starts == [0, stop_step]


@pytest.mark.slow
def test_grace_running_out_exits_at_once_and_leaves_the_last_checkpoint(pools, tmp_path, capfd):
    """SIGTERM to rank 1 in step 4 with a grace period far shorter than a step: it exits at once
    (143) mid-step; the launcher ends the job; step 2's checkpoint is complete and resumes."""
    out = str(tmp_path / "run")
    flags = [
        *FLAGS,
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        "--out-dir",
        out,
        "--grace",
        "0.001",
        "--fail-at-step",
        "3",
        "--fail-rank",
        "1",
        "--fail-signal",
        "term",
    ]
    with pytest.raises(SystemExit) as info:
        main(flags)
    assert info.value.code == 1  # a rank failed: LaunchError
    err = capfd.readouterr().err
    assert "grace period after SIGTERM ran out: exiting at once" in err
    assert f"rank 1 (exit code {EXIT_HARD})" in err
    assert "newest complete checkpoint is" in err and "step-00000002" in err
    assert ckpt.latest(os.path.join(out, "checkpoints")).endswith("step-00000002")
    options = {**TINY, "steps": 4, "checkpoint_every": -1}
    resumed = pools(2).run("workers_cluster:train_outcome", {**options, "out_dir": out})[0]
    reference = pools(2).run(
        "workers_cluster:train_outcome", {**options, "out_dir": str(tmp_path / "ref")}
    )[0]
    assert resumed["start_step"] == 2
    torch.testing.assert_close(
        [r["loss"] for r in resumed["history"]],
        [r["loss"] for r in reference["history"]][2:],
        rtol=1e-6,
        atol=0,
    )


_HARD_EXIT = """
import os, signal, sys, time
from ringattn.runtime import preempt
stop = preempt.install(grace_s=float(sys.argv[1]))
for n in range(1, int(sys.argv[2]) + 1):  # the copies of several layers, seconds apart
    os.kill(os.getpid(), signal.SIGTERM)
    while stop.signals < n:  # handled by the watcher thread
        time.sleep(0.01)
    print("requested", stop.requested, "signals", stop.signals, flush=True)
    time.sleep(preempt.DEBOUNCE_S + 0.3 if n < int(sys.argv[2]) else 0)
if sys.argv[3] == "finish":  # the checkpoint is written: the rank returns normally
    stop.finished()
    sys.exit(0)
time.sleep(60)
print("still running", flush=True)
"""


@pytest.mark.slow
def test_grace_expiry_exits_at_once():
    proc = subprocess.run([sys.executable, "-c", _HARD_EXIT, "1", "1", "wait"], check=False,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == EXIT_HARD, proc.stderr
    assert "requested True" in proc.stdout and "still running" not in proc.stdout
    assert "grace period after SIGTERM ran out: exiting at once" in proc.stderr


@pytest.mark.slow
def test_sigterms_seconds_apart_are_one_request():
    """A second and a third SIGTERM more than DEBOUNCE_S apart (a scheduler's copy, then the
    launcher's, on a loaded node) do not end the rank: it finishes and returns normally."""
    proc = subprocess.run([sys.executable, "-c", _HARD_EXIT, "600", "3", "finish"],
                          check=False, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "requested True signals 3" in proc.stdout
    assert "exiting at once" not in proc.stderr


@pytest.mark.slow
def test_divergence_skips_the_update_on_every_rank_and_stops(pools, tmp_path):
    """lr 1e30: step 1's update makes the weights ~1e30 (finite), so every later loss overflows.
    Steps 2-4 are not applied on any rank (the weights stay step 1's, bitwise), the run stops
    after --max-bad-steps 3 naming the steps and ranks, and no checkpoint follows step 1."""
    options = {**TINY, "lr": 1e30, "steps": 10, "checkpoint_every": 1}
    diverged = pools(2).run(
        "workers_cluster:train_outcome", {**options, "out_dir": str(tmp_path / "a")}
    )[0]
    after_one = pools(2).run(
        "workers_cluster:train_outcome", {**options, "stop_at": 1, "out_dir": str(tmp_path / "b")}
    )[0]
    stopped = diverged["stopped"]
    assert stopped["reason"] == "diverged" and stopped["exit_code"] == EXIT_DIVERGED
    assert stopped["step"] == 4
    history = diverged["history"]
    assert [r["applied"] for r in history] == [True, False, False, False]
    assert all(not math.isfinite(r["loss"]) for r in history[1:])
    for record in history[1:]:
        ranks = record["non_finite"]
        assert ranks and set(ranks) <= {"0", "1"}
        for rank, what in ranks.items():
            assert f"rank {rank}: {what}" in stopped["message"]
    assert "step 2 non-finite" in stopped["message"] and "step 4 non-finite" in stopped["message"]
    assert "--max-bad-steps 3" in stopped["message"] and "step-00000001" in stopped["message"]
    assert diverged["checkpoints"] == [1]  # nothing written after the last applied update
    for name, value in after_one["params"].items():
        assert torch.equal(diverged["params"][name], value), name
        assert torch.isfinite(value).all()


def test_tensorboard_event_files_carry_the_json_log_fields(pools, tmp_path):
    """--tensorboard: loss, lr, grad norm, tokens/s, MFU and each rank's peak memory per step,
    read back with TensorBoard's own EventAccumulator, equal to the JSON log's values."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = str(tmp_path / "tb")
    pools(2).run(
        "workers_cluster:train_outcome",
        {
            **TINY,
            "steps": 3,
            "checkpoint_every": -1,
            "out_dir": out,
            "tensorboard": True,
            "peak_tflops": 0.5,
        },
    )
    steps = [r for r in read_log(os.path.join(out, "train_log.jsonl")) if "loss" in r]
    events = EventAccumulator(os.path.join(out, "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    want = {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mb/rank0", "peak_mb/rank1"}
    assert want <= tags, tags
    for tag in want:
        key, _, rank = tag.partition("/rank")
        logged = [r[key][int(rank)] if rank else r[key] for r in steps]
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [1, 2, 3]
        torch.testing.assert_close([s.value for s in scalars], logged, rtol=1e-6, atol=0)
    for r in steps:  # MFU: the planner's FLOPs per second over 2 devices of 0.5 TFLOP/s
        assert r["mfu"] == pytest.approx(r["flops"] / r["seconds"] / 1e12)
        assert 0 < r["mfu"] < 1


def _freeze_directory(path: str) -> str:
    """Make `path` refuse new entries: chmod for a normal user; as root (whom chmod does not
    stop) the immutable attribute, which the kernel enforces for root too. Returns the undo."""
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        return "chmod"
    subprocess.run(["chattr", "+i", path], check=True, capture_output=True)
    return "chattr"


def _thaw_directory(path: str, how: str) -> None:
    if how == "chmod":
        os.chmod(path, 0o755)
    else:
        subprocess.run(["chattr", "-i", path], check=True, capture_output=True)


def _can_freeze(tmp_path) -> bool:
    probe = str(tmp_path / "probe")
    os.makedirs(probe)
    try:
        how = _freeze_directory(probe)
    except (OSError, subprocess.CalledProcessError):
        return False
    try:
        open(os.path.join(probe, "x"), "w").close()
        frozen = False
    except OSError:
        frozen = True
    _thaw_directory(probe, how)
    return frozen


@pytest.mark.slow
def test_checkpoint_directory_turning_read_only_ends_the_job_and_keeps_the_last_one(
    pools, tmp_path, capfd
):
    """The checkpoint directory turns read-only (really: chattr +i as root) right after step 2's
    checkpoint: the next write fails on rank 0, every rank stops with the same clear error
    (exit 74), and the newest complete checkpoint loads and resumes."""
    if shutil.which("chattr") is None and os.geteuid() == 0 or not _can_freeze(tmp_path):
        pytest.skip("cannot make a directory read-only here (no chattr +i)")
    out, ckpt_dir = str(tmp_path / "run"), str(tmp_path / "run" / "checkpoints")
    froze: list[str] = []
    ended = threading.Event()

    def freeze_after_step_two() -> None:
        while not froze and not ended.is_set():
            if os.path.isdir(os.path.join(ckpt_dir, "step-00000002")):
                froze.append(_freeze_directory(ckpt_dir))
            time.sleep(0.005)

    watcher = threading.Thread(target=freeze_after_step_two, daemon=True)
    watcher.start()
    try:
        code = main(
            [*FLAGS, "--steps", "40", "--checkpoint-every", "1", "--keep", "10", "--out-dir", out]
        )
    finally:
        ended.set()
        watcher.join()
        if froze:
            _thaw_directory(ckpt_dir, froze[0])
    assert froze, "the run ended before step 2's checkpoint appeared"
    assert code == EXIT_CHECKPOINT
    err = capfd.readouterr().err
    assert "could not write the checkpoint of step" in err
    assert "rank 0: PermissionError" in err and "newest complete checkpoint is" in err
    complete = ckpt.complete_checkpoints(ckpt_dir)
    last = complete[-1][0]
    assert last >= 2 and f"step-{last:08d}" in err
    assert not any(name.startswith(".tmp-step-") for name in os.listdir(ckpt_dir))
    resumed = pools(2).run(
        "workers_cluster:train_outcome",
        {**TINY, "steps": 40, "stop_at": last + 1, "checkpoint_every": -1, "out_dir": out},
    )[0]
    assert resumed["start_step"] == last and len(resumed["history"]) == 1
    assert math.isfinite(resumed["history"][0]["loss"])
