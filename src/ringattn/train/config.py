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
from ringattn.runtime.mesh import degrees
from ringattn.runtime.metrics import check_tensorboard

__all__ = ["DTYPES", "IDENTITY", "TrainConfig", "check_fresh_start", "validate"]

DTYPES = ("float32", "bfloat16")
FAIL_SIGNALS = ("kill", "term", "stop", "term-launcher")
COMPILE_BACKENDS = ("inductor", "aot_eager")

# a checkpoint whose config differs in one of these is from another run: resuming is refused
IDENTITY = ("model", "dim", "layers", "heads", "kv_heads", "data", "seq_len", "seed", "keys",
            "copies", "noisy", "hf")  # fmt: skip


@dataclass
class TrainConfig:
    """What `ringattn train` runs; each field is the flag of the same name (kebab-case)."""

    model: str = "small"
    """Model size preset: tiny, small, base, large (see model.MODEL_SIZES)."""
    hf: str = ""
    """A local Hugging Face model directory or config.json to train instead (train/hf/recipe.py)."""
    export: str = ""
    """--hf: write the final checkpoint's weights here as a save_pretrained directory."""
    export_dtype: str = ""
    token_cache: str = ""
    """--hf: where the memory-mapped token files of --data go (default ~/.cache/ringattn/tokens)."""
    """--export in this dtype (float32, bfloat16, float16); empty: the dtype the model came in."""
    dim: int = 0
    """Override the preset's model width (0 = keep)."""
    layers: int = 0
    heads: int = 0
    kv_heads: int = 0
    seq_len: int = 4096
    """Tokens per sequence (the global length that CP splits)."""
    batch_size: int = 1
    """Sequences per data-parallel rank per step."""
    nproc: int = 4
    """Local processes to launch (ignored under torchrun: the world is used)."""
    dp: int = 1
    """Data-parallel degree (0 = the processes left over after cp)."""
    cp: int = 0
    """Context-parallel degree (0 = the processes left over after dp)."""
    tp: int = 1
    """Tensor-parallel degree: ranks splitting each layer's heads and MLP (tensor_parallel.py)."""
    pp: int = 1
    """Pipeline-parallel degree: stages splitting the decoder's blocks."""
    microbatches: int = 1
    """pp > 1: micro-batches each rank's batch is split into (a divisor of batch_size)."""
    pp_schedule: str = "gpipe"
    """pp > 1: gpipe (all forwards, then all backwards) or 1f1b (needs microbatches >= pp)."""
    strategy: str = "ring"
    ulysses: int = 0
    """strategy=hybrid: the all-to-all (Ulysses) degree inside each cp group; ring across."""
    layout: str = "zigzag"
    steps: int = 200
    lr: float = 3e-3
    warmup: int = 20
    """Steps of linear learning-rate warm-up; then cosine decay to lr/10 at `steps`."""
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    data: str = "key-value"
    """`key-value` (the retrieval task) or `text:PATH` (bytes of a file or directory)."""
    keys: int = 12
    """key-value: keys per sequence (each queried once at the end), at most 12."""
    copies: int = 8
    """key-value: records of each key in a sequence."""
    noisy: int = 0
    """key-value: copies of each key with a wrong value (answer = majority)."""
    seed: int = 0
    out_dir: str = "runs/train"
    checkpoint_dir: str = ""
    """Where checkpoints go (default: OUT_DIR/checkpoints)."""
    checkpoint_every: int = 50
    """Save every N steps (and at the end); 0 = only at the end; -1 = never."""
    keep: int = 2
    """Complete checkpoints to keep."""
    resume: bool = True
    """Continue from the newest complete checkpoint in checkpoint_dir, if there is one."""
    stop_at: int = 0
    """Stop after this step (checkpointing it) without changing the schedule; 0 = at `steps`."""
    log_every: int = 10
    """Progress line every N steps when stdout is not a terminal."""
    activation_checkpointing: bool = False
    """Recompute each block in backward instead of keeping its activations."""
    loss_chunk: int = -1
    """Tokens per chunk of the output projection + loss (0 = all at once; -1 = the most whose
    float32 logits fit in 256 MiB at the model's vocabulary: models/loss.py's auto_chunk)."""
    compile: bool = False
    """torch.compile(model, fullgraph=True) after parallelizing it (attention: ringattn's ops)."""
    compile_backend: str = "inductor"
    """torch.compile's backend with `compile`: inductor, or aot_eager (the same graphs, no code
    generation: for debugging and fast tests)."""
    dtype: str = "float32"
    """Compute dtype: float32, or bfloat16 (float32 master weights and gradient reduction)."""
    timeout_s: float = 600.0
    """Process-group timeout: a dead peer turns into an error after at most this long."""
    stall_s: float = 10.0
    """A rank whose heartbeat stops this long is named and the job ends (launcher or torchrun)."""
    memory_warmup: bool = False
    """Run one throwaway step of a tiny model before measuring memory (keeps code pages out)."""
    max_bad_steps: int = 3
    """Stop after this many steps in a row whose loss or gradient norm is non-finite on any rank
    (each one's update is skipped on every rank)."""
    grace_s: float = 25.0
    """After SIGTERM: seconds to finish the step and checkpoint it before exiting at once."""
    tensorboard: bool = False
    """Also write TensorBoard event files under OUT_DIR/tensorboard (needs `tensorboard`)."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s of one device for the MFU estimate (0: the GPU preset or CPU calibration)."""
    fail_at_step: int = -1
    """Testing only: rank `fail_rank` signals itself (`fail_signal`) when it reaches this step."""
    fail_rank: int = 0
    fail_signal: str = "kill"
    """Testing only: kill (SIGKILL), term (SIGTERM), stop (SIGSTOP: frozen), term-launcher."""
    quiet: bool = False
    """No progress output (the JSON log is still written)."""

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
    if not cfg.grace_s > 0:
        raise ValueError(f"--grace must be > 0 seconds, got {cfg.grace_s}")
    if cfg.tensorboard:
        check_tensorboard()
    check_fresh_start(cfg)
    if check is not None:  # what only the model can see: its shape, its data (recipe.check)
        check(cfg, cp)
    return dp, cp
