"""No leaked process groups: a pool's worker processes hold the same threads, case after case.

Every gloo group holds three threads (two `pt_gloo_runloop`, one `gloo_tcp_loop`) until it is
destroyed. The library used to make its groups per call (a Trainer's cp rows, a training run's
DeviceMesh and dynamic-CP sub-groups, the tp and ep meshes of generate and serve), so a long-lived
process (a notebook, a sweep, the suite's worker pools) kept every earlier copy: after an hour a
4-rank pool's process held 601 threads. comm/group_cache.py makes each group once per default
group. Here the pools' heaviest group-building cases run once to warm up, then again: the second
round must leave every worker with the threads the first round left.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("trl")

import workers_hf_moe

GLOO = ("pt_gloo_runloop", "gloo_tcp_loop")


def test_group_cache_returns_the_same_groups(pools):
    for rank, checks in enumerate(pools(4).run("workers_group_leaks:memo")):
        assert all(checks.values()), f"rank {rank}: {checks}"


def test_a_server_started_twice_reuses_its_side_group(pools):
    """serve/protocol.py's Verdict made its gloo side group per server start; now once per
    timeout (comm/group_cache.py)."""
    for rank, checks in enumerate(pools(2).run("workers_group_leaks:verdicts")):
        assert all(checks.values()), f"rank {rank}: {checks}"


def _heavy_cases(tmp_path) -> list[tuple[str, tuple]]:
    """(worker, args) at W = 4 of every path that built groups per call (module docstring), each
    writing under `tmp_path` (a fresh one per round: a run finding its checkpoint resumes)."""
    tmp_path.mkdir()
    workers_hf_moe.save_config(tmp_path / "mixtral")
    (tmp_path / "docs").mkdir()
    for i in range(8):
        (tmp_path / "docs" / f"{i}.txt").write_text(f"document {i} " + "abcdefgh"[i:] * (2 + i))
    train_4d = {"model": "tiny", "dim": 32, "seq_len": 64, "keys": 3, "copies": 2, "steps": 1,
                "warmup": 1, "lr": 1.0, "optimizer": "sgd", "quiet": True,
                "checkpoint_every": -1, "pp": 1, "dp": 1, "cp": 2, "tp": 2, "batch_size": 4,
                "out_dir": str(tmp_path / "4d")}  # fmt: skip
    experts = {"hf": str(tmp_path / "mixtral"), "data": f"text:{tmp_path / 'docs'}",
               "seq_len": 29, "warmup": 1, "quiet": True, "batch_size": 1, "steps": 1,
               "lr": 2.0, "optimizer": "sgd", "checkpoint_every": 0, "dp": 2, "cp": 2, "ep": 2,
               "out_dir": str(tmp_path / "ep")}  # fmt: skip
    trainer = {"kind": "trainer", "cp": 2, "steps": 1}  # dp 2 x cp 2
    return [
        ("workers_train_4d:train_all_parameters", (train_4d,)),
        ("workers_hf_trainer:run", (trainer, str(tmp_path / "trainer"))),
        ("workers_hf_experts:train", (experts,)),
    ]


@pytest.mark.slow
def test_heavy_cases_leak_no_threads(pools, tmp_path):
    """Each worker's threads after a second round of the heavy cases equal those after the
    first (gloo's by name, and all of them)."""
    pool = pools(4)
    rounds = []
    for i in range(2):
        cases = _heavy_cases(tmp_path / f"round{i}")
        for worker, args in cases:
            pool.run(worker, *args, timeout=600)
        rounds.append(pool.run("workers_group_leaks:threads"))
    for rank, (first, second) in enumerate(zip(*rounds)):
        for name in (*GLOO, "all"):
            assert second.get(name, 0) == first.get(name, 0), (
                f"rank {rank}: {name} threads {first.get(name, 0)} after the first round of "
                f"{[w for w, _ in cases]}, {second.get(name, 0)} after the second"
            )
