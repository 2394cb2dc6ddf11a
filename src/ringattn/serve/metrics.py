"""`GET /metrics`: the server's counters in the Prometheus text format (version 0.0.4).

    ringattn_requests_total{outcome}          requests ended: stop, length (finished), cancelled
                                              (the client left), invalid (4xx), failed (5xx),
                                              rejected (503: the queue was full)
    ringattn_prompt_tokens_total              prompt tokens of the requests run
    ringattn_generation_tokens_total          tokens generated
    ringattn_time_to_first_token_seconds      histogram, from admission to the first token
    ringattn_inter_token_latency_seconds      histogram, between a sequence's tokens
    ringattn_request_latency_seconds          histogram, from admission to the end
    ringattn_running_sequences                sequences running (prefilling or decoding)
    ringattn_waiting_requests                 admitted requests waiting for the ranks
    ringattn_kv_blocks{state}                 each rank's KV pool: used (by running sequences,
                                              and the prefix chunks they share), cached (prefix
                                              chunks no one uses, evictable), free
    ringattn_kv_blocks_shared                 blocks referenced by more than one sequence
    ringattn_kv_state_snapshot_bytes          a hybrid's prefix entries: bytes of the mixers'
                                              states kept with them (each rank; in the pool)
    ringattn_prefix_cache_hits_total          requests that started from cached prefix chunks
    ringattn_prefix_cache_hit_tokens_total    prompt tokens they did not compute
    ringattn_preemptions_total                sequences sent back to recompute (no free block)

Written by hand (a few lines) rather than with prometheus_client: no dependency, no global
registry. The worker thread records, the HTTP thread renders; a lock keeps each sample whole.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable

__all__ = ["OUTCOMES", "Histogram", "Metrics"]

OUTCOMES = ("stop", "length", "cancelled", "invalid", "failed", "rejected")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    """Cumulative buckets, a sum and a count (the Prometheus histogram)."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds, self.counts = bounds, [0] * (len(bounds) + 1)  # the last: +Inf only
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            total += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        return [*out, f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]


class Metrics:
    """Rank 0's counters; `waiting` reports the queue's length when rendered."""

    def __init__(self, waiting: Callable[[], int] = lambda: 0):
        self.lock = threading.Lock()
        self.waiting = waiting
        self.requests = dict.fromkeys(OUTCOMES, 0)
        self.prompt_tokens = self.generation_tokens = self.running = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.blocks = {"used": 0, "cached": 0, "free": 0}
        self.shared_blocks = self.snapshot_bytes = 0
        self.prefix_hits = self.prefix_hit_tokens = self.preemptions = 0

    def pool(self, pool) -> None:
        """The KV pool's state now (serve/pool.py's BlockPool)."""
        with self.lock:
            counts = pool.counts()  # one pass over the entries
            self.blocks = {k: counts[k] for k in ("used", "cached", "free")}
            self.shared_blocks = counts["shared"]
            self.snapshot_bytes = pool.snapshots_held
            self.prefix_hits, self.prefix_hit_tokens = pool.hits, pool.hit_tokens

    def ended(self, outcome: str, prompt_tokens: int = 0, new_tokens: int = 0,
              latency_s: float | None = None) -> None:  # fmt: skip
        assert outcome in OUTCOMES, outcome
        with self.lock:
            self.requests[outcome] += 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += new_tokens
            if latency_s is not None:
                self.latency.observe(latency_s)

    def token(self, first_s: float | None = None, gap_s: float | None = None) -> None:
        """One generated token: its time to first token, or its gap after the previous one."""
        with self.lock:
            if first_s is not None:
                self.ttft.observe(first_s)
            if gap_s is not None:
                self.itl.observe(gap_s)

    def render(self) -> str:
        with self.lock:
            out = ["# HELP ringattn_requests_total Requests ended, by outcome.",
                   "# TYPE ringattn_requests_total counter"]  # fmt: skip
            out += [f'ringattn_requests_total{{outcome="{k}"}} {n}'
                    for k, n in self.requests.items()]  # fmt: skip
            for name, value, kind, text in (
                ("prompt_tokens_total", self.prompt_tokens, "counter", "Prompt tokens run."),
                ("generation_tokens_total", self.generation_tokens, "counter", "Tokens generated."),
                ("running_sequences", self.running, "gauge", "Sequences in the running batch."),
                ("waiting_requests", self.waiting(), "gauge", "Admitted requests waiting."),
                (
                    "prefix_cache_hits_total",
                    self.prefix_hits,
                    "counter",
                    "Requests that reused cached prefix chunks.",
                ),
                (
                    "prefix_cache_hit_tokens_total",
                    self.prefix_hit_tokens,
                    "counter",
                    "Prompt tokens reused from the prefix cache.",
                ),
            ):
                out += [f"# HELP ringattn_{name} {text}", f"# TYPE ringattn_{name} {kind}",
                        f"ringattn_{name} {value}"]  # fmt: skip
            out += ["# HELP ringattn_kv_blocks KV blocks of each rank's pool, by state.",
                    "# TYPE ringattn_kv_blocks gauge"]  # fmt: skip
            out += [f'ringattn_kv_blocks{{state="{k}"}} {n}' for k, n in self.blocks.items()]
            out += ["# HELP ringattn_kv_blocks_shared KV blocks used by more than one sequence.",
                    "# TYPE ringattn_kv_blocks_shared gauge",
                    f"ringattn_kv_blocks_shared {self.shared_blocks}",
                    "# HELP ringattn_kv_state_snapshot_bytes Hybrid prefix state snapshots, bytes.",
                    "# TYPE ringattn_kv_state_snapshot_bytes gauge",
                    f"ringattn_kv_state_snapshot_bytes {self.snapshot_bytes}"]  # fmt: skip
            for name, hist, text in (
                ("time_to_first_token_seconds", self.ttft, "Admission to the first token."),
                ("inter_token_latency_seconds", self.itl, "Time between a sequence's tokens."),
                ("request_latency_seconds", self.latency, "Admission to the end of a request."),
            ):
                out += [f"# HELP ringattn_{name} {text}", f"# TYPE ringattn_{name} histogram"]
                out += hist.lines(f"ringattn_{name}")
        return "\n".join(out) + "\n"
