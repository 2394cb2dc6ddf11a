"""`ringattn generate`: decoding from a training checkpoint over a sharded KV cache.

    parent (ringattn generate --nproc W)       rank r of W (launched here, or torchrun's ranks)
    ------------------------------------       --------------------------------------------------
    launch(generate_worker, W) ------------->  load the checkpoint (DCP, resharded to 1 process)
                                               join the group; Session(model, group, layout):
                                                 KVEngine, the engine --hf and serve run on
                                               prefill: the prompt sharded by the layout; each
                                                 rank keeps its shard of every layer's K/V
                                               decode: every rank computes each new token; its K/V
                                                 goes to one rank; partials merge exactly
                                               rank 0 streams the tokens, then prints the time to
                                                 first token, decode tokens/s, each rank's cache MB

The checkpoint's train_state.json gives the model shape. The prompt is --prompt TEXT or
--prompt-file FILE (bytes are tokens); without either, and when the run trained on the key-value
task, it is a fresh sample of that task (never seen in training) cut after its last query's key,
so the next token is the model's answer, printed with the right one. `--hf DIR` decodes a local
transformers model instead (greedy, ringattn.hf.generate; generate_hf.py). `generate` below is the
old path without a cache (the whole sequence re-run per token): the tests' reference.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp

from ringattn.comm import all_gather_ints, backend_device, resolve_group
from ringattn.inference.generate_hf import Progress, hf_worker
from ringattn.inference.generate_hf import check as check_hf
from ringattn.inference.partials import MERGES
from ringattn.inference.sampling import Sampling
from ringattn.inference.session import Session
from ringattn.layout import LAYOUTS
from ringattn.models import Transformer, model_config
from ringattn.runtime import checkpoint as ckpt
from ringattn.runtime.extras import require
from ringattn.runtime.flags import check_at_least, check_choice
from ringattn.runtime.launch import init_distributed

__all__ = ["GenerateConfig", "check_config", "generate", "generate_worker", "load_model", "prompt",
           "resolve_checkpoint"]  # fmt: skip


def _bytes(tokens: list[int]) -> str:
    return bytes(t % 256 for t in tokens).decode("utf-8", errors="replace")


@dataclass
class GenerateConfig:
    """What `ringattn generate` runs; each field is the flag of the same name."""

    checkpoint: str = "runs/demo/checkpoints"
    """a step-N checkpoint or a directory of them (the newest is used)"""
    hf: str | None = None
    """a local Hugging Face model directory (config.json, weights, tokenizer; a bare config.json:
    random init from --seed) decoded with ringattn.hf.generate (greedy, or sampled with
    --temperature/--top-k/--top-p/--seed); without a tokenizer the prompt's bytes mod vocab_size
    are the tokens"""
    prompt: str | None = None
    """text to continue (bytes are tokens)"""
    prompt_file: str | None = None
    """a file whose bytes are the prompt"""
    max_new_tokens: int = 1
    """tokens to generate"""
    sample: int = 0
    """which fresh key-value sample to ask (without --prompt)"""
    nproc: int = 1
    """ranks the KV cache is sharded over"""
    layout: str = "zigzag"
    """how the prompt is sharded"""
    merge: str = "allgather"
    """the one collective per layer that merges the ranks' partial attention per token"""
    temperature: float = 0.0
    """0 = greedy"""
    top_k: int = 0
    """sample among the k likeliest (0: all)"""
    top_p: float = 1.0
    """nucleus sampling mass (1: all)"""
    seed: int = 0
    """sampling seed, shared by all ranks"""
    eos_id: int | None = None
    """stop after this token id"""
    offload_kv: bool = False
    """keep each rank's cache shard in host memory (pinned on CUDA) and copy each layer's to the
    device while the previous layer computes"""
    tp: int = 1
    """--hf: tensor-parallel degree (the model's own tp plan: heads and MLP over tp ranks); the
    --nproc ranks form cp = nproc / tp context-parallel groups of tp"""
    ep: int = 1
    """--hf MoE models: expert-parallel degree, each MoE layer's experts split over blocks of ep
    ranks (a divisor of --nproc and of the expert count; --tp 1)"""
    chat: bool = False
    """--hf: wrap the prompt as one user message with the tokenizer's chat template (and its
    generation prompt)"""
    dtype: str = "auto"
    """--hf: the weights' dtype (auto: the checkpoint's, float32 for a random init)"""
    prompt_ids: list[int] | None = None
    """The prompt's tokens, resolved from the flags before launch (`prompt`); not a flag."""
    answer: int | None = None
    """The right next token when the prompt is a key-value sample; not a flag."""


