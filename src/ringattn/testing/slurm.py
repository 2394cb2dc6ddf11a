"""A one-node Slurm cluster on this machine, for the tests of examples/clusters/slurm/.

    with LocalSlurm(cpus=2) as slurm:                  munged, slurmctld and slurmd, started here
        job = slurm.submit("train.sbatch", "--steps", "40", env={...})
        slurm.state(job)                               "RUNNING", "COMPLETED", "FAILED"...

Everything lives in one temporary folder: the munge key and socket, slurm.conf (one node named
after this host at 127.0.0.1 with `cpus` CPUs, one partition, ports of its own so that a
system Slurm is left alone; credentials that expire in 5 s, because a requeued job becomes
eligible only once its old credential expired, 120 s by default; a main scheduling pass every
second, because an eligible requeued job otherwise waits for the next pass, 60 s by default:
together a requeue took 56 s of idle waiting, now about 6), the controller's state, the node's
spool and the logs. Clients (sbatch, scancel, scontrol) find the cluster through SLURM_CONF,
which `env()` sets. Processes are tracked by parentage (proctrack/linuxproc, no cgroups:
containers rarely delegate them).
`close()` stops the two daemons and munged (SIGTERM, then SIGKILL) and removes the folder; it
runs at exit and on SIGTERM of this process too (a test run cut short leaves no daemon behind),
and is idempotent. Needs root and the Debian packages slurm-wlm and munge
(scripts/setup.sh installs them when it runs as root with apt); `unavailable()` says why not.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from ringattn.testing.teardown import Teardown

__all__ = ["LocalSlurm", "unavailable"]

_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "scontrol", "sinfo")


def unavailable() -> str | None:
    """Why a local Slurm cannot run here (not root, packages missing), or None."""
    if os.geteuid() != 0:
        return "slurmd and munged need root"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return (f"{', '.join(missing)} not found: apt-get install slurm-wlm munge "
                f"(scripts/setup.sh does, as root)")  # fmt: skip
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurm(Teardown):
    """munged + slurmctld + slurmd on 127.0.0.1 with one node of `cpus` CPUs."""

    def __init__(self, cpus: int = 2, kill_wait_s: int = 30):
        why = unavailable()
        if why:
            raise RuntimeError(f"a local Slurm cannot run here: {why}")
        self.dir = tempfile.mkdtemp(prefix="ringattn-slurm-")
        self.node = socket.gethostname()
        self.cpus, self.kill_wait_s = cpus, kill_wait_s
        self.conf = os.path.join(self.dir, "slurm.conf")
        self._pids: list[str] = []  # pid files of the daemons started here

    def env(self, extra: dict | None = None) -> dict:
        """The environment of a client command: SLURM_CONF pointing here."""
        return {**os.environ, "SLURM_CONF": self.conf, **(extra or {})}

    def run(self, *argv: str) -> str:
        """A client command's output; RuntimeError naming it when it fails."""
        done = subprocess.run(argv, env=self.env(), capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()}")  # fmt: skip
        return done.stdout

    def _start(self) -> None:
        d = self.dir
        munge = os.path.join(d, "munge")
        for sub in ("munge", "state", "spool", "log"):
            os.makedirs(os.path.join(d, sub))
        os.chmod(munge, 0o711)
        key = os.path.join(munge, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        socket_path = os.path.join(munge, "munge.socket")
        self._pids.append(os.path.join(munge, "munged.pid"))
        self.run("munged", "--force", f"--key-file={key}", f"--socket={socket_path}",
                 f"--pid-file={self._pids[-1]}", f"--log-file={munge}/munged.log",
                 f"--seed-file={munge}/munged.seed")  # fmt: skip
        ctld, slurmd = _free_port(), _free_port()
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=ringattn
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={slurmd}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket_path},cred_expire=5
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait={self.kill_wait_s}
SlurmdTimeout=300
MinJobAge=3600
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        self._pids += [os.path.join(d, "slurmctld.pid"), os.path.join(d, "slurmd.pid")]
        self.run("slurmctld", "-c", "-f", self.conf)  # -c: no state from an earlier run
        self.run("slurmd", "-f", self.conf)
        while "idle" not in self.run("sinfo", "-h", "-o", "%t"):  # the node registers
            time.sleep(0.5)

    def submit(self, script: str, *args: str, env: dict | None = None,
               options: tuple[str, ...] = ()) -> str:  # fmt: skip
        """`sbatch [options] script args...`: the job id."""
        argv = ["sbatch", "--parsable", *options, script, *args]
        done = subprocess.run(argv, env=self.env(env), capture_output=True, text=True,
                              check=False)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode...)."""
        text = self.run("scontrol", "show", "job", "-o", job_id)
        return dict(item.split("=", 1) for item in text.split() if "=" in item)

    def state(self, job_id: str) -> str:
        return self.job(job_id)["JobState"]

    def _daemons(self) -> list[int]:
        """The pids of the daemons started here, from their pid files."""
        found = []
        for path in self._pids:
            try:
                with open(path) as f:
                    found.append(int(f.read().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
        return found

    def pids(self) -> list[int]:
        """The daemons and every slurmstepd (whose children are the jobs' processes)."""
        found = self._daemons()
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if entry.isdigit() and f.read().startswith("slurmstepd"):
                        found.append(int(entry))
            except OSError:
                pass
        return found

    def close(self) -> None:
        """Cancel this cluster's jobs, stop the daemons started here (TERM, then KILL) and remove
        the folder. Idempotent."""
        if self._pids and os.path.exists(self.conf):
            subprocess.run(["scancel", "--user", "root"],
                           env=self.env(), capture_output=True, check=False)  # fmt: skip
        pids = self._daemons()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(_alive(p) for p in pids):
                time.sleep(0.2)
        self._pids = []
        shutil.rmtree(self.dir, ignore_errors=True)
        self._disarm()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
