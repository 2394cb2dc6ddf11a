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

A write that fails (disk full, permission, a directory turned read-only) is a decision of every
rank: each rank catches its own error, the ranks share them (one small all-gather per phase: the
directory, then the files), and every rank raises the same `CheckpointError` naming the failed
ranks; rank 0 removes the temporary directory. Nothing is renamed, so the previous complete
checkpoint stays the newest, and old checkpoints are pruned only after a new one is committed.
Weights that are not finite are never written (`NonFiniteWeights`, checked on every rank first).

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

__all__ = ["CheckpointError", "NonFiniteWeights", "latest", "load", "save"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (raised on every rank); the previous one is intact."""


class NonFiniteWeights(CheckpointError):
    """The weights hold NaN or infinity on some rank: the checkpoint was not written."""


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
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = dist.get_rank() if dist.is_initialized() else 0
    final = _step_dir(root, step)
    tmp = os.path.join(root, f".tmp-step-{step:08d}")
    model_state, optim_state = get_state_dict(model, optimizer)
    bad = [name for name, value in model_state.items() if not _finite(value)]
    failed = _share(f"non-finite values in {', '.join(bad[:3])}" if bad else None)
    if failed:
        raise NonFiniteWeights(f"checkpoint of step {step} not written: {_ranks(failed)}; the "
                               f"newest complete checkpoint is {latest(root)}")  # fmt: skip
    error = None
    if rank == 0:
        try:
            for name in os.listdir(root) if os.path.isdir(root) else []:
                if name.startswith(".tmp-step-"):  # left by a crash: never complete, never read
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            os.makedirs(os.path.join(tmp, "rng"))
        except OSError as err:
            error = _describe(err)
    _raise_if_failed(_share(error), step, root, tmp, rank)  # a barrier: the directory is there
    try:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
        torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank{rank}.pt"))
        if rank == 0:
            with open(os.path.join(tmp, "train_state.json"), "w") as f:
                json.dump(state, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
        error = None
    except (OSError, CheckpointException) as err:
        error = _describe(err)
    _raise_if_failed(_share(error), step, root, tmp, rank)  # every rank's files are written
    if rank == 0:
        if os.path.exists(final):  # the same step saved again (a rerun): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)  # the commit point
        _fsync_dir(root)
        for _, old in complete_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _finite(value: object) -> bool:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return True
    local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor: this shard
    return bool(torch.isfinite(local).all())


def _describe(err: BaseException) -> str:
    """One line per error: DCP's CheckpointException wraps each rank's own exception."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = []
        for wrapped in failures.values():
            exc = wrapped[0] if isinstance(wrapped, tuple) else getattr(wrapped, "exc", wrapped)
            inner.append(f"{type(exc).__name__}: {exc}")
        return "; ".join(sorted(set(inner)))
    return f"{type(err).__name__}: {err}"


def _share(error: str | None) -> dict[int, str]:
    """{rank: error} of every rank that failed (collective; a barrier too)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {0: error} if error else {}
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return {rank: e for rank, e in enumerate(errors) if e}


def _ranks(failed: dict[int, str]) -> str:
    by_error: dict[str, list[int]] = {}
    for rank, error in failed.items():
        by_error.setdefault(error, []).append(rank)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {e}"
                     for e, r in by_error.items())  # fmt: skip


def _raise_if_failed(failed: dict[int, str], step: int, root: str, tmp: str, rank: int) -> None:
    if not failed:
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    raise CheckpointError(
        f"could not write the checkpoint of step {step} under {root} ({_ranks(failed)}); the "
        f"newest complete checkpoint is {latest(root)}; free space or fix the permissions, then "
        f"run the same command again to resume from it"
    )


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
