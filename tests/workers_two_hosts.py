"""A torchrun script for tests/test_two_hosts.py: train several configurations one after another
in one process group spanning two hosts (one launch instead of one per configuration).

    torchrun ... tests/workers_two_hosts.py OUT.json '[{TrainConfig options}, ...]'

Rank 0 writes {"runs": [{"losses", "params", "dp_cp", "group_rank"...}]} to OUT.json; every
rank records the hosts' node ranks (GROUP_RANK) of the whole world in "nodes".
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from ringattn.runtime.launch import init_distributed
from ringattn.train.config import TrainConfig
from ringattn.train.loop import train
from ringattn.train.run import build_run
from workers_train import full_parameters


def main(out: str, options: list[dict]) -> None:
    device = init_distributed(timeout_s=120, stall_s=20)
    nodes: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, int(os.environ["GROUP_RANK"]))
    runs = []
    for opts in options:
        run = train(build_run(TrainConfig(**opts), device))
        params = full_parameters(run.model)
        runs.append({"losses": [h["loss"] for h in run.history],
                     "dp_cp": [run.mesh.dp, run.mesh.cp],
                     "params": {k: v.tolist() for k, v in params.items()}})  # fmt: skip
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"runs": runs, "nodes": nodes}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], json.loads(sys.argv[2]))
