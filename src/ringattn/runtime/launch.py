"""Run a function on W local processes, one per rank, through torch's elastic agent.

This is what `ringattn demo` and `ringattn check` use to get a process group on one machine without
asking the user to type `torchrun`. It is `torchrun --standalone` as a library call:

    parent (this process)                 children (spawned, one per rank)
    ---------------------                 --------------------------------
    launch(fn, W, *args)  --elastic-->    env RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT
        waits, collects                   fn(*args): init_distributed(); ...; return value
    {rank: return value}  <--pickle--     (an exception becomes an error file for the parent)

`fn` must be importable by name (a module-level function), since children are spawned, not forked.
A rank that raises or dies makes the whole launch fail with `LaunchError`, whose message names each
failed rank, its exit code and the first lines of its error; the elastic agent tears down the rest.

Inside `fn`, call `init_distributed()` to join the process group (gloo on CPU, NCCL when there is
a GPU per rank). Under a real `torchrun`, `running_under_torchrun()` is true and callers should use
the world they are in instead of launching a new one.

Nothing listens beyond loopback. torchrun's c10d rendezvous and the workers' env:// store are
TCPStores, which bind every interface, unauthenticated. A local launch needs neither: the agent
rendezvouses through a FileStore in a private run directory (mode 0700), the ranks join their
process group through another file there, and gloo is pinned to the loopback interface. Multi-node
runs use torchrun itself (its rendezvous, documented in docs/cluster-faults.md).

A rank that freezes (stopped, hung) is named within `stall_s` seconds: see heartbeat.py (and
peer_heartbeat.py under torchrun). A SIGTERM to the launcher is forwarded by the agent to every
rank, which checkpoints and exits (preempt.py); `LaunchInterrupted` then says so.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ringattn.runtime.heartbeat import (
    RUN_DIR_ENV,
    STALL_S,
    Watchdog,
    kill_ranks,
    start_beating,
    stop_beating,
)
from ringattn.runtime.peer_heartbeat import start_peer_beating
from ringattn.runtime.preempt import SigtermForwarder

__all__ = ["LaunchError", "LaunchInterrupted", "init_distributed", "launch",
           "running_under_torchrun"]  # fmt: skip

# Set in every child we launch, so a child can tell it was started by us and not by torchrun.
_CHILD_ENV = "RINGATTN_LAUNCHED"
_ERROR_LINES = 12


class LaunchError(RuntimeError):
    """One or more ranks of a local launch failed; the message says which and why."""


class LaunchInterrupted(LaunchError):
    """The launch was cut short by a signal to the launcher: a second SIGTERM (the first one is
    forwarded to the ranks, which checkpoint and return: preempt.py), SIGINT, SIGHUP..."""

    def __init__(self, message: str, signal_name: str):
        super().__init__(message)
        self.signal_name = signal_name


def running_under_torchrun() -> bool:
    """True when this process is a rank started by an external launcher such as `torchrun`.

    That is: RANK, WORLD_SIZE and LOCAL_RANK are set, and we are not one of `launch`'s children.
    """
    have_env = all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    return have_env and os.environ.get(_CHILD_ENV) != "1"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _quiet_elastic_logs() -> None:
    # The agent logs its whole config and each rendezvous at INFO/WARNING; keep only real problems.
    # A failed rank is reported once, by LaunchError, not again as the agent's ERROR log and the
    # SIGTERM warnings for its peers.
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)


def _user_frames(traceback_text: str, drop: str) -> list[str]:
    """Traceback lines without the header, the elastic agent's own frames and the final `drop`."""
    lines: list[str] = []
    in_agent_frame = False
    for line in traceback_text.splitlines():
        if not line.strip() or line.startswith("Traceback (most recent call last)"):
            continue
        if line.startswith("  File "):
            in_agent_frame = "torch/distributed/elastic" in line
        elif not line.startswith(" "):
            in_agent_frame = False
        caret_only = not line.strip(" ^~")  # Python 3.11's underline of the failing expression
        if not in_agent_frame and not caret_only and line.strip() != drop:
            lines.append(line)
    return lines


def _failure_text(failure: Any) -> str:
    """The first lines of a failed rank's error: the exception, then the end of its traceback."""
    data = getattr(failure, "error_file_data", None) or {}
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        headline = str(message.get("message", "")).strip()
        stack = str(message.get("extraInfo", {}).get("py_callstack", ""))
        tail = _user_frames(stack, drop=headline)[-_ERROR_LINES:]
        return "\n".join([headline] + [f"  | {line}" for line in tail])
    if isinstance(message, str) and message.strip() not in ("", "<NONE>"):
        return message.strip()
    exitcode = getattr(failure, "exitcode", None)
    if exitcode is not None and exitcode < 0:
        return f"killed by signal {-exitcode} ({failure.signal_name()}), no Python traceback"
    return "exited without a Python traceback (see that rank's output above)"


def _launch_error(err: Exception, nproc: int, name: str, verdicts: list[str]) -> LaunchError:
    failures = getattr(err, "failures", {}) or {}
    parts = [f"{name}: {len(failures)} of {nproc} ranks failed", *verdicts]
    for rank in sorted(failures):
        failure = failures[rank]
        parts.append(f"rank {rank} (exit code {failure.exitcode}): {_failure_text(failure)}")
    return LaunchError("\n".join(parts))


