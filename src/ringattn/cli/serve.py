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
from dataclasses import replace

from ringattn.cli.flags import add_flags, from_args
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
        "context-parallel prefill and decode. Rank 0 schedules every step (continuous batching: "
        "decodes first, then prompt chunks under --max-batch-tokens) over a pool of KV blocks "
        "(--kv-cache-gb) with prefix reuse; each answer is the one it gets alone. Needs the "
        "serve extra (pip install 'ringattn[serve]').",
    )
    # name, type, default and help: ServeConfig's fields. The API key's default comes from the
    # environment: a key on the command line shows in `ps` to every user
    d = replace(d, api_key=os.environ.get(API_KEY_ENV, d.api_key))
    names = ("hf", "nproc", "tp", "ep", "host", "port", "model_name", "api_key", "layout", "seed",
             "max_batch", "max_batch_tokens", "kv_cache_gb", "kv_block_size", "max_model_len",
             "prefix_cache", "max_queue", "max_body_mb", "dtype")  # fmt: skip
    add_flags(
        p,
        d,
        names,
        choices={"layout": tuple(LAYOUTS), "dtype": tuple(DTYPES)},
        metavars={
            "hf": "DIR",
            "api_key": "KEY",
            "max_body_mb": "MB",
            "kv_cache_gb": "G",
            "max_batch_tokens": "N",
            "max_model_len": "N",
        },
        negatable=("prefix_cache",),
        required=("hf",),
    )
    p.set_defaults(run=_run_from_args)


def _run_from_args(args: argparse.Namespace) -> int:
    return run_serve(from_args(ServeConfig, args))
