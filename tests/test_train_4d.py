"""4-D parallelism in the trainer: tp x cp, dp x tp, pp x cp, pp x dp, pp x tp equal one process
step by step, a DCP checkpoint saved under cp 4 resumes under cp 2 x tp 2 or pp 2 x cp 2 with the
same next-step loss, and bad degrees fail before anything launches.

Multi-rank cases run the real training loop (build_run + loop.train) in a pool of 4 gloo ranks
(workers_train.py, workers_train_4d.py); the reference is the same model on one process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from patience import wait_until
from ringattn.train.config import TrainConfig, validate
from ringattn.train.decoder import DECODER
from ringattn.train.progress import read_log

# 2 layers of width 32, 4 heads / 2 kv heads, 64-token sequences, 3 steps
# SGD: weights compared across meshes are then exact by construction (workers_train.build)
TINY = {"model": "tiny", "dim": 32, "seq_len": 64, "keys": 3, "copies": 2, "steps": 3,
        "warmup": 1, "lr": 1.0, "optimizer": "sgd", "quiet": True,
        "checkpoint_every": -1}  # fmt: skip
GLOBAL_BATCH = 4  # sequences per step over all dp groups


def _options(tmp_path, name: str, **overrides) -> dict:
    return {**TINY, "out_dir": str(tmp_path / name), **overrides}


def _single(pools, tmp_path, **overrides) -> dict:
    options = _options(tmp_path, "one", batch_size=GLOBAL_BATCH, **overrides)
    return pools(1).run("workers_train:train", options)[0]


def _assert_same(got: dict, want: dict, atol: float = 1e-6) -> None:
    """Losses within 1e-5 relative; every parameter within 1e-6 (SGD: lr x summed gradients, so
    equal to rounding; Adam's lr-sized steps on near-zero gradients would not be, issue 31)."""
    torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64),
                               torch.tensor(want["losses"], dtype=torch.float64),
                               rtol=1e-5, atol=0)  # fmt: skip
    assert got["params"].keys() == want["params"].keys()
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=10 * atol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip


def _merged(results: list[dict]) -> dict:
    """Rank 0's losses with the parameters of every rank (each pp stage holds its own)."""
    params = {}
    for r in results:
        params.update(r["params"])
    return {**results[0], "params": params}


