"""ringattn.launch: W local ranks through torch's elastic agent, and clear errors when one fails."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from ringattn.runtime.launch import LaunchError, init_distributed, launch, running_under_torchrun


def _sum_of_ranks(offset: float) -> dict:
    """A rank's entry point: joins the group, all-reduces, reports what it saw."""
    device = init_distributed(timeout_s=30)
    total = torch.tensor([dist.get_rank() + offset], device=device)
    dist.all_reduce(total)
    return {
        "total": total.item(),
        "world_size": dist.get_world_size(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "under_torchrun": running_under_torchrun(),
    }


def _fail_on_rank_one() -> None:
    init_distributed(timeout_s=30)
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank one")
    dist.barrier()


def _exit_on_rank_zero() -> None:
    init_distributed(timeout_s=30)
    if dist.get_rank() == 0:
        os._exit(7)
    dist.barrier()


@pytest.mark.slow
def test_launch_returns_every_ranks_value():
    results = launch(_sum_of_ranks, 3, 1.0)
    assert sorted(results) == [0, 1, 2]
    for value in results.values():
        assert value["total"] == 0 + 1 + 2 + 3 * 1.0
        assert value["world_size"] == 3
        expected_omp = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // 3)))
        assert value["omp"] == expected_omp  # the caller's setting wins, else cores // W
        assert value["under_torchrun"] is False  # a launched child is not a torchrun rank


@pytest.mark.slow
def test_single_process_launch():
    assert launch(_sum_of_ranks, 1, 0.5)[0]["total"] == 0.5


@pytest.mark.slow
def test_failed_rank_names_rank_and_error():
    with pytest.raises(LaunchError) as info:
        launch(_fail_on_rank_one, 2)
    message = str(info.value)
    assert "rank 1 (exit code 1)" in message
    assert "ValueError: deliberate failure on rank one" in message
    assert "_fail_on_rank_one" in message  # the traceback tail points at the user's code


@pytest.mark.slow
def test_dead_rank_reports_exit_code():
    with pytest.raises(LaunchError, match=r"rank 0 \(exit code 7\): exited without"):
        launch(_exit_on_rank_zero, 2)


def test_bad_nproc():
    with pytest.raises(ValueError, match="nproc must be a positive int, got 0"):
        launch(_sum_of_ranks, 0, 1.0)


def test_running_under_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "RINGATTN_LAUNCHED"):
        monkeypatch.delenv(name, raising=False)
    assert not running_under_torchrun()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert running_under_torchrun()
    monkeypatch.setenv("RINGATTN_LAUNCHED", "1")
    assert not running_under_torchrun()


def _listening_sockets_of_the_launch() -> list[str]:
    """Local addresses of every listening TCP socket held by this launch's processes (the agent,
    our parent, and every rank it spawned), read from /proc."""
    init_distributed(timeout_s=30)
    dist.barrier()  # every rank has joined: its sockets exist
    agent = os.getppid()
    pids = {agent} | {
        int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == agent
    }
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    found.append(fields[1][:width])
    dist.barrier()
    return found


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return -1


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc")
@pytest.mark.slow
def test_a_local_launch_listens_on_loopback_only():
    """No store or rendezvous reachable from the network: every listening socket of the agent and
    the ranks is bound to 127.0.0.1 or ::1 (hex in /proc: 0100007F, ...0001)."""
    loopback = ("0100007F", "00000000000000000000000001000000")
    for rank, addresses in launch(_listening_sockets_of_the_launch, 2).items():
        assert all(a in loopback for a in addresses), (rank, addresses)


def _freeze_rank_one() -> None:
    import signal
    import time

    from ringattn.runtime.heartbeat import report_progress

    init_distributed(timeout_s=120)
    report_progress(step=3, phase="forward")
    # the beat thread writes the report when it next runs; freezing within microseconds of the
    # report could name the previous one (seen once in CI), so give it a beat's time first
    time.sleep(1.5)
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen, not dead: the agent cannot see it
    dist.barrier()  # rank 0 waits here; without the heartbeat, for the whole 120 s timeout


@pytest.mark.slow
def test_a_frozen_rank_is_named_within_seconds():
    import time

    start = time.perf_counter()
    with pytest.raises(LaunchError) as info:
        launch(_freeze_rank_one, 2, stall_s=4.0)
    elapsed = time.perf_counter() - start
    message = str(info.value)
    assert "rank 1 (pid" in message and "stopped responding" in message, message
    assert "step 3, phase forward" in message, message
    assert "attention" not in message, message  # the beat's attention states are not progress
    assert elapsed < 30, elapsed  # the process-group timeout is 120 s
