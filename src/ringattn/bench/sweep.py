"""`ringattn bench`: one rank's share of a W-way ring against monolithic attention, one device.

For each configuration (mask, heads, W, tokens per rank n; global sequence S = W * n):

    monolithic   F.scaled_dot_product_attention over all S tokens, per SDPA backend
                 (CUDA: cudnn and flash via torch.nn.attention.sdpa_kernel; CPU: the CPU flash op)
    ring         emulate.py: rank r's share of the W-way ring on the same device (its W steps of
                 block kernels and merges; K/V transfers as device copies on a side stream), for
                 the first and the last rank (zigzag gives them the two extreme block shapes)
    efficiency   (monolithic time / W) / ring time of the slower timed rank; 1.0 = the ring costs
                 nothing over a perfect split of the monolithic kernel

forward and forward+backward, timed with CUDA events (CPU: perf_counter) after warm-up, medians
of repeats, in one process, so every number is a ratio measured on the same device in the same run
(absolute CPU times are noise: read the ratios). FLOPs: forward 4*B*Hq*S*S*D, halved when causal;
backward 2.5x forward. Memory: the peak of tensor bytes one call adds (CUDA allocator; CPU the
profiler's allocation events) plus the inputs a process holds (all S tokens for the monolithic run,
one shard and its travelling dK/dV partial for a rank), for fwd+bwd. The ring's
out is compared with the monolithic out (max abs difference) so a fast wrong result shows.

Results print as a table and go to JSON (machine, versions, date, command, config, rows) and, when
matplotlib imports, a PNG of efficiency against tokens per rank. `--million` runs bench_million.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from ringattn.bench.common import (
    PASSES,
    attention_flops,
    format_table,
    header,
    peak_mb,
    resolve_device,
    tensor_mb,
    time_interleaved,
    write_json,
    write_plot,
)
from ringattn.bench.packed import format_packed, packed_rows
from ringattn.kernels.triton_merge import merge_fused_, triton_merge_
from ringattn.layout import get_layout
from ringattn.merge import merge_
from ringattn.testing import emulated as emulate

MERGES = {"auto": merge_fused_, "torch": merge_, "triton": triton_merge_, "none": None}
SDPA_BACKENDS = {
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}
GPU_SIZES = [(8, 4096), (8, 8192), (4, 16384), (4, 32768), (2, 65536), (2, 131072)]
CPU_SIZES = [(4, 512), (4, 1024), (2, 2048)]
GPU_HEADS, CPU_HEADS = [(32, 32), (32, 8)], [(8, 8), (8, 2)]


@dataclass
class BenchConfig:
    """What `ringattn bench` runs; None fields take a per-device default (GPU: the H200 sweep of
    the issue, bf16; CPU: small sizes, float32)."""

    sizes: list[tuple[int, int]] | None = None
    """(world size W, tokens per rank n) pairs."""
    heads: list[tuple[int, int]] | None = None
    """(query heads, key/value heads) pairs; GPU 32:32 and 32:8 (GQA), CPU 8:8 and 8:2."""
    head_dim: int | None = None
    masks: list[str] = field(default_factory=lambda: ["causal", "full"])
    passes: list[str] = field(default_factory=lambda: list(PASSES))
    layout: str = "zigzag"
    device: str = "auto"
    dtype: str | None = None
    backend: str = "auto"
    """Block kernel of the ring (kernels.py name or auto)."""
    baselines: list[str] | None = None
    """Monolithic SDPA backends (SDPA_BACKENDS names); CUDA: cudnn, flash; CPU: flash."""
    merge: str = "auto"
    ranks: str = "ends"
    """Ranks to time: ends (first and last), all, or comma-separated numbers."""
    warmup: int = 1
    repeats: int = 5
    batch: int = 1
    threads: int | None = None
    """CPU threads (torch.set_num_threads); default 1 on a CPU: on a shared machine an OpenMP
    team stalls whenever one of its cores is taken, which skews ratios; one thread does not."""
    seed: int = 0
    documents: int | None = None
    """Also run the packed case: the same tokens as this many documents (bench/packed.py)."""
    window: int | None = None
    """Also run (or run the packed case with) a sliding window of this many keys back."""
    json_path: str | None = None
    plot_path: str | None = None

    def resolve(self, device: torch.device) -> BenchConfig:
        """A copy with every per-device default filled in, checked."""
        cuda = device.type == "cuda"
        out = BenchConfig(**asdict(self))
        out.device = str(device)
        out.sizes = [tuple(s) for s in (self.sizes or (GPU_SIZES if cuda else CPU_SIZES))]
        out.heads = [tuple(h) for h in (self.heads or (GPU_HEADS if cuda else CPU_HEADS))]
        out.head_dim = self.head_dim or (128 if cuda else 64)
        out.dtype = self.dtype or ("bfloat16" if cuda else "float32")
        out.baselines = self.baselines or (["cudnn", "flash"] if cuda else ["flash"])
        out.threads = self.threads or (None if cuda else 1)
        if out.merge == "triton" and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "--merge triton runs the Triton kernel, which needs CUDA tensors here; on a CPU "
                "set TRITON_INTERPRET=1 (Triton's interpreter, slow) or use --merge auto"
            )
        _check(out)
        return out


def _check(cfg: BenchConfig) -> None:
    """ValueError with the values and the fix, before anything runs."""
    get_layout(cfg.layout)
    choices = {"masks": ("causal", "full"), "passes": PASSES, "baselines": tuple(SDPA_BACKENDS)}
    for name, allowed in choices.items():
        bad = [x for x in getattr(cfg, name) if x not in allowed]
        if bad:
            raise ValueError(f"unknown {name} {bad}; choose from {list(allowed)}")
    if cfg.merge not in MERGES:
        raise ValueError(f"unknown merge {cfg.merge!r}; choose one of {list(MERGES)}")
    chunks = get_layout(cfg.layout).chunks_per_rank
    for world_size, n in cfg.sizes:
        if world_size < 1 or n < 1 or n % chunks:
            raise ValueError(
                f"size {world_size}x{n}: need W >= 1 and tokens per rank a multiple of {chunks} "
                f"({cfg.layout} layout)"
            )
    for hq, hkv in cfg.heads:
        if hkv < 1 or hq % hkv:
            raise ValueError(f"heads {hq}:{hkv}: query heads must be a multiple of kv heads")
    if cfg.documents is not None and cfg.documents < 1:
        raise ValueError(f"--documents {cfg.documents}: need at least 1 document")
    if cfg.window is not None and cfg.window < 0:
        raise ValueError(f"--window {cfg.window}: need a window of 0 or more keys back")
    if cfg.repeats < 1 or cfg.warmup < 0:
        raise ValueError(f"need --repeats >= 1 and --warmup >= 0, got {cfg.repeats}, {cfg.warmup}")


# ---- monolithic SDPA -----------------------------------------------------------------------------


def sdpa_runner(backend: str, q, k, v, causal: bool) -> tuple[Callable, str]:
    """f(q, k, v) -> out through SDPA restricted to `backend`; GQA natively (enable_gqa) when the
    backend takes it, else K/V repeated. Returns (f, how GQA ran); raises RuntimeError when the
    backend cannot run the case at all."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = getattr(SDPBackend, SDPA_BACKENDS[backend])
    groups = q.shape[1] // k.shape[1]

    def native(q, k, v):
        with sdpa_kernel(kind):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=groups > 1)

    def repeated(q, k, v):
        k, v = (x.repeat_interleave(groups, 1) for x in (k, v))  # (B, Hq, S, D)
        with sdpa_kernel(kind):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    if groups == 1:
        native(q[:, :, :8], k[:, :, :8], v[:, :, :8])
        return native, "mha"
    try:
        native(q[:, :, :8], k[:, :, :8], v[:, :, :8])
        return native, "enable_gqa"
    except RuntimeError:
        repeated(q[:, :, :8], k[:, :, :8], v[:, :, :8])
        return repeated, "repeat_interleave"


