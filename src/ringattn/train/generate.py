"""`ringattn generate`: decoding from a training checkpoint over a sharded KV cache.

    parent (ringattn generate --nproc W)       rank r of W (launched here, or torchrun's ranks)
    ------------------------------------       --------------------------------------------------
    launch(generate_worker, W) ------------->  load the checkpoint (DCP, resharded to 1 process)
                                               join the group; Session(model, group, layout)
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

import argparse
import os
import sys
import time
import warnings
from dataclasses import dataclass, fields

import torch

from ringattn.layout import LAYOUTS
from ringattn.runtime.launch import init_distributed, launch, running_under_torchrun
from ringattn.train import checkpoint as ckpt
from ringattn.train.data import KeyValueTask, render
from ringattn.train.model import Transformer, model_config

__all__ = [
    "GenerateConfig",
    "add_generate_command",
    "generate",
    "generate_worker",
    "load_model",
    "run_generate",
]


@dataclass
class GenerateConfig:
    """What `ringattn generate` runs; each field is the flag of the same name."""

    checkpoint: str = "runs/demo/checkpoints"
    """A checkpoint directory (step-N) or a directory of them (the newest is used)."""
    hf: str | None = None
    """A local Hugging Face model directory (or config.json) instead of --checkpoint."""
    prompt: str | None = None
    """Text to continue; default: a fresh sample of the key-value task, if the run used it."""
    prompt_file: str | None = None
    """A file whose bytes are the prompt (instead of --prompt)."""
    max_new_tokens: int = 1
    sample: int = 0
    """Which fresh key-value sample to use as the prompt."""
    nproc: int = 1
    """Ranks the prompt and the KV cache are sharded over (ignored under torchrun)."""
    layout: str = "zigzag"
    merge: str = "allgather"
    """How the ranks' partial attention merges at each decoded token: allgather or allreduce."""
    temperature: float = 0.0
    """0: greedy."""
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    eos_id: int | None = None
    """Stop after this token id (a byte value)."""
    offload_kv: bool = False
    """Keep the cache shards in host memory, each layer's copied in while the previous computes."""


def _resolve(path: str) -> str:
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
    import torch.distributed.checkpoint as dcp

    path = _resolve(path)
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
    out = list(tokens)
    for _ in range(max_new_tokens):
        x = torch.tensor([out])  # (1, S)
        logits = model(x, torch.arange(len(out)))  # (1, S, vocab)
        out.append(int(logits[0, -1].argmax()))
    return out[len(tokens) :]


def _prompt(cfg: GenerateConfig, train_cfg: dict) -> tuple[list[int], int | None]:
    """The prompt tokens, and the right answer when it is a key-value sample (else None)."""
    if cfg.prompt_file is not None:
        with open(cfg.prompt_file, "rb") as f:
            return list(f.read()), None
    if cfg.prompt is not None:
        return list(cfg.prompt.encode()), None
    if train_cfg["data"] != "key-value":
        raise ValueError(f"the run trained on {train_cfg['data']!r}; pass --prompt TEXT")
    task = KeyValueTask(
        train_cfg["seq_len"], train_cfg["keys"], train_cfg["copies"], train_cfg["noisy"],
        seed=train_cfg["seed"] + 1,  # a different stream from every training sample
    )  # fmt: skip
    inputs, labels = task.sample(cfg.sample)
    answer_at = int((labels >= 0).nonzero()[-1])  # the last query's key
    return inputs[: answer_at + 1].tolist(), int(labels[answer_at])


def check_config(cfg: GenerateConfig) -> None:
    """ValueErrors for flags that cannot work, before any process starts."""
    if not isinstance(cfg.max_new_tokens, int) or cfg.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {cfg.nproc}")
    if cfg.prompt is not None and cfg.prompt_file is not None:
        raise ValueError("pass --prompt or --prompt-file, not both")
    if cfg.prompt_file is not None and not os.path.isfile(cfg.prompt_file):
        raise ValueError(f"--prompt-file {cfg.prompt_file!r} is not a file")
    if cfg.prompt == "" or (cfg.prompt_file is not None and os.path.getsize(cfg.prompt_file) == 0):
        raise ValueError("the prompt is empty; pass at least one byte")
    if cfg.hf is not None and cfg.offload_kv:
        raise ValueError("--offload-kv applies to --checkpoint's decoder; drop it with --hf")
    if cfg.hf is not None:
        from ringattn.train.generate_hf import check

        check(cfg)
    else:
        _resolve(cfg.checkpoint)


