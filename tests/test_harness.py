"""Tests of the multi-process harness itself: results, collectives, errors, hangs and dead ranks."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import basetemp
from harness import WorkerPool

# Worker functions: module level, so workers can import them as `test_harness:<name>`.


def _whoami(rank: int, world_size: int, tag: str = "") -> tuple[int, int, str]:
    return rank, world_size, tag


def _all_reduce(rank: int, world_size: int, base: float) -> torch.Tensor:
    t = torch.tensor([base + rank], dtype=torch.float64)
    dist.all_reduce(t)
    return t


def _raise_on(rank: int, world_size: int, bad_rank: int) -> int:
    if rank == bad_rank:
        raise ValueError(f"boom on rank {rank}")
    return rank


def _raise_everywhere(rank: int, world_size: int) -> None:
    raise ValueError(f"bad input on rank {rank} of {world_size}")


def _rank0_waits_forever(rank: int, world_size: int) -> int:
    if rank == 0:
        dist.recv(torch.empty(1), src=1)  # rank 1 never sends
    return rank


def _rank1_dies(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


@pytest.mark.parametrize("pool", [1, 2, 3], indirect=True)
def test_every_rank_runs_with_args(pool):
    w = pool.world_size
    assert pool.run(_whoami) == [(r, w, "") for r in range(w)]
    assert pool.run("test_harness:_whoami", tag="x") == [(r, w, "x") for r in range(w)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_sums_over_the_group(pools, world_size):
    results = pools(world_size).run(_all_reduce, 10.0)
    expected = sum(10.0 + r for r in range(world_size))
    assert len(results) == world_size
    for t in results:
        assert t.dtype == torch.float64 and t.item() == expected


def test_error_on_one_rank_names_it_and_pool_survives(pools):
    pool = pools(2)
    with pytest.raises(AssertionError) as info:
        pool.run(_raise_on, 1)
    report = str(info.value)
    assert "ranks [1] raised" in report
    assert "----- rank 1 traceback -----" in report and "rank 0 traceback" not in report
    assert "ValueError: boom on rank 1" in report and "_raise_on" in report
    assert pools(2) is pool and pool.run(_whoami) == [(0, 2, ""), (1, 2, "")]


def test_run_expect_error(pools):
    pool = pools(2)
    messages = pool.run_expect_error(
        _raise_everywhere, match=r"bad input on rank \d", exc_type=ValueError
    )
    assert messages == ["bad input on rank 0 of 2", "bad input on rank 1 of 2"]
    with pytest.raises(AssertionError, match="rank 0 did not raise"):
        pool.run_expect_error(_raise_on, 1, match="boom")
    with pytest.raises(AssertionError, match="does not match"):
        pool.run_expect_error(_raise_everywhere, match="something else")
    with pytest.raises(AssertionError, match="not builtins.KeyError"):
        pool.run_expect_error(_raise_everywhere, match="bad input", exc_type=KeyError)
    assert pools(2) is pool


def test_unimportable_functions_are_rejected(pools):
    with pytest.raises(ValueError, match="module level"):
        pools(2).run(lambda rank, world_size: rank)
    with pytest.raises(ValueError, match="module:qualname"):
        pools(2).run("no_colon_here")


def test_dead_rank_is_reported_with_exit_code(pools):
    pool = pools(2)
    with pytest.raises(AssertionError, match="rank 1 exited with code 3"):
        pool.run(_rank1_dies)
    assert pool.closed


@pytest.mark.slow
def test_hang_hits_deadline_and_pool_is_replaced(pools):
    pool = pools(2)
    pool.run(_whoami)  # import this module on both ranks first, so only rank 0 can be late
    with pytest.raises(AssertionError, match=r"ranks \[0\] did not answer within 3 s"):
        pool.run(_rank0_waits_forever, timeout=3)
    assert pool.closed
    with pytest.raises(RuntimeError, match="is shut down"):
        pool.run(_whoami)
    fresh = pools(2)
    assert fresh is not pool and fresh.run(_whoami) == [(0, 2, ""), (1, 2, "")]


@pytest.mark.slow
def test_a_straggler_ends_the_run_soon_after_the_first_answer(pools):
    """straggler_s: rank 1 answers at once, rank 0 never; the run ends straggler_s after rank
    1's answer, long before its timeout, and the pool is replaced."""
    pool = pools(2)
    pool.run(_whoami)
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[0\] did not answer within 1 s of rank 1"):
        pool.run(_rank0_waits_forever, timeout=120, straggler_s=1.0)
    assert time.monotonic() - start < 60 and pool.closed


def test_startup_deadline_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"startup: ranks \[0\] did not answer within 0.01 s"):
        WorkerPool(1, startup_timeout_s=0.01)


def test_a_run_deletes_only_ended_runs_folders_beyond_the_newest_kept(tmp_path, monkeypatch):
    """basetemp.claim: a live run's folder (its lock held) survives, ended ones beyond `keep`
    go, oldest first, and the claiming run's own folder is new."""
    runs = str(tmp_path / "runs")
    os.makedirs(runs)
    for second in range(4):  # four ended runs: folders with a free lock
        name = os.path.join(runs, f"run-20260101-00000{second}-1")
        os.makedirs(name)
        open(name + ".lock", "w").close()
    live_folder, live_lock = basetemp.claim(runs, keep=1)  # itself deletes ended runs 0-2
    os.makedirs(live_folder)
    try:
        assert sorted(os.listdir(runs)) == sorted(
            ["run-20260101-000003-1", "run-20260101-000003-1.lock",
             os.path.basename(live_folder), os.path.basename(live_folder) + ".lock"]
        )  # fmt: skip
        monkeypatch.setattr(basetemp.time, "strftime", lambda fmt: "29991231-235959")
        second, lock = basetemp.claim(runs, keep=0)  # every ended run goes, the live one stays
        lock.close()
        assert os.path.isdir(live_folder) and not os.path.exists(second)
        assert not os.path.exists(os.path.join(runs, "run-20260101-000003-1"))
    finally:
        live_lock.close()
    assert basetemp.remove_ended(runs, keep=0) == [live_folder, second]
