"""One rank of `ringattn serve`: load the model, join the group, and run steps in a loop.

    every rank                                     rank 0 also
    ----------                                     -----------
    load model + tokenizer, init_distributed       bind the socket, start uvicorn in a thread;
    size the KV pool (--kv-cache-gb, blocks of     the Scheduler (scheduler.py) over the job
      --kv-block-size tokens; pool_blocks)           queue and the pool's accounting (pool.py)
    loop:                                          each turn: plan the step (decodes first,
      plan = exchange(rank 0's plan)                 then prompt chunks under
      "idle": again; "stop": return                  --max-batch-tokens, admissions while
      "step": Runner.step(plan) (runner.py):         blocks last), "idle" after IDLE_S without
              free, open, decode, prefill chunks     work, "stop" when the HTTP thread ended;
              over this rank's cache               after the step: sample each sequence's next
                                                     token, emit its text, end the finished

Continuous batching: a request that arrives while others decode joins at the next step, and
one that finishes (end of sequence, a stop string, max_tokens) or is cancelled (its client
gone) leaves at once, its blocks freed. Each answer is the one its request gets alone.

Nothing a request does ends the server: a step that raises (an OOM, the same on every rank)
sends its sequences back to recompute, each alone until one of its steps succeeds, so a
failure of one request's own fails that request alone (500, or 400 for a ValueError). NaN
logits the same way: a sequence that shared its step recomputes alone (prompts packed into one
forward can pass a NaN on), and NaN alone fails its request with a 500 (Scheduler.after).
A step that raises on one rank only ends the server within AGREE_S, naming that rank
(protocol.Verdict): the ranks' caches no longer agree.

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
import time
import traceback

import torch

import ringattn.hf
from ringattn.comm import GroupInfo, all_gather_ints, backend_device, resolve_group
from ringattn.inference.hf import mixer_states
from ringattn.inference.hf.engine import KVEngine
from ringattn.inference.hf.weights import lay_out_for_decode
from ringattn.integrations.hf import vision
from ringattn.integrations.hf.experts import split_experts
from ringattn.integrations.hf.source import load_model, load_tokenizer, model_source
from ringattn.integrations.hf.tensor_parallel import split_cp_tp
from ringattn.runtime.heartbeat import report_progress
from ringattn.runtime.launch import init_distributed
from ringattn.serve.api.app import build_app, serve_in_thread
from ringattn.serve.api.schema import Limits
from ringattn.serve.config import ServeConfig, bind, model_aliases, model_name
from ringattn.serve.metrics import Metrics
from ringattn.serve.pool import BlockPool
from ringattn.serve.protocol import AGREE_S, Job, Verdict, exchange
from ringattn.serve.runner import Runner
from ringattn.serve.scheduler import Scheduler
from ringattn.serve.shares import Shares

__all__ = ["SAMPLING", "Sink", "check_pool", "eos_ids", "kv_token_bytes", "limits", "pool_blocks",
           "prepare", "rank_loop", "serve_worker", "served_context"]  # fmt: skip

# ringattn.hf.generate samples when it takes do_sample (issue 22's sampling contract)
SAMPLING = "do_sample" in inspect.signature(ringattn.hf.generate).parameters
DEFAULT_CPU_KV_GB = 4.0  # the KV pool per rank on the CPU when --kv-cache-gb is not given
BODY_BYTES_PER_TOKEN = 32  # the default body limit: a prompt's JSON rarely takes more per token


def eos_ids(model, tokenizer) -> list[int]:
    """End-of-sequence ids: the generation_config's and the tokenizer's (end of turn)."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted({int(t) for t in ids})


def served_context(model, max_model_len: int | None = None) -> int:
    """The longest prompt + completion served: the model's context, or --max-model-len when
    given (ValueError beyond the model's context)."""
    context = int(model.config.get_text_config().max_position_embeddings)
    if max_model_len is None:
        return context
    if max_model_len > context:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's context of "
                         f"{context} tokens (max_position_embeddings); give at most "
                         f"{context}")  # fmt: skip
    return max_model_len


