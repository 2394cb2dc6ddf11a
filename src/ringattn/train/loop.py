"""`ringattn train`: train the decoder on sequences sharded over a dp x cp mesh.

    parent (ringattn train)            rank r of W = dp x cp (launched here, or torchrun's ranks)
    -----------------------            ----------------------------------------------------------
    validate flags                     mesh (dp, cp); model from the seed; CP attention; FSDP2
    launch(train_worker, W) -------->  resume from the newest complete checkpoint, if any
                                       for each step:
                                         full (B, S) batch of this dp row -> shard over the cp row
                                         loss_sum, count = model(tokens, positions, labels)
                                         count <- all_reduce(count) over the whole mesh
                                         (loss_sum / count).backward()  # FSDP sums over all ranks
                                         clip, AdamW step; progress line + JSON log (rank 0)
                                         checkpoint every N steps (atomic; see checkpoint.py)
    summary  <-----------------------  rank 0's history

The loss is the mean over every supervised token of the global batch: each rank divides its SUM
of token losses by the global count, and the gradients are summed over all ranks. A mean of
per-rank means would weight a rank holding 3 supervised tokens like one holding 3000.

A rank that dies makes the launch fail with LaunchError naming it (launch.py); running the same
command again resumes from the last complete checkpoint, reading the same samples in the same
order, so the resumed run's losses equal the uninterrupted run's.
"""

from __future__ import annotations

import math
import os
import platform
import signal
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from ringattn.layout import get_layout
from ringattn.runtime.launch import LaunchError, init_distributed, launch, running_under_torchrun
from ringattn.runtime.meter import Meter
from ringattn.train import checkpoint as ckpt
from ringattn.train.data import Batch, get_dataset, global_batch, shard_batch
from ringattn.train.mesh import Mesh, build_mesh, degrees, parallelize
from ringattn.train.model import MODEL_SIZES, ModelConfig, Transformer, model_config
from ringattn.train.progress import JsonLog, ProgressBar

__all__ = ["TrainConfig", "run_train", "train_loop", "train_worker"]

DTYPES = ("float32", "bfloat16")


@dataclass
class TrainConfig:
    """What `ringattn train` runs; each field is the flag of the same name (kebab-case)."""

    model: str = "small"
    """Model size preset: tiny, small, base, large (see model.MODEL_SIZES)."""
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
    loss_chunk: int = 4096
    """Tokens per chunk of the output projection + loss (0 = all at once)."""
    dtype: str = "float32"
    """Compute dtype: float32, or bfloat16 (float32 master weights and gradient reduction)."""
    timeout_s: float = 600.0
    """Process-group timeout: a dead peer turns into an error after at most this long."""
    memory_warmup: bool = False
    """Run one throwaway step of a tiny model before measuring memory (keeps code pages out)."""
    fail_at_step: int = -1
    """Testing only: rank `fail_rank` kills itself (SIGKILL) when it reaches this step."""
    fail_rank: int = 0
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