@pytest.mark.parametrize(
    "pp, dp, cp, tp, extra",
    [
        (1, 1, 2, 2, {}),
        (1, 2, 1, 2, {}),
        (2, 1, 2, 1, {"microbatches": 2}),  # GPipe
        (2, 2, 1, 1, {"microbatches": 2, "pp_schedule": "1f1b"}),
        (2, 1, 1, 2, {"microbatches": 4}),
    ],
)
@pytest.mark.slow
def test_parallel_layouts_equal_one_process(pools, tmp_path, pp, dp, cp, tp, extra):
    """fp32, 4 ranks: tp x cp, dp x tp, pp x cp, pp x dp (1F1B), pp x tp give the single
    process's losses and weights after 3 steps (the zigzag ring over cp, heads and MLP over tp,
    blocks over pp, FSDP2 over dp x cp)."""
    want = _single(pools, tmp_path)
    options = _options(tmp_path, "four", pp=pp, dp=dp, cp=cp, tp=tp,
                       batch_size=GLOBAL_BATCH // dp, **extra)  # fmt: skip
    got = pools(4).run("workers_train_4d:train_all_parameters", options)
    assert got[0]["degrees"] == (pp, dp, cp, tp)
    _assert_same(_merged(got), want)
    assert want["losses"][0] != want["losses"][-1]  # the steps trained


@pytest.mark.slow
def test_three_and_four_dimensions_on_8_ranks_equal_one_process(pools, tmp_path):
    """fp32, 8 ranks: pp 2 x cp 2 x tp 2 (GPipe, 2 micro-batches) and dp 2 x cp 2 x tp 2 give the
    single process's losses and weights after 3 steps."""
    want = _single(pools, tmp_path)
    for pp, dp, extra in ((2, 1, {"microbatches": 2}), (1, 2, {})):
        options = _options(tmp_path, f"eight-{pp}-{dp}", pp=pp, dp=dp, cp=2, tp=2,
                           batch_size=GLOBAL_BATCH // dp, **extra)  # fmt: skip
        got = pools(8).run("workers_train_4d:train_all_parameters", options)
        assert got[0]["degrees"] == (pp, dp, 2, 2)
        _assert_same(_merged(got), want)


def test_parameters_are_split_over_tp_and_sharded_over_dp_cp(pools, tmp_path):
    """Under cp 2 x tp 2 the query projection is split by output rows over tp (ColwiseParallel),
    the output projection by input columns (RowwiseParallel), norms replicated over tp; FSDP then
    shards each over dp x cp: the local shards are 1/4 (1/2 for norms) of the whole."""
    results = pools(4).run("workers_train_4d:sharding", _options(tmp_path, "s", cp=2, tp=2))
    assert [r["coords"] for r in results] == [(0, 0, c, t) for c in range(2) for t in range(2)]
    assert results[0]["degrees"] == (1, 1, 2, 2)
    assert results[0]["mesh_dims"] == ("pp", "dp", "cp", "tp")
    params = results[0]["params"]
    local, full, placements = params["layers.0.attention.wq.weight"]  # (32, 32): 4 heads of 8
    assert full == (32, 32) and local == (8, 32) and placements[-1] == "Shard"
    local, full, _ = params["layers.0.attention.wo.weight"]
    assert full == (32, 32) and local == (16, 16)  # rows over dp_cp, columns over tp
    local, full, placements = params["layers.0.attention_norm.weight"]
    assert full == (32,) and local == (16,) and placements[-1] == "Replicate"


@pytest.mark.parametrize(
    "before, after",
    [
        ({"cp": 4}, {"cp": 2, "tp": 2}),
        ({"cp": 4}, {"pp": 2, "cp": 2, "microbatches": 2}),
        ({"pp": 2, "cp": 1, "tp": 2, "microbatches": 2}, {"nproc": 1, "cp": 1}),
    ],
    ids=["cp4-to-cp2-tp2", "cp4-to-pp2-cp2", "pp2-tp2-to-one-process"],
)
@pytest.mark.slow
def test_checkpoint_resumes_under_another_layout(pools, tmp_path, before, after):
    """Two steps under one layout, checkpointed; the third step under another from that
    checkpoint has the loss of the uninterrupted run's third step (one process's), and the
    weights after it are the same."""
    # AdamW: a resume restores the optimizer's state, which build_run loads into AdamW; its
    # weights get Adam's tolerance (1% of a step of lr 1e-2, as in test_train.py's resume)
    adam = {"optimizer": "adamw", "lr": 1e-2}
    want = _single(pools, tmp_path, **adam)
    run = _options(tmp_path, "run", batch_size=GLOBAL_BATCH, checkpoint_every=0, **adam)
    first = pools(4).run("workers_train:train", {**run, **before, "stop_at": 2})[0]
    assert first["start_step"] == 0 and len(first["losses"]) == 2
    world = after.get("nproc", 4)
    second = pools(world).run("workers_train_4d:train_all_parameters", {**run, **after})
    assert second[0]["start_step"] == 2 and len(second[0]["losses"]) == 1
    _assert_same({**_merged(second), "losses": first["losses"] + second[0]["losses"]}, want,
                 atol=1e-4)  # fmt: skip


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"cp": 2, "tp": 3}, r"pp=1 x dp=1 x cp=2 x tp=3 != 4; pick degrees whose product is 4"),
        ({"dp": 0, "cp": 0, "tp": 3}, r"pp x dp x cp x tp must equal the number of processes"),
        ({"tp": 4, "cp": 1}, r"--kv-heads \(2\) is not divisible by --tp 4.*pick --tp among"),
        ({"tp": 0}, r"--tp and --pp must be >= 1, got tp=0"),
        ({"pp": 4, "cp": 1}, r"--pp 4 stages need at least 4 blocks; the model has 2"),
        ({"pp": 2, "cp": 2, "microbatches": 3, "batch_size": 4},
         r"--microbatches 3 must divide --batch-size 4"),
        ({"pp": 2, "cp": 2, "microbatches": 1, "pp_schedule": "1f1b"},
         r"1f1b needs --microbatches >= --pp 2, got 1"),
        ({"tp": 2, "cp": 2, "seq_len": 66}, r"--seq-len 66 is not divisible by 4"),
        ({"tp": 4, "cp": 1, "heads": 8, "kv_heads": 4, "seq_len": 66},
         r"66 tokens per cp rank are not divisible by --tp 4"),
    ],
)  # fmt: skip
def test_bad_degrees_fail_before_launching(tmp_path, overrides, match):
    """validate() is what the parent runs before launching and every rank before its first
    collective: the same ValueError with the values and the fix."""
    with pytest.raises(ValueError, match=match):
        options = _options(tmp_path, "bad", **overrides)
        options.pop("optimizer")  # the tests' SGD switch (workers_train.build), not a flag
        validate(TrainConfig(**options), 4, DECODER.check)