def check_pool(blocks: int, block: int, shares: Shares, chunk: int, context: int) -> None:
    """ValueError, with the numbers, unless `blocks` blocks of `block` tokens per rank hold one
    sequence of `context` tokens (prompt and completion split either way: its fullest rank's
    rows). Then every request the API admits fits the pool alone, and one without max_tokens
    (the rest of the context) needs no reservation: it grows as it goes."""
    rows, need = shares.most(context, chunk, block)  # by region: chunks, decoded (pool.py)
    if need > blocks:
        raise ValueError(
            f"the KV pool holds {blocks} blocks of {block} tokens per rank, but one sequence of "
            f"the served context ({context} tokens: {rows} on the fullest of "
            f"{shares.world_size} ranks) needs {need}; give a larger --kv-cache-gb (x "
            f"{need / max(blocks, 1):.2f} at least) or serve a shorter context with "
            f"--max-model-len"
        )


def limits(model, tokenizer=None, max_body_bytes: int | None = None,
           max_model_len: int | None = None) -> Limits:  # fmt: skip
    """What admission checks against: the context (`served_context`), the vocabulary, the
    sampling defaults, the most characters a prompt can have and still fit (context x the
    longest token's characters, with `tokenizer`), the largest body (default
    BODY_BYTES_PER_TOKEN x context) and the end-of-sequence ids (with `tokenizer`)."""
    text = model.config.get_text_config()
    gen = getattr(model, "generation_config", None)
    sampled = bool(getattr(gen, "do_sample", False))
    context = served_context(model, max_model_len)
    chars = None
    if tokenizer is not None:
        longest = max((len(piece) for piece in tokenizer.get_vocab()), default=0)
        chars = context * max(1, longest)
    if max_body_bytes is None:
        max_body_bytes = max(1 << 20, BODY_BYTES_PER_TOKEN * context)
    return Limits(
        context=context, vocab_size=int(text.vocab_size), sampling=SAMPLING,
        default_temperature=float(gen.temperature or 1.0) if sampled else 0.0,
        default_top_p=float(gen.top_p or 1.0) if sampled else 1.0,
        max_prompt_chars=chars, max_body_bytes=int(max_body_bytes),
        eos=tuple(eos_ids(model, tokenizer)) if tokenizer is not None else (),
    )  # fmt: skip


class Sink:
    """Where one request's events go on this rank: its Job on rank 0 (elsewhere nowhere). On
    rank 0 it also times the tokens and counts the outcome (`metrics`). The scheduler emits
    each token once, also when a sequence recomputes after a failed step or a preemption (it
    keeps the tokens already sent), so nothing here is ever replayed."""

    def __init__(self, job: Job | None = None, metrics: Metrics | None = None):
        self.job, self.metrics = job, metrics
        self.last: float | None = None  # when the last token came

    def __call__(self, kind: str, *event: object) -> None:
        if kind == "token":
            self._timed()
            return
        if self.metrics is not None and self.job is not None and kind in ("done", "error"):
            self._ended(kind, *event)
        if self.job is not None:
            self.job.emit(kind, *event)

    def _timed(self) -> None:
        now = time.monotonic()
        if self.metrics is not None and self.job is not None:
            first = now - self.job.arrived if self.last is None else None
            self.metrics.token(first, None if self.last is None else now - self.last)
        self.last = now

    def _ended(self, kind: str, *event: object) -> None:
        latency = time.monotonic() - self.job.arrived
        if kind == "error":
            outcome = "invalid" if event[1] < 500 else "failed"
            self.metrics.ended(outcome, latency_s=latency)
            return
        finish, usage = event
        outcome = "cancelled" if self.job.cancelled else str(finish)
        self.metrics.ended(outcome, usage["prompt_tokens"], usage["completion_tokens"], latency)


def _free_device_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # an OOM's partial buffers go back before the next request


