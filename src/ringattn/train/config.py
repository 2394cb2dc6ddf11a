"""What a training run is: `TrainConfig` (one field per flag) and the checks made before any
process starts.

`validate(cfg, world_size, check)` is a function of the flags, the number of processes, the model
recipe's own `check` (recipe.py; the config never imports a recipe) and, for --no-resume, of
whether the checkpoint directory already holds checkpoints (`check_fresh_start`): the
parent calls it before launching (so a bad flag is a ValueError in one process, not W tracebacks),
and every rank calls it again in `build_run`, before its first collective, so a run started under
torchrun fails the same way on every rank. It returns the (dp, cp) degrees.

The config is read in one place only, `run.build_run`, which turns it into the objects of the run
(mesh, model, optimizer, data, checkpoints); the loop reads the few schedule fields it needs
(`steps`, `stop_at`, `lr`...) from `run.cfg`. `IDENTITY` lists the fields a checkpoint must share
with the run that resumes from it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import ringattn
from ringattn.models.config import MODEL_SIZES, ModelConfig, model_config
from ringattn.runtime import checkpoint as ckpt
from ringattn.runtime.flags import check_at_least, check_choice
from ringattn.runtime.mesh import check_expert_degree, degrees
from ringattn.runtime.metrics import check_tensorboard

__all__ = ["DTYPES", "IDENTITY", "TrainConfig", "check_fresh_start", "validate"]

DTYPES = ("float32", "bfloat16")
FAIL_SIGNALS = ("kill", "term", "stop", "term-launcher")
COMPILE_BACKENDS = ("inductor", "aot_eager")

# a checkpoint whose config differs in one of these is from another run: resuming is refused
IDENTITY = ("model", "dim", "layers", "heads", "kv_heads", "data", "seq_len", "seed", "keys",
            "copies", "noisy", "hf", "rope_scaling", "max_position_embeddings")  # fmt: skip


@dataclass
class TrainConfig:
    """What `ringattn train` runs; each field is the flag of the same name (kebab-case)."""

    model: str = "small"
    """size preset (tiny: dim 64 x 2 layers ... large: dim 512 x 8 layers)"""
    hf: str = ""
    """train this local Hugging Face model directory (config.json, weights, tokenizer) or bare
    config.json (random init) instead of the decoder; needs --data text:PATH (packed documents)
    or chat:PATH (conversations)"""
    export: str = ""
    """--hf: after training, write the final checkpoint's model as a save_pretrained directory
    (AutoModelForCausalLM.from_pretrained(DIR) loads it)"""
    export_dtype: str = ""
    """--export: the weights' dtype (default: the dtype of the model --hf loaded, its
    config.json's dtype, else float32)"""
    token_cache: str = ""
    """--hf: where --data is tokenized to, once, as memory-mapped token files (default:
    ~/.cache/ringattn/tokens)"""
    rope_scaling: str = ""
    """--hf: extend the context with the model's own RoPE scaling TYPE:FACTOR (linear, dynamic,
    yarn, llama3), e.g. yarn:4; written into --export's config.json (train/hf/context.py)"""
    max_position_embeddings: int = 0
    """--hf: the model's new context length (0: its own x the --rope-scaling factor)"""
    eval_niah_every: int = 0
    """--hf: every K steps and at the last, a small needle-in-a-haystack grid (--seq-len / 2 and
    --seq-len tokens x depths 0, 50, 100 %) through the sharded KV cache, logged (and to
    TensorBoard); 0: never (train/hf/probe.py)"""
    dim: int = 0
    """model width; 0 keeps the preset's"""
    layers: int = 0
    """blocks; 0 keeps the preset's"""
    heads: int = 0
    """query heads; 0 keeps the preset's"""
    kv_heads: int = 0
    """key/value heads (GQA); 0 keeps the preset's"""
    seq_len: int = 4096
    """tokens per sequence (split over the cp ranks)"""
    batch_size: int = 1
    """sequences per data-parallel group per step"""
    nproc: int = 4
    """local processes to launch (under torchrun the world is used instead)"""
    dp: int = 1
    """data-parallel degree: groups reading different sequences (0 = nproc / cp)"""
    cp: int = 0
    """context-parallel degree: ranks sharing each sequence (0 = nproc / dp)"""
    tp: int = 1
    """tensor-parallel degree: ranks splitting each layer's heads and MLP"""
    pp: int = 1
    """pipeline-parallel degree: stages splitting the decoder's blocks"""
    ep: int = 1
    """--hf MoE models: expert-parallel degree, each MoE layer's experts split over blocks of
    ep ranks (a multiple of cp dividing dp x cp)"""
    microbatches: int = 1
    """pp > 1: micro-batches per step (a divisor of --batch-size)"""
    pp_schedule: str = "gpipe"
    """pp > 1: pipeline schedule (1f1b needs --microbatches >= --pp)"""
    strategy: str = "ring"
    """context-parallel attention strategy"""
    ulysses: int = 0
    """hybrid: Ulysses (all-to-all) degree inside each cp group, ring across"""
    layout: str = "zigzag"
    """which tokens each cp rank holds"""
    mixer_scheme: str = "auto"
    """--hf hybrid models: how the recurrent mixer layers run under CP: state (each rank its own
    tokens, states passed between ranks), heads, whole, or auto (the first of those the layer
    can run exactly)"""
    dynamic_cp: bool = False
    """with --data docs:...: each step, give every packed document a group of 1, 2, ... --cp
    ranks and place them over dp x cp balancing the planned cost (short documents on one rank,
    no communication); the same loss and gradients as static CP (train/dynamic/)"""
    steps: int = 200
    """optimizer steps in total"""
    lr: float = 3e-3
    """peak learning rate (AdamW)"""
    warmup: int = 20
    """linear warm-up steps, then cosine decay to lr/10"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    grad_clip: float = 1.0
    """max gradient norm"""
    data: str = "key-value"
    """key-value (the long-range retrieval task), docs:MEAN,SIGMA,MIN,MAX (windows packed with
    copy-task documents of lognormal lengths: static CP over packed documents, or --dynamic-cp)
    or text:PATH (bytes of a file or of every file in a directory; with --hf: one document per
    file of a directory, per row's 'text' of its .jsonl/.parquet files, or per
    blank-line-separated block of a file); with --hf also chat:PATH
    (a .jsonl of {'messages': [...]} per line, or a directory of .jsonl/.parquet files with a
    'messages' column: chat SFT, the loss on the assistant's tokens)"""
    keys: int = 12
    """key-value: keys per sequence, each queried once at the end (<= 12)"""
    copies: int = 8
    """key-value: records of each key per sequence"""
    noisy: int = 0
    """key-value: copies of each key with a wrong value (answer = majority)"""
    seed: int = 0
    """seed of the weights and the data"""
    out_dir: str = "runs/train"
    """where the JSON log (and plot) go"""
    checkpoint_dir: str = ""
    """checkpoint directory; empty: OUT_DIR/checkpoints"""
    checkpoint_every: int = 50
    """save every N steps and at the end (0 = only at the end, -1 = never)"""
    keep: int = 2
    """complete checkpoints to keep"""
    resume: bool = True
    """continue from the newest complete checkpoint in the checkpoint directory, if any
    (--no-resume: start afresh; refused when that directory already holds checkpoints)"""
    stop_at: int = 0
    """stop after this step, checkpointed, keeping the --steps schedule; rerun with a later
    --stop-at (or none) to continue"""
    log_every: int = 10
    """progress line every N steps when stdout is not a terminal"""
    activation_checkpointing: bool = False
    """recompute each block in backward instead of keeping its activations"""
    offload_activations: bool = False
    """with --activation-checkpointing: keep each checkpointed layer's input in pinned host
    memory, prefetched in backward on a side stream (saves GPU memory on a GPU only; on CPU it
    runs and changes nothing)"""
    tiled_mlp: int = 0
    """run each layer's MLP (a MoE layer's experts) over the rank's tokens in tiles of this
    many, each tile recomputed in backward: only one tile's intermediates alive, the same loss
    (0 = untiled)"""
    loss_chunk: int = -1
    """tokens per chunk of output projection + loss, recomputed in backward (0 = all at once;
    -1 = the most tokens whose float32 logits fit in 256 MiB, i.e. 256 MiB / (4 bytes x
    vocabulary) rounded down to a multiple of 64: 512 at a 128k vocabulary, 2,048 at 32k)"""
    compile: bool = False
    """torch.compile the parallelized model (fullgraph; inductor)"""
    compile_backend: str = "inductor"
    """torch.compile backend for --compile (aot_eager: same graphs, no code generation)"""
    dtype: str = "float32"
    """compute dtype (bfloat16: float32 master weights and gradient sums)"""
    timeout_s: float = 600.0
    """seconds before a collective waiting on a dead peer fails"""
    stall_s: float = 10.0
    """seconds without a heartbeat after which a frozen rank is named and the job ends (our
    launcher and torchrun)"""
    memory_warmup: bool = False
    """before measuring memory, run one step of a tiny model, so the baseline already holds the
    kernels' code"""
    max_bad_steps: int = 3
    """stop after this many steps in a row with a non-finite loss or gradient norm on any rank
    (their updates are skipped)"""
    grace_s: float = 25.0
    """after SIGTERM: seconds to finish the step and checkpoint it before exiting at once (more
    SIGTERMs, the copies a scheduler and a launcher send, join the first)"""
    tensorboard: bool = False
    """also write TensorBoard event files under OUT_DIR/tensorboard (loss, lr, grad norm,
    tokens/s, MFU, per-rank peak memory); needs tensorboard"""
    peak_tflops: float = 0.0
    """peak TFLOP/s of one device for the MFU estimate (0: GPU preset or the CPU calibration of
    `ringattn plan --calibrate`)"""
    fail_at_step: int = -1
    """Testing only: rank `fail_rank` signals itself (`fail_signal`) when it reaches this step."""
    fail_rank: int = 0
    fail_signal: str = "kill"
    """Testing only: kill (SIGKILL), term (SIGTERM), stop (SIGSTOP: frozen), term-launcher."""
    quiet: bool = False
    """no progress line (the log is written)"""

    def model_config(self) -> ModelConfig:
        return model_config(
            self.model, dim=self.dim, n_layers=self.layers, n_heads=self.heads,
            n_kv_heads=self.kv_heads,
        )  # fmt: skip

    @property
    def checkpoint_path(self) -> str:
        return self.checkpoint_dir or os.path.join(self.out_dir, "checkpoints")

    @property
    def log_path(self) -> str:
        return os.path.join(self.out_dir, "train_log.jsonl")

    @property
    def tensorboard_path(self) -> str:
        return os.path.join(self.out_dir, "tensorboard")

    @property
    def last_step(self) -> int:
        """The step this invocation stops after: `stop_at` when set (and earlier), else `steps`."""
        return min(self.steps, self.stop_at) if self.stop_at > 0 else self.steps


def check_fresh_start(cfg: TrainConfig) -> None:
    """--no-resume into a checkpoint directory that holds checkpoints is refused (when the run
    would write checkpoints): the new run's would sit beside the old run's, and `latest`, a later
    resume, --export and `generate` could not tell which run the newest one belongs to."""
    found = ckpt.complete_checkpoints(cfg.checkpoint_path) if not cfg.resume else []
    if found and cfg.checkpoint_every >= 0:
        steps = ", ".join(str(step) for step, _ in found)
        raise ValueError(
            f"--no-resume: {cfg.checkpoint_path} holds the checkpoints of an earlier run (steps "
            f"{steps}; newest {found[-1][1]}), which a new run would mix with its own; use "
            f"another --checkpoint-dir (or --out-dir), delete that directory, or drop --no-resume "
            f"to continue from its newest checkpoint"
        )


# --mixer-scheme: ringattn.hf.parallelize's mixer_scheme (integrations/hf/mixers/hooks.py)
MIXER_SCHEMES = ("auto", "state", "heads", "whole")
# what --data docs: (and so --dynamic-cp) runs with; everything else is refused by name
DOCUMENT_STRATEGIES = ("ring", "allgather", "ulysses")


def check_documents(cfg: TrainConfig, cp: int) -> None:
    """--dynamic-cp and --data docs: on the allow-list only: the decoder with --data docs:, or
    --hf with its packed text:/chat: documents; ring, allgather or ulysses, no --tp, --pp, --ep,
    --compile, nor activation checkpointing but with --hf, cp a power of two; each refusal names
    the flag and the fix (the --hf model's own refusals: train/hf/dynamic.check_model)."""
    docs = cfg.data.startswith("docs:")
    if docs and cfg.hf:
        raise ValueError(
            f"--data {cfg.data} with --hf: the copy-task documents are the decoder's; --hf "
            f"packs the documents of --data text:PATH or chat:PATH (--dynamic-cp too)"
        )
    if cfg.dynamic_cp and not (docs or cfg.hf):
        raise ValueError(
            f"--dynamic-cp places packed documents, and --data {cfg.data} has one document per "
            f"window; use --data docs:MEAN,SIGMA,MIN,MAX (e.g. docs:1024,1.5,128,8192), or --hf "
            f"DIR with --data text:PATH or chat:PATH"
        )
    if not (docs or cfg.dynamic_cp):
        return
    what = "--dynamic-cp" if cfg.dynamic_cp else f"--data {cfg.data}"
    refused = {"--tp": cfg.tp != 1, "--pp": cfg.pp != 1, "--compile": cfg.compile,
               # --hf recomputes through transformers' checkpointing, segments in the kwargs
               "--activation-checkpointing": cfg.activation_checkpointing and not cfg.hf,
               "--ep": cfg.ep != 1}  # fmt: skip
    for flag, on in refused.items():
        if on:
            raise ValueError(f"{what} is not supported with {flag}; drop {flag}")
    if cfg.strategy not in DOCUMENT_STRATEGIES:
        raise ValueError(
            f"{what} with --strategy {cfg.strategy}: the sub-groups of dynamic CP are 1-D; use "
            f"one of {', '.join(DOCUMENT_STRATEGIES)}"
        )
    if cp & (cp - 1):
        raise ValueError(
            f"{what} needs cp a power of two (groups of 1, 2, 4, ... ranks), got cp={cp}; use "
            f"cp={1 << (cp.bit_length() - 1)} or {1 << cp.bit_length()}"
        )


def validate(
    cfg: TrainConfig, world_size: int, check: Callable[[TrainConfig, int], None] | None = None
) -> tuple[int, int]:
    """Raise ValueError (values and fix) before any process starts; return (dp, cp).

    `check(cfg, cp)` is the model's own check (a ModelRecipe's `check`), run last."""
    check_choice("model", cfg.model, MODEL_SIZES)
    cfg.model_config()
    check_choice("dtype", cfg.dtype, DTYPES)
    check_at_least("nproc", world_size, 1)
    dp, cp = degrees(world_size, cfg.dp, cfg.cp, cfg.tp, cfg.pp)
    check_choice("layout", cfg.layout, ringattn.LAYOUTS)
    chunks = cp * ringattn.LAYOUTS[cfg.layout].chunks_per_rank
    if cfg.seq_len % chunks and not cfg.hf:  # ringattn.hf pads any length
        fixed = -(-cfg.seq_len // chunks) * chunks
        raise ValueError(
            f"--seq-len {cfg.seq_len} is not divisible by {chunks} ({cfg.layout} layout on cp={cp} "
            f"ranks); use {fixed}"
        )
    if cfg.ep != 1 and not cfg.hf:
        raise ValueError(f"--ep {cfg.ep} splits the experts of a --hf MoE model; add --hf DIR")
    check_choice("mixer-scheme", cfg.mixer_scheme, MIXER_SCHEMES)
    if cfg.mixer_scheme != "auto" and not cfg.hf:
        raise ValueError(
            f"--mixer-scheme {cfg.mixer_scheme} picks how a --hf hybrid model's recurrent mixers "
            f"run; the decoder (--model) has none: add --hf DIR or drop the flag"
        )
    check_expert_degree(cfg.ep, dp, cp)
    if cfg.ep > 1 and cfg.compile:
        raise ValueError(
            f"--ep {cfg.ep} with --compile: the expert dispatch exchanges per-expert counts on "
            f"the host (a graph break, refused by fullgraph); drop --compile or use --ep 1"
        )
    if cfg.compile_backend not in COMPILE_BACKENDS:
        raise ValueError(
            f"unknown --compile-backend {cfg.compile_backend!r}; choose from "
            f"{', '.join(COMPILE_BACKENDS)}"
        )
    if cfg.strategy == "hybrid" and not (cfg.ulysses > 0 and cp % cfg.ulysses == 0):
        raise ValueError(
            f"--strategy hybrid needs --ulysses U, a divisor of cp={cp} (Ulysses "
            f"inside groups of U ranks, a ring across them); got {cfg.ulysses}"
        )
    check_at_least("steps", cfg.steps, 1)
    check_at_least("batch-size", cfg.batch_size, 1)
    if cfg.fail_at_step >= 0 and not 0 <= cfg.fail_rank < world_size:
        raise ValueError(f"--fail-rank {cfg.fail_rank} is not a rank of {world_size}")
    check_choice("fail-signal", cfg.fail_signal, FAIL_SIGNALS)
    check_at_least("max-bad-steps", cfg.max_bad_steps, 1)
    check_at_least("loss-chunk", cfg.loss_chunk, -1)
    check_at_least("tiled-mlp", cfg.tiled_mlp, 0)
    if cfg.tiled_mlp and (cfg.compile or cfg.tp > 1):
        flag = "--compile" if cfg.compile else f"--tp {cfg.tp}"
        raise ValueError(f"--tiled-mlp {cfg.tiled_mlp} is not supported with {flag} (its tiles "
                         f"are recomputed by a Python autograd function over whole rows); drop "
                         f"one of them")  # fmt: skip
    if cfg.offload_activations and not cfg.activation_checkpointing:
        raise ValueError("--offload-activations moves the checkpointed layer inputs to host "
                         "memory: add --activation-checkpointing")  # fmt: skip
    if cfg.offload_activations and (cfg.pp > 1 or cfg.compile):
        flag = "--compile" if cfg.compile else f"--pp {cfg.pp}"
        raise ValueError(f"--offload-activations is not supported with {flag}; drop one")
    if not cfg.grace_s > 0:
        raise ValueError(f"--grace must be > 0 seconds, got {cfg.grace_s}")
    if cfg.tensorboard:
        check_tensorboard()
    check_documents(cfg, cp)
    check_fresh_start(cfg)
    if check is not None:  # what only the model can see: its shape, its data (recipe.check)
        check(cfg, cp)
    return dp, cp
