"""What `ringattn bench` and `ringattn bench --million` share: timing, memory, FLOPs, the
machine header of their JSON, the table and the plot.

Timing uses CUDA events on a GPU (recorded on the current stream around the call, so queued work
on other streams that the call waits for is counted) and perf_counter on a CPU; `time_ms` reports
the median of repeats after warm-up calls.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict

import torch
from typing_extensions import Self

from ringattn.runtime.meter import Meter

PASSES = ("fwd", "fwd+bwd")


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of `fn()` after `warmup` calls: CUDA events on a GPU, else
    perf_counter."""
    for _ in range(warmup):
        fn()
    times = [timed(fn, device)[1] for _ in range(repeats)]
    return statistics.median(times)


def time_interleaved(
    fns: dict[object, Callable[[], object]], device: torch.device, warmup: int, repeats: int
) -> dict[object, float]:
    """Median milliseconds of each fn, timed in rounds (every fn once per round, in order), so
    that a change in the machine's load during the measurement hits every fn alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[object, list[float]] = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            times[key].append(timed(fn, device)[1])
    return {key: statistics.median(values) for key, values in times.items()}


def timed(fn: Callable, device: torch.device, *args: object) -> tuple[object, float]:
    """(fn(*args), its milliseconds) for one call: CUDA events on a GPU, else perf_counter."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn(*args)
        end.record()
        end.synchronize()
        return result, start.elapsed_time(end)
    t0 = time.perf_counter()
    result = fn(*args)
    return result, (time.perf_counter() - t0) * 1e3


MEMORY_METHOD = {
    "cuda": "torch.cuda.max_memory_allocated above the start (meter.py), plus the inputs",
    "cpu": "peak of live tensor bytes from torch.profiler's allocator events, plus the inputs",
}


class PeakMemory:
    """Context manager: the peak of tensor bytes the region adds, in MiB (`.mb`; MEMORY_METHOD).

    On a CPU the resident set size (meter.py) cannot see a region's peak once earlier calls have
    grown the heap, so the profiler's allocation and free events ("[memory]", each with its own
    time and signed size) are summed in time order instead (the profiler slows the region: time
    it separately). Not the ops' `self_cpu_memory_usage`: that nets each op's allocations and
    frees and is placed at the op's start, so a free inside a long op (an autograd node that
    recomputes a chunk) counted before the allocations it follows: the peak of a chunked loss's
    backward (checkpointed chunks, tests/test_linear_loss.py's case) read 3.1 MiB where the
    events give 4.1.
    """

    def __init__(self, device: torch.device):
        self.device, self.mb = device, 0.0

    def __enter__(self) -> Self:
        if self.device.type == "cuda":
            self._meter = Meter(self.device).__enter__()
        else:
            self._recording = memory_profile()
            self._prof = self._recording.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self._meter.__exit__(*exc)
            self.mb = self._meter.peak_mb
            return
        self._recording.__exit__(*exc)
        live = peak = 0
        memory = (e for e in self._prof.profiler.kineto_results.events() if e.name() == "[memory]")
        for event in sorted(memory, key=lambda e: e.start_ns()):
            live += event.nbytes()  # + allocated, - freed
            peak = max(peak, live)
        self.mb = peak / 2**20


def peak_mb(fn: Callable[[], object], device: torch.device) -> float:
    """Peak tensor memory that one call of `fn` adds, in MiB (see PeakMemory)."""
    with PeakMemory(device) as peak:
        fn()
    return peak.mb


@contextlib.contextmanager
def memory_profile() -> Iterator[object]:
    """torch's profiler recording every allocation and free on the CPU, its own log lines
    (written to fd 2 at start and stop) dropped; yields the profile."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield prof


@contextlib.contextmanager
def _quiet_stderr():
    """Drop what native code writes to fd 2 (the profiler logs its start and stop there)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def tensor_mb(*tensors: torch.Tensor) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def attention_flops(batch, hq, seq_len, head_dim, causal: bool, with_backward: bool) -> float:
    fwd = 4.0 * batch * hq * seq_len * seq_len * head_dim * (0.5 if causal else 1.0)
    return fwd * (3.5 if with_backward else 1.0)


