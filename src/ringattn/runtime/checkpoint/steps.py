"""Atomic, durable training checkpoints with `torch.distributed.checkpoint` (DCP).

    <dir>/step-00000200/        a complete checkpoint: what `latest` returns
        .metadata, __0_0.distcp ...   model and optimizer (sharded: each rank writes its part)
        train_state.json             step, data position, config (rank 0)
        order.json                   {"written": n}: this checkpoint was the n-th written here
        rng/rank0.pt ...             each rank's RNG state
    <dir>/.tmp-step-00000300/   being written; never read, removed by the next run or save
    <dir>/.replaced-step-N/     the old step-N while a new step-N replaces it (`publish`)

Every rank writes into the temporary directory and fsyncs its files (DCP's writer does so for the
shards, `write_synced` for the RNG state); after every rank reported success, rank 0 fsyncs the
directory and renames it to `step-N` (`publish`), then fsyncs `<dir>`. So a crash or a power
loss at any moment leaves the previous complete checkpoints, or those and the new one, never a
`step-N` with missing or truncated files (a rename is atomic, but says nothing of the renamed
files' data: only the fsyncs before it do). On several nodes, `dir` must be on a file system
every node sees (DCP's own requirement).

The write-aside, fsync and rename-as-commit protocol itself is durable.py's, shared with the
token cache and --export; a `.replaced-step-N` whose `step-N` is missing (a crash between a
replacement's two renames) counts as the complete checkpoint of step N here.

"Newest" means last written, not highest step: `latest` and the pruning order checkpoints by
`order.json` (a checkpoint written before it existed counts as older than any with it, by step
among themselves). After a commit, rank 0 deletes the oldest-written complete checkpoints beyond
`keep`: never the one just written, whatever its step.

Any failure inside a save (disk full, permission, a read-only directory, `torch.save`'s
RuntimeError, a bug) is a decision of every rank: each rank catches its own error, the ranks share
them (one small all-gather per phase: the directory, the files, the commit), and every rank
raises the same `CheckpointError` naming the failed ranks and their errors; rank 0 removes the
temporary directory. The previous complete checkpoint stays the newest. Weights that are not
finite are never written (`NonFiniteWeights`, checked on every rank first).

`fault(point)`, where given, is called on every rank at each named point of a save (FAULT_POINTS;
the commit's points on rank 0 only): the fault-injection tests kill the job or fill the disk there.

The model and optimizer state come from `get_state_dict` (FSDP2 parameters are DTensors, so each
rank saves and loads only its shard, and a run may resume on a different number of ranks). The
data position is the step: samples are a pure function of (seed, sample index).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from ringattn.runtime.checkpoint import durable
from ringattn.runtime.checkpoint.durable import (
    ASIDE_PREFIX,
    PRUNED_PREFIX,
    TMP_PREFIX,
    fsync_path,
    publish,
    write_synced,
)

__all__ = ["FAULT_POINTS", "CheckpointError", "NonFiniteWeights", "complete_checkpoints", "latest",
           "load", "read_state", "save", "step_of", "sweep"]  # fmt: skip

FAULT_POINTS = ("start", "directory", "model", "rng", "state", "shared", "aside", "committed",
                "synced", "pruned", "end")  # fmt: skip
"""Where `save` calls `fault`, in order ("aside" only when the step is saved again)."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (raised on every rank); the previous one is intact."""


class NonFiniteWeights(CheckpointError):
    """The weights hold NaN or infinity on some rank: the checkpoint was not written."""


_STEP_DIR = re.compile(r"^step-(\d{8})$")
_ASIDE_DIR = re.compile(rf"^{re.escape(ASIDE_PREFIX)}step-(\d{{8}})$")
ORDER_FILE = "order.json"
_NON_FINITE = "non-finite values in"


