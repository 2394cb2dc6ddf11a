"""Multi-process test harness: a pool of W long-lived gloo ranks on CPU that run test functions.

Spawning a rank costs about a second on 2 cores (mostly `import torch`), so a `WorkerPool` spawns
its W processes once and then runs many tasks in them:

    test process                                  worker r of W (spawned once)
    ------------                                  ----------------------------
    WorkerPool(W)  --spawn-->                     OMP_NUM_THREADS=1; gloo group on a FileStore
    pool.run(fn, *args) --task to every rank-->   fn(r, W, *args) -> result (tensors moved to CPU)
    [result_0 .. result_W-1] <--(rank, ok, ..)--  or the formatted traceback; then wait for the next

Worker functions are sent by reference: a module-level function object, or "module:qualname"
(e.g. "workers:attention_case"). Each rank imports the module on first use, so it must be
importable from tests/ (on every worker's sys.path) or the environment. Test modules qualify (pytest
imports tests/test_x.py as top-level `test_x`, there being no __init__.py), but small worker modules
that do not import pytest load faster on 8 ranks. Lambdas and closures raise ValueError up front.

A rank that raises fails `run` with an AssertionError holding each failing rank's traceback; the
pool stays usable. A deadline or a dead process shuts the pool down (conftest's `pools(W)` then
spawns a fresh one) and the AssertionError names the ranks and exit codes. `timeout` is `run`'s own
keyword, never passed to the task.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import os
import pickle
import queue
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = ["RankError", "WorkerPool", "function_ref"]

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_LIVE_POOLS: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


@dataclass(frozen=True)
class RankError:
    """An exception raised on one rank, reduced to picklable text."""

    type_names: tuple[str, ...]  # qualified names along the exception's MRO, for isinstance checks
    message: str
    traceback: str


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def function_ref(fn: Callable[..., Any] | str) -> str:
    """Return the "module:qualname" reference a worker can import, or raise ValueError."""
    if isinstance(fn, str):
        module, _, qualname = fn.partition(":")
        if not module or not qualname:
            raise ValueError(f"worker function reference {fn!r} must look like 'module:qualname'")
        return fn
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module in (None, "__main__") or "<" in qualname:
        raise ValueError(
            f"cannot send {fn!r} to workers: define it at module level in a module under tests/ "
            "(or pass 'module:qualname'); lambdas, closures and __main__ functions cannot be "
            "imported by a worker"
        )
    return f"{module}:{qualname}"


def _resolve(ref: str) -> Callable[..., Any]:
    module, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _to_cpu(obj: Any) -> Any:
    """Detach and copy tensors to CPU, through lists, tuples and dicts, so results pickle small."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()  # clone: a view would otherwise pickle its whole storage
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _describe(exc: BaseException) -> RankError:
    names = tuple(_qualified(cls) for cls in type(exc).__mro__)
    return RankError(names, str(exc), traceback.format_exc())