# ---- one configuration ---------------------------------------------------------------------------


def _ranks(spec: str, world_size: int) -> list[int]:
    if spec == "ends":
        return sorted({0, world_size - 1})
    if spec == "all":
        return list(range(world_size))
    ranks = sorted({int(x) % world_size for x in spec.split(",") if x.strip()})
    if not ranks:
        raise ValueError(f"--ranks {spec!r}: give ends, all or comma-separated rank numbers")
    return ranks


def bench_one(
    cfg: BenchConfig, mask: str, hq: int, hkv: int, world_size: int, n: int, device
) -> list[dict]:
    """Rows (one per pass) for one configuration.

    Per pass, every candidate (each baseline, each timed rank) runs once per round, round after
    round, and each reports its median: a slow spell of the machine hits all of them alike.
    """
    causal, dtype, d, b = mask == "causal", getattr(torch, cfg.dtype), cfg.head_dim, cfg.batch
    seq_len = world_size * n
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    shapes = [(b, hq, seq_len, d), (b, hkv, seq_len, d), (b, hkv, seq_len, d), (b, hq, seq_len, d)]
    q, k, v, dout = (torch.randn(s, generator=gen, device=device, dtype=dtype) for s in shapes)
    shards = emulate.make_shards(get_layout(cfg.layout), world_size, q, k, v, dout)
    merge = MERGES[cfg.merge]
    call = emulate.make_call(
        cfg.layout, world_size, shards.q[0], shards.kv[0, 0], causal, cfg.backend, merge=merge
    )
    partials = emulate.new_partials(shards)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    ranks = _ranks(cfg.ranks, world_size)

    def ring_fwd(rank):
        return emulate.forward_share(call, shards, rank)

    def ring_fwd_bwd(rank):
        out, lse = ring_fwd(rank)
        emulate.backward_share(call, shards, rank, out, lse, partials)
        return emulate.finish_dkv(partials, rank, dtype)

    runners, mono = {}, {}
    for name in cfg.baselines:
        try:
            runners[name], gqa = sdpa_runner(name, q, k, v, causal)
            mono[name] = {"gqa": gqa}
        except RuntimeError as err:
            mono[name] = {"error": str(err).splitlines()[0][:200]}

    def mono_fwd_bwd(name):
        torch.autograd.grad(runners[name](*leaves), leaves, dout)

    diff = None  # the ring's out against the first baseline's
    if runners and merge is not None:
        reference = runners[next(iter(runners))](q, k, v)
        diff = max(
            (ring_fwd(r)[0].float() - reference.index_select(2, shards.index[r]).float())
            .abs().max().item()
            for r in ranks
        )  # fmt: skip
        del reference
    for name in runners:
        mono[name]["peak_mb"] = peak_mb(lambda name=name: mono_fwd_bwd(name), device)
        mono[name]["peak_mb"] += tensor_mb(q, k, v, dout)
    ring_peak = max(peak_mb(lambda r=r: ring_fwd_bwd(r), device) for r in ranks)
    ring_peak += tensor_mb(shards.q[0], shards.kv[0], shards.dout[0])
    ring_peak += emulate.partial_bytes(shards) / 2**20  # a real rank holds its partial
    first_peak = next((m["peak_mb"] for m in mono.values() if "peak_mb" in m), None)
    rows = []
    for pass_ in cfg.passes:
        fwd_only = pass_ == "fwd"
        ring_fn = ring_fwd if fwd_only else ring_fwd_bwd
        candidates = {("ring", r): (lambda r=r, fn=ring_fn: fn(r)) for r in ranks}
        for name, sdpa in runners.items():
            candidates[("mono", name)] = (
                (lambda sdpa=sdpa: sdpa(q, k, v)) if fwd_only else
                (lambda name=name: mono_fwd_bwd(name))
            )  # fmt: skip
        ms = time_interleaved(candidates, device, cfg.warmup, cfg.repeats)
        by_rank = {r: ms["ring", r] for r in ranks}
        ring_ms = max(by_rank.values())
        flops = attention_flops(b, hq, seq_len, d, causal, not fwd_only)
        row = {
            "mask": mask, "hq": hq, "hkv": hkv, "head_dim": d, "world_size": world_size,
            "tokens_per_rank": n, "seq_len": seq_len, "pass": pass_, "dtype": cfg.dtype,
            "kernel": call.kernel.name, "merge": cfg.merge,
            "ring_ms": ring_ms, "ring_ms_by_rank": by_rank,
            "ring_tflops": flops / world_size / (ring_ms * 1e-3) / 1e12,
            "out_max_diff": diff, "ring_peak_mb": ring_peak,
            "memory_ratio": ring_peak / first_peak if first_peak else None,
            "mono": {}, "efficiency": {},
        }  # fmt: skip
        for name, m in mono.items():
            if "error" in m:
                row["mono"][name] = m
                continue
            mono_ms = ms["mono", name]
            row["mono"][name] = {**m, "ms": mono_ms, "tflops": flops / (mono_ms * 1e-3) / 1e12}
            row["efficiency"][name] = (mono_ms / world_size) / ring_ms
        rows.append(row)
    if cfg.documents is not None or cfg.window is not None:
        packed = packed_rows(cfg, rows, call, (q, k, v, dout), ranks, device)
        for row, packed_row in zip(rows, packed):
            row["packed"] = packed_row
    return rows


