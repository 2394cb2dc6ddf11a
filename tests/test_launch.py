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


def test_launch_returns_every_ranks_value():
    results = launch(_sum_of_ranks, 3, 1.0)
    assert sorted(results) == [0, 1, 2]
    for value in results.values():
        assert value["total"] == 0 + 1 + 2 + 3 * 1.0
        assert value["world_size"] == 3
        expected_omp = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // 3)))
        assert value["omp"] == expected_omp  # the caller's setting wins, else cores // W
        assert value["under_torchrun"] is False  # a launched child is not a torchrun rank


def test_single_process_launch():
    assert launch(_sum_of_ranks, 1, 0.5)[0]["total"] == 0.5


def test_failed_rank_names_rank_and_error():
    with pytest.raises(LaunchError) as info:
        launch(_fail_on_rank_one, 2)
    message = str(info.value)
    assert "rank 1 (exit code 1)" in message
    assert "ValueError: deliberate failure on rank one" in message
    assert "_fail_on_rank_one" in message  # the traceback tail points at the user's code


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
