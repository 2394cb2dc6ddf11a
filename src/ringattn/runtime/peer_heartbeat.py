"""Heartbeats under an external `torchrun`: ranks watch their ring neighbours through the store.

Under our own launch the parent watches every rank's heartbeat file (heartbeat.py). Under torchrun
there is no such parent (its agent sees a rank that exits, not one that freezes), and on several
nodes no shared directory. But every rank can reach torchrun's TCPStore (MASTER_ADDR:MASTER_PORT,
the store the agent hosts and the process group was built on), so the ranks watch each other:

    rank r, thread "ringattn-peer-heartbeat", every BEAT_S:
      store[hb/r] = {count, step, phase, pid, host, node,    its own beat (count always grows)
                     host_id}
      read hb/(r-1) and hb/(r+1)                              its two ring neighbours
      a neighbour's value unchanged for stall_s (measured on r's own clock, so clock skew
      between nodes does not matter) and not "done":
        -> print "rank s (pid P on node 1, host H) stopped responding: no heartbeat for 10 s,
           last at step 60 (train step); node 1 holds ranks 2, 3"; SIGKILL it when it runs on
           this host; exit EXIT_FROZEN_PEER (70)
      the store itself silent for stall_s (the link to its node is down):
        -> print "lost contact with the store at A:P for 10 s: ranks 0, 1 (node 0) are
           unreachable"; exit EXIT_FROZEN_PEER (70)
      torchrun's agent then sees ranks exit and ends the job.

"This host" is `host_identity()`: the boot id and the network and pid namespaces, not the
hostname. Two containers, or two network namespaces standing in for two hosts (testing/hosts.py),
share a hostname; a pid is only ours to signal when all three match.

Each rank reads two keys per beat, so the store's load grows with W, not W^2; every rank is watched
by two peers, so one frozen rank is named even if one of its neighbours is slow. The beat thread
runs while the main thread computes or waits in a collective: only a process that stops running
(SIGSTOP, a hung driver, a swapped-out machine) stops beating. A rank that finishes marks itself
done (at exit), so a neighbour still training does not mistake it for a frozen one.

The beat also carries the rank's attention calls (ringattn/inflight.py). A rank that has waited
in an attention agreement for MIN_S reads every rank's beat (W reads, only while it waits) and
asks runtime/mismatch.py whether a peer passed that agreement without it: a rank that changed its
arguments after the ranks agreed. If so it posts the message under ringattn/mismatch/<restart>
and exits EXIT_MISMATCH (76); every other rank checks that one key per beat and exits the same
way, printing the same message, so the job ends in seconds instead of at the group's timeout.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import signal
import socket
import sys
import threading
import time

import torch.distributed as dist

from ringattn.inflight import snapshot
from ringattn.runtime.mismatch import MIN_S, MismatchWatch
from ringattn.runtime.outcome import EXIT_FROZEN_PEER, EXIT_MISMATCH

__all__ = ["host_identity", "start_peer_beating"]

BEAT_S = 1.0
_PREFIX = "ringattn/heartbeat/"
# one per restart of torchrun's worker group: a restarted group must not read the last one's
_MISMATCH_KEY = f"ringattn/mismatch/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def host_identity() -> str:
    """What tells this host apart from every other: the kernel's boot id (another machine, or
    the same one rebooted) and this process's network and pid namespaces (another container, or
    another namespace of testing/hosts.py), after the hostname for people to read."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        pass
    for kind in ("net", "pid"):
        try:
            parts.append(os.readlink(f"/proc/self/ns/{kind}"))
        except OSError:
            pass
    return "/".join(parts)


def _where(record: dict) -> str:
    """ "node 1, host vm" (node: torchrun's node rank, GROUP_RANK), or the hostname alone."""
    node = record.get("node")
    return (f"node {node}, host " if node is not None else "") + str(record.get("host"))


