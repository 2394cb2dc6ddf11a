"""`ringattn plan --calibrate`: measure this machine for `--hardware cpu`, and cache the result.

What is measured (the fastest of 5 samples after a warm-up call, for 1 thread and for all cores,
the two thread counts the local launcher gives its processes):

    matmul        GFLOP/s of (2048, w) @ (w, w) for widths w = 16 ... 1024
    attention     GFLOP/s of the ring's CPU block kernel (cpu_flash), forward and backward,
                  full and causal blocks, head dims 16 ... 128, blocks of 128 ... 2048 keys
                  (causal flops counted as visible pairs only)
    elementwise   GB/s of activation-sized multiply and add passes
    gloo          latency and bandwidth of send/recv ping-pong between two local processes
                  (torch.distributed gloo, launched by ringattn.runtime.launch)
    sharing       the cost of 2 x cores processes taking turns on the cores beyond the
                  2x stretch (oversubscribe.py): a ring of compute + send/recv on `cores`
                  and on 2 x cores processes
    step floor    the median step time of `ringattn train` at a size where the kernels cost
                  almost nothing (tiny model, 2 processes, cp 2, 512 tokens): what the trainer
                  spends per step outside the kernels (Python and autograd dispatch, FSDP hooks
                  and their small collectives, the data, the optimizer's per-tensor calls)

The result is a JSON file (default ~/.cache/ringattn/calibration-cpu.json, or --calibration
PATH). `ringattn plan --hardware cpu` reads it; it is re-measured only with --calibrate. A cache
from another machine (other node name or core count) or another torch version is refused.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch

from ringattn.kernels import KERNELS
from ringattn.planner.oversubscribe import measure_oversubscription
from ringattn.runtime.launch import init_distributed, launch

__all__ = ["DEFAULT_PATH", "calibrate", "is_calibration_file", "load_calibration", "machine_key"]

DEFAULT_PATH = os.path.join(os.path.expanduser("~"), ".cache", "ringattn", "calibration-cpu.json")
VERSION = 4
WIDTHS = (16, 32, 64, 128, 256, 512, 1024)
HEAD_DIMS = (16, 32, 64, 128)
BLOCKS = (128, 512, 2048)
SIZES = (4096, 65536, 1 << 20, 8 << 20)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def machine_key() -> dict:
    """What a cached calibration must match to be reused."""
    return {"node": platform.node(), "cores": _cores(), "torch": torch.__version__,
            "version": VERSION}  # fmt: skip


def _best_s(fn, repeats: int, min_sample_s: float = 0.02) -> float:
    """Seconds of one call of fn: the fastest of `repeats` samples, each looping fn long enough
    (>= min_sample_s) that timer resolution and scheduler ticks do not dominate. The fastest,
    not the median: on a shared machine other processes only ever slow a sample down, and a
    2-thread sample stalls whenever another process holds one of the cores."""
    start = time.perf_counter()
    fn()  # warm-up, and a first estimate of the time of one call
    once = max(time.perf_counter() - start, 1e-7)
    loops = max(1, int(min_sample_s / once))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        times.append((time.perf_counter() - start) / loops)
    return min(times)


def _matmul(repeats: int) -> dict:
    rates = {}
    for w in WIDTHS:
        a, b = torch.randn(2048, w, device="cpu"), torch.randn(w, w, device="cpu")
        rates[str(w)] = 2 * 2048 * w * w / _best_s(lambda a=a, b=b: a @ b, repeats) / 1e9
    return rates


def _attention_rates(kernel, heads: int, n: int, d: int, causal: bool, repeats: int):
    """(forward, backward) GFLOP/s of one block shape; causal flops are visible pairs only."""
    q, k, v, dout = (torch.randn(1, heads, n, d, device="cpu") for _ in range(4))
    scale = d**-0.5
    flops = 4 * heads * n * n * d / (2 if causal else 1)
    out, lse = kernel.forward(q, k, v, causal, scale)
    fwd = _best_s(lambda: kernel.forward(q, k, v, causal, scale), repeats)
    bwd = _best_s(lambda: kernel.backward(dout, q, k, v, out, lse, causal, scale), repeats)
    return flops / fwd / 1e9, 2.5 * flops / bwd / 1e9


def _attention(repeats: int) -> dict:

    kernel, heads = KERNELS["cpu_flash"], 4
    table: dict = {f"{p}_{m}": {} for p in ("fwd", "bwd") for m in ("full", "causal")}
    for d in HEAD_DIMS:
        for rates in table.values():
            rates[str(d)] = {}
        for n in BLOCKS:
            for causal in (False, True):
                mask = "causal" if causal else "full"
                fwd, bwd = _attention_rates(kernel, heads, n, d, causal, repeats)
                table[f"fwd_{mask}"][str(d)][str(n)] = fwd
                table[f"bwd_{mask}"][str(d)][str(n)] = bwd
    return table


def _elementwise(repeats: int) -> float:
    x, w = torch.randn(1 << 20, device="cpu"), torch.randn(1 << 20, device="cpu")

    def passes():  # 4 passes, each reading one or two tensors and writing one
        y = x * w
        y = y + x
        y = y * 0.5
        return y - w

    nbytes = 4 * 8 * x.numel()  # read + write of 4 bytes, per element, per pass
    return nbytes / _best_s(passes, repeats) / 1e9


def _gloo_worker(sizes: tuple[int, ...], repeats: int) -> dict:
    import torch.distributed as dist

    init_distributed("gloo")
    rank = dist.get_rank()
    result = {}
    for size in sizes:
        buf = torch.zeros(size // 4, device="cpu")
        times = []
        for i in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i:
                times.append((time.perf_counter() - start) / 2)  # one way
        result[str(size)] = statistics.median(times)
    dist.destroy_process_group()
    return result


def _gloo(repeats: int) -> dict:

    one_way = launch(_gloo_worker, 2, SIZES, repeats)[0]
    small, large = one_way[str(SIZES[0])], one_way[str(SIZES[-1])]
    bandwidth = (SIZES[-1] - SIZES[0]) / max(large - small, 1e-9) / 1e9
    return {"latency_s": small, "bandwidth_gbs": bandwidth, "one_way_s": one_way}


def _step_floor(steps: int = 10) -> float:
    """Median seconds of a `ringattn train` step of the tiny model on 512 tokens (see above);
    run through the CLI, as a user would, in a temporary directory."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ringattn-calibrate-") as tmp:
        cmd = [sys.executable, "-m", "ringattn", "train", "--model", "tiny", "--nproc", "2",
               "--cp", "2", "--seq-len", "512", "--steps", str(steps), "--warmup", "1",
               "--checkpoint-every", "-1", "--no-resume", "--quiet", "--out-dir", tmp]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        done = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=300, check=False
        )
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")
        with open(os.path.join(tmp, "train_log.jsonl")) as f:
            seconds = [r["seconds"] for r in map(json.loads, f) if "seconds" in r]
    return statistics.median(seconds[1:])