def validate(cfg: TrainConfig, world_size: int) -> tuple[int, int]:
    """Raise ValueError (values and fix) before any process starts; return (dp, cp)."""
    if cfg.model not in MODEL_SIZES:
        raise ValueError(f"unknown --model {cfg.model!r}; choose from {', '.join(MODEL_SIZES)}")
    cfg.model_config()
    if cfg.dtype not in DTYPES:
        raise ValueError(f"unknown --dtype {cfg.dtype!r}; choose from {', '.join(DTYPES)}")
    if world_size < 1:
        raise ValueError(f"--nproc must be >= 1, got {world_size}")
    dp, cp = degrees(world_size, cfg.dp, cfg.cp)
    chunks = cp * get_layout(cfg.layout).chunks_per_rank
    if cfg.seq_len % chunks:
        fixed = -(-cfg.seq_len // chunks) * chunks
        raise ValueError(
            f"--seq-len {cfg.seq_len} is not divisible by {chunks} ({cfg.layout} layout on cp={cp} "
            f"ranks); use {fixed}"
        )
    if cfg.strategy == "hybrid" and not (cfg.ulysses > 0 and cp % cfg.ulysses == 0):
        raise ValueError(
            f"--strategy hybrid needs --ulysses U, a divisor of cp={cp} (Ulysses "
            f"inside groups of U ranks, a ring across them); got {cfg.ulysses}"
        )
    for name in ("steps", "batch_size"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.fail_at_step >= 0 and not 0 <= cfg.fail_rank < world_size:
        raise ValueError(f"--fail-rank {cfg.fail_rank} is not a rank of {world_size}")
    get_dataset(cfg.data, cfg.seq_len, cfg.seed, cfg.keys, cfg.copies, cfg.noisy)  # its own checks
    return dp, cp


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine from lr to lr/10: a pure function of the step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@dataclass
class Run:
    """What `train_loop` leaves: the trained model and optimizer, the mesh, rank 0's history."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    mesh: Mesh
    history: list[dict] = field(default_factory=list)
    start_step: int = 0
    checkpoint: str | None = None
    memory_method: str = ""
    baseline_mb: list[float] = field(default_factory=list)
    """Each rank's resident memory when the tracker started (CPU; 0 on CUDA)."""

    def summary(self) -> dict:
        return {
            "history": self.history, "start_step": self.start_step,
            "checkpoint": self.checkpoint, "memory_method": self.memory_method,
            "baseline_mb": self.baseline_mb,
            "dp": self.mesh.dp, "cp": self.mesh.cp,
            "rank": dist.get_rank() if dist.is_initialized() else 0,
        }  # fmt: skip


def _build(cfg: TrainConfig, mcfg: ModelConfig, mesh: Mesh, device: torch.device):
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank and every world size
    model = Transformer(mcfg).to(device)
    model.loss_chunk = cfg.loss_chunk
    param_dtype = None if cfg.dtype == "float32" else getattr(torch, cfg.dtype)
    model = parallelize(
        model, mesh, layout=cfg.layout, strategy=cfg.strategy,
        checkpoint_blocks=cfg.activation_checkpointing, param_dtype=param_dtype,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    return model, optimizer


def _warm_up(cfg: TrainConfig, mesh: Mesh, device: torch.device) -> None:
    """One step of a tiny model through the same code paths, then freed: loads kernels' code
    pages and creates communication buffers before the memory baseline is taken."""
    tiny = ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1)
    model, optimizer = _build(cfg, tiny, mesh, device)
    tokens = torch.zeros(1, 8 * mesh.cp, dtype=torch.int64)
    batch = shard_batch(tokens, tokens, mesh.cp_group, cfg.layout, device)
    loss, _, _ = model(batch.inputs, batch.positions, batch.labels)
    loss.backward()
    optimizer.step()
    del model, optimizer, loss
    if dist.is_initialized():
        dist.barrier()


def _all_reduce(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def _all_gather(value: float, device: torch.device) -> list[float]:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if not dist.is_initialized():
        return [value]
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [x.item() for x in out]


def _check_compatible(cfg: TrainConfig, state: dict, path: str) -> None:
    saved = state.get("config", {})
    keys = ("model", "dim", "layers", "heads", "kv_heads", "data", "seq_len", "seed", "keys",
            "copies", "noisy")  # fmt: skip
    diff = [f"{k}: {saved.get(k)!r} there, {getattr(cfg, k)!r} now" for k in keys
            if k in saved and saved[k] != getattr(cfg, k)]  # fmt: skip
    if diff:
        raise ValueError(
            f"the checkpoint {path} is from a different run ({'; '.join(diff)}); use another "
            f"--checkpoint-dir, --no-resume, or the same flags"
        )


def forward_backward(
    model: torch.nn.Module, batch: Batch, device: torch.device
) -> tuple[float, float, float]:
    """Loss and gradients of the global batch's mean token loss; returns the global (loss sum,
    supervised tokens, right predictions), each summed over every rank of the mesh.

    Each rank backpropagates its SUM of token losses divided by the GLOBAL count; FSDP then sums
    the gradients over all ranks, which gives the gradient of the global mean exactly, however
    unequally the supervised tokens are spread over the ranks.
    """
    loss_sum, count, correct = model(batch.inputs, batch.positions, batch.labels)
    total_loss, total_count, total_correct = _all_reduce(
        [loss_sum.item(), count.item(), correct.item()], device
    )
    (loss_sum / max(total_count, 1.0)).backward()
    return total_loss, total_count, total_correct


def train_loop(cfg: TrainConfig, device: torch.device) -> Run:
    """The per-rank training loop. Needs the default process group (or none: one process)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    validate(cfg, world_size)
    mesh = build_mesh(device, cfg.dp, cfg.cp, cfg.ulysses if cfg.strategy == "hybrid" else 0)
    if cfg.memory_warmup:
        _warm_up(cfg, mesh, device)
    memory = Meter(device).start()
    baselines = _all_gather(memory.baseline_mb, device)
    model, optimizer = _build(cfg, cfg.model_config(), mesh, device)
    run = Run(model, optimizer, mesh, memory_method=memory.method, baseline_mb=baselines)
    resume_from = ckpt.latest(cfg.checkpoint_path) if cfg.resume else None
    if resume_from is not None:
        _check_compatible(cfg, ckpt.read_state(resume_from), resume_from)
        run.start_step = ckpt.load(resume_from, model, optimizer)["step"]
    dataset = get_dataset(cfg.data, cfg.seq_len, cfg.seed, cfg.keys, cfg.copies, cfg.noisy)
    lead = rank == 0
    log = JsonLog(cfg.log_path) if lead else None
    last_step = min(cfg.steps, cfg.stop_at) if cfg.stop_at > 0 else cfg.steps
    bar = ProgressBar(last_step, cfg.log_every) if lead and not cfg.quiet else None
    tokens_per_step = cfg.seq_len * cfg.batch_size * mesh.dp
    if log:
        log.write({
            "event": "start", "step": run.start_step, "resumed_from": resume_from,
            "world_size": world_size, "dp": mesh.dp, "cp": mesh.cp, "device": str(device),
            "torch": torch.__version__, "machine": platform.node(), "memory": memory.method,
            "baseline_mb": baselines,
            "config": asdict(cfg),
        })  # fmt: skip
    if bar and resume_from:
        bar.write(f"resumed from {resume_from} at step {run.start_step}")
    for step in range(run.start_step, last_step):
        if step == cfg.fail_at_step and rank == cfg.fail_rank:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash, as abrupt as a real one
        t0 = time.perf_counter()
        inputs, labels = global_batch(dataset, step, cfg.batch_size, mesh.dp_rank, mesh.dp)
        batch = shard_batch(inputs, labels, mesh.cp_group, cfg.layout, device)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        total_loss, total_count, total_correct = forward_backward(model, batch, device)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        done = step + 1
        peaks = _all_gather(memory.peak_so_far_mb(), device)
        record = {
            "step": done, "loss": total_loss / max(total_count, 1.0),
            "accuracy": total_correct / max(total_count, 1.0), "tokens": tokens_per_step,
            "supervised": int(total_count), "lr": learning_rate(cfg, step),
            "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor")
                               else grad_norm),
            "seconds": seconds, "tokens_per_s": tokens_per_step / seconds, "peak_mb": peaks,
        }  # fmt: skip
        if lead:
            run.history.append(record)
            log.write(record)
            if bar:
                bar.update(done, record["loss"], record["accuracy"], record["tokens_per_s"],
                           peaks)  # fmt: skip
        every = cfg.checkpoint_every
        if every >= 0 and (done == last_step or (every and done % every == 0)):
            state = {"step": done, "config": asdict(cfg), "world_size": world_size}
            run.checkpoint = ckpt.save(
                cfg.checkpoint_path, done, model, optimizer, state, keep=cfg.keep
            )
    if log:
        log.write({"event": "end", "step": last_step, "checkpoint": run.checkpoint})
    if bar:
        bar.close()
    return run


def train_worker(cfg: TrainConfig) -> dict:
    """Entry point of each launched rank."""
    device = init_distributed(timeout_s=cfg.timeout_s)
    summary = train_loop(cfg, device).summary()
    dist.destroy_process_group()
    return summary


def run_train(cfg: TrainConfig) -> dict:
    """`ringattn train`: launch the ranks (or join torchrun's world); return rank 0's summary."""
    world_size = int(os.environ["WORLD_SIZE"]) if running_under_torchrun() else cfg.nproc
    validate(cfg, world_size)
    os.makedirs(cfg.out_dir, exist_ok=True)
    if running_under_torchrun():
        return train_worker(cfg)
    try:
        return launch(train_worker, cfg.nproc, cfg)[0]
    except LaunchError as err:
        last = ckpt.latest(cfg.checkpoint_path)
        hint = (
            (
                f"the newest complete checkpoint is {last}; run the same command again to resume "
                f"from it"
            )
            if last
            else "no checkpoint was completed; a rerun starts afresh"
        )
        raise LaunchError(f"{err}\n{hint}") from None
