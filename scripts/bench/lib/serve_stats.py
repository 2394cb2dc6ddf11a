"""scripts/bench/serve.py's figures from timed records: percentiles, the longest stall, tokens/s,
time to first token, one server's summary, issue 32's targets, and the printed table.

A record is one request as the load sent it: `sent` (time.perf_counter seconds), `first` (its
first chunk with text or a finish reason), `times` (every chunk's arrival) and `tokens`.
"""

from __future__ import annotations

import itertools

TARGETS = {"throughput": (">=", 1.0), "stall": ("<=", 0.25), "prefix": ("<=", 0.3),
           "w2_prefill": ("<=", 0.65)}  # fmt: skip


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default)."""
    if not values:
        return None
    xs, pos = sorted(values), (len(values) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(values) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def longest_stall(streams: list[dict], start: float, end: float) -> float | None:
    """The longest gap between two chunks of one stream that overlaps (start, end); None when no
    stream had two chunks around or inside that window."""
    overlapping = [b - a for s in streams for a, b in itertools.pairwise(s["times"])
                   if b > start and a < end]  # fmt: skip
    return max(overlapping, default=None)


def throughput(records: list[dict]) -> float | None:
    """Generated tokens / (the last chunk's arrival - the first request's send)."""
    done = [r for r in records if r["times"]]
    wall = max((r["times"][-1] for r in done), default=0) - min(r["sent"] for r in records)
    return sum(r["tokens"] for r in done) / wall if done and wall > 0 else None


def ttft(record: dict) -> float | None:
    """Send to the first chunk with text or a finish reason (an answer may start with its end)."""
    return record["first"] - record["sent"] if record.get("first") is not None else None


def summarize(phases: dict) -> dict:
    """One server's figures from its phases' records (times are time.perf_counter seconds)."""
    shorts = [*phases["burst"], *phases["mixed"]["streams"], *phases["mixed"]["late"]]
    firsts = [t for t in map(ttft, shorts) if t is not None]
    itl = [b - a for r in shorts for a, b in itertools.pairwise(r["times"])]
    mixed = phases["mixed"]
    long_sent, long_ttft = mixed["long"]["sent"], ttft(mixed["long"])
    long_first = mixed["long"]["first"] if long_ttft is not None else float("inf")
    running = [*mixed["streams"], *mixed["late"]]
    stall = longest_stall(running, long_sent, long_first)
    first, second = (ttft(r) for r in phases["prefix"])
    late = [t for t in map(ttft, mixed["late"]) if t is not None]
    return {
        "ttft_p50_s": percentile(firsts, 50), "ttft_p99_s": percentile(firsts, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "burst_tokens_per_s": throughput(phases["burst"]),
        "mixed_tokens_per_s": throughput([*running, mixed["long"]]),
        "long_alone_ttft_s": ttft(phases["alone"]), "long_mixed_ttft_s": long_ttft,
        "longest_stall_s": stall,
        "stall_ratio": None if stall is None or not long_ttft else stall / long_ttft,
        "late_ttft_max_s": max(late, default=None),
        "prefix_first_ttft_s": first, "prefix_second_ttft_s": second,
        "prefix_ratio": second / first if first and second is not None else None,
        "kv_blocks": mixed.get("kv_blocks"),
    }  # fmt: skip


def targets(summaries: dict[str, dict], paired: float | None = None,
            prefill: float | None = None) -> list[dict]:  # fmt: skip
    """Issue 32's targets from the summaries by server: one row each, pass None if not measured;
    `paired`: the median ratio of paired bursts (serve_pairs.py), else the bursts' ratio;
    `prefill`: the median W = 2 / W = 1 8k TTFT of paired prefills, else the alone phases'."""
    w1, w2 = summaries.get("ringattn W=1", {}), summaries.get("ringattn W=2", {})
    hf = summaries.get("transformers", {})
    ratio = lambda a, b: a / b if a is not None and b else None
    burst_ratio = ratio(w1.get("burst_tokens_per_s"), hf.get("burst_tokens_per_s"))
    values = {"throughput": burst_ratio if paired is None else paired,
              "stall": w1.get("stall_ratio"), "prefix": w1.get("prefix_ratio"),
              "w2_prefill": prefill if prefill is not None else ratio(
                  w2.get("long_alone_ttft_s"), w1.get("long_alone_ttft_s"))}  # fmt: skip
    ok = lambda v, op, b: None if v is None else v >= b if op == ">=" else v <= b
    return [{"target": n, "value": values[n], "bound": f"{op} {b}", "pass": ok(values[n], op, b)}
            for n, (op, b) in TARGETS.items()]  # fmt: skip


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(summaries: dict[str, dict], rows: list[dict]) -> str:
    """The side-by-side table and the targets' pass/fail, as printed."""
    cols = [("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99"), ("itl_p50_s", "ITL p50"),
            ("itl_p99_s", "ITL p99"), ("burst_tokens_per_s", "tok/s"),
            ("long_alone_ttft_s", "long alone"), ("long_mixed_ttft_s", "long mixed"),
            ("longest_stall_s", "max gap"), ("late_ttft_max_s", "late TTFT"),
            ("prefix_ratio", "prefix x")]  # fmt: skip
    lines = [f"{'server':<14}" + "".join(f"{h:>11}" for _, h in cols) + f"{'KV blocks':>11}"]
    for name, s in summaries.items():
        kv = ",".join(f"{v:g}" for v in s["kv_blocks"].values()) if s.get("kv_blocks") else "null"
        cells = "".join(f"{_fmt(s.get(k)):>11}" for k, _ in cols)
        lines.append(f"{name:<14}{cells}{kv:>11}")
    lines.append("")  # then the targets
    for r in rows:
        verdict = {True: "pass", False: "FAIL", None: "n/a"}[r["pass"]]
        lines.append(f"{r['target']:<12} {_fmt(r['value'], '.3f'):>8} {r['bound']:<8} {verdict}")
    return "\n".join(lines)
