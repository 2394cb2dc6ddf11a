"""Paired bursts: two servers up at once, the same burst of short chats on each in turn.

serve_bench.py runs each server's phases in turn, minutes apart; on a shared machine a server's
speed drifts by 10 % or more over that time (transformers serve's decode step measured 137 to
183 ms between runs of the same command), which is as large as the difference being measured.
Here `ringattn serve` W = 1 and `transformers serve` run side by side: each round sends the
burst to one server while the other is stopped (SIGSTOP to its process group, so it takes no
CPU), then to the other, in ABBA order so that a drift within a round cancels. Each round's
chats are new to both servers (a round number leads each user message), so a prefix cache
reuses the system prompt only, as in serve_bench's burst. The ratio of each
round's two throughputs is measured seconds apart; the median over the rounds is the
throughput target's value.

`--prefill-pairs N` pairs W = 2's 8k prefill with W = 1's the same way: both `ringattn serve`s up,
each round a new 8k prompt (another seed: no prefix to reuse) alone on one, then on the other,
ABBA; the median of the rounds' TTFT ratios is the W = 2 target's value. Neither is stopped, as
there is nothing to stop: an idle `ringattn serve` takes no CPU (rank 0 waits on its queue, the
ranks exchange one "idle" plan a second; measured: its ranks' CPU time did not move in 40 s,
its agent's by under a second).

    python scripts/bench/serve.py --hf DIR --pairs 4 --prefill-pairs 3
"""

from __future__ import annotations

import os
import signal
import statistics
from collections.abc import Callable


def _signal(server, sig: int) -> None:
    os.killpg(server.proc.pid, sig)  # the server runs in its own session: its whole group


def paired(start: Callable, burst: Callable, throughput: Callable, rounds: int,
           names: tuple[str, str] = ("ringattn:1", "transformers"),
           pause: bool = True) -> dict:  # fmt: skip
    """`rounds` bursts on each of the two servers `start(kind)` gives ((server, client, model),
    warm), alternating A B, B A, ...; {"tokens_per_s": {kind: [per round]}, "ratios": [A / B
    per round], "median_ratio"}. `burst(client, model, round)` runs one burst: its records.
    `pause`: the idle server is stopped (SIGSTOP) during the other's burst."""
    up = {}
    sig = (lambda server, s: _signal(server, s)) if pause else (lambda server, s: None)
    try:
        for kind in names:
            up[kind] = start(kind)
            sig(up[kind][0], signal.SIGSTOP)
        speeds: dict[str, list[float]] = {kind: [] for kind in names}
        for i in range(rounds):
            for kind in names if i % 2 == 0 else names[::-1]:
                server, client, model = up[kind]
                sig(server, signal.SIGCONT)
                try:
                    speeds[kind].append(throughput(burst(client, model, i)))
                finally:
                    sig(server, signal.SIGSTOP)
    finally:
        for server, _, _ in up.values():
            _signal(server, signal.SIGCONT)  # a stopped process ignores SIGTERM until continued
            server.stop()
    a, b = names
    ratios = [x / y for x, y in zip(speeds[a], speeds[b])]
    return {"order": "ABBA", "tokens_per_s": speeds, "ratios": ratios,
            "median_ratio": statistics.median(ratios) if ratios else None}  # fmt: skip