_STORE_FILE = "process-group-store"
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_SAVED_ENV = (_CHILD_ENV, "OMP_NUM_THREADS", RUN_DIR_ENV, "GLOO_SOCKET_IFNAME",
              "NCCL_SOCKET_IFNAME", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")  # fmt: skip


def _child_env(nproc: int, run_dir: str) -> None:
    """Environment the children inherit (spawned children copy the parent's os.environ)."""
    os.environ[_CHILD_ENV] = "1"
    os.environ[RUN_DIR_ENV] = run_dir
    # no TCPStore in the agent: its rendezvous is a FileStore (see the module docstring)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if sys.platform == "linux" and os.path.exists("/sys/class/net/lo"):
        # one node: both backends bootstrap over loopback, never a routable interface
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    # Each rank gets its share of the cores; W ranks x all cores each would oversubscribe.
    threads = max(1, (os.cpu_count() or 1) // nproc)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def _run_rank(fn: Callable[..., Any], *args: Any) -> Any:
    """A child's entry point: `fn(*args)`, then its heartbeat stops (a finished rank is not a
    frozen one)."""
    try:
        return fn(*args)
    finally:
        stop_beating()


def launch(
    fn: Callable[..., Any], nproc: int, *args: Any, stall_s: float = STALL_S
) -> dict[int, Any]:
    """Run `fn(*args)` on `nproc` local processes and return `{rank: fn's return value}`.

    `fn` must be a module-level function (children are spawned), and it should call
    `init_distributed()` before any collective. Arguments and return values are pickled.
    Raises `LaunchError` naming the failed ranks when any rank raises or dies, or stops
    responding for `stall_s` seconds (it is then killed, and the message says where it was).
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    # Imported here: the launcher package pulls in the elastic agent, which `import ringattn` and
    # the ranks themselves do not need.
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _quiet_elastic_logs()
    run_dir = tempfile.mkdtemp(prefix="ringattn-run-")  # mode 0700: this user only
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"ringattn-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint=os.path.join(run_dir, "rendezvous"),
        rdzv_configs={"timeout": 60, "store_type": "file"},
        local_addr="127.0.0.1",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        signals_to_handle="SIGINT,SIGHUP,SIGQUIT",  # SIGTERM: SigtermForwarder (preempt.py)
    )
    saved = {name: os.environ.get(name) for name in _SAVED_ENV}
    _child_env(nproc, run_dir)
    name = getattr(fn, "__qualname__", repr(fn))
    watchdog = Watchdog(run_dir, stall_s)
    # the agent installs its own handlers for the other signals (raising SignalException here,
    # forwarding the signal to every rank); they are put back afterwards
    handlers = {sig: signal.getsignal(sig) for sig in _AGENT_SIGNALS}
    # only this launch's ranks: a process that launches may have other children of its own (a
    # test suite's worker pools, a notebook's), and a forwarded SIGTERM must not reach them
    others = {p.pid for p in multiprocessing.active_children()}
    forwarder = SigtermForwarder(
        lambda: [p.pid for p in multiprocessing.active_children() if p.pid not in others]
    )
    try:
        with watchdog, forwarder:
            results = elastic_launch(config, _run_rank)(fn, *args)
    except ChildFailedError as err:
        if forwarder.hard:
            raise LaunchInterrupted(f"{name}: a second SIGTERM to the launcher killed the ranks "
                                    "at once", "SIGTERM") from None  # fmt: skip
        raise _launch_error(err, nproc, name, watchdog.verdicts) from None
    except SignalException as err:  # SIGINT...: the agent signalled the ranks and waited
        killed = kill_ranks(run_dir)  # those it did not wait for, if a second signal came
        what = f"{name}: the launcher received {err.sigval.name}"
        what += f"; ranks {killed} were killed" if killed else ""
        raise LaunchInterrupted(what, err.sigval.name) from None
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(run_dir, ignore_errors=True)
    return dict(sorted(results.items()))


def init_distributed(
    backend: str | None = None, timeout_s: float = 300.0, stall_s: float = STALL_S
) -> torch.device:
    """Join the default process group from the env set by `launch` or `torchrun`; return the device.

    `backend=None` picks NCCL when CUDA is available with at least one GPU per local rank (and
    sets this rank's device to LOCAL_RANK), gloo otherwise. `timeout_s` bounds every collective,
    so a dead peer turns into an error instead of a hang. A rank that stops running for
    `stall_s` seconds is named: by our launch's watchdog, or under torchrun by its ring
    neighbours (peer_heartbeat.py). Calling it twice is harmless.
    """
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    if backend is None:
        backend = "nccl" if use_cuda else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = device  # lets NCCL bind eagerly and fail fast on a bad setup
        run_dir = os.environ.get(RUN_DIR_ENV)
        if run_dir is not None and os.environ.get(_CHILD_ENV) == "1":
            # our launch: join through a file in the private run directory, so no TCPStore
            # listens on any interface (torchrun's env:// store would)
            kwargs["init_method"] = "file://" + os.path.join(run_dir, _STORE_FILE)
            kwargs["rank"] = int(os.environ["RANK"])
            kwargs["world_size"] = world_size
        dist.init_process_group(
            backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs
        )
    if os.environ.get(_CHILD_ENV) == "1":
        start_beating(int(os.environ["RANK"]))
    elif running_under_torchrun():
        start_peer_beating(dist.get_rank(), dist.get_world_size(), stall_s)
    return device
