"""What is alive at a region's peak of tensor memory on CPU, and who allocated it.

    profiler trace    "[memory]" instant events: time, thread, address, signed size
                      ops ("aten::mm") and autograd nodes ("...evaluate_function: MmBackward0")
                      as spans on their thread
    peak              allocation and free events summed in time order (as PeakMemory)
    live at the peak  allocations not yet freed, paired by address, each named by the innermost
                      op around it and the autograd node it ran in ("" in forward), grouped

The groups answer "what is the step holding at its peak beyond X": a chunk's logits, three
(vocab, dim) weight gradients, attention's buffers. Sizes per local token (`per_token`: bytes /
tokens / element size) name a tensor's kind at a glance: the model width, the MLP's intermediate
width, K/V heads x head dim. Used by scripts/bench/long_seq.py --breakdown.
"""

from __future__ import annotations

import bisect
import collections
import json
import os
import tempfile

from typing_extensions import Self

from ringattn.bench.common import memory_profile

__all__ = ["Breakdown"]


class Breakdown:
    """Context manager (CPU): `.mb` the peak MiB the region adds, `.at` the (autograd node, op)
    where it peaked, `.live` the groups alive then, largest first: dicts with `mb`, `count`,
    `node`, `op`, `per_token`."""

    def __init__(self, tokens: int, element_size: int = 4, top: int = 16):
        self.tokens, self.element_size, self.top = tokens, element_size, top
        self.mb, self.at, self.live = 0.0, ("", ""), []

    def __enter__(self) -> Self:
        self._recording = memory_profile()
        self._prof = self._recording.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._recording.__exit__(*exc)
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            self._prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        finally:
            os.unlink(path)
        self._read(events)

    def _read(self, events: list[dict]) -> None:
        memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
        live, total, peak, at = {}, 0, 0, -1
        for i, event in enumerate(memory):
            total += event["args"]["Bytes"]
            if total > peak:
                peak, at = total, i
        for event in memory[: at + 1]:
            size, addr = event["args"]["Bytes"], event["args"]["Addr"]
            if size > 0:
                live[addr] = event
            else:
                live.pop(addr, None)
        spans = _Spans(events)
        groups: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])
        for event in live.values():
            group = groups[spans.origin(event)]
            group[0] += event["args"]["Bytes"]
            group[1] += 1
        self.mb = peak / 2**20
        self.at = spans.origin(memory[at]) if at >= 0 else ("", "")
        per_token = self.tokens * self.element_size
        self.live = [
            {"mb": size / 2**20, "count": count, "node": node, "op": op,
             "per_token": round(size / count / per_token, 1)}
            for (node, op), (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])
        ][: self.top]  # fmt: skip


class _Spans:
    """The ops of each thread, to find the ones around an instant."""

    def __init__(self, events: list[dict]):
        by_thread = collections.defaultdict(list)
        for e in events:
            if e.get("ph") == "X" and e.get("cat") == "cpu_op":
                by_thread[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
        self.spans = {tid: sorted(s) for tid, s in by_thread.items()}
        self.starts = {tid: [s[0] for s in spans] for tid, spans in self.spans.items()}

    def origin(self, event: dict) -> tuple[str, str]:
        """(autograd node or "", innermost op) around the instant `event`."""
        spans, ts = self.spans.get(event["tid"], []), event["ts"]
        around = [s for s in spans[: bisect.bisect_right(self.starts.get(event["tid"], []), ts)]
                  if s[1] >= ts]  # fmt: skip
        nodes = [s[2].split(": ")[-1] for s in around if "evaluate_function" in s[2]]
        return (nodes[-1] if nodes else "", around[-1][2] if around else "")
