"""Activation offload: the checkpointed layer inputs kept in (pinned) host memory, not the GPU's.

With activation checkpointing, what a layer keeps between forward and backward is its input
(S/W x hidden per layer, `layers` of them): at long sequences these checkpoints are most of the
activation memory that is left. torch's non-reentrant checkpoint saves a layer's inputs through
the saved-tensor hooks active around the `checkpoint(...)` call (its own hooks handle what runs
inside), so hooks entered around each checkpointed layer see exactly those inputs:

    forward   pack(x)    copy x to a host buffer (pinned on CUDA) on a side stream; the GPU copy
                         is released once the copy is done (the caching allocator reuses it)
    backward  unpack(k)  wait for the prefetch of checkpoint k (or copy it now), and start the
                         copy of checkpoint k-1 (the next layer backward needs) on the side
                         stream, so the transfer of one layer hides behind the recompute of the
                         next

torch.autograd.graph.save_on_cpu is the model; it copies synchronously and prefetches nothing.
On CPU the same path runs (host = device: a copy into another CPU tensor) and is exact; the memory
benefit exists on a GPU only, bounded by the host's RAM (layers x S/W x hidden x bytes per rank)
and by the link (PCIe/C2C) time against the layer's compute: the planner prices both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Self

import torch
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["ActivationOffload"]


@dataclass
class _Saved:
    host: torch.Tensor | None
    device: torch.device
    kept: torch.Tensor | None = None  # small tensors and parameters stay where they are
    ready: object = None  # the CUDA event after which `host` (D2H) or `prefetched` (H2D) is valid
    prefetched: torch.Tensor | None = None


@dataclass
class ActivationOffload:
    """Saved-tensor hooks that move the tensors saved inside `with offload:` to host memory.

    One instance per forward pass (records index the checkpoints in forward order); enter it
    around each checkpointed layer call. `min_bytes`: smaller tensors stay on the device (RoPE
    tables, masks); parameters always stay. `offloaded_bytes` counts what went to the host."""

    min_bytes: int = 1 << 16
    offloaded_bytes: int = 0
    records: list[_Saved] = field(default_factory=list)
    _stream: object = None

    def __post_init__(self) -> None:
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> Self:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _side_stream(self) -> object:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def _pack(self, t: torch.Tensor) -> int:
        size = t.numel() * t.element_size()
        if isinstance(t, torch.nn.Parameter) or size < self.min_bytes or t.is_sparse:
            self.records.append(_Saved(None, t.device, kept=t))
            return len(self.records) - 1
        if t.is_cuda:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(stream)
            t.record_stream(stream)  # the allocator keeps t's memory until the copy is done
        else:  # host = device: the same path, a copy into another CPU tensor
            host, ready = t.detach().clone(), None
        self.offloaded_bytes += size
        self.records.append(_Saved(host, t.device, ready=ready))
        return len(self.records) - 1

    def _fetch(self, saved: _Saved) -> None:
        """Start the copy back to the device on the side stream (CUDA), once."""
        if saved.host is None or saved.prefetched is not None or saved.device.type != "cuda":
            return
        stream = self._side_stream()
        with torch.cuda.stream(stream):
            if saved.ready is not None:
                stream.wait_event(saved.ready)
            saved.prefetched = saved.host.to(saved.device, non_blocking=True)
            saved.ready = torch.cuda.Event()
            saved.ready.record(stream)

    def _unpack(self, index: int) -> torch.Tensor:
        saved = self.records[index]
        if saved.kept is not None:
            return saved.kept
        if saved.device.type != "cuda":
            return saved.host
        self._fetch(saved)
        current = torch.cuda.current_stream(saved.device)
        current.wait_event(saved.ready)
        out, saved.prefetched, saved.ready = saved.prefetched, None, None  # the host copy stays
        out.record_stream(current)
        # the previous checkpoint is the one backward reaches next: start its copy now
        earlier = next((s for s in reversed(self.records[:index]) if s.host is not None), None)
        if earlier is not None:
            self._fetch(earlier)
        return out