class _PeerBeat:
    def __init__(self, store: dist.Store, rank: int, world_size: int, stall_s: float):
        self.store, self.rank, self.world_size, self.stall_s = store, rank, world_size, stall_s
        self.progress: dict = {}
        self.count = 0
        self.lock = threading.Lock()
        self.done = False
        self.neighbours = sorted({(rank - 1) % world_size, (rank + 1) % world_size} - {rank})
        self.seen: dict[int, tuple[bytes, float]] = {}  # rank -> (last value, when it changed)
        self.mismatch = MismatchWatch()
        self.host_id = host_identity()
        node = os.environ.get("GROUP_RANK")
        self.node = int(node) if node is not None and node.isdigit() else None
        self.peers: dict[int, dict] = {}  # rank -> its last beat read (where it runs)
        self.contact = time.monotonic()  # the last store operation that succeeded

    def beat(self, done: bool = False) -> None:
        with self.lock:
            self.count += 1
            record = {"count": self.count, "pid": os.getpid(), "host": socket.gethostname(),
                      "node": self.node, "host_id": self.host_id, "done": done,
                      **self.progress, "attention": snapshot()}  # fmt: skip
        self.store.set(f"{_PREFIX}{self.rank}", json.dumps(record))

    def check(self) -> None:
        self.check_calls()
        if len(self.peers) < self.world_size and self.count % 3 == 0:
            self.read_peers(range(self.world_size))  # where each rank runs (W reads, until known)
        now = time.monotonic()
        keys = [f"{_PREFIX}{r}" for r in self.neighbours]
        present = [r for r, key in zip(self.neighbours, keys) if self.store.check([key])]
        for r in present:
            value = self.store.get(f"{_PREFIX}{r}")
            last = self.seen.get(r)
            if last is None or last[0] != value:
                self.seen[r] = (value, now)
                continue
            record = json.loads(value)
            if not record.get("done") and now - last[1] >= self.stall_s:
                self.verdict(r, record, now - last[1])

    def read_peers(self, ranks: range | list[int]) -> None:
        for r in ranks:
            key = f"{_PREFIX}{r}"
            if self.store.check([key]):
                self.peers[r] = json.loads(self.store.get(key))

    def same_host(self, record: dict) -> bool:
        return record.get("host_id") == self.host_id

    def verdict(self, rank: int, record: dict, silent: float) -> None:
        hidden = ("count", "pid", "host", "node", "host_id", "done", "attention")
        where = ", ".join(f"{k} {v}" for k, v in record.items() if k not in hidden)
        tail = ""
        if self.same_host(record):  # never a pid of another host, whatever its hostname
            try:
                os.kill(record["pid"], signal.SIGKILL)
                tail = "; it was killed to end the job"
            except (ProcessLookupError, PermissionError):
                pass
        else:
            try:
                self.read_peers(range(self.world_size))
            except (RuntimeError, OSError, ValueError):
                pass
            mates = sorted(r for r, p in self.peers.items()
                           if p.get("host_id") == record.get("host_id"))  # fmt: skip
            if record.get("node") is not None and mates:
                tail = f"; node {record['node']} holds ranks {', '.join(map(str, mates))}"
        self.exit(f"rank {rank} (pid {record.get('pid')} on {_where(record)}) stopped "
                  f"responding: no heartbeat for {silent:.0f} s"
                  + (f", last at {where}" if where else "") + tail)  # fmt: skip

    def lost_store(self, silent: float) -> None:
        """The store has not answered for stall_s: the link to its host is down (or its agent
        ended the job). Name the ranks of the other hosts, as last seen."""
        others = {}
        for r, p in sorted(self.peers.items()):
            if not self.same_host(p):
                others.setdefault(_where(p), []).append(str(r))
        lost = "; ".join(f"ranks {', '.join(rs)} ({where})" for where, rs in others.items())
        address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        self.exit(f"lost contact with the job's store at {address} for {silent:.0f} s"
                  + (f": unreachable {lost}" if lost else ""))  # fmt: skip

    def exit(self, message: str) -> None:
        code = EXIT_FROZEN_PEER
        text = f"[rank {self.rank}] {message}; rank {self.rank} exits with code {code}\n"
        try:
            os.write(sys.stderr.fileno(), text.encode())
        finally:
            os._exit(EXIT_FROZEN_PEER)

    def check_calls(self) -> None:
        """A mismatch another rank found ends this rank too; while this rank itself waits in an
        attention agreement, read every rank's beat and judge (mismatch.py)."""
        if self.store.check([_MISMATCH_KEY]):
            self.say(self.store.get(_MISMATCH_KEY).decode(), EXIT_MISMATCH)
            self.store.add(_MISMATCH_KEY + "/seen", 1)
            self.leave_together()
        mine = snapshot()
        if not any(e["state"] == "agreeing" and e["for_s"] >= MIN_S for e in mine):
            self.mismatch.observe({})
            return
        records = {self.rank: mine}
        for r in range(self.world_size):
            key = f"{_PREFIX}{r}"
            if r != self.rank and self.store.check([key]):
                records[r] = json.loads(self.store.get(key)).get("attention", [])
        found = self.mismatch.observe(records)
        if found is not None:
            self.say(found[1], EXIT_MISMATCH)
            self.store.set(_MISMATCH_KEY, found[1])
            self.leave_together()

    def leave_together(self) -> None:
        """Exit EXIT_MISMATCH once every other rank has printed the message (a few beats at
        most): the first rank to exit makes torchrun's agent SIGTERM the others."""
        deadline = time.monotonic() + 3 * BEAT_S
        while self.store.add(_MISMATCH_KEY + "/seen", 0) < self.world_size - 1:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        os._exit(EXIT_MISMATCH)

    def say(self, message: str, code: int) -> None:
        os.write(sys.stderr.fileno(), f"[rank {self.rank}] {message}; rank {self.rank} exits "
                 f"with code {code}\n".encode())  # fmt: skip

    def run(self) -> None:
        while not self.done:
            try:
                self.beat()
                self.check()
                self.contact = time.monotonic()
            except (RuntimeError, OSError, ValueError):
                pass  # the store does not answer: watch_store decides
            time.sleep(BEAT_S)

    def watch_store(self) -> None:
        """Its own thread: a store operation on a cut link can block in recv for much longer
        than the store's timeout, so the beat thread cannot be the one to notice. The store
        silent for stall_s (a cut link, or torchrun's agent ended the job) ends this rank."""
        while not self.done:
            time.sleep(BEAT_S)
            silent = time.monotonic() - self.contact
            if not self.done and silent >= self.stall_s:
                self.lost_store(silent)

    def finish(self) -> None:
        """At exit: the last beat, marked done (a finished rank is not a frozen one). It runs on
        a thread of its own, waited for at most stall_s: on a cut link a store operation can
        block in recv until the kernel gives the connection up (about 15 minutes of TCP
        retransmissions), and this runs in atexit, after watch_store has stopped watching. A
        rank whose main thread failed on the cut link hung there for 17 minutes; now the
        store's silence ends it as it ends a rank that is still computing (lost_store)."""
        self.done = True
        last = threading.Thread(target=self._last_beat, name="ringattn-last-beat", daemon=True)
        start = time.monotonic()
        last.start()
        last.join(self.stall_s)
        if last.is_alive():
            self.lost_store(time.monotonic() - start)

    def _last_beat(self) -> None:
        try:
            self.beat(done=True)
        except (RuntimeError, OSError, ValueError):
            pass


_PEER: _PeerBeat | None = None


def start_peer_beating(rank: int, world_size: int, stall_s: float) -> None:
    """Under torchrun: beat into torchrun's store and watch the ring neighbours (idempotent).

    Needs MASTER_ADDR and MASTER_PORT (set by torchrun); a no-op with one rank or without them.
    """
    global _PEER
    if _PEER is not None or world_size < 2 or "MASTER_ADDR" not in os.environ:
        return
    # a store operation that takes stall_s is a lost link, not a slow store (it answers in ms)
    timeout = datetime.timedelta(seconds=max(2.0, stall_s))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)  # fmt: skip
    _PEER = _PeerBeat(store, rank, world_size, stall_s)
    _PEER.beat()
    atexit.register(_PEER.finish)
    threading.Thread(target=_PEER.run, name="ringattn-peer-heartbeat", daemon=True).start()
    threading.Thread(target=_PEER.watch_store, name="ringattn-store-watch", daemon=True).start()


def report_peer_progress(**progress: object) -> None:
    """Where this rank is (step, phase): part of its next beat."""
    if _PEER is not None:
        with _PEER.lock:
            _PEER.progress = dict(progress)
