"""One rank of `ringattn serve`: load the model, join the group, and run requests in a loop.

    every rank                                     rank 0 also
    ----------                                     -----------
    load model + tokenizer, init_distributed       bind the socket, start uvicorn in a thread
    loop:                                          next message: the oldest Job in the queue
      message = exchange(rank 0's message)           (a "run"), or "idle" after IDLE_S, or
      "idle": again; "stop": return                  "stop" when the HTTP thread has ended
      "run":  ringattn.hf.generate(request),
              TextStream per token (stop strings:  emit the text, then ("done", finish, usage),
              every rank stops at the same token)    on the job: the HTTP thread answers

The idle broadcast keeps the waiting ranks inside the process-group timeout while no request
comes, and lets a Ctrl-C land within a second. A rank that dies ends the launch: the launcher
names it (runtime/launch.py) and tears the others down. In launched ranks Ctrl-C (SIGINT) has
its default meaning, so the ranks end at once and the parent reports one line, not W tracebacks.
"""

from __future__ import annotations

import inspect
import os
import queue
import signal
import sys

import torch

import ringattn.hf
from ringattn.comm import GroupInfo, resolve_group
from ringattn.integrations.hf.source import load_model, load_tokenizer, model_source
from ringattn.runtime.heartbeat import report_progress
from ringattn.runtime.launch import init_distributed
from ringattn.serve.app import build_app, serve_in_thread
from ringattn.serve.config import ServeConfig, bind, model_name
from ringattn.serve.protocol import IDLE_S, Job, Request, exchange
from ringattn.serve.schema import Limits
from ringattn.serve.text import TextStream

__all__ = ["SAMPLING", "eos_ids", "limits", "rank_loop", "run_request", "serve_worker"]

# ringattn.hf.generate samples when it takes do_sample (issue 22's sampling contract)
SAMPLING = "do_sample" in inspect.signature(ringattn.hf.generate).parameters


class _Stopped(Exception):
    """A stop string appeared: raised from on_token on every rank at the same token."""


def eos_ids(model, tokenizer) -> list[int]:
    """End-of-sequence ids: the generation_config's and the tokenizer's (end of turn)."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted({int(t) for t in ids})


def limits(model) -> Limits:
    text = model.config.get_text_config()
    gen = getattr(model, "generation_config", None)
    sampled = bool(getattr(gen, "do_sample", False))
    return Limits(
        context=int(text.max_position_embeddings), vocab_size=int(text.vocab_size),
        sampling=SAMPLING,
        default_temperature=float(gen.temperature or 1.0) if sampled else 0.0,
        default_top_p=float(gen.top_p or 1.0) if sampled else 1.0,
    )  # fmt: skip


def run_request(model, tokenizer, request: Request, eos: list[int], layout: str,
                emit=None) -> str:  # fmt: skip
    """Generate `request` on this rank (all ranks together); `emit` (rank 0) gets the events.

    Returns the finish reason: "stop" (end of sequence or a stop string) or "length"."""
    text = TextStream(tokenizer, request.stop)
    emit = emit or (lambda *event: None)

    def on_token(token: int) -> None:
        piece = text.push(token)
        if piece:
            emit("text", piece)
        if text.stopped:
            raise _Stopped

    sampling = {}
    if request.temperature > 0:
        sampling = {"do_sample": True, "temperature": request.temperature,
                    "top_p": request.top_p, "seed": request.seed}  # fmt: skip
    finish, device = "length", next(model.parameters()).device
    try:
        input_ids = torch.tensor([request.ids], dtype=torch.int64, device=device)  # (1, S)
        ringattn.hf.generate(model, input_ids, request.max_new_tokens,
                             layout=layout, eos_token_id=eos, on_token=on_token,
                             **sampling)  # fmt: skip
        if text.ids and text.ids[-1] in eos:
            finish = "stop"
    except _Stopped:
        finish = "stop"
    piece = text.flush()
    if piece:
        emit("text", piece)
    prompt, completion = len(request.ids), len(text.ids)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion,
             "total_tokens": prompt + completion}  # fmt: skip
    emit("done", finish, usage)
    return finish


def _next_message(jobs: queue.Queue, http) -> tuple[dict, Job | None]:
    """Rank 0: what to broadcast next, and the job it runs (if any)."""
    try:
        job = jobs.get(timeout=IDLE_S)
    except queue.Empty:
        return ({"op": "idle"} if http.is_alive() else {"op": "stop"}), None
    return {"op": "run", "request": job.request.to_json()}, job


def rank_loop(model, tokenizer, info: GroupInfo, layout: str, jobs: queue.Queue, http) -> int:
    """Run requests until rank 0 says stop (`http`, its HTTP thread, has ended); the count."""
    eos, served = eos_ids(model, tokenizer), 0
    while True:
        message, job = _next_message(jobs, http) if info.rank == 0 else (None, None)
        message = exchange(message, info)
        if message["op"] == "stop":
            return served
        if message["op"] == "idle":
            continue
        served += 1
        report_progress(phase="request", request=served)
        request = Request.from_json(message["request"])
        try:
            run_request(model, tokenizer, request, eos, layout, job.emit if job else None)
        except ValueError as err:  # refused by generate's checks, the same on every rank
            if job is not None:
                job.emit("error", str(err))
        report_progress(phase="idle", served=served)


def serve_worker(cfg: ServeConfig) -> dict:
    """One rank of `ringattn serve` (see the module docstring); returns what it served."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    source = model_source(cfg.hf)
    torch.manual_seed(cfg.seed)  # from_config: the same random weights on every rank
    model = load_model(source).eval()  # on the CPU, before the group exists
    tokenizer = load_tokenizer(source.tokenizer_dir)
    device = torch.device("cpu")
    if world_size > 1:
        device = init_distributed()  # NCCL (a GPU per rank) or gloo (the CPU)
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    model.to(device)  # the group's device: NCCL collectives take CUDA tensors only
    info = resolve_group(None)
    jobs, http = queue.Queue(), None
    if info.rank == 0:
        sock = bind(cfg.host, cfg.port)
        name = model_name(cfg)
        app = build_app(name, tokenizer, limits(model), jobs, cfg.api_key)
        _, http = serve_in_thread(app, sock)
        host, port = sock.getsockname()[:2]
        key = " (API key required)" if cfg.api_key else ""
        print(f"[serve] {name} ({type(model).__name__}, {source.describe()}) on "
              f"{info.world_size} rank(s), {cfg.layout}: listening on http://{host}:{port}/v1{key}",
              file=sys.stderr, flush=True)  # fmt: skip
    served = rank_loop(model, tokenizer, info, cfg.layout, jobs, http)
    return {"rank": info.rank, "served": served}
