"""The `ringattn train` and `ringattn demo` subcommands: one flag per TrainConfig field, kebab-case.

`add_train_command(sub)` and `add_demo_command(sub)` register the two subcommands on the CLI's
subparsers (cli/main.py calls them); each sets `run`, the function main() calls with the parsed
flags. `add_arguments(parser, defaults)` adds the flags in groups (model, parallelism, data and
optimisation, output); `config_from_args` turns the parsed namespace back into a TrainConfig.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from ringattn import LAYOUTS
from ringattn.api import STRATEGIES
from ringattn.models import MODEL_SIZES
from ringattn.models.pipeline import SCHEDULES
from ringattn.train.config import COMPILE_BACKENDS, DTYPES, TrainConfig
from ringattn.train.demo import demo_config, run_train_demo
from ringattn.train.hf.run import EXPORT_DTYPES, run_hf_train
from ringattn.train.main import run_train

__all__ = ["add_arguments", "add_demo_command", "add_train_command", "config_from_args"]


def add_arguments(p: argparse.ArgumentParser, d: TrainConfig, *, demo: bool = False) -> None:
    """The flags of `ringattn train` (and of `ringattn demo`, which hides a few) on parser `p`."""

    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        default=d.model,
        choices=tuple(MODEL_SIZES),
        help="size preset (tiny: dim 64 x 2 layers ... large: dim 512 x 8 layers)",
    )
    m.add_argument("--dim", type=int, default=d.dim, help="model width; 0 keeps the preset's")
    m.add_argument("--layers", type=int, default=d.layers, help="blocks; 0 keeps the preset's")
    m.add_argument("--heads", type=int, default=d.heads, help="query heads; 0 keeps the preset's")
    m.add_argument(
        "--kv-heads",
        type=int,
        default=d.kv_heads,
        help="key/value heads (GQA); 0 keeps the preset's",
    )
    if not demo:
        m.add_argument(
            "--hf",
            default=d.hf,
            metavar="DIR",
            help="train this local Hugging Face model directory (config.json, weights, "
            "tokenizer) or bare config.json (random init) instead of the decoder; needs "
            "--data text:PATH (packed documents) or chat:PATH (conversations)",
        )
    g = p.add_argument_group("parallelism")
    g.add_argument(
        "--nproc",
        type=int,
        default=d.nproc,
        help="local processes to launch (under torchrun the world is used instead)",
    )
    g.add_argument(
        "--cp",
        type=int,
        default=d.cp,
        help="context-parallel degree: ranks sharing each sequence (0 = nproc / dp)",
    )
    g.add_argument(
        "--dp",
        type=int,
        default=d.dp,
        help="data-parallel degree: groups reading different sequences (0 = nproc / cp)",
    )
    g.add_argument(
        "--tp",
        type=int,
        default=d.tp,
        help="tensor-parallel degree: ranks splitting each layer's heads and MLP",
    )
    g.add_argument(
        "--pp",
        type=int,
        default=d.pp,
        help="pipeline-parallel degree: stages splitting the decoder's blocks",
    )
    g.add_argument(
        "--microbatches",
        type=int,
        default=d.microbatches,
        help="pp > 1: micro-batches per step (a divisor of --batch-size)",
    )
    g.add_argument(
        "--pp-schedule",
        default=d.pp_schedule,
        choices=SCHEDULES,
        help="pp > 1: pipeline schedule (1f1b needs --microbatches >= --pp)",
    )
    g.add_argument(
        "--strategy",
        default=d.strategy,
        choices=tuple(STRATEGIES),
        help="context-parallel attention strategy",
    )
    g.add_argument(
        "--ulysses",
        type=int,
        default=d.ulysses,
        help="hybrid: Ulysses (all-to-all) degree inside each cp group, ring across",
    )
    g.add_argument(
        "--layout", default=d.layout, choices=tuple(LAYOUTS), help="which tokens each cp rank holds"
    )
    g.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=d.activation_checkpointing,
        help="recompute each block in backward instead of keeping its activations",
    )
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=d.compile,
        help="torch.compile the parallelized model (fullgraph; inductor)",
    )
    g.add_argument(
        "--compile-backend",
        default=d.compile_backend,
        choices=COMPILE_BACKENDS,
        help="torch.compile backend for --compile (aot_eager: same graphs, no code generation)",
    )
    g.add_argument(
        "--loss-chunk",
        type=int,
        default=d.loss_chunk,
        help="tokens per chunk of output projection + loss, recomputed in backward "
        "(0 = all at once; default -1: the most tokens whose float32 logits fit in 256 MiB, "
        "i.e. 256 MiB / (4 bytes x vocab) rounded down to a multiple of 64: 512 at a "
        "128k vocabulary)",
    )
    g.add_argument(
        "--dtype",
        default=d.dtype,
        choices=DTYPES,
        help="compute dtype (bfloat16: float32 master weights and gradient sums)",
    )
    g.add_argument(
        "--timeout",
        dest="timeout_s",
        type=float,
        default=d.timeout_s,
        help="seconds before a collective waiting on a dead peer fails",
    )
    g.add_argument(
        "--stall-timeout",
        dest="stall_s",
        type=float,
        default=d.stall_s,
        help="seconds without a heartbeat after which a frozen rank is named and the "
        "job ends (our launcher and torchrun)",
    )
    t = p.add_argument_group("data and optimisation")
    t.add_argument(
        "--data",
        default=d.data,
        help="key-value (the long-range retrieval task) or text:PATH (bytes of a file "
        "or of every file in a directory; with --hf: one document per file of a directory, per "
        "row's 'text' of its .jsonl/.parquet files, or per blank-line-separated block of a "
        "file); with --hf also chat:PATH (a .jsonl of {'messages': [...]} per line, or a "
        "directory of .jsonl/.parquet files with a 'messages' column: chat SFT, the loss on "
        "the assistant's tokens)",
    )
    if not demo:
        t.add_argument(
            "--token-cache",
            default=d.token_cache,
            metavar="DIR",
            help="--hf: where --data is tokenized to, once, as memory-mapped token files "
            "(default: ~/.cache/ringattn/tokens)",
        )
    t.add_argument(
        "--seq-len",
        type=int,
        default=d.seq_len,
        help="tokens per sequence (split over the cp ranks)",
    )
    t.add_argument(
        "--batch-size",
        type=int,
        default=d.batch_size,
        help="sequences per data-parallel group per step",
    )
    t.add_argument(
        "--keys",
        type=int,
        default=d.keys,
        help="key-value: keys per sequence, each queried once at the end (<= 12)",
    )
    t.add_argument(
        "--copies", type=int, default=d.copies, help="key-value: records of each key per sequence"
    )
    t.add_argument(
        "--noisy",
        type=int,
        default=d.noisy,
        help="key-value: copies of each key with a wrong value (answer = majority)",
    )
    t.add_argument("--steps", type=int, default=d.steps, help="optimizer steps in total")
    t.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    t.add_argument(
        "--warmup",
        type=int,
        default=d.warmup,
        help="linear warm-up steps, then cosine decay to lr/10",
    )
    t.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    t.add_argument("--grad-clip", type=float, default=d.grad_clip, help="max gradient norm")
    t.add_argument("--seed", type=int, default=d.seed, help="seed of the weights and the data")
    hide = argparse.SUPPRESS if demo else None
    o = p.add_argument_group("output")
    o.add_argument("--out-dir", default=d.out_dir, help="where the JSON log (and plot) go")
    o.add_argument(
        "--checkpoint-dir",
        default=d.checkpoint_dir,
        help="checkpoint directory; empty: OUT_DIR/checkpoints",
    )
    o.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        help="save every N steps and at the end (0 = only at the end, -1 = never)",
    )
    o.add_argument("--keep", type=int, default=d.keep, help="complete checkpoints to keep")
    if not demo:
        o.add_argument(
            "--export",
            default=d.export,
            metavar="DIR",
            help="--hf: after training, write the final checkpoint's model as a "
            "save_pretrained directory (AutoModelForCausalLM.from_pretrained(DIR) loads it)",
        )
        o.add_argument(
            "--export-dtype",
            default=d.export_dtype,
            choices=("", *EXPORT_DTYPES),
            help="--export: the weights' dtype (default: the dtype of the model --hf loaded, "
            "its config.json's dtype, else float32)",
        )
    o.add_argument(
        "--stop-at",
        type=int,
        default=d.stop_at,
        help=hide
        or "stop after this step, checkpointed, keeping the --steps schedule; "
        "rerun with a later --stop-at (or none) to continue",
    )
    o.add_argument(
        "--log-every",
        type=int,
        default=d.log_every,
        help="progress line every N steps when stdout is not a terminal",
    )
    o.add_argument(
        "--quiet",
        action="store_true",
        default=d.quiet,
        help="no progress line (the log is written)",
    )
    o.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=d.resume,
        help=hide
        or "continue from the newest complete checkpoint in the checkpoint "
        "directory, if any (--no-resume: start afresh; refused when that directory "
        "already holds checkpoints)",
    )
    o.add_argument(
        "--memory-warmup",
        action="store_true",
        default=d.memory_warmup,
        help=hide
        or "before measuring memory, run one step of a tiny model, so the "
        "baseline already holds the kernels' code",
    )
    o.add_argument(
        "--tensorboard",
        action=argparse.BooleanOptionalAction,
        default=d.tensorboard,
        help="also write TensorBoard event files under OUT_DIR/tensorboard (loss, lr, "
        "grad norm, tokens/s, MFU, per-rank peak memory); needs tensorboard",
    )
    o.add_argument(
        "--peak-tflops",
        type=float,
        default=d.peak_tflops,
        help="peak TFLOP/s of one device for the MFU estimate (0: GPU preset or the "
        "CPU calibration of `ringattn plan --calibrate`)",
    )
    o.add_argument(
        "--max-bad-steps",
        type=int,
        default=d.max_bad_steps,
        help="stop after this many steps in a row with a non-finite loss or gradient "
        "norm on any rank (their updates are skipped)",
    )
    o.add_argument(
        "--grace",
        dest="grace_s",
        type=float,
        default=d.grace_s,
        help="after SIGTERM: seconds to finish the step and checkpoint it before "
        "exiting at once (a second SIGTERM exits at once too)",
    )
    # for tests: a rank killing, signalling or freezing itself mid-run
    o.add_argument("--fail-at-step", type=int, default=d.fail_at_step, help=argparse.SUPPRESS)
    o.add_argument("--fail-rank", type=int, default=d.fail_rank, help=argparse.SUPPRESS)
    o.add_argument("--fail-signal", default=d.fail_signal, help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of parsed flags (other entries of the namespace, e.g. `run`, are ignored)."""
    names = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


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