def _worker_main(
    rank: int,
    world_size: int,
    init_file: str,
    pg_timeout_s: float,
    parent_pid: int,
    tasks: mp.Queue,
    results: mp.Queue,
) -> None:
    """Body of one worker process: join the group, then run tasks until the None sentinel."""
    os.environ["OMP_NUM_THREADS"] = "1"  # set before torch is imported in this process
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the test process's to handle
    # Test modules are `test_x` under pytest's default import mode and `tests.test_x` under
    # --import-mode=importlib: make both importable.
    if TESTS_DIR not in sys.path:
        sys.path.insert(0, TESTS_DIR)
    sys.path.append(os.path.dirname(TESTS_DIR))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
    except Exception as exc:  # noqa: BLE001 - reported to the test process, which raises
        results.put(pickle.dumps((rank, False, _describe(exc))))
        return
    results.put(pickle.dumps((rank, True, None)))
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent_pid:  # orphaned: the test process died without shutdown
                break
            continue
        if task is None:
            break
        try:
            ref, args, kwargs = pickle.loads(task)
            result = _resolve(ref)(rank, world_size, *args, **kwargs)
            reply = pickle.dumps((rank, True, _to_cpu(result)))
        except Exception as exc:  # noqa: BLE001 - reported (with an unpicklable result too)
            reply = pickle.dumps((rank, False, _describe(exc)))
        results.put(reply)
    dist.destroy_process_group()
    # Every reply was consumed before the sentinel was sent, so skipping interpreter teardown loses
    # nothing and saves ~0.3 s of CPU per rank (torch's finalisation).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class WorkerPool:
    """W spawned processes in one gloo process group, running tasks on every rank at once."""

    def __init__(
        self,
        world_size: int,
        *,
        pg_timeout_s: float = 60.0,
        task_timeout_s: float = 120.0,
        startup_timeout_s: float = 120.0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.task_timeout_s = task_timeout_s
        self.closed = False
        ctx = mp.get_context("spawn")
        self._tmpdir = tempfile.mkdtemp(prefix=f"ringattn-pool{world_size}-")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(
                target=_worker_main,
                name=f"ringattn-rank{rank}",
                daemon=True,
                args=(
                    rank,
                    world_size,
                    os.path.join(self._tmpdir, "store"),
                    pg_timeout_s,
                    os.getpid(),
                    self._tasks[rank],
                    self._results,
                ),
            )
            for rank in range(world_size)
        ]
        _LIVE_POOLS.add(self)
        for proc in self._procs:
            proc.start()
        try:
            self._collect("startup", startup_timeout_s, check=True)
        except AssertionError as err:  # a rank failed to join the group, died, or hung
            self.shutdown(timeout=0)
            raise RuntimeError(str(err)) from None

    def __repr__(self) -> str:
        return f"WorkerPool(world_size={self.world_size}, closed={self.closed})"

    def run(
        self,
        fn: Callable[..., Any] | str,
        *args: Any,
        timeout: float | None = None,
        straggler_s: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run fn(rank, world_size, *args, **kwargs) on every rank; return the results by rank.

        `straggler_s`: once one rank has answered, the others get at most this long more (a
        test that expects some ranks to stay stuck ends on progress, not on `timeout`)."""
        return [
            payload
            for _, payload in self._submit(fn, args, kwargs, timeout, straggler_s=straggler_s)
        ]

    def run_expect_error(
        self,
        fn: Callable[..., Any] | str,
        *args: Any,
        match: str,
        exc_type: type[BaseException] = Exception,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[str]:
        """Assert that EVERY rank raised `exc_type` with a message matching the regex `match`.

        Returns the exception messages by rank.
        """
        replies = self._submit(fn, args, kwargs, timeout, check=False)
        problems = []
        for rank, (ok, payload) in enumerate(replies):
            if ok:
                problems.append(f"rank {rank} did not raise; it returned {payload!r:.200}")
            elif _qualified(exc_type) not in payload.type_names:
                problems.append(
                    f"rank {rank} raised {payload.type_names[0]}, not "
                    f"{_qualified(exc_type)}:\n{payload.traceback}"
                )
            elif not re.search(match, payload.message):
                problems.append(
                    f"rank {rank} raised {payload.message!r}, which does not match "
                    f"{match!r}:\n{payload.traceback}"
                )
        if problems:
            raise AssertionError(
                f"{self!r} {function_ref(fn)}: expected every rank to raise\n" + "\n".join(problems)
            )
        return [payload.message for _, payload in replies]

    def _submit(
        self,
        fn: Callable[..., Any] | str,
        args: tuple,
        kwargs: dict,
        timeout: float | None,
        check: bool = True,
        straggler_s: float | None = None,
    ) -> list[tuple[bool, Any]]:
        if self.closed:
            raise RuntimeError(f"{self!r} is shut down; get a fresh pool from the `pools` fixture")
        ref = function_ref(fn)
        task = pickle.dumps((ref, args, kwargs))  # unpicklable args fail here, not in a worker
        for q in self._tasks:
            q.put(task)
        timeout = self.task_timeout_s if timeout is None else timeout
        return self._collect(ref, timeout, check, straggler_s)

    def _collect(
        self, what: str, timeout: float, check: bool, straggler_s: float | None = None
    ) -> list[tuple[bool, Any]]:
        """One (ok, payload) reply per rank, in rank order; raise if check and any rank raised."""
        try:
            replies = self._gather(what, timeout, straggler_s)
        except BaseException:  # deadline, dead rank, Ctrl-C: replies may still be in flight
            self.shutdown(timeout=0)
            raise
        failed = [r for r, (ok, _) in replies.items() if not ok]
        if check and failed:
            raise AssertionError(self._report(what, [f"ranks {sorted(failed)} raised"], replies))
        return [replies[r] for r in range(self.world_size)]

    def _gather(
        self, what: str, timeout: float, straggler_s: float | None = None
    ) -> dict[int, tuple[bool, Any]]:
        replies: dict[int, tuple[bool, Any]] = {}
        deadline, limit = time.monotonic() + timeout, f"{timeout:g} s"
        while len(replies) < self.world_size:
            try:
                rank, ok, payload = pickle.loads(self._results.get(timeout=0.05))
                soon = time.monotonic() + (straggler_s or 0.0)
                if not replies and straggler_s is not None and soon < deadline:
                    deadline, limit = soon, f"{straggler_s:g} s of rank {rank}'s answer"
                replies[rank] = (ok, payload)
                continue
            except queue.Empty:
                pass
            missing = [r for r in range(self.world_size) if r not in replies]
            exitcodes = {r: self._procs[r].exitcode for r in missing}
            dead = {r: code for r, code in exitcodes.items() if code is not None}
            if dead or time.monotonic() > deadline:
                lines = [f"rank {r} exited with code {code}" for r, code in dead.items()]
                if not dead:
                    lines.append(f"ranks {missing} did not answer within {limit}")
                lines.append("the pool was shut down; the next pools(W) call spawns a fresh one")
                raise AssertionError(self._report(what, lines, replies))
        return replies

    def _report(self, what: str, lines: list[str], replies: dict[int, tuple[bool, Any]]) -> str:
        parts = [f"{self!r} {what}: " + "; ".join(lines)]
        for rank in sorted(replies):
            ok, payload = replies[rank]
            if not ok:
                parts.append(f"----- rank {rank} traceback -----\n{payload.traceback.rstrip()}")
        return "\n".join(parts)

    def gloo_groups(self) -> int:
        """The most gloo process groups any worker holds, the default one included: each holds
        one `gloo_tcp_loop` thread (read from /proc, no task sent, so it works between tasks
        only: call it when no task runs)."""
        most = 0
        for proc in self._procs:
            task_dir = f"/proc/{proc.pid}/task"
            count = 0
            for tid in os.listdir(task_dir) if os.path.isdir(task_dir) else ():
                try:
                    with open(f"{task_dir}/{tid}/comm") as f:
                        count += f.read().strip() == "gloo_tcp_loop"
                except OSError:  # a thread that ended while they were listed
                    continue
            most = max(most, count)
        return most

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the workers: sentinel, join for up to `timeout` s, then terminate, then kill.

        Idempotent. `timeout=0` skips the sentinel, for workers that may be stuck in a task.
        """
        if self.closed:
            return
        self.closed = True
        if timeout > 0:
            for q in self._tasks:
                q.put(None)
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for q in [*self._tasks, self._results]:
            q.cancel_join_thread()  # never block exit on undelivered tasks of a killed worker
            q.close()
        shutil.rmtree(self._tmpdir, ignore_errors=True)


@atexit.register
def _shutdown_live_pools() -> None:
    for pool in list(_LIVE_POOLS):
        pool.shutdown()