def generate_worker(cfg: GenerateConfig) -> dict:
    """One rank: load, join the group, generate; rank 0 prints as the tokens come."""
    from ringattn.comm import all_gather_ints, resolve_group
    from ringattn.inference import Sampling, Session

    if cfg.hf is not None:
        from ringattn.train.generate_hf import hf_worker

        return hf_worker(cfg)
    model, state = load_model(cfg.checkpoint)  # before the group exists: a plain local load
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        init_distributed()
    info = resolve_group(None)
    lead = info.rank == 0
    prompt, answer = _prompt(cfg, state["config"])
    if lead:
        print(f"model from {cfg.checkpoint} (step {state['step']}, {state['config']['model']} "
              f"size), {len(prompt)} prompt tokens on {info.world_size} ranks ({cfg.layout})",
              flush=True)  # fmt: skip
        _print_head(prompt, answer)

    def on_prefill(done: int, total: int) -> None:
        if lead:
            print(f"[prefill] layer {done}/{total}", file=sys.stderr, flush=True)

    def on_token(token: int) -> None:
        if lead:
            print(render([token]), end="", flush=True)

    sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed)
    session = Session(model, layout=cfg.layout, merge=cfg.merge)
    if cfg.offload_kv:
        session.decoder.cache.offload()  # before the prefill stores anything
    start = time.perf_counter()
    tokens, stats = session.generate(prompt, cfg.max_new_tokens, sampling=sampling,
                                     eos_id=cfg.eos_id, on_token=on_token,
                                     on_prefill=on_prefill)  # fmt: skip
    total_s = time.perf_counter() - start
    cache_bytes = [
        row[0] for row in all_gather_ints([stats.cache_bytes], info, torch.device("cpu"))
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


def _print_head(prompt: list[int], answer: int | None) -> None:
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


def run_generate(cfg: GenerateConfig) -> int:
    """`ringattn generate`: launch the ranks (or join torchrun's world, or run in-process)."""
    check_config(cfg)
    if running_under_torchrun() or cfg.nproc == 1:
        generate_worker(cfg)
    else:
        launch(generate_worker, cfg.nproc, cfg)
    return 0


def add_generate_command(sub: argparse._SubParsersAction) -> None:
    """The `generate` subcommand and its flags, for cli/main.py; defaults from GenerateConfig."""
    d = GenerateConfig()
    p = sub.add_parser(
        "generate",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="decoding from a training checkpoint or a local Hugging Face model (--hf) over a "
        "KV cache sharded across --nproc ranks",
        description="Load a checkpoint written by `ringattn train` or `ringattn demo` (or, with "
        "--hf DIR, a local transformers model: train/generate_hf.py) on --nproc "
        "local processes (or torchrun's ranks), prefill the prompt context-parallel (each rank "
        "keeps its shard of the KV cache) and decode, streaming the tokens; prints the time to "
        "first token, decode tokens/s and each rank's KV-cache MB. Without --prompt or "
        "--prompt-file, a run trained on the key-value task is asked a fresh sample's last "
        "query, and the right answer is shown.",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--checkpoint",
        default=d.checkpoint,
        help="a step-N checkpoint or a directory of them (the newest is used)",
    )
    source.add_argument(
        "--hf",
        default=d.hf,
        metavar="DIR",
        help="a local Hugging Face model directory (config.json, weights, tokenizer; a bare "
        "config.json: random init from --seed) decoded greedily with ringattn.hf.generate; "
        "without a tokenizer the prompt's bytes mod vocab_size are the tokens",
    )
    p.add_argument("--prompt", default=d.prompt, help="text to continue (bytes are tokens)")
    p.add_argument("--prompt-file", default=d.prompt_file, help="a file whose bytes are the prompt")
    p.add_argument(
        "--max-new-tokens", type=int, default=d.max_new_tokens, help="tokens to generate"
    )
    p.add_argument(
        "--sample",
        type=int,
        default=d.sample,
        help="which fresh key-value sample to ask (without --prompt)",
    )
    p.add_argument("--nproc", type=int, default=d.nproc, help="ranks the KV cache is sharded over")
    p.add_argument(
        "--layout",
        choices=tuple(LAYOUTS),
        default=d.layout,
        help="how the prompt is sharded",
    )
    p.add_argument(
        "--merge",
        choices=("allgather", "allreduce"),
        default=d.merge,
        help="the one collective per layer that merges the ranks' partial attention per token",
    )
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    p.add_argument(
        "--top-k", type=int, default=d.top_k, help="sample among the k likeliest (0: all)"
    )
    p.add_argument("--top-p", type=float, default=d.top_p, help="nucleus sampling mass (1: all)")
    p.add_argument("--seed", type=int, default=d.seed, help="sampling seed, shared by all ranks")
    p.add_argument("--eos-id", type=int, default=d.eos_id, help="stop after this token id")
    p.add_argument(
        "--offload-kv",
        action="store_true",
        help="keep each rank's cache shard in host memory (pinned on CUDA) and copy each layer's "
        "to the device while the previous layer computes (--checkpoint only)",
    )
    p.set_defaults(run=_run_from_args)


def _run_from_args(args: argparse.Namespace) -> int:
    return run_generate(
        GenerateConfig(**{f.name: getattr(args, f.name) for f in fields(GenerateConfig)})
    )