def _oversubscription(cores: int) -> dict:
    return measure_oversubscription(cores)


def _memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return 16.0


def calibrate(path: str = DEFAULT_PATH, repeats: int = 5, log=print) -> dict:
    """Measure this machine (about a minute on 2 cores) and write the cache file."""
    start = time.perf_counter()
    saved = torch.get_num_threads()
    cores = _cores()
    result = {**machine_key(), "memory_gib": _memory_gib(), "measured_at": time.time(),
              "matmul": {}, "attention": {}, "elementwise_gbs": {}}  # fmt: skip
    try:
        for threads in sorted({1, cores}):
            torch.set_num_threads(threads)
            log(f"[calibrate] {threads} thread(s): matmul, attention, elementwise...")
            result["matmul"][str(threads)] = _matmul(repeats)
            result["attention"][str(threads)] = _attention(repeats)
            result["elementwise_gbs"][str(threads)] = _elementwise(repeats)
    finally:
        torch.set_num_threads(saved)
    log("[calibrate] gloo send/recv between 2 processes...")
    result["gloo"] = _gloo(repeats * 3)
    log(f"[calibrate] {cores} vs {2 * cores} processes sharing {cores} cores...")
    shared = _oversubscription(cores)
    result["oversubscription"] = shared["cost"]
    result["oversubscription_detail"] = shared
    if shared.get("busy"):
        log(f"[calibrate] warning: load average {max(shared['load_average']):.1f} on {cores} "
            "cores while measuring: other processes distort every figure here (the sharing "
            "cost most); calibrate again on a quiet machine")  # fmt: skip
    log("[calibrate] the trainer's per-step floor (tiny model, 512 tokens, 2 processes)...")
    result["step_floor_s"] = _step_floor()
    result["step_floor_nproc"] = 2
    result["seconds"] = time.perf_counter() - start
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    log(f"[calibrate] wrote {path} ({result['seconds']:.0f} s)")
    return result


def is_calibration_file(path: str) -> bool:
    """Whether `path` holds a calibration (of any machine): safe to overwrite with a new one."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"matmul", "attention", "gloo"} <= set(data)


def load_calibration(path: str = DEFAULT_PATH) -> dict:
    """The cached calibration; ValueError saying how to make one when it is missing or stale."""
    if not os.path.exists(path):
        raise ValueError(f"no CPU calibration at {path}; run `ringattn plan --calibrate` first "
                         "(about a minute)")  # fmt: skip
    with open(path) as f:
        result = json.load(f)
    want = machine_key()
    stale = {k: (result.get(k), v) for k, v in want.items() if result.get(k) != v}
    if stale:
        diff = ", ".join(f"{k} {a!r} != {b!r}" for k, (a, b) in stale.items())
        raise ValueError(f"the calibration at {path} is from another machine or version ({diff}); "
                         "run `ringattn plan --calibrate` again")  # fmt: skip
    return result
