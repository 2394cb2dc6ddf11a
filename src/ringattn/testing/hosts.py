"""Two hosts on one machine: two network namespaces joined by a veth pair whose link is shaped.

    namespace ringattn-<pid>-<n>-h0            namespace ringattn-<pid>-<n>-h1
    +-----------------------------+            +-----------------------------+
    | lo (ranks of this host)     |            | lo (ranks of this host)     |
    | ra0 10.213.0.1/30  tbf rate |<-- veth -->| ra0 10.213.0.2/30  tbf rate |
    +-----------------------------+            +-----------------------------+

Each namespace has its own network stack: traffic between two ranks of one host stays on that
host (its own address, memory speed), traffic between the hosts crosses the veth, shaped in both
directions by a token bucket (`tc qdisc ... tbf rate R`). The addresses exist only inside the two
namespaces (the veth is created inside them, never in the machine's own namespace), so nothing
sent there can leave them. Both hosts still share the machine's file system (a checkpoint
directory is "shared storage"), its pid space and its hostname; peer_heartbeat.py tells them apart
by network namespace.

    with TwoHosts(rate="100mbit") as hosts:
        outputs = hosts.torchrun(["-m", "ringattn", "train", "--cp", "4"], nproc_per_node=2)

Every process in the two namespaces was started here (torchrun's agents put their ranks in
sessions of their own, so a process group is not enough): `kill_all()` SIGKILLs the pids that
`ip netns pids` lists, and `close()` does that, then deletes both namespaces (the veth goes with
them); `close()` also runs at exit and on SIGTERM of this
process, and is idempotent. Needs root and `ip` (iproute2) with `tc`; `unavailable()` says why
not, for tests to skip with.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from ringattn.testing.teardown import Teardown

__all__ = ["ADDRESSES", "DEVICE", "TwoHosts", "unavailable"]

ADDRESSES = ("10.213.0.1", "10.213.0.2")
"""The two hosts' addresses: a private /30 that exists only inside the two namespaces."""
DEVICE = "ra0"
"""The veth end's name inside each namespace (GLOO_SOCKET_IFNAME)."""
PORT = 29500
_COUNTER = itertools.count()


def unavailable() -> str | None:
    """Why two hosts cannot be made here (not root, no iproute2 or tc), or None."""
    if sys.platform != "linux":
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} (iproute2) not found"
    return None


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): "
                           f"{(result.stderr or result.stdout).strip()}")  # fmt: skip