def kv_token_bytes(model, tp: int = 1) -> int:
    """Bytes of one token's K and V over every layer on one rank (its heads: 1 / tp of them)."""
    text = model.config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    size = next(model.parameters()).element_size()
    return 2 * text.num_hidden_layers * -(-kv_heads // tp) * head_dim * size


def pool_blocks(model, cfg: ServeConfig, info: GroupInfo, device: torch.device) -> int:
    """Blocks in each rank's KV pool: --kv-cache-gb (default: 0.8 x free GPU memory, or
    DEFAULT_CPU_KV_GB) over a block's bytes; the smallest over the ranks (one collective)."""
    gb = cfg.kv_cache_gb
    if gb is None and device.type == "cuda":
        gb = 0.8 * torch.cuda.mem_get_info(device)[0] / (1 << 30)
    gb = DEFAULT_CPU_KV_GB if gb is None else gb
    blocks = int(gb * (1 << 30)) // (cfg.kv_block_size * kv_token_bytes(model, cfg.tp))
    if info.world_size > 1:
        rows = all_gather_ints([blocks], info, backend_device(info, device))
        blocks = min(row[0] for row in rows)
    return blocks


def prepare(model, info: GroupInfo, layout: str, cfg: ServeConfig,
            groups: tuple = (None, None)) -> tuple[Runner, int, int]:  # fmt: skip
    """The step runner over this rank's paged pool and the pool's blocks, once checked to hold
    one sequence of the served context (`check_pool`: the same numbers on every rank, so
    every rank raises alike). A server runs it before it listens: it listens only when it
    can serve. Also the bytes of a hybrid's mixer states for one sequence (0 without mixers):
    what each prefix entry's snapshot costs the pool (`snapshot_bytes`)."""
    device = next(model.parameters()).device
    cp_group = groups[0]
    cp = resolve_group(cp_group).world_size
    blocks = pool_blocks(model, cfg, info, device)
    check_pool(blocks, cfg.kv_block_size, Shares(layout, cp), cfg.max_batch_tokens,
               served_context(model, cfg.max_model_len))  # fmt: skip
    engine = KVEngine(model, group=cp_group, layout=layout)
    runner = Runner(engine, cfg.kv_block_size, cfg.max_batch_tokens, blocks)
    return runner, blocks, snapshot_bytes(engine)


def snapshot_bytes(engine: KVEngine) -> int:
    """The bytes of every mixer's states of one sequence (a hybrid's; else 0), measured on a
    one-token sequence that is then released (the same on every rank: a collective forward).
    Sequence ids start at 0 again after it: the scheduler's plans count from 0."""
    if not engine.hybrid:
        return 0
    seq = engine.open()
    with torch.no_grad(), engine.holding():
        engine.step([], [(seq, torch.zeros(1, dtype=torch.int64, device=engine.device))])
    size = mixer_states.snapshot_bytes(mixer_states.snapshot(engine.state, seq))
    engine.release(seq)
    engine.next_seq = 0
    return size


def rank_loop(model, tokenizer, info: GroupInfo, layout: str, jobs: queue.Queue, http,
              cfg: ServeConfig | None = None, groups: tuple = (None, None),
              metrics: Metrics | None = None, agree_s: float = AGREE_S,
              prepared: tuple[Runner, int, int] | None = None) -> int:  # fmt: skip
    """Run steps until rank 0 says stop (`http`, its HTTP thread, has ended); the requests run.

    `info` is the whole world (rank 0 broadcasts each plan to it); `groups` the (cp, tp) groups
    that the engine runs over with --tp; `cfg` the engine's settings (max_batch,
    max_batch_tokens, kv_cache_gb, kv_block_size, prefix_cache); `metrics` (rank 0) what
    /metrics shows; `prepared` what `prepare` gave (else it runs here). A step that raises
    alike on every rank sends its sequences back to recompute, and a sequence that fails
    twice fails alone (Scheduler.failed); a step that raises on some ranks only (`agree_s`:
    protocol.Verdict) or a failed collective (a dead rank) raises out of here and ends the
    server."""
    cfg = cfg or ServeConfig()
    runner, blocks, snapshot = prepared or prepare(model, info, layout, cfg, groups)
    shares = Shares(layout, resolve_group(groups[0]).world_size)
    verdict = Verdict(info, agree_s)
    scheduler = None
    if info.rank == 0:
        pool = BlockPool(blocks, cfg.kv_block_size, snapshot,
                         cfg.kv_block_size * kv_token_bytes(model, cfg.tp))  # fmt: skip
        scheduler = Scheduler(jobs, http, tokenizer, eos_ids(model, tokenizer), pool,
                              shares, cfg.max_batch_tokens, cfg.max_batch,
                              cfg.prefix_cache, metrics,
                              lambda job: Sink(job, metrics))  # fmt: skip
        if metrics is not None:
            metrics.waiting = lambda: jobs.qsize() + scheduler.held
            metrics.pool(pool)
    with runner.engine.holding():  # the model runs nothing else while the server steps
        return _steps(runner, scheduler, info, verdict)


def _steps(runner: Runner, scheduler: Scheduler | None, info: GroupInfo, verdict: Verdict) -> int:
    """rank_loop's loop: plan (rank 0), share the plan, run it, sample (rank 0)."""
    served = steps = 0
    while True:
        plan = scheduler.plan() if scheduler is not None else None
        plan = exchange(plan, info)
        if plan["op"] == "stop":
            return served
        if plan["op"] == "idle":
            continue
        steps += 1  # every rank counts the same steps
        if plan.get("new"):  # taken on, whether or not this step succeeds
            served += plan["new"]
            report_progress(phase="serving", served=served)
        try:
            with torch.no_grad():
                decoded, chunks = runner.step(plan)
        except Exception as err:  # noqa: BLE001 - a step's failure is its sequences', not ours
            _free_device_memory()
            verdict.check(steps, err)  # raises unless every rank's step raised
            if scheduler is not None:
                traceback.print_exception(err, file=sys.stderr)
                scheduler.failed(err)
            continue
        if scheduler is not None:
            scheduler.after(decoded, chunks, runner.scores)


def serve_worker(cfg: ServeConfig) -> dict:
    """One rank of `ringattn serve` (see the module docstring); returns what it served."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    source = model_source(cfg.hf)
    torch.manual_seed(cfg.seed)  # from_config: the same random weights on every rank
    model = load_model(source, dtype=cfg.dtype).eval()  # on the CPU, before the group exists
    tokenizer = load_tokenizer(source.tokenizer_dir)
    if vision.is_multimodal(model):  # on every rank, before any collective
        raise ValueError(f"--hf {cfg.hf} is a vision-language model ({type(model).__name__}); "
                         f"ringattn serve prefills prompts in chunks, which a VLM's positions "
                         f"(M-RoPE, merged image embeddings) do not allow; serve its text model, "
                         f"or use ringattn generate --hf")  # fmt: skip
    device = torch.device("cpu")
    if world_size > 1:
        device = init_distributed()  # NCCL (a GPU per rank) or gloo (the CPU)
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    groups = split_cp_tp(model, cfg.tp, world_size, device)  # first: only shards reach a GPU
    split_experts(model, cfg.ep, device)  # --ep: this rank's experts only
    model.to(device)  # the group's device: NCCL collectives take CUDA tensors only
    lay_out_for_decode(model, device)  # the head column-major: a CPU decode step 1.06-1.10x
    info = resolve_group(None)
    prepared = prepare(model, info, cfg.layout, cfg, groups)  # a pool too small: no listening
    jobs, http, metrics = queue.Queue(), None, None
    if info.rank == 0:
        sock = bind(cfg.host, cfg.port)
        name = model_name(cfg)
        metrics = Metrics(jobs.qsize)
        body = None if cfg.max_body_mb is None else int(cfg.max_body_mb * (1 << 20))
        app = build_app(name, tokenizer, limits(model, tokenizer, body, cfg.max_model_len), jobs,
                        cfg.api_key, metrics=metrics, max_queue=cfg.max_queue or None,
                        aliases=model_aliases(cfg))  # fmt: skip
        _, http = serve_in_thread(app, sock)
        host, port = sock.getsockname()[:2]
        key = " (API key required)" if cfg.api_key else ""
        ranks = (
            f"cp {world_size // cfg.tp} x tp {cfg.tp}" if cfg.tp > 1 else f"{world_size} rank(s)"
        )
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        print(f"[serve] {name} ({type(model).__name__}, {source.describe()}, {dtype}) on "
              f"{ranks}, {cfg.layout}, {device.type}: listening on http://{host}:{port}/v1{key}",
              file=sys.stderr, flush=True)  # fmt: skip
    served = rank_loop(model, tokenizer, info, cfg.layout, jobs, http, cfg, groups, metrics,
                       prepared=prepared)  # fmt: skip
    return {"rank": info.rank, "served": served}