def resolve_checkpoint(path: str) -> str:
    """`path` itself when it is a checkpoint, else the newest checkpoint in it (ValueError)."""
    newest = ckpt.latest(path)
    if newest is not None:
        return newest
    try:
        ckpt.read_state(path)
    except FileNotFoundError:
        raise ValueError(
            f"{path!r} is neither a checkpoint (step-N with train_state.json) nor a directory "
            f"holding one; train first, e.g. `ringattn demo`, or pass --checkpoint DIR"
        ) from None
    return path


def load_model(path: str) -> tuple[Transformer, dict]:
    """The model of checkpoint `path` on one process (CPU), and its training state."""
    path = resolve_checkpoint(path)
    state = ckpt.read_state(path)
    cfg = state["config"]
    model = Transformer(model_config(
        cfg["model"], dim=cfg["dim"], n_layers=cfg["layers"], n_heads=cfg["heads"],
        n_kv_heads=cfg["kv_heads"],
    ))  # fmt: skip
    weights = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(weights, checkpoint_id=path)
    model.load_state_dict(weights["model"])
    return model.eval(), state


@torch.no_grad()
def generate(model: Transformer, tokens: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of `tokens` by `max_new_tokens` tokens, without a KV cache: the whole
    sequence runs again for every token (one process; the reference for the cached path)."""
    out, device = list(tokens), model.tok_embeddings.weight.device
    for _ in range(max_new_tokens):
        x = torch.tensor([out], device=device)  # (1, S)
        logits = model(x, torch.arange(len(out), device=device))  # (1, S, vocab)
        out.append(int(logits[0, -1].argmax()))
    return out[len(tokens) :]


def prompt(
    cfg: GenerateConfig, train_cfg: dict, task: Callable[[dict], object] | None = None
) -> tuple[list[int], int | None]:
    """The prompt tokens, and the right answer when it is a key-value sample (else None).

    `task(train_cfg)` makes the training run's task (a fresh stream of it: `sample(i)` gives
    (inputs, labels)); only needed when neither --prompt nor --prompt-file is given."""
    if cfg.prompt_file is not None:
        with open(cfg.prompt_file, "rb") as f:
            return list(f.read()), None
    if cfg.prompt is not None:
        return list(cfg.prompt.encode()), None
    if train_cfg["data"] != "key-value" or task is None:
        raise ValueError(f"the run trained on {train_cfg['data']!r}; pass --prompt TEXT")
    inputs, labels = task(train_cfg).sample(cfg.sample)
    answer_at = int((labels >= 0).nonzero()[-1])  # the last query's key
    return inputs[: answer_at + 1].tolist(), int(labels[answer_at])


def check_config(cfg: GenerateConfig) -> None:
    """ValueErrors for flags that cannot work, before any process starts."""
    check_at_least("max-new-tokens", cfg.max_new_tokens, 1)
    check_at_least("nproc", cfg.nproc, 1)
    check_choice("layout", cfg.layout, LAYOUTS)
    check_choice("merge", cfg.merge, MERGES)
    if cfg.prompt is not None and cfg.prompt_file is not None:
        raise ValueError("pass --prompt or --prompt-file, not both")
    if cfg.prompt_file is not None and not os.path.isfile(cfg.prompt_file):
        raise ValueError(f"--prompt-file {cfg.prompt_file!r} is not a file")
    if cfg.prompt == "" or (cfg.prompt_file is not None and os.path.getsize(cfg.prompt_file) == 0):
        raise ValueError("the prompt is empty; pass at least one byte")
    if cfg.hf is None and (cfg.tp != 1 or cfg.ep != 1 or cfg.chat):
        raise ValueError("--tp, --ep and --chat apply to --hf models; drop them with --checkpoint")
    if cfg.hf is not None:
        require("hf", "ringattn generate --hf")
        check_hf(cfg)
    else:
        resolve_checkpoint(cfg.checkpoint)


def generate_worker(cfg: GenerateConfig, render: Callable[[list[int]], str] = _bytes) -> dict:
    """One rank: load, join the group, generate; rank 0 prints as the tokens come.

    `render` writes tokens as text (a module-level function: ranks are spawned); the CLI passes
    the key-value task's, which shows its record tokens as {K=v}."""
    if cfg.hf is not None:
        return hf_worker(cfg)
    model, state = load_model(cfg.checkpoint)  # before the group exists: a plain local load
    device = torch.device("cpu")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        device = init_distributed()  # CUDA under NCCL: the model and its cache go there too
    model.to(device)
    info = resolve_group(None)
    lead = info.rank == 0
    prompt, answer = cfg.prompt_ids, cfg.answer
    if prompt is None:
        raise ValueError("GenerateConfig.prompt_ids is unset: resolve the prompt first (prompt)")
    if lead:
        print(f"model from {cfg.checkpoint} (step {state['step']}, {state['config']['model']} "
              f"size), {len(prompt)} prompt tokens on {info.world_size} ranks ({cfg.layout})",
              flush=True)  # fmt: skip
        _print_head(prompt, answer, render)

    progress = Progress(lead)

    def on_token(token: int) -> None:
        progress.end()
        if lead:
            print(render([token]), end="", flush=True)

    sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed)
    session = Session(model, layout=cfg.layout, merge=cfg.merge, offload_kv=cfg.offload_kv)
    start = time.perf_counter()
    tokens, stats = session.generate(prompt, cfg.max_new_tokens, sampling=sampling,
                                     eos_id=cfg.eos_id, on_token=on_token,
                                     on_prefill=progress.layer)  # fmt: skip
    total_s = time.perf_counter() - start
    progress.end()
    cache_bytes = [
        row[0] for row in all_gather_ints([stats.cache_bytes], info, backend_device(info, device))
    ]
    if lead:
        tail = "" if answer is None else f"    (right answer: {render([answer])})"
        print(tail, flush=True)
        per_rank = ", ".join(f"{b / 2**20:.3f}" for b in cache_bytes)
        print(f"[generate] time to first token {stats.first_token_s * 1e3:.1f} ms (prefill of "
              f"{len(prompt)} tokens), {stats.new_tokens} tokens in {total_s:.2f} s, decode "
              f"{stats.decode_tokens_per_s:.1f} tokens/s; KV cache per rank: {per_rank} MB"
              f"{' (host memory: --offload-kv)' if cfg.offload_kv else ''}",
              file=sys.stderr, flush=True)  # fmt: skip
    return {"tokens": tokens, "cache_bytes": stats.cache_bytes, "rank": info.rank}


def _print_head(prompt: list[int], answer: int | None, render: Callable[[list[int]], str]) -> None:
    """What precedes the streamed tokens: the prompt (text) or the key-value sample's records."""
    if answer is None:
        print(render(prompt) + "|", end="", flush=True)
        return
    key = prompt[-1]
    records = [render([t]) for t in prompt if render([t]).startswith(f"{{{chr(key)}=")]
    print(f"prompt: a fresh key-value sample, {len(prompt)} tokens; records of the queried key:")
    print(f"  {' '.join(records)}")
    print(f"prompt ends: ...{render(prompt[-30:])}")
    print("generated:   ", end="", flush=True)