def run_bench(cfg: BenchConfig, argv: list[str] | None = None) -> int:
    """Run the sweep, print the table, write JSON and PNG; 0 on success."""
    device = resolve_device(cfg.device)
    cfg = cfg.resolve(device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    data = header(device, cfg, argv)
    data["results"], data["failed"] = rows, failed = [], []
    where = data["machine"].get("gpu") or data["machine"].get("cpu")
    threads = f", {torch.get_num_threads()} thread(s)" if device.type == "cpu" else ""
    print(
        f"ringattn bench on {device} ({where}{threads}), {cfg.dtype}, head dim {cfg.head_dim}, "
        f"layout {cfg.layout}, merge {cfg.merge}, median of {cfg.repeats} interleaved rounds "
        f"after {cfg.warmup} warm-up",
        flush=True,
    )
    for mask in cfg.masks:
        for hq, hkv in cfg.heads:
            for world_size, n in cfg.sizes:
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # also after a configuration that failed
                t0, what = time.perf_counter(), f"{mask} {hq}:{hkv} W={world_size} n={n}"
                try:
                    rows += bench_one(cfg, mask, hq, hkv, world_size, n, device)
                except RuntimeError as err:  # one size a kernel refuses, or out of memory
                    failed.append({"config": what, "error": str(err).splitlines()[0][:300]})
                    print(f"  {what}: FAILED: {failed[-1]['error']}", flush=True)
                    continue
                print(f"  {what}: {time.perf_counter() - t0:.1f} s", flush=True)
                if cfg.json_path:  # after every configuration: a cut-short run keeps its rows
                    write_json(cfg.json_path, data)
    print(format_table(rows, cfg.baselines))
    packed = [r["packed"] for r in rows if "packed" in r]
    if packed:
        print("packed case (same tokens, fresh plan every step; GFLOP = attention actually needed)")
        print(format_packed(packed))
    print(
        "eff = (monolithic ms / W) / ring ms (the slower of the timed ranks); mem/mono = ring rank "
        "peak / monolithic peak, inputs included"
    )
    if cfg.json_path:
        write_json(cfg.json_path, data)
        print(f"wrote {cfg.json_path}")
    if cfg.plot_path:
        print(write_plot(rows, cfg.baselines[0], cfg.plot_path))
    return 1 if failed else 0