def test_bad_degrees_raise_on_every_rank(pools, tmp_path):
    """Under torchrun (no parent check) every rank raises the same error before any collective."""
    options = _options(tmp_path, "bad", tp=4, cp=1)
    pools(4).run_expect_error("workers_train:train", options, match="not divisible by --tp 4",
                              exc_type=ValueError)  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_torchrun_nodes_on_loopback_equal_one_node(pools, tmp_path):
    """`ringattn train` as two torchrun "nodes" of 2 ranks each (c10d rendezvous on 127.0.0.1),
    dp 2 x tp 2 across them, logs the losses of the same run on one node (4 ranks)."""
    flags = ["--dp", "2", "--cp", "1", "--tp", "2", "--model", "tiny", "--dim", "32",
             "--seq-len", "64", "--keys", "3", "--copies", "2", "--steps", "3", "--warmup", "1",
             "--lr", "1e-2", "--batch-size", "2", "--checkpoint-every", "0", "--quiet"]  # fmt: skip
    rendezvous = f"127.0.0.1:{_free_port()}"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-id", "two-nodes",
                "--rdzv-endpoint", rendezvous, "--local-addr", "127.0.0.1"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    nodes = [subprocess.Popen([*torchrun, "--node-rank", str(i), "-m", "ringattn", "train",
                               *flags, "--out-dir", str(tmp_path / "two")], env=env,
                              stdout=log.open("w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
             for i, log in enumerate(logs)]  # fmt: skip
    try:  # as long as the job makes progress, however loaded the machine (patience.py)
        wait_until(lambda: all(n.poll() is not None for n in nodes),
                   lambda: [n.pid for n in nodes], "two torchrun nodes")  # fmt: skip
    finally:
        for node in nodes:
            if node.poll() is None:  # a hang: the agent and its ranks, its whole session
                os.killpg(node.pid, signal.SIGKILL)
            node.wait()
    outputs = [log.read_text() for log in logs]
    for i, (node, out) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, f"node {i} exited with {node.returncode}:\n{out[-3000:]}"
    records = read_log(str(tmp_path / "two" / "train_log.jsonl"))
    assert records[0]["event"] == "start" and records[0]["world_size"] == 4
    two_nodes = [r["loss"] for r in records if "loss" in r]
    one_node = pools(4).run("workers_train:train", _options(tmp_path, "one", dp=2, cp=1, tp=2,
                                                            batch_size=2, optimizer="adamw",
                                                            lr=1e-2))[0]  # fmt: skip
    assert len(two_nodes) == 3
    torch.testing.assert_close(two_nodes, one_node["losses"], rtol=1e-6, atol=0)
