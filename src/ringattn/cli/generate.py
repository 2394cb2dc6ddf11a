"""The `ringattn generate` subcommand: its flags (one per GenerateConfig field) and the launch.

    flags -> GenerateConfig -> check_config -> the prompt (--prompt, --prompt-file, or a fresh
    sample of the run's key-value task) -> generate_worker on --nproc ranks (inference/generate.py)

The decoding itself is the inference library's (inference/generate.py, generate_hf.py); this
module only reads flags, picks the prompt and launches.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from ringattn.inference.generate import (
    GenerateConfig,
    check_config,
    generate_worker,
    prompt,
    resolve_checkpoint,
)
from ringattn.inference.partials import MERGES
from ringattn.integrations.hf.source import DTYPES
from ringattn.layout import LAYOUTS
from ringattn.runtime import checkpoint as ckpt
from ringattn.runtime.launch import launch, running_under_torchrun
from ringattn.train.data import KeyValueTask, render

__all__ = ["add_generate_command", "run_generate"]


def run_generate(cfg: GenerateConfig) -> int:
    """`ringattn generate`: check the flags, resolve the prompt, launch the ranks (or join
    torchrun's world, or run in-process)."""
    check_config(cfg)
    if cfg.hf is None:
        state = ckpt.read_state(resolve_checkpoint(cfg.checkpoint))
        cfg.prompt_ids, cfg.answer = prompt(cfg, state["config"], _fresh_task)
    if running_under_torchrun() or cfg.nproc == 1:
        generate_worker(cfg, render)
    else:
        launch(generate_worker, cfg.nproc, cfg, render)
    return 0


def _fresh_task(train_cfg: dict) -> KeyValueTask:
    """The run's key-value task on a different stream from every training sample."""
    return KeyValueTask(
        train_cfg["seq_len"], train_cfg["keys"], train_cfg["copies"], train_cfg["noisy"],
        seed=train_cfg["seed"] + 1,
    )  # fmt: skip


def add_generate_command(sub: argparse._SubParsersAction) -> None:
    """The `generate` subcommand and its flags, for cli/main.py; defaults from GenerateConfig."""
    d = GenerateConfig()
    p = sub.add_parser(
        "generate",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="decoding from a training checkpoint or a local Hugging Face model (--hf) over a "
        "KV cache sharded across --nproc ranks",
        description="Load a checkpoint written by `ringattn train` or `ringattn demo` (or, with "
        "--hf DIR, a local transformers model: inference/generate_hf.py) on --nproc "
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
        "config.json: random init from --seed) decoded with ringattn.hf.generate (greedy, or "
        "sampled with --temperature/--top-k/--top-p/--seed); without a tokenizer the prompt's "
        "bytes mod vocab_size are the tokens",
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
        choices=MERGES,
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
        "to the device while the previous layer computes",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=d.tp,
        help="--hf: tensor-parallel degree (the model's own tp plan: heads and MLP over tp ranks); "
        "the --nproc ranks form cp = nproc / tp context-parallel groups of tp",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="--hf: wrap the prompt as one user message with the tokenizer's chat template "
        "(and its generation prompt)",
    )
    p.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=d.dtype,
        help="--hf: the weights' dtype (auto: the checkpoint's, float32 for a random init)",
    )
    p.set_defaults(run=_run_from_args)


def _run_from_args(args: argparse.Namespace) -> int:
    flags = {f.name: getattr(args, f.name) for f in fields(GenerateConfig) if hasattr(args, f.name)}
    return run_generate(GenerateConfig(**flags))
