"""`ringattn check`: the correctness matrix, against an independent float64 reference.

For each world size W (W local processes, or the current world under torchrun) and each
strategy x layout x causal x head shape (MHA, GQA, MQA) x dtype, every rank:

    full q, k, v, dout  = randn from a seed            (the same on every rank, independent of W)
    expected            = reference_attention(...)     float64, explicit mask, autograd grads
    q_local, ...        = shard(full, 2, layout)       and checks shard == full[..., positions, :]
    out, lse            = attention(q_local, ...), then out.backward(shard(dout))
    errors              = |actual - expected[..., positions, :]| for out, lse, dq, dk, dv

The ranks all-reduce their errors (max of maxima, mean of means: shards are equal-sized), so every
rank holds the same row and the same verdict; rank 0 prints it. Gates are those of
`ringattn.reference`: absolute for float64/float32, relative to single-device SDPA in the same dtype
for bfloat16/float16.

Not every strategy takes every case (Ulysses splits heads, so it needs heads % W == 0). A case that
every rank refuses before communicating is reported, not failed: N/A for a ValueError (the library
says why), SKIP for NotImplementedError (not built yet). Ranks that disagree are a FAIL. The hybrid
strategy runs on a 2-D DeviceMesh ("ulysses", "ring") as close to square as the heads allow.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ringattn.api import STRATEGIES, attention, positions, shard
from ringattn.comm import group_cache
from ringattn.kernels import BACKENDS
from ringattn.layout import LAYOUTS
from ringattn.runtime.launch import LaunchError, init_distributed, launch, running_under_torchrun
from ringattn.testing import yardstick as ref

# name -> (query heads, kv heads)
HEAD_SHAPES = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}
QUANTITIES = ("out", "lse", "dq", "dk", "dv")
DTYPES = ("float64", "float32", "bfloat16", "float16")
STATUSES = ("PASS", "FAIL", "N/A", "SKIP")


@dataclass
class CheckConfig:
    """What `ringattn check` runs; every field is a CLI flag."""

    world_sizes: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    dtypes: list[str] = field(default_factory=lambda: ["float64", "float32", "bfloat16"])
    layouts: list[str] = field(default_factory=lambda: ["contiguous", "zigzag", "striped"])
    strategies: list[str] = field(default_factory=lambda: ["ring"])
    seq_local: int = 32
    """Tokens per rank; the full sequence is seq_local * W."""
    head_dim: int = 40
    """Not a power of two on purpose."""
    batch: int = 2
    backend: str = "auto"
    seed: int = 0
    timeout_s: float = 120.0
    """Process-group timeout: a hung collective fails after this long."""


@dataclass
class Row:
    """One case of the matrix and its verdict."""

    world_size: int
    strategy: str
    layout: str
    causal: bool
    heads: str
    dtype: str
    errors: dict[str, tuple[float, float]] = field(default_factory=dict)
    status: str = "PASS"
    """PASS, FAIL, N/A (the library refused the case with a reason) or SKIP (not built yet)."""
    worst: float = 0.0
    """Worst error as a fraction of what its gate allows (1.0 is the limit)."""
    note: str = ""


def _inputs(cfg: CheckConfig, seq_len: int, heads: str, dtype: torch.dtype, device):
    """Full q, k, v, dout from randn: float64 draws, rounded once to `dtype`."""
    num_q, num_kv = HEAD_SHAPES[heads]
    seed = zlib.crc32(f"{cfg.seed}/{seq_len}/{heads}".encode())
    gen = torch.Generator().manual_seed(seed)
    shapes = [(cfg.batch, h, seq_len, cfg.head_dim) for h in (num_q, num_kv, num_kv, num_q)]
    return [
        torch.randn(s, generator=gen, dtype=torch.float64, device="cpu").to(device, dtype)
        for s in shapes
    ]


@dataclass
class _Local:
    """One rank's outcome of one case, before the ranks pool theirs."""

    refused: int = 0
    """0 ran, 1 NotImplementedError, 2 ValueError."""
    shard_mismatch: bool = False
    maxes: list[float] = field(default_factory=lambda: [0.0] * len(QUANTITIES))
    means: list[float] = field(default_factory=lambda: [0.0] * len(QUANTITIES))
    ratios: list[float] = field(default_factory=lambda: [0.0] * len(QUANTITIES))
    """allclose worst ratio per quantity (float64/float32; 0 for low precision)."""


