"""Atomic training checkpoints with `torch.distributed.checkpoint` (DCP).

    <dir>/step-00000200/        a complete checkpoint: what `latest` returns
        .metadata, __0_0.distcp ...   model and optimizer (sharded: each rank writes its part)
        train_state.json             step, data position, config (rank 0)
        rng/rank0.pt ...             each rank's RNG state
    <dir>/.tmp-step-00000300/   being written; never read, removed by the next save

Every rank writes into the temporary directory; after a barrier (every rank's files are on disk),
rank 0 renames it to `step-N`. A rename within one file system is atomic, so a crash at any moment
leaves either the previous set of complete checkpoints or the new one, never a half-written
`step-N`. Only the last `keep` complete checkpoints are kept. On several nodes, `dir` must be on a
file system every node sees (DCP's own requirement).

The model and optimizer state come from `get_state_dict` (FSDP2 parameters are DTensors, so each
rank saves and loads only its shard, and a run may resume on a different number of ranks). The
data position is the step: samples are a pure function of (seed, sample index).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
import torch.distributed as dist

__all__ = ["latest", "load", "save"]

_STEP_DIR = re.compile(r"^step-(\d{8})$")


def _step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, name))
             for name in os.listdir(root) if (m := _STEP_DIR.match(name))]  # fmt: skip
    return sorted(found)


def latest(root: str | None) -> str | None:
    """Path of the newest complete checkpoint under `root`, or None."""
    found = complete_checkpoints(root) if root else []
    return found[-1][1] if found else None


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    root: str,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict,
    keep: int = 2,
) -> str:
    """Write the checkpoint of `step` (collective: every rank calls it); return its path.

    `state` is JSON-serialisable training state (step, config...) written by rank 0.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = dist.get_rank() if dist.is_initialized() else 0
    final = _step_dir(root, step)
    tmp = os.path.join(root, f".tmp-step-{step:08d}")
    if rank == 0:
        for name in os.listdir(root) if os.path.isdir(root) else []:
            if name.startswith(".tmp-step-"):  # left by a crash: never complete, never read
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(os.path.join(tmp, "rng"))
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(tmp, "train_state.json"), "w") as f:
            json.dump(state, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
    _barrier()  # every rank's files are written
    if rank == 0:
        if os.path.exists(final):  # the same step saved again (a rerun): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)  # the commit point
        _fsync_dir(root)
        for _, old in complete_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Restore model, optimizer and this rank's RNG from `path` (collective); return the state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    loaded = {"model": model_state, "optim": optim_state}
    dcp.load(loaded, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = os.path.join(path, "rng", f"rank{rank}.pt")
    if os.path.exists(rng_file):  # absent when resuming on more ranks than saved
        _set_rng_state(torch.load(rng_file, weights_only=True))
    with open(os.path.join(path, "train_state.json")) as f:
        return json.load(f)


def read_state(path: str) -> dict:
    with open(os.path.join(path, "train_state.json")) as f:
        return json.load(f)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