def _step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def _written(path: str) -> int:
    """The write order of a checkpoint: -1 for one written before order.json existed."""
    try:
        with open(os.path.join(path, ORDER_FILE)) as f:
            return int(json.load(f)["written"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint under `root`, in write order (newest last).

    A `.replaced-step-N` whose `step-N` is missing (a crash between a replacement's two renames)
    is the complete checkpoint of step N."""
    if not os.path.isdir(root):
        return []
    names = os.listdir(root)
    found = [(int(m.group(1)), os.path.join(root, name))
             for name in names if (m := _STEP_DIR.match(name))]  # fmt: skip
    found += [(int(m.group(1)), os.path.join(root, name)) for name in names
              if (m := _ASIDE_DIR.match(name)) and f"step-{m.group(1)}" not in names]  # fmt: skip
    return sorted(found, key=lambda sp: (_written(sp[1]), sp[0]))


def step_of(path: str) -> int:
    """The step of a checkpoint directory (`step-N` or `.replaced-step-N`)."""
    return int(os.path.basename(os.path.normpath(path)).rsplit("-", 1)[1])


def latest(root: str | None) -> str | None:
    """Path of the newest (last written) complete checkpoint under `root`, or None."""
    found = complete_checkpoints(root) if root else []
    return found[-1][1] if found else None


def save(root: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         state: dict, keep: int = 2,
         fault: Callable[[str], None] | None = None) -> str:  # fmt: skip
    """Write the checkpoint of `step` (collective: every rank calls it); return its path.

    `state` is JSON-serialisable training state (step, config...) written by rank 0. `fault`:
    see the module docstring (testing)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    fault = fault or (lambda point: None)
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = _step_dir(root, step)
    tmp = os.path.join(root, f"{TMP_PREFIX}step-{step:08d}")
    try:
        model_state, optim_state = get_state_dict(model, optimizer)
        bad = [name for name, value in model_state.items() if not _finite(value)]
        error = f"{_NON_FINITE} {', '.join(bad[:3])}" if bad else None
    except Exception as err:  # noqa: BLE001 - shared like any other failure
        error = _describe(err)
    failed = _share(error)
    if any(e.startswith(_NON_FINITE) for e in failed.values()):
        raise NonFiniteWeights(f"checkpoint of step {step} not written: {_ranks(failed)}; the "
                               f"newest complete checkpoint is {latest(root)}")  # fmt: skip
    _raise_if_failed(failed, step, root, tmp, rank)
    fault("start")
    error = None
    if rank == 0:
        try:
            sweep(root, aside=True)
            os.makedirs(os.path.join(tmp, "rng"))
        except Exception as err:  # noqa: BLE001 - every failure is shared, whatever it is
            error = _describe(err, root)
    _raise_if_failed(_share(error), step, root, tmp, rank)  # a barrier: the directory is there
    fault("directory")
    try:
        dcp.save(_view(model, model_state, optim_state), checkpoint_id=tmp)  # fsyncs
        fault("model")
        rng = _rng_state()
        write_synced(os.path.join(tmp, "rng", f"rank{rank}.pt"), lambda f: torch.save(rng, f))
        fault("rng")
        if rank == 0:
            order = max([_written(p) for _, p in complete_checkpoints(root)], default=-1) + 1
            _write_json(os.path.join(tmp, "train_state.json"), state)
            _write_json(os.path.join(tmp, ORDER_FILE), {"written": order, "step": step})
            fault("state")
        error = None
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP's is a BaseException
        error = _describe(err, root)
    _raise_if_failed(_share(error), step, root, tmp, rank)  # every rank's files are written
    fault("shared")
    if rank == 0:
        try:
            fsync_path(os.path.join(tmp, "rng"))  # the files' names: every rank's are there now
            fsync_path(tmp)
            publish(tmp, final, fault)
            error = None
        except Exception as err:  # noqa: BLE001
            error = _describe(err, root)
        if error is None:
            _prune(root, keep)
            fault("pruned")
    _raise_if_failed(_share(error), step, root, tmp, rank)  # committed (or not) on every rank
    fault("end")
    return final


def _write_json(path: str, value: dict) -> None:
    write_synced(path, lambda f: json.dump(value, f, indent=2), mode="w")


def sweep(root: str | None, aside: bool = False) -> None:
    """Rank 0: remove what a crash left that is never read (a save or a prune cut short), and
    with `aside` (before a save) finish replacements (durable.recover); not when a run starts
    (the other ranks may be loading an aside checkpoint then)."""
    durable.sweep(root, "step-", aside)


def _prune(root: str, keep: int) -> None:
    """Delete the oldest-written complete checkpoints beyond `keep` (the newest one never). Best
    effort: the new checkpoint is committed, so a failure here only leaves an old one behind."""
    if keep <= 0:
        return
    for step, old in complete_checkpoints(root)[:-keep]:
        doomed = os.path.join(root, f"{PRUNED_PREFIX}step-{step:08d}")
        try:
            os.rename(old, doomed)  # a half-deleted checkpoint never keeps a complete one's name
        except OSError as err:
            print(f"[checkpoint] could not prune {old}: {err}", file=sys.stderr, flush=True)
            continue
        shutil.rmtree(doomed, ignore_errors=True)


def _finite(value: object) -> bool:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return True
    local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor: this shard
    return bool(torch.isfinite(local).all())


def _describe(err: BaseException, root: str | None = None) -> str:
    """One line per error (DCP's CheckpointException wraps each rank's own). A file system under
    `root` left with under 1 MiB free says so: torch.save, DCP's writer too, reports a write cut
    short by a full disk as "RuntimeError: ... unexpected pos 704 vs 598", naming no cause."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        excs = [w[0] if isinstance(w, tuple) else getattr(w, "exc", w) for w in failures.values()]
        text = "; ".join(sorted({f"{type(exc).__name__}: {exc}" for exc in excs}))
    else:
        text = f"{type(err).__name__}: {err}"
    known = not root or not os.path.isdir(root) or "No space left" in text
    free = None if known else shutil.disk_usage(root).free
    full = free is not None and free < 1 << 20
    return text + (f" [No space left on device: {free} bytes free under {root}]" if full else "")


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
    dcp.load(_view(model, model_state, optim_state), checkpoint_id=path)  # in place: shared
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = os.path.join(path, "rng", f"rank{rank}.pt")
    if os.path.exists(rng_file):  # absent when resuming on more ranks than saved
        _set_rng_state(torch.load(rng_file, weights_only=True))
    with open(os.path.join(path, "train_state.json")) as f:
        return json.load(f)


def _view(model: torch.nn.Module, model_state: dict, optim_state: dict) -> dict:
    view = getattr(model, "checkpoint_view", None)  # --ep: expert slices as whole DTensors
    states = view(model_state, optim_state) if view is not None else (model_state, optim_state)
    return {"model": states[0], "optim": states[1]}


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
