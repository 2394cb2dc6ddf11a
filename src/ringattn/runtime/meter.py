"""Wall-clock time and peak memory of a region of code, on CPU or CUDA.

    with Meter(device) as total:                    # time and memory
    tracker = Meter(device).start()                 # or: read tracker.peak_so_far_mb() any time
        with Meter(device, memory=False) as fwd:    # time only: nests inside a memory meter
            out = attention(q, k, v)
    total.seconds, total.peak_mb, fwd.seconds

Time is `time.perf_counter` around the region, with `torch.cuda.synchronize` on both ends on a GPU
so queued kernels are counted. Peak memory is what the region added on top of what was already held
when it started:

- CUDA: `torch.cuda.max_memory_allocated` after resetting the peak, minus the bytes allocated at the
  start. Exact for tensors, blind to the caching allocator's reserve and to NCCL buffers.
- CPU: the process's peak resident set size (VmHWM) minus its resident size at the start. On Linux
  the peak is reset at the start (`/proc/self/clear_refs`), so the region is measured alone;
  elsewhere the lifetime peak from `resource.getrusage` is used, which over-counts when an earlier
  phase peaked higher. RSS counts everything the process touches (allocator slack, thread stacks,
  gloo buffers), so read it as an upper bound on the tensors' share, to within a few MB.
"""

from __future__ import annotations

import os
import resource
import sys
import time

import torch
from typing_extensions import Self

__all__ = ["Meter", "rss_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """This process's current resident set size in bytes (0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "reset the peak resident set size", Linux >= 4.0
        return True
    except OSError:
        return False


def _peak_rss_bytes(after_reset: bool) -> int:
    if after_reset:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


class Meter:
    """Context manager measuring seconds and (unless `memory=False`) peak added bytes."""

    def __init__(self, device: torch.device | str = "cpu", memory: bool = True):
        self.device = torch.device(device)
        self.memory = memory
        self.seconds = 0.0
        self.peak_bytes = 0
        self.method = ""
        self._start_bytes = 0
        self._reset = False

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / 2**20

    @property
    def baseline_mb(self) -> float:
        """What was held when the meter started (RSS on CPU, allocated tensors on CUDA)."""
        return self._start_bytes / 2**20

    def start(self) -> Self:
        """Start measuring (what `with` does); the peak can then be read at any time."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.memory:
            self._start_memory()
        self._t0 = time.perf_counter()
        return self

    def __enter__(self) -> Self:
        return self.start()

    def _start_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start_bytes = torch.cuda.memory_allocated(self.device)
            self.method = "torch.cuda.max_memory_allocated above the start"
        else:
            self._start_bytes = rss_bytes()
            self._reset = _reset_peak_rss()
            self.method = "peak RSS above the RSS at the start" + (
                "" if self._reset else " (lifetime peak: may over-count)"
            )

    def peak_so_far_mb(self) -> float:
        """Peak added memory from the start until now, without stopping the meter."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _peak_rss_bytes(self._reset)
        return max(0, peak - self._start_bytes) / 2**20

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - self._t0
        if self.memory:
            self.peak_bytes = round(self.peak_so_far_mb() * 2**20)