def _burst(rate: str) -> str:
    """tbf's bucket: 5 ms at the rate, at least 32 KiB (a whole GSO segment must fit)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            bits = float(rate[: -len(unit)]) * scale
            return f"{max(32 * 1024, int(bits / 8 * 0.005))}b"
    raise ValueError(f"rate {rate!r}: give a number with kbit, mbit or gbit, e.g. 100mbit")


class TwoHosts(Teardown):
    """Two namespaces ("hosts") joined by a veth shaped to `rate` (tc's syntax: 100mbit, 1gbit)."""

    def __init__(self, rate: str = "1gbit"):
        why = unavailable()
        if why:
            raise RuntimeError(f"two hosts cannot be made here: {why}")
        self.rate = rate
        tag = f"ringattn-{os.getpid()}-{next(_COUNTER)}"
        self.names = (f"{tag}-h0", f"{tag}-h1")
        self.addresses = ADDRESSES
        self.procs: list[subprocess.Popen] = []
        self.launches = 0  # each launch rendezvouses on a port of its own (no TIME_WAIT clash)
        self._made: list[str] = []

    def _start(self) -> None:
        for name in self.names:
            _run("ip", "netns", "add", name)
            self._made.append(name)
        h0, h1 = self.names
        _run("ip", "link", "add", DEVICE, "netns", h0, "type", "veth", "peer", "name", DEVICE,
             "netns", h1)  # fmt: skip
        for name, address in zip(self.names, self.addresses):
            _run("ip", "netns", "exec", name, "sysctl", "-q", "-w",
                 f"net.ipv6.conf.{DEVICE}.disable_ipv6=1")  # fmt: skip
            _run("ip", "-n", name, "addr", "add", f"{address}/30", "dev", DEVICE)
            _run("ip", "-n", name, "link", "set", "lo", "up")
            _run("ip", "-n", name, "link", "set", DEVICE, "up")
        self.set_rate(self.rate, replace=False)

    def set_rate(self, rate: str, replace: bool = True) -> None:
        """Shape both directions of the link to `rate`."""
        verb = "replace" if replace else "add"
        for name in self.names:
            _run("tc", "-n", name, "qdisc", verb, "dev", DEVICE, "root", "tbf", "rate", rate,
                 "burst", _burst(rate), "latency", "400ms")  # fmt: skip
        self.rate = rate

    def link(self, up: bool) -> None:
        """Cut (or restore) the link between the hosts: host 0's end down (or up)."""
        _run("ip", "-n", self.names[0], "link", "set", DEVICE, "up" if up else "down")

    def popen(self, host: int, argv: Sequence[str], env: dict | None = None,
              **kwargs: object) -> subprocess.Popen:  # fmt: skip
        """Start `argv` on `host` (0 or 1) in its own session; killed by `close()`."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[host], *argv],
                                env=env, start_new_session=True, **kwargs)  # fmt: skip
        self.procs.append(proc)
        return proc

    def torchrun_argv(self, host: int, args: Sequence[str], nproc_per_node: int = 2,
                      run_id: str = "two-hosts", port: int = PORT) -> list[str]:  # fmt: skip
        """`torchrun` for node `host` of 2, rendezvous at host 0, then `args` (e.g. -m ringattn
        train ...)."""
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", str(nproc_per_node), "--node-rank", str(host),
                "--rdzv-backend", "c10d", "--rdzv-id", run_id,
                "--rdzv-endpoint", f"{self.addresses[0]}:{port}",
                # host 0 serves the rendezvous store: torchrun guesses that from the hostname,
                # which both namespaces share and which resolves to neither address
                "--rdzv-conf", f"is_host={int(host == 0)}",
                "--local-addr", self.addresses[host], *args]  # fmt: skip

    def env(self, extra: dict | None = None) -> dict:
        """The environment of a rank: gloo on the veth end, one thread per rank."""
        return {**os.environ, "GLOO_SOCKET_IFNAME": DEVICE, "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", **(extra or {})}  # fmt: skip

    def start_torchrun(self, args: Sequence[str], nproc_per_node: int = 2, env: dict | None = None,
                       run_id: str = "two-hosts") -> list[subprocess.Popen]:  # fmt: skip
        """Start torchrun on both hosts; output (stdout and stderr together) in pipes."""
        self.launches += 1
        port, run_id = PORT + self.launches, f"{run_id}-{self.launches}"
        return [self.popen(host, self.torchrun_argv(host, args, nproc_per_node, run_id, port),
                           env=self.env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
                for host in range(2)]  # fmt: skip

    def torchrun(self, args: Sequence[str], nproc_per_node: int = 2, env: dict | None = None,
                 timeout: float = 300) -> list[tuple[int, str]]:  # fmt: skip
        """Run torchrun on both hosts to the end: [(exit code, output)] per host. Past `timeout`
        both are killed (exit code -9) and their output so far returned."""
        return self.finish(self.start_torchrun(args, nproc_per_node, env), timeout)

    def finish(self, procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
        """Wait for `procs` (started with output in a pipe) until `timeout` seconds in all; then
        every process of both hosts is killed and the late ones report -9. [(exit code, output)]
        in order."""
        deadline = time.monotonic() + timeout
        results = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill_all()
                out, _ = proc.communicate()
            results.append((proc.returncode, out or ""))
        return results

    def pids(self) -> list[int]:
        """Every process in the two namespaces (agents and ranks)."""
        found = []
        for name in self._made:
            listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                    text=True, check=False)  # fmt: skip
            found += [int(pid) for pid in listed.stdout.split() if pid.isdigit()]
        return found

    def kill_all(self) -> None:
        """SIGKILL every process in the two namespaces (all started here, ranks included)."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    def close(self) -> None:
        """Kill what was started here, delete both namespaces (and so the veth). Idempotent."""
        self.kill_all()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []
        while self._made:
            name = self._made.pop()
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        self._disarm()
