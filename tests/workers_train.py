"""Worker functions for tests/test_train.py, run on every rank of a WorkerPool (see harness.py).

Each runs the real training code (`ringattn.train`) inside the pool's gloo world, so the
equivalence, loss-scaling, resume and mesh tests need no process launch of their own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringattn.train.config import TrainConfig
from ringattn.train.data import IGNORE, shard_batch
from ringattn.train.loop import train as train_run
from ringattn.train.run import Run, build_run
from ringattn.train.step import forward_backward

CPU = torch.device("cpu")


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (FSDP shards all-gathered), by name."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def build(options: dict) -> Run:
    """build_run(TrainConfig(**options)), where `optimizer="sgd"` in `options` swaps the run's
    AdamW for plain SGD. Weights after SGD are the initial ones minus lr x the summed gradients,
    equal across world sizes to the gradients' rounding; Adam divides each element by its own
    magnitude and turns a near-zero gradient's rounding into an lr-sized step, so Adam-trained
    weights compared across world sizes depend on the CPU that adds them (issue 31). Tests that
    compare trained weights across meshes use SGD; losses and resumes keep AdamW."""
    options = dict(options)
    optimizer = options.pop("optimizer", "adamw")
    run = build_run(TrainConfig(**options), CPU)
    if optimizer == "sgd":
        run.optimizer = torch.optim.SGD(run.model.parameters(), lr=run.cfg.lr)
    return run


def train(rank: int, world_size: int, options: dict) -> dict:
    """Train with TrainConfig(**options); losses and accuracies of rank 0, final parameters."""
    run = train_run(build(options))
    params = full_parameters(run.model)
    return {
        "losses": [h["loss"] for h in run.history],
        "grad_norms": [h["grad_norm"] for h in run.history],
        "accuracy": [h["accuracy"] for h in run.history],
        "supervised": [h["supervised"] for h in run.history],
        "start_step": run.start_step,
        "params": params if rank == 0 else None,
        "dp_cp": (run.mesh.dp, run.mesh.cp),
        "dp_rank": run.mesh.dp_rank,
    }


def global_mean_gradients(
    rank: int, world_size: int, options: dict, inputs: torch.Tensor, labels: torch.Tensor
) -> dict:
    """One forward/backward of the training code on a given global batch (dp*B, S), returning
    the full gradients: rank (d, c) takes rows d*B..(d+1)*B of the batch and its cp shard.
    The model is the run's (build_run: seeded, CP attention, FSDP2), before any step."""
    cfg = TrainConfig(**options)
    run = build_run(cfg, CPU)
    mesh = run.mesh
    rows = slice(mesh.dp_rank * cfg.batch_size, (mesh.dp_rank + 1) * cfg.batch_size)
    batch = shard_batch(inputs[rows], labels[rows], mesh.cp_group, cfg.layout, CPU)
    local_count = int((batch.labels != IGNORE).sum())
    total_loss, total_count, _ = forward_backward(run.model, batch, CPU)
    grads = {}
    for name, p in run.model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = grad.clone()
    counts = [torch.zeros((), dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(counts, torch.tensor(local_count))
    return {
        "grads": grads if rank == 0 else None,
        "loss": total_loss / total_count,
        "counts": [int(c) for c in counts],
    }


def sharded_batch(rank: int, world_size: int, options: dict) -> dict:
    """What a rank gets from the run's data pipeline at step 0, with the full batch for
    comparison."""
    run = build_run(TrainConfig(**options), CPU)
    inputs, labels = run.data.full(0)
    batch = run.data.batch(0)
    return {
        "full_inputs": inputs,
        "full_labels": labels,
        "inputs": batch.inputs,
        "labels": batch.labels,
        "positions": batch.positions,
        "dp_rank": run.mesh.dp_rank,
    }
