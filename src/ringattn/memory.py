"""Per-rank peak memory of a training run, on CPU or CUDA.

- CUDA: `torch.cuda.max_memory_allocated` (every tensor torch allocated on the device; the
  caching allocator's reserve and NCCL's buffers are not counted).
- CPU: peak resident set size (VmHWM) above the resident size when the tracker started. The peak
  is reset at the start (Linux `/proc/self/clear_refs`), so earlier phases do not count. RSS counts
  every page the process touched (allocator slack, thread stacks, gloo buffers, code pages loaded
  on first use), so it is an upper bound on the tensors' share. To keep code pages out of the
  figure, `ringattn train --memory-warmup` runs one throwaway step of a tiny model before the
  tracker starts.

Without Linux's /proc (macOS), the process's lifetime peak is used instead, which also counts
everything before the start; the `method` string says which one was used.
"""

from __future__ import annotations

import os
import resource
import sys

import torch

__all__ = ["MemoryTracker"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class MemoryTracker:
    """Peak memory since `start()`: `peak_mb()` may be read at any time."""

    def __init__(self, device: torch.device):
        self.device = device
        self.baseline_bytes = 0
        self.method = ""

    def start(self) -> MemoryTracker:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.method = "torch.cuda.max_memory_allocated"
        else:
            self.baseline_bytes = _rss_bytes()
            exact = _reset_peak()
            self.method = "peak RSS (VmHWM) above the RSS at the start" + (
                "" if exact else " (lifetime peak: over-counts)"
            )
        return self

    def peak_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        return max(0, _peak_rss_bytes() - self.baseline_bytes) / 2**20

    def baseline_mb(self) -> float:
        return self.baseline_bytes / 2**20