def _run_local(cfg, row: Row, full, expected: ref.Result, dtype, device, group) -> _Local:
    """Shard, run fwd+bwd on this rank, and measure this rank's errors."""
    seq_len = full[0].shape[2]
    kw = {"layout": row.layout, "group": group}
    try:
        pos = positions(seq_len, device=device, **kw)
        q, k, v, dout = (shard(x, 2, **kw) for x in full)
        mismatch = not torch.equal(q, full[0].index_select(2, pos))
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        out, lse = attention(
            q, k, v, causal=row.causal, strategy=row.strategy, backend=cfg.backend,
            return_lse=True, **kw,
        )  # fmt: skip
    except (ValueError, NotImplementedError) as err:
        row.note = f"{type(err).__name__}: {err}"
        return _Local(refused=1 if isinstance(err, NotImplementedError) else 2)
    out.backward(dout)
    actual = {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    local = _Local(shard_mismatch=mismatch)
    for i, name in enumerate(QUANTITIES):
        want = getattr(expected, name).index_select(2, pos)
        err = ref.compare(actual[name], want)
        local.maxes[i], local.means[i] = err.max, err.mean
        if dtype not in ref.LOW_PRECISION:  # low precision is judged after pooling
            local.ratios[i] = ref.allclose_gate(actual[name], want, *ref.tolerance(dtype, name))[1]
    return local


def _run_case(cfg, row: Row, full, expected, baseline, dtype, device, group) -> Row:
    """Run one case on every rank, pool the errors, and fill in the row's verdict."""
    local = _run_local(cfg, row, full, expected, dtype, device, group)
    n = len(QUANTITIES)
    # One MAX and one SUM reduction per case on every rank, whatever happened locally, so the
    # collectives stay matched. -refused under MAX gives the minimum: did *all* ranks refuse?
    peak = [local.refused, -local.refused, local.shard_mismatch, *local.maxes, *local.ratios]
    peak = torch.tensor(peak, dtype=torch.float64, device=device)
    total = torch.tensor(local.means, dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    most, least = peak[0].item(), -peak[1].item()
    if most > 0:
        row.status = {1: "SKIP", 2: "N/A"}[int(most)] if most == least else "FAIL"
        if most != least:
            here = f"raised {row.note}" if row.note else "ran the case"
            row.note = f"ranks disagree on refusing the case; this rank {here}"
        return row
    maxes, ratios = peak[3 : 3 + n].tolist(), peak[3 + n :].tolist()
    means = (total / dist.get_world_size()).tolist()  # shards are equal-sized
    row.errors = {name: (maxes[i], means[i]) for i, name in enumerate(QUANTITIES)}
    if dtype in ref.LOW_PRECISION:
        for i, name in enumerate(QUANTITIES):
            ratios[i] = ref.relative_gate(ref.Errors(maxes[i], means[i]), baseline[name])[1]
    row.worst = max(ratios)
    row.status = "PASS" if row.worst <= 1.0 else "FAIL"
    if peak[2].item() > 0:
        row.status, row.note = "FAIL", "shard() disagrees with x[..., positions(), :]"
    return row


def _hybrid_mesh(device: torch.device, world_size: int, num_heads: int):
    """A ("ulysses", "ring") DeviceMesh: the ulysses size divides the heads, the shape is as square
    as that allows (ties go to the larger ulysses size, which communicates less)."""
    sizes = [u for u in range(1, world_size + 1) if world_size % u == 0 and num_heads % u == 0]
    ulysses = min(sizes, key=lambda u: (abs(u - world_size // u), -u))
    shape = (ulysses, world_size // ulysses)
    return group_cache.device_mesh(device.type, shape, ("ulysses", "ring"))  # once per process


def _baseline(full, expected: ref.Result, causal: bool) -> dict[str, ref.Errors]:
    """Errors of single-device SDPA in the inputs' dtype against the float64 reference."""
    q, k, v, dout = full
    sdpa = ref.sdpa_attention(q, k, v, dout, causal=causal, with_lse=True)
    return {name: ref.compare(getattr(sdpa, name), getattr(expected, name)) for name in QUANTITIES}


def _fmt(err: tuple[float, float]) -> str:
    return f"{err[0]:.1e}/{err[1]:.0e}"


HEADER = (
    f"{'W':>2} {'strategy':<9} {'layout':<10} {'causal':<6} {'heads':<5} {'dtype':<8} "
    + " ".join(f"{name + ' max/mean':<15}" for name in QUANTITIES)
    + " verdict"
)


def format_row(row: Row) -> str:
    cells = " ".join(f"{_fmt(row.errors[n]) if row.errors else '-':<15}" for n in QUANTITIES)
    verdict = f"{row.status} {row.worst:.2f}" if row.errors else row.status
    line = (
        f"{row.world_size:>2} {row.strategy:<9} {row.layout:<10} {row.causal!s:<6} "
        f"{row.heads:<5} {row.dtype:<8} {cells} {verdict}"
    )
    note = row.note
    if row.status in ("N/A", "SKIP") and len(note) > 60:
        note = note[:57] + "..."  # the summary prints each reason in full, once
    return line + (f"  ({note})" if note else "")


def check_rank(cfg: CheckConfig) -> list[Row]:
    """Run the whole matrix for the current world on this rank; every rank returns the same rows."""
    device = init_distributed(timeout_s=cfg.timeout_s)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows = []
    seq_len = cfg.seq_local * world_size
    meshes = {}
    if "hybrid" in cfg.strategies:  # every rank builds the same meshes, in the same order
        meshes = {
            heads: _hybrid_mesh(device, world_size, hq) for heads, (hq, _) in HEAD_SHAPES.items()
        }
    for causal in (False, True):
        for heads in HEAD_SHAPES:
            for dtype_name in cfg.dtypes:
                dtype = getattr(torch, dtype_name)
                full = _inputs(cfg, seq_len, heads, dtype, device)
                expected = ref.reference_attention(*full[:3], full[3], causal=causal)
                low = dtype in ref.LOW_PRECISION
                baseline = _baseline(full, expected, causal) if low else None
                for strategy in cfg.strategies:
                    group = meshes[heads] if strategy == "hybrid" else None
                    for layout in cfg.layouts:
                        row = Row(world_size, strategy, layout, causal, heads, dtype_name)
                        args = (full, expected, baseline, dtype, device, group)
                        row = _run_case(cfg, row, *args)
                        rows.append(row)
                        if rank == 0:
                            print(format_row(row), flush=True)
    dist.barrier()
    return rows


def validate(cfg: CheckConfig) -> None:
    """Raise ValueError, listing the choices, for any unknown name, before launching anything."""

    for kind, names, choices in (
        ("layout", cfg.layouts, LAYOUTS),
        ("strategy", cfg.strategies, STRATEGIES),
        ("dtype", cfg.dtypes, DTYPES),
        ("backend", [cfg.backend], BACKENDS),
    ):
        for name in names:
            if name not in choices:
                raise ValueError(f"unknown {kind} {name!r}; choose from {', '.join(choices)}")
    if not cfg.world_sizes or any(w < 1 for w in cfg.world_sizes):
        raise ValueError(f"world sizes must be positive ints, got {cfg.world_sizes}")
    if cfg.seq_local < 2 or cfg.seq_local % 2:
        raise ValueError(f"seq_local must be even and >= 2 (zigzag halves), got {cfg.seq_local}")


def run_check(cfg: CheckConfig) -> int:
    """Run the matrix (launching W local processes per world size); return the exit code."""
    validate(cfg)
    if not _is_rank0():
        return _summary(check_rank(cfg), [])
    print(
        f"ringattn check: seq_local={cfg.seq_local} head_dim={cfg.head_dim} batch={cfg.batch} "
        f"backend={cfg.backend}; gates: fp64 atol=rtol=1e-9, fp32 out/lse 2e-5/1e-5 and grads "
        f"1e-4/1e-4, bf16/fp16 max <= {ref.MAX_RATIO}x and mean <= {ref.MEAN_RATIO}x single-device "
        "SDPA's error (verdict number: worst error / allowed, 1.00 = limit)",
        flush=True,
    )
    rows: list[Row] = []
    crashed: list[str] = []
    if running_under_torchrun():
        _print_header()
        rows = check_rank(cfg)
    else:
        for world_size in cfg.world_sizes:
            print(f"-- launching {world_size} process(es)", flush=True)
            _print_header()
            try:
                rows += launch(check_rank, world_size, cfg)[0]
            except LaunchError as err:
                print(f"FAIL: world size {world_size} crashed:\n{err}", flush=True)
                crashed.append(str(world_size))
    return _summary(rows, crashed)


def _is_rank0() -> bool:
    """True in the launching process and on rank 0 of a torchrun world (the ones that print)."""
    return os.environ.get("RANK", "0") == "0" or not running_under_torchrun()


def _print_header() -> None:
    if _is_rank0():
        print(HEADER, flush=True)


def _summary(rows: list[Row], crashed: list[str]) -> int:
    counts = {status: sum(r.status == status for r in rows) for status in STATUSES}
    failed = counts["FAIL"] + len(crashed)
    if _is_rank0():
        for row in rows:
            if row.status == "FAIL":
                print("FAILED: " + format_row(row))
        if crashed:
            print(f"FAILED: world sizes {', '.join(crashed)} crashed (see above)")
        for status in ("N/A", "SKIP"):
            for reason in sorted({r.note for r in rows if r.status == status}):
                print(f"{status}: {reason}")
        extra = f", {counts['N/A']} not applicable" if counts["N/A"] else ""
        print(f"{counts['PASS']} passed, {failed} failed, {counts['SKIP']} skipped{extra}")
    return 0 if failed == 0 and counts["PASS"] > 0 else 1
