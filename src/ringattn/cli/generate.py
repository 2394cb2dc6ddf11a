"""The `ringattn generate` subcommand: its flags (one per GenerateConfig field) and the launch.

    flags -> GenerateConfig -> check_config -> the prompt (--prompt, --prompt-file, or a fresh
    sample of the run's key-value task) -> generate_worker on --nproc ranks (inference/generate.py)

The decoding itself is the inference library's (inference/generate.py, generate_hf.py); this
module only reads flags, picks the prompt and launches.
"""

from __future__ import annotations

import argparse

from ringattn.cli.flags import add_flags, from_args
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
    source = p.add_mutually_exclusive_group()  # one, name, type, default and help: GenerateConfig
    add_flags(source, d, ("checkpoint", "hf"), metavars={"hf": "DIR"})
    names = (
        "prompt",
        "prompt_file",
        "max_new_tokens",
        "sample",
        "nproc",
        "layout",
        "merge",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "eos_id",
        "offload_kv",
        "tp",
        "ep",
        "chat",
        "dtype",
    )
    add_flags(p, d, names, choices={"layout": tuple(LAYOUTS), "merge": MERGES,
                                    "dtype": tuple(DTYPES)})  # fmt: skip
    p.set_defaults(run=_run_from_args)


def _run_from_args(args: argparse.Namespace) -> int:
    return run_generate(from_args(GenerateConfig, args))
