"""The server processes of the serving benchmarks (serve_bench.py, serve_pairs.py).

`Server` starts one server as a child process in its own session (so a signal reaches its
whole process group: its ranks, its elastic agent), its output in a log file, and waits until
it answers; `server_argv` builds the command line of `transformers serve` or `ringattn serve`.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode()
    except OSError:  # not served (404) or no answer
        return None


class Server:
    """A server as a child process in its own session, its output in a log file; `url` (…/v1)
    once ready. `stop()` ends its whole process group (SIGTERM, then SIGKILL after 30 s)."""

    def __init__(self, argv: list[str], env: dict, ready, timeout_s: float = 900.0):
        # the log lives as long as the server: stop() closes (and so deletes) it
        self.log = tempfile.NamedTemporaryFile("w+", prefix="serve_bench_", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            self.url = ready(self)
            if self.url:
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{shlex.join(argv)} did not start:\n{self.output()[-4000:]}")

    def output(self) -> str:
        return pathlib.Path(self.log.name).read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.log.close()


def ringattn_ready(server: Server) -> str | None:
    found = re.search(r"listening on (http://127\.0\.0\.1:\d+/v1)", server.output())
    return found[1] if found else None


def server_argv(kind: str, args: argparse.Namespace) -> tuple[list[str], int, str | None]:
    """(argv, processes, port or None) for "transformers" or "ringattn:W"."""
    pin = ["taskset", "-c", args.cpus] if args.cpus else []
    if kind == "transformers":
        with socket.socket() as sock:  # a free port (transformers serve takes no port 0)
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        exe = os.path.join(os.path.dirname(sys.executable), "transformers")
        argv = [exe, "serve", args.hf, "--continuous-batching", "--host", "127.0.0.1", "--port",
                str(port), "--device", "cpu", *shlex.split(args.transformers_args)]  # fmt: skip
        return pin + argv, 1, port
    nproc = int(kind.split(":")[1])
    argv = [sys.executable, "-m", "ringattn", "serve", "--hf", args.hf, "--nproc", str(nproc),
            "--port", "0", *shlex.split(args.serve_args)]  # fmt: skip
    return pin + argv, nproc, None
