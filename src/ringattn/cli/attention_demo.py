"""`ringattn demo`: one long sequence on W local processes, checked against one process.

    parent                               rank r of W (spawned by launch.py, or torchrun's ranks)
    ------                               ------------------------------------------------------
    launch(demo_rank, W)  ------------>  full q, k, v, dout from the seed; keep shard(x)[r]
                                         forward + backward of ringattn.attention, timed,
                                           peak memory measured above the sharded inputs
                                         unshard out, dq, dk, dv; rank 0 saves them
    single-process SDPA on the full  <-  per-rank stats
    tensors (float32; float64 for float64 input), with all the cores,
    then errors, gates and the verdict

The single-process reference runs in the parent after the ranks have exited, so it neither competes
with them for cores nor sits inside a process-group timeout. It uses the fused SDPA, which on CPU
is a flash kernel that never materialises the S x S scores: 64k tokens fit in memory.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringattn.api import attention, shard, unshard
from ringattn.cli.check import DTYPES
from ringattn.runtime.launch import init_distributed, launch, running_under_torchrun
from ringattn.runtime.meter import Meter
from ringattn.testing import yardstick as ref

GRADS = ("dq", "dk", "dv")


@dataclass
class DemoConfig:
    """What `ringattn demo` runs; every field but timeout_s is a CLI flag of the same name."""

    nproc: int = 4
    seq_len: int = 65536
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 64
    dtype: str = "float32"
    layout: str = "zigzag"
    strategy: str = "ring"
    causal: bool = True
    backend: str = "auto"
    seed: int = 0
    timeout_s: float = 1800.0
    """Process-group timeout; long, since one ring step on CPU takes seconds at 64k tokens."""


def make_inputs(cfg: DemoConfig) -> list[torch.Tensor]:
    """Full q (1, H, S, D), k, v (1, Hkv, S, D) and dout (1, H, S, D) on CPU, from the seed."""
    gen = torch.Generator().manual_seed(cfg.seed)
    dtype = getattr(torch, cfg.dtype)
    heads = (cfg.heads, cfg.kv_heads, cfg.kv_heads, cfg.heads)
    return [
        torch.randn(1, h, cfg.seq_len, cfg.head_dim, generator=gen, device="cpu").to(dtype)
        for h in heads
    ]


# Seconds in progress lines count from the parent's start; spawned ranks inherit it.
_START_ENV = "RINGATTN_DEMO_START"


def _say(text: str) -> None:
    """Progress line from the parent or rank 0, stamped with seconds since the demo started."""
    if os.environ.get("RANK", "0") == "0":
        start = float(os.environ.get(_START_ENV, time.time()))
        print(f"[demo {time.time() - start:6.1f}s] {text}", flush=True)


def _warm_up(fn, *tensors: torch.Tensor, tokens: int = 16) -> None:
    """Run fwd+bwd once on the first `tokens` of each tensor, so the measured run does not pay
    for first-call costs: lazily loaded kernel code pages (tens of MB of RSS), allocator setup."""
    q, k, v, dout = (x[:, :, :tokens].detach() for x in tensors)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    fn(q, k, v).backward(dout)


def demo_rank(cfg: DemoConfig, save_dir: str | None) -> list[dict]:
    """One rank's part; returns every rank's stats (all ranks get the same list)."""
    device = init_distributed(timeout_s=cfg.timeout_s)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    kw = {"layout": cfg.layout}
    full = make_inputs(cfg)
    q, k, v, dout = (shard(x.to(device), 2, **kw) for x in full)  # (1, H, S/W, D)
    del full  # each rank keeps only its shard: the memory baseline is the sharded inputs
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))

    def ring(q, k, v):
        return attention(
            q, k, v, causal=cfg.causal, layout=cfg.layout, strategy=cfg.strategy,
            backend=cfg.backend,
        )  # fmt: skip

    _warm_up(ring, q, k, v, dout)
    _say(f"{world_size} rank(s) ready, {q.shape[2]} tokens each; forward...")
    dist.barrier()
    with Meter(device) as memory:
        with Meter(device, memory=False) as fwd:
            out = ring(q, k, v)
        _say(f"forward done on rank 0 in {fwd.seconds:.1f} s; backward...")
        with Meter(device, memory=False) as bwd:
            out.backward(dout)
    # Numbers travel as a tensor: all_gather_object would need numpy, which torch does not.
    mine = [q.shape[2], fwd.seconds, bwd.seconds, memory.peak_mb]
    mine = torch.tensor(mine, dtype=torch.float64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(rows, mine)
    everyone = [
        {"rank": r, "tokens": int(row[0]), "fwd_s": row[1].item(), "bwd_s": row[2].item(),
         "peak_mb": row[3].item(), "memory": memory.method, "device": str(device)}
        for r, row in enumerate(rows)
    ]  # fmt: skip
    _say("backward done; gathering out, dq, dk, dv")
    tensors = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    gathered = {name: unshard(t.detach(), 2, **kw).cpu() for name, t in tensors.items()}
    if rank == 0 and save_dir is not None:
        torch.save(gathered, os.path.join(save_dir, "ring.pt"))
    dist.barrier()
    return everyone


def _single_process(cfg: DemoConfig, device: torch.device) -> tuple[ref.Result, dict]:
    """Monolithic SDPA on the full tensors, in float32 (float64 for float64 input)."""
    ref_dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    q, k, v, dout = (x.to(device, ref_dtype) for x in make_inputs(cfg))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    group = cfg.heads // cfg.kv_heads

    def sdpa(q, k, v):
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (1, H, S, D)
        return F.scaled_dot_product_attention(q, k, v, is_causal=cfg.causal)  # (1, H, S, D)

    _warm_up(sdpa, q, k, v, dout)
    with Meter(device) as memory:
        with Meter(device, memory=False) as fwd:
            out = sdpa(q, k, v)
        with Meter(device, memory=False) as bwd:
            out.backward(dout)
    stats = {"rank": "1 proc", "tokens": cfg.seq_len, "fwd_s": fwd.seconds, "bwd_s": bwd.seconds}
    stats["peak_mb"] = memory.peak_mb
    result = ref.Result(out.detach().cpu(), None, q.grad.cpu(), k.grad.cpu(), v.grad.cpu())
    return result, stats


def _judge(cfg: DemoConfig, ring: dict, expected: ref.Result, device) -> list[dict]:
    """Errors of the ring results against the reference, with the gate applied to each."""
    dtype = getattr(torch, cfg.dtype)
    baseline = None
    if dtype in ref.LOW_PRECISION:
        _say(f"low precision: single-process SDPA in {cfg.dtype} as the yardstick...")
        q, k, v, dout = (x.to(device) for x in make_inputs(cfg))
        baseline = ref.sdpa_attention(q, k, v, dout, causal=cfg.causal)
    rows = []
    for name in ("out", *GRADS):
        want = getattr(expected, name)
        err = ref.compare(ring[name], want)
        row = {"quantity": name, "max_err": err.max, "mean_err": err.mean}
        if baseline is None:
            atol, rtol = ref.tolerance(dtype, name)
            passed, worst = ref.allclose_gate(ring[name], want, atol, rtol)
            row["gate"] = f"|err| <= {atol:g} + {rtol:g}*|ref|"
        else:
            base = ref.compare(getattr(baseline, name).cpu(), want)
            passed, worst = ref.relative_gate(err, base)
            row["gate"] = (
                f"max <= {ref.MAX_RATIO}x {base.max:.1e}, mean <= {ref.MEAN_RATIO}x {base.mean:.1e}"
            )
        row.update(passed=passed, worst=worst)
        rows.append(row)
    return rows


def _print_tables(cfg: DemoConfig, stats: list[dict], errors: list[dict]) -> None:
    print(f"\n{'rank':>6} {'tokens':>8} {'fwd s':>8} {'bwd s':>8} {'peak MB':>9}")
    for s in stats:
        print(
            f"{s['rank']:>6} {s['tokens']:>8} {s['fwd_s']:>8.2f} {s['bwd_s']:>8.2f} "
            f"{s['peak_mb']:>9.1f}"
        )
    print(f"peak MB: {stats[0]['memory']} of fwd+bwd (the inputs are not counted)")
    ring_peak = max(s["peak_mb"] for s in stats[:-1])
    if stats[-1]["peak_mb"] > 0:
        print(f"largest rank peak = {ring_peak / stats[-1]['peak_mb']:.2f}x the single process's")
    width = max(len(e["gate"]) for e in errors)
    print(f"\n{'':<4} {'max err':>9} {'mean err':>9}  {'gate':<{width}} verdict")
    for e in errors:
        verdict = f"{'PASS' if e['passed'] else 'FAIL'} ({e['worst']:.2f} of allowed)"
        errs = f"{e['max_err']:>9.2e} {e['mean_err']:>9.2e}"
        print(f"{e['quantity']:<4} {errs}  {e['gate']:<{width}} {verdict}")


def validate(cfg: DemoConfig) -> None:
    """Raise ValueError with the values and the fix, before any process is started."""
    if cfg.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {cfg.dtype!r}; choose from {', '.join(DTYPES)}")
    if cfg.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {cfg.nproc}")
    if cfg.kv_heads < 1 or cfg.heads % cfg.kv_heads:
        raise ValueError(f"--heads {cfg.heads} must be a multiple of --kv-heads {cfg.kv_heads}")
    # Each rank checks this too; checking here saves launching W processes to hear it.
    chunks = 2 * cfg.nproc if cfg.layout == "zigzag" else cfg.nproc
    if cfg.seq_len % chunks:
        size = -(-cfg.seq_len // chunks) * chunks
        raise ValueError(
            f"--seq-len {cfg.seq_len} is not divisible by {chunks} ({cfg.layout} layout on "
            f"{cfg.nproc} ranks); use {size}"
        )


def run_demo(cfg: DemoConfig, json_path: str | None = None) -> int:
    """Run the demo end to end; return the exit code (0 when every gate passes)."""
    validate(cfg)
    os.environ[_START_ENV] = str(time.time())  # inherited by the spawned ranks
    if running_under_torchrun():
        cfg.nproc = int(os.environ["WORLD_SIZE"])
    tokens = cfg.seq_len // cfg.nproc
    _say(
        f"{cfg.seq_len} tokens over {cfg.nproc} rank(s) = {tokens} per rank; "
        f"q {cfg.heads} heads, k/v {cfg.kv_heads} heads, head dim {cfg.head_dim}, {cfg.dtype}, "
        f"{'causal' if cfg.causal else 'full'}, layout {cfg.layout}, strategy {cfg.strategy}, "
        f"backend {cfg.backend}"
    )
    with tempfile.TemporaryDirectory(prefix="ringattn-demo-") as tmp:
        if running_under_torchrun():
            stats = demo_rank(cfg, tmp)
            if os.environ["RANK"] != "0":
                return 0
        else:
            _say(f"launching {cfg.nproc} local process(es)...")
            stats = launch(demo_rank, cfg.nproc, cfg, tmp)[0]
            _say("ranks finished")
        ring = torch.load(os.path.join(tmp, "ring.pt"))
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    _say(f"single-process reference (SDPA on all {cfg.seq_len} tokens, {device})...")
    expected, single = _single_process(cfg, device)
    errors = _judge(cfg, ring, expected, device)
    _print_tables(cfg, [*stats, single], errors)
    passed = all(e["passed"] for e in errors)
    print(f"\n{'PASS' if passed else 'FAIL'}: ring attention on {cfg.nproc} rank(s) vs 1 process")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"config": asdict(cfg), "ranks": stats, "single_process": single,
                       "errors": errors, "passed": passed}, f, indent=2)  # fmt: skip
        print(f"wrote {json_path}")
    return 0 if passed else 1
