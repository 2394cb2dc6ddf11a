"""One rank of `ringattn serve`: load the model, join the group, and run requests in a loop.

    every rank                                     rank 0 also
    ----------                                     -----------
    load model + tokenizer, init_distributed       bind the socket, start uvicorn in a thread
    loop:                                          next message: every Job waiting in the
      message = exchange(rank 0's message)           queue, oldest first, up to max_batch (a
      "idle": again; "stop": return                  "run"), or "idle" after IDLE_S, or "stop"
      "run":  ringattn.hf.generate(the requests      when the HTTP thread has ended
              as one ragged batch), a TextStream
              per sequence (a stop string ends     emit each job's text, then ("done", finish,
              that sequence on every rank at the     usage): the HTTP thread answers
              same token)

A batch runs to its end before the next starts (no continuous batching): a request that arrives
meanwhile waits for it. Each answer is the one its request gets alone, batched or not.

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
from ringattn.integrations.hf.tensor_parallel import split_cp_tp
from ringattn.runtime.heartbeat import report_progress
from ringattn.runtime.launch import init_distributed
from ringattn.serve.app import build_app, serve_in_thread
from ringattn.serve.config import ServeConfig, bind, model_name
from ringattn.serve.protocol import IDLE_S, Job, Request, exchange
from ringattn.serve.schema import Limits
from ringattn.serve.text import TextStream

__all__ = ["MAX_BATCH", "SAMPLING", "eos_ids", "limits", "rank_loop", "run_batch", "serve_worker"]

# ringattn.hf.generate samples when it takes do_sample (issue 22's sampling contract)
SAMPLING = "do_sample" in inspect.signature(ringattn.hf.generate).parameters
MAX_BATCH = 8  # requests waiting together run as one ragged batch of at most this many


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


def run_batch(model, tokenizer, requests: list[Request], eos: list[int], layout: str,
              emits: list | None = None, groups: tuple = (None, None)) -> list[str]:  # fmt: skip
    """Generate `requests` as one ragged batch on this rank (all ranks together); `emits`
    (rank 0: one per request) get the events. Each answer is the one its request gets alone
    (ringattn.hf.generate's ragged-batch contract; each sequence samples from its own seed).
    `groups`: the (cp, tp) process groups with --tp, else (None, None): the default group.

    Returns each finish reason: "stop" (end of sequence or a stop string) or "length"."""
    texts = [TextStream(tokenizer, r.stop) for r in requests]
    emits = emits or [lambda *event: None] * len(requests)

    def on_token(index: int, token: int) -> bool:
        piece = texts[index].push(token)
        if piece:
            emits[index]("text", piece)
        return texts[index].stopped  # True: this sequence leaves the batch

    device = next(model.parameters()).device
    prompts = [torch.tensor(r.ids, dtype=torch.int64, device=device) for r in requests]  # (S_i,)
    sampling = {}
    if SAMPLING:  # temperature 0 is greedy for its sequence; a seed per sequence
        sampling = {"do_sample": True, "temperature": [r.temperature for r in requests],
                    "top_p": [r.top_p for r in requests],
                    "seed": [r.seed or 0 for r in requests]}  # fmt: skip
    group, tp_group = groups
    ringattn.hf.generate(model, prompts, [r.max_new_tokens for r in requests], group=group,
                         layout=layout, eos_token_id=eos, on_token=on_token, tp_group=tp_group,
                         **sampling)  # fmt: skip
    finishes = []
    for text, request, emit in zip(texts, requests, emits):
        ended = text.stopped or bool(text.ids and text.ids[-1] in eos)
        finishes.append("stop" if ended else "length")
        piece = text.flush()
        if piece:
            emit("text", piece)
        prompt, completion = len(request.ids), len(text.ids)
        emit("done", finishes[-1], {"prompt_tokens": prompt, "completion_tokens": completion,
                                    "total_tokens": prompt + completion})  # fmt: skip
    return finishes


def _next_message(jobs: queue.Queue, http, max_batch: int) -> tuple[dict, list[Job]]:
    """Rank 0: what to broadcast next, and the jobs it runs: every waiting one, up to
    `max_batch`, in arrival order."""
    try:
        batch = [jobs.get(timeout=IDLE_S)]
    except queue.Empty:
        return ({"op": "idle"} if http.is_alive() else {"op": "stop"}), []
    while len(batch) < max_batch:
        try:
            batch.append(jobs.get_nowait())
        except queue.Empty:
            break
    return {"op": "run", "requests": [job.request.to_json() for job in batch]}, batch


def rank_loop(model, tokenizer, info: GroupInfo, layout: str, jobs: queue.Queue, http,
              max_batch: int = MAX_BATCH, groups: tuple = (None, None)) -> int:  # fmt: skip
    """Run requests until rank 0 says stop (`http`, its HTTP thread, has ended); the count.

    `info` is the whole world (rank 0 broadcasts each message to it); `groups` the (cp, tp)
    groups that generation runs over with --tp."""
    eos, served = eos_ids(model, tokenizer), 0
    while True:
        message, batch = _next_message(jobs, http, max_batch) if info.rank == 0 else (None, [])
        message = exchange(message, info)
        if message["op"] == "stop":
            return served
        if message["op"] == "idle":
            continue
        requests = [Request.from_json(r) for r in message["requests"]]
        report_progress(phase="batch", requests=len(requests), served=served)
        try:
            emits = [j.emit for j in batch] or None
            run_batch(model, tokenizer, requests, eos, layout, emits, groups)
        except ValueError as err:  # refused by generate's checks, the same on every rank
            for job in batch:
                job.emit("error", str(err))
        served += len(requests)
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
    groups = split_cp_tp(model, cfg.tp, world_size, device)
    info = resolve_group(None)
    jobs, http = queue.Queue(), None
    if info.rank == 0:
        sock = bind(cfg.host, cfg.port)
        name = model_name(cfg)
        app = build_app(name, tokenizer, limits(model), jobs, cfg.api_key)
        _, http = serve_in_thread(app, sock)
        host, port = sock.getsockname()[:2]
        key = " (API key required)" if cfg.api_key else ""
        ranks = (
            f"cp {world_size // cfg.tp} x tp {cfg.tp}" if cfg.tp > 1 else f"{world_size} rank(s)"
        )
        print(f"[serve] {name} ({type(model).__name__}, {source.describe()}) on {ranks}, "
              f"{cfg.layout}, {device.type}: listening on http://{host}:{port}/v1{key}",
              file=sys.stderr, flush=True)  # fmt: skip
    served = rank_loop(model, tokenizer, info, cfg.layout, jobs, http, cfg.max_batch, groups)
    return {"rank": info.rank, "served": served}
