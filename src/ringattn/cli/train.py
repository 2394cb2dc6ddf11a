"""The `ringattn train` and `ringattn demo` subcommands: one flag per TrainConfig field, kebab-case.

`add_train_command(sub)` and `add_demo_command(sub)` register the two subcommands on the CLI's
subparsers (cli/main.py calls them); each sets `run`, the function main() calls with the parsed
flags. `add_arguments(parser, defaults)` adds the flags in groups (model, parallelism, data and
optimisation, output); `config_from_args` turns the parsed namespace back into a TrainConfig.
"""

from __future__ import annotations

import argparse
import sys

from ringattn import LAYOUTS
from ringattn.api import STRATEGIES
from ringattn.cli.flags import add_flags, from_args
from ringattn.models import MODEL_SIZES
from ringattn.models.pipeline import SCHEDULES
from ringattn.train.config import COMPILE_BACKENDS, DTYPES, MIXER_SCHEMES, TrainConfig
from ringattn.train.demo import demo_config, run_train_demo
from ringattn.train.hf.run import EXPORT_DTYPES, run_hf_train
from ringattn.train.main import run_train

__all__ = ["add_arguments", "add_demo_command", "add_train_command", "config_from_args"]


# the flags of each group, in --help's order; name, type, default and help come from TrainConfig
MODEL = ("model", "dim", "layers", "heads", "kv_heads", "hf", "rope_scaling",
         "max_position_embeddings")  # fmt: skip
PARALLELISM = ("nproc", "cp", "dp", "tp", "pp", "ep", "microbatches", "pp_schedule", "strategy",
               "ulysses", "layout", "mixer_scheme", "dynamic_cp", "activation_checkpointing",
               "offload_activations", "compile", "compile_backend", "loss_chunk", "tiled_mlp",
               "dtype", "timeout_s", "stall_s")  # fmt: skip
DATA = ("data", "token_cache", "seq_len", "batch_size", "keys", "copies", "noisy", "steps", "lr",
        "warmup", "weight_decay", "grad_clip", "seed")  # fmt: skip
OUTPUT = ("out_dir", "checkpoint_dir", "checkpoint_every", "keep", "export", "export_dtype",
          "stop_at", "log_every", "quiet", "resume", "memory_warmup", "tensorboard", "peak_tflops",
          "max_bad_steps", "grace_s", "eval_niah_every", "fail_at_step", "fail_rank",
          "fail_signal")  # fmt: skip
CHOICES = {"model": tuple(MODEL_SIZES), "pp_schedule": SCHEDULES, "strategy": tuple(STRATEGIES),
           "layout": tuple(LAYOUTS), "compile_backend": COMPILE_BACKENDS, "dtype": DTYPES,
           "export_dtype": ("", *EXPORT_DTYPES), "mixer_scheme": MIXER_SCHEMES}  # fmt: skip
SPELLED = {"timeout_s": "--timeout", "stall_s": "--stall-timeout", "grace_s": "--grace"}
METAVARS = {"hf": "DIR", "token_cache": "DIR", "export": "DIR", "timeout_s": "SECONDS",
            "stall_s": "SECONDS", "grace_s": "SECONDS", "rope_scaling": "TYPE:FACTOR",
            "eval_niah_every": "K", "tiled_mlp": "TOKENS"}  # fmt: skip
NEGATABLE = ("activation_checkpointing", "compile", "resume", "tensorboard")
HIDDEN = ("fail_at_step", "fail_rank", "fail_signal")  # tests: a rank killing or freezing itself
# the demo trains our decoder
DEMO_HIDES = ("hf", "token_cache", "export", "export_dtype", "rope_scaling",
              "max_position_embeddings", "eval_niah_every")  # fmt: skip


def add_arguments(p: argparse.ArgumentParser, d: TrainConfig, *, demo: bool = False) -> None:
    """The flags of `ringattn train` (and of `ringattn demo`, which hides a few) on parser `p`,
    one per TrainConfig field (cli/flags.py), defaults from `d`."""
    for title, names in (("model", MODEL), ("parallelism", PARALLELISM),
                         ("data and optimisation", DATA), ("output", OUTPUT)):  # fmt: skip
        shown = [n for n in names if not (demo and n in DEMO_HIDES)]
        add_flags(p.add_argument_group(title), d, shown, choices=CHOICES, metavars=METAVARS,
                  spelled=SPELLED, negatable=NEGATABLE, hidden=HIDDEN)  # fmt: skip


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of parsed flags (other entries of the namespace, e.g. `run`, are ignored)."""
    return from_args(TrainConfig, args)


def add_demo_command(sub: argparse._SubParsersAction) -> None:
    """`ringattn demo`: the train flags with the demo's defaults, and --no-plot."""

    p = sub.add_parser(
        "demo",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="start here: train a small decoder with context parallelism (CP = 4) on CPU",
        description="Train a small Llama-style decoder on a long-range retrieval task, every "
        "sequence split over 4 local processes (context parallelism, exact ring attention). "
        "Shows the loss falling and the retrieval accuracy rising, each rank's peak memory, "
        "and writes the JSON log, a checkpoint and a PNG plot under --out-dir (a few minutes "
        "on 2 CPU cores). Any `ringattn train` flag changes the run.",
    )
    add_arguments(p, demo_config(), demo=True)
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG plot")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:

    return run_train_demo(config_from_args(args), make_plot=not args.no_plot)


def add_train_command(sub: argparse._SubParsersAction) -> None:
    """`ringattn train`."""
    p = sub.add_parser(
        "train",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="train the decoder over a dp x cp mesh of local processes (or under torchrun)",
        description="Train a Llama-style decoder whose sequences are split over cp ranks "
        "(context parallelism) and whose batch is split over dp groups; parameters sharded with "
        "FSDP2 over all ranks. Launches --nproc local processes (gloo on CPU, NCCL with a GPU "
        "each), or joins the world when run under torchrun. Prints a progress line, appends a "
        "JSON log to OUT_DIR/train_log.jsonl, checkpoints atomically, and resumes from the "
        "newest checkpoint when rerun.",
    )
    add_arguments(p, TrainConfig())
    p.set_defaults(run=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    # a transformers model: says what it trains, then exports and plots
    summary = run_hf_train(cfg) if cfg.hf else run_train(cfg)
    lead = summary.get("rank", 0) == 0
    if summary.get("checkpoint") and lead:
        print(f"checkpoint: {summary['checkpoint']}")
    stopped = summary.get("stopped")
    if stopped:  # preempted, diverged, a failed checkpoint: runtime/outcome.py
        if lead:
            print(f"ringattn train: {stopped['message']}", file=sys.stderr, flush=True)
        return stopped["exit_code"]
    return 0
