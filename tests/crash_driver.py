"""Kill a training job at chosen points of its checkpoint saves, then resume it: run as a script by
tests/test_crash_consistency.py (not collected by pytest).

    python tests/crash_driver.py SPEC.json RESULT.json

SPEC: {"world_size": W, "options": TrainConfig fields (out_dir excluded), "root": a directory,
"cases": [{"name", "keep", "fault": {"rank", "save", "point"} or {"rank", "save", "delay"}}]}.

This process imports torch and trains one step without a process group (OMP_NUM_THREADS=1: no
thread pool to break by forking); each job is then W ranks forked from it (a fork costs
milliseconds where a spawn costs an import of torch and seconds of first calls), in a process
group of their own, joined in a gloo group over a FileStore. A fault is the real thing: at the
chosen point of the chosen save (checkpoint.FAULT_POINTS, through the `fault` hook of `Run`), or
`delay` seconds after that save began (wherever the writers then are, inside DCP's writes too),
rank `rank` sends SIGKILL to the whole job (every rank dies at once, as when a node is lost).
Then the directory is inspected (which checkpoints are complete, what else is there) and the
same options are run again, unfaulted: the resumed run's start step and losses are the result.
RESULT: the uninterrupted run's losses, and per case the exit codes, the checkpoints found and
the resumed run.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

os.environ["OMP_NUM_THREADS"] = "1"

import torch
import torch.distributed as dist

from ringattn.runtime import checkpoint as ckpt
from ringattn.train.config import TrainConfig
from ringattn.train.loop import train
from ringattn.train.run import build_run

CPU = torch.device("cpu")


def _killer(rank: int, fault: dict):
    """The `fault` hook of one rank: SIGKILL to the job at the fault's point of its save."""
    saves = [0]

    def at(point: str) -> None:
        if point == "start":
            saves[0] += 1
        if rank != fault["rank"] or saves[0] != fault["save"]:
            return
        if point == fault.get("point"):
            os.killpg(0, signal.SIGKILL)
        if point == "start" and "delay" in fault:
            threading.Timer(fault["delay"], os.killpg, (0, signal.SIGKILL)).start()

    return at


def _rank(rank: int, world_size: int, store: str, options: dict, fault: dict | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))  # fmt: skip
    run = build_run(TrainConfig(**options), CPU)
    if fault:
        run.fault = _killer(rank, fault)
    train(run)
    if rank == 0:
        with open(os.path.join(options["out_dir"], "result.json"), "w") as f:
            json.dump({"start_step": run.start_step, "losses": [h["loss"] for h in run.history],
                       "stopped": run.stopped.as_dict() if run.stopped else None}, f)  # fmt: skip
    dist.destroy_process_group()


def launch(world_size: int, options: dict, fault: dict | None, deadline_s: float = 180.0) -> dict:
    """Run one job of W forked ranks; {"codes": exit codes (-9: killed), "result": rank 0's}."""
    store = os.path.join(options["out_dir"], f"store-{time.monotonic_ns()}")
    os.makedirs(options["out_dir"], exist_ok=True)
    pids: list[int] = []
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setpgid(0, pids[0] if pids else 0)
                _rank(rank, world_size, store, options, fault)
                code = 0
            except BaseException:  # noqa: BLE001 - reported as the exit code and traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        try:
            os.setpgid(pid, pids[0] if pids else pid)
        except OSError:  # the child already did it (or already died)
            pass
        pids.append(pid)
    codes: dict[int, int] = {}
    end = time.monotonic() + deadline_s
    while len(codes) < len(pids):
        for rank, pid in enumerate(pids):
            if rank not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
        if time.monotonic() > end:  # a hang is a failure: reported as -9 after the deadline
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return {"codes": [codes.get(r, "hung") for r in range(world_size)], "result": None}
        time.sleep(0.02)
    path = os.path.join(options["out_dir"], "result.json")
    result = None
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
        os.remove(path)
    return {"codes": [codes[r] for r in range(world_size)], "result": result}


def inspect(root: str) -> dict:
    """The complete checkpoints (step, files) and every other name in `root`."""
    complete = []
    for step, path in ckpt.complete_checkpoints(root):
        files = sorted(os.path.relpath(os.path.join(d, n), path)
                       for d, _, names in os.walk(path) for n in names)  # fmt: skip
        complete.append({"step": step, "name": os.path.basename(path), "files": files})
    return {"complete": complete, "names": sorted(os.listdir(root)) if os.path.isdir(root) else []}


def main(spec_path: str, result_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    world_size, options, root = spec["world_size"], spec["options"], spec["root"]
    started = time.monotonic()
    # one process, no group: the lazy imports and first-call costs (FSDP2, DCP: seconds on a busy
    # machine) are paid here once, and every forked rank inherits them
    warm = {
        **options,
        "nproc": 1,
        "cp": 1,
        "dp": 1,
        "steps": 1,
        "out_dir": os.path.join(root, "warm"),
    }
    train(build_run(TrainConfig(**warm), CPU))
    reference = launch(world_size, {**options, "out_dir": os.path.join(root, "reference")}, None)
    cases = []
    for case in spec["cases"]:
        out = os.path.join(root, case["name"])
        opts = {**options, "out_dir": out, "keep": case["keep"]}
        t0 = time.monotonic()
        killed = launch(world_size, opts, case["fault"])
        found = inspect(os.path.join(out, "checkpoints"))
        resumed = launch(world_size, opts, None)
        after = inspect(os.path.join(out, "checkpoints"))
        cases.append({**case, "killed": killed["codes"], "found": found, "resumed": resumed,
                      "after": after, "seconds": time.monotonic() - t0})  # fmt: skip
    result = {"reference": reference, "cases": cases, "seconds": time.monotonic() - started}
    with open(result_path, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
