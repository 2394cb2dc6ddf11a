"""The `ringattn serve` subcommand: its flags (one per ServeConfig field) and the launch.

    flags -> ServeConfig -> check (serve/config.py: ValueErrors before any launch)
          -> serve_worker on --nproc ranks (serve/worker.py), rank 0 listening on --host:--port

SIGTERM or Ctrl-C to this process ends every rank (the launcher's teardown) and returns 0 with
one line; a rank that dies on its own ends the server with the launcher's message naming it
(exit 1).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from dataclasses import fields

from ringattn.integrations.hf.source import DTYPES
from ringattn.layout import LAYOUTS
from ringattn.runtime.launch import LaunchError, launch, running_under_torchrun
from ringattn.serve.config import ServeConfig, check

API_KEY_ENV = "RINGATTN_API_KEY"

__all__ = ["add_serve_command", "run_serve"]


def run_serve(cfg: ServeConfig) -> int:
    """`ringattn serve`: check the flags, then serve on --nproc ranks until stopped.

    SIGTERM and SIGINT are the elastic agent's: it raises SignalException and tears the ranks
    down. It may also see a rank end in that teardown before its handler runs, and then reports
    a failed rank; so every signal this process receives is also written to a wakeup pipe
    (`signal.set_wakeup_fd`), and a failure after SIGTERM or SIGINT counts as a stop."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    check(cfg)  # first: the serve extra, whose FastAPI and pydantic the worker imports
    from ringattn.serve.worker import serve_worker  # optional: needs the serve extra

    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd)
    failure = None
    try:
        if running_under_torchrun() or cfg.nproc == 1:
            serve_worker(cfg)
        else:
            launch(serve_worker, cfg.nproc, cfg)
    except (KeyboardInterrupt, SignalException):
        pass
    except LaunchError as err:
        failure = err
    finally:
        signal.set_wakeup_fd(previous)
        try:
            received = os.read(read_fd, 64)
        except BlockingIOError:
            received = b""
        os.close(read_fd)
        os.close(write_fd)
    stops = [signal.Signals(n).name for n in received if n in (signal.SIGTERM, signal.SIGINT)]
    if failure is not None and not stops:
        raise failure
    if stops:
        print(f"[serve] stopped by {stops[0]}: every rank has ended", file=sys.stderr, flush=True)
    return 0


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    """The `serve` subcommand and its flags, for cli/main.py; defaults from ServeConfig."""
    d = ServeConfig()
    p = sub.add_parser(
        "serve",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="an OpenAI-compatible HTTP server over a KV cache sharded across --nproc ranks",
        description="Serve a local Hugging Face model (--hf DIR) with the OpenAI API "
        "(GET /v1/models, POST /v1/chat/completions, POST /v1/completions; streaming as "
        "server-sent events). Rank 0 listens; every rank takes part in each request's "
        "context-parallel prefill and decode. Requests that wait together run as one ragged batch "
        "(each answer is the one it gets alone). Needs the "
        "serve extra (pip install 'ringattn[serve]').",
    )
    p.add_argument("--hf", required=True, metavar="DIR",
                   help="a local Hugging Face model directory with its tokenizer (a bare "
                   "config.json: random init from --seed)")  # fmt: skip
    p.add_argument("--nproc", type=int, default=d.nproc, help="ranks the KV cache is sharded over")
    p.add_argument("--tp", type=int, default=d.tp,
                   help="tensor-parallel degree: heads and MLP split over tp by the model's own "
                   "tp plan, each prompt over cp = nproc / tp")  # fmt: skip
    p.add_argument("--host", default=d.host, help="interface to listen on (loopback by default)")
    p.add_argument("--port", type=int, default=d.port, help="TCP port (0: any free port)")
    p.add_argument("--model-name", default=d.model_name,
                   help="the model id in the API (default: the directory's name)")  # fmt: skip
    # from the environment by default: a key on the command line shows in `ps` to every user
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV, d.api_key), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every request (default: "
                   f"${API_KEY_ENV}, which other users cannot see in ps)")  # fmt: skip
    p.add_argument("--layout", choices=tuple(LAYOUTS), default=d.layout,
                   help="how each prompt is sharded")  # fmt: skip
    p.add_argument("--seed", type=int, default=d.seed, help="seed of a random init (no weights)")
    p.add_argument(
        "--max-batch", type=int, default=d.max_batch,
        help="requests waiting together run as one ragged batch of up to this many",
    )  # fmt: skip
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="requests that may wait for the ranks; beyond, 503 with Retry-After "
                   "(0: no limit)")  # fmt: skip
    p.add_argument("--max-body-mb", type=float, default=d.max_body_mb, metavar="MB",
                   help="the largest request body in MiB, 413 beyond (None: 32 bytes per "
                   "context token, at least 1 MiB)")  # fmt: skip
    p.add_argument("--dtype", choices=tuple(DTYPES), default=d.dtype,
                   help="the weights' dtype (auto: the checkpoint's)")  # fmt: skip
    p.set_defaults(run=_run_from_args)


def _run_from_args(args: argparse.Namespace) -> int:
    flags = {f.name: getattr(args, f.name) for f in fields(ServeConfig) if hasattr(args, f.name)}
    return run_serve(ServeConfig(**flags))