def machine(device: torch.device) -> dict:
    """What ran the benchmark: enough to compare runs, nothing identifying."""
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - optional
        info["triton"] = None
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        info["cudnn"] = torch.backends.cudnn.version()
    else:
        try:
            with open("/proc/cpuinfo") as f:
                names = [x.split(":", 1)[1].strip() for x in f if x.startswith("model name")]
            info["cpu"] = names[0] if names else platform.processor()
        except OSError:
            info["cpu"] = platform.processor()
    return info


def header(device: torch.device, cfg: object, argv: list[str] | None = None) -> dict:
    """The JSON header every bench output starts with; `argv` is the command's arguments as
    `ringattn.cli.main` got them (this process's own when None: a caller that passed its own
    argv to `main` must not record its host's, e.g. pytest's)."""
    args = sys.argv[1:] if argv is None else argv
    return {
        "machine": machine(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["ringattn", *args]),
        "config": asdict(cfg),
        "memory_method": MEMORY_METHOD[device.type],
    }


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine; use cpu")
    return device


# ---- table and plot ------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_table(rows: list[dict], baselines: list[str]) -> str:
    head = (
        f"{'mask':<6} {'heads':>6} {'W':>2} {'tok/rank':>8} {'pass':<7} {'ring ms':>9} "
        + " ".join(f"{b + ' ms':>9}" for b in baselines)
        + " "
        + " ".join(f"{'eff ' + b:>10}" for b in baselines)
        + f" {'ring TF/s':>9} {'mem/mono':>8} {'|out diff|':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        mono = [r["mono"].get(b, {}).get("ms") for b in baselines]
        eff = [r["efficiency"].get(b) for b in baselines]
        lines.append(
            f"{r['mask']:<6} {r['hq']:>3}:{r['hkv']:<2} {r['world_size']:>2} "
            f"{r['tokens_per_rank']:>8} {r['pass']:<7} {r['ring_ms']:>9.2f} "
            + " ".join(f"{_fmt(m, '.2f'):>9}" for m in mono)
            + " "
            + " ".join(f"{_fmt(e, '.3f'):>10}" for e in eff)
            + f" {r['ring_tflops']:>9.3g} {_fmt(r['memory_ratio'], '.3f'):>8}"
            + f" {_fmt(r['out_max_diff'], '.1e'):>10}"
        )
    return "\n".join(lines)


def write_plot(rows: list[dict], baseline: str, path: str) -> str:
    """Efficiency vs tokens per rank, one line per (mask, heads, pass). Returns a status line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed: no plot written ({path} skipped)"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, pass_ in zip(axes, PASSES):
        lines: dict[tuple, list] = {}
        for r in rows:
            if r["pass"] == pass_ and baseline in r["efficiency"]:
                key = (r["mask"], f"{r['hq']}:{r['hkv']}")
                lines.setdefault(key, []).append((r["tokens_per_rank"], r["efficiency"][baseline]))
        for (mask, heads), points in sorted(lines.items()):
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, marker="o", label=f"{mask}, heads {heads}")
        for target in (0.95, 0.85):
            ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        sizes: dict[int, set] = {}
        for r in rows:
            sizes.setdefault(r["tokens_per_rank"], set()).add(r["world_size"])
        ax.set_xticks(sorted(sizes))
        ax.set_xticklabels([f"{n}\nW={','.join(map(str, sorted(w)))}" for n, w in
                            sorted(sizes.items())])  # fmt: skip
        ax.minorticks_off()
        ax.set_title(f"{pass_}: (monolithic {baseline} / W) / ring rank")
        ax.set_xlabel("tokens per rank")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("efficiency")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
