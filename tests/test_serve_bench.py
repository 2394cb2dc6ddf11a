"""scripts/bench/serve.py and serve_stats.py: the statistics, targets and table on synthetic
timings, and the load's phases against the tests' tiny chat model served in process (ringattn
only; no timing asserted).
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import time
import urllib.request

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "bench" / "serve.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPT.parent / "lib"))  # its servers and statistics, as it does
    spec = importlib.util.spec_from_file_location("serve_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_bench"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["serve_bench"]
    sys.path.remove(str(SCRIPT.parent / "lib"))


@pytest.fixture(scope="module")
def stats(bench):
    """scripts/bench/lib/serve_stats.py, which serve.py imports (its figures from records)."""
    return sys.modules["serve_stats"]


class Stand:
    """A stand-in server: a real process in its own session (what serve_pairs signals)."""

    def __init__(self):
        self.proc = subprocess.Popen(["sleep", "300"], start_new_session=True)

    def stop(self):
        self.proc.kill()
        self.proc.wait(30)


def record(sent: float, times: list[float], first: float | None = None, tokens=None) -> dict:
    first = times[0] if first is None and times else first
    return {"sent": sent, "first": first, "times": times,
            "tokens": len(times) if tokens is None else tokens}  # fmt: skip


def test_percentile_interpolates_between_ranks(stats):
    assert stats.percentile([], 50) is None
    assert stats.percentile([3.0], 99) == 3.0
    assert stats.percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert stats.percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert stats.percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def test_longest_stall_counts_only_gaps_overlapping_the_window(stats):
    a = record(0.0, [0.5, 1.0, 5.0, 5.5])  # the 4 s gap (1, 5) spans the window (2, 4)
    b = record(0.0, [3.0, 3.2, 3.3])  # inside it: 0.2 and 0.1
    c = record(0.0, [6.0, 9.0])  # after it: a 3 s gap that must not count
    assert stats.longest_stall([a, b, c], 2.0, 4.0) == pytest.approx(4.0)
    assert stats.longest_stall([b], 2.0, 4.0) == pytest.approx(0.2)
    assert stats.longest_stall([c], 2.0, 4.0) is None
    assert stats.longest_stall([record(0.0, [3.0])], 2.0, 4.0) is None  # one chunk: no gap


def test_ttft_counts_an_answer_that_starts_with_its_end(stats):
    assert stats.ttft(record(1.0, [], first=3.5, tokens=1)) == pytest.approx(2.5)
    assert stats.ttft(record(1.0, [])) is None
    assert stats.throughput([record(0.0, [1.0, 2.0], tokens=4), record(1.0, [3.0, 4.0])]) == 1.5


def phases(prefix_second: float, stall_at: float) -> dict:
    """Synthetic phases: a 10 s long prompt sent at t=100 beside a stream that waits `stall_at`
    once, then chunks every 0.5 s."""
    resumed = [100.2 + stall_at + 0.5 * k for k in range(int((111 - 100.2 - stall_at) / 0.5))]
    return {
        "alone": record(0.0, [8.0, 8.5]),
        "prefix": [record(10.0, [14.0]), record(20.0, [20.0 + 4.0 * prefix_second])],
        "burst": [record(30.0, [31.0, 31.5, 32.0]), record(30.0, [32.0, 32.5, 33.0])],
        "mixed": {
            "streams": [record(99.0, [99.5, 100.2, *resumed])],
            "long": record(100.0, [110.0]),
            "late": [record(101.0, [110.5, 111.5])],
            "kv_blocks": {"ringattn_kv_blocks_used": 12.0},
        },
    }


def test_summary_and_targets_from_synthetic_timings(stats):
    w1 = stats.summarize(phases(prefix_second=0.25, stall_at=2.0))
    assert w1["long_alone_ttft_s"] == 8.0 and w1["long_mixed_ttft_s"] == 10.0
    assert w1["longest_stall_s"] == pytest.approx(2.0) and w1["stall_ratio"] == pytest.approx(0.2)
    assert w1["prefix_ratio"] == pytest.approx(0.25) and w1["late_ttft_max_s"] == 9.5
    assert w1["burst_tokens_per_s"] == pytest.approx(6 / 3.0)
    # TTFTs of the short chats: burst 1, 2; stream 0.5; late 9.5
    assert w1["ttft_p50_s"] == pytest.approx(1.5)
    assert w1["itl_p50_s"] == pytest.approx(0.5)
    w2 = {**w1, "long_alone_ttft_s": 4.0}
    hf = {**w1, "burst_tokens_per_s": 2.5}
    rows = {r["target"]: r for r in stats.targets({"ringattn W=1": w1, "ringattn W=2": w2,
                                                    "transformers": hf})}  # fmt: skip
    assert rows["throughput"]["value"] == pytest.approx(0.8) and rows["throughput"]["pass"] is False
    assert rows["stall"]["pass"] is True and rows["prefix"]["pass"] is True
    assert rows["w2_prefill"]["value"] == pytest.approx(0.5) and rows["w2_prefill"]["pass"] is True
    stalled = stats.summarize(phases(prefix_second=1.0, stall_at=9.0))
    rows = {r["target"]: r for r in stats.targets({"ringattn W=1": stalled})}
    assert rows["stall"]["pass"] is False and rows["prefix"]["pass"] is False
    assert rows["throughput"]["pass"] is None and rows["w2_prefill"]["pass"] is None
    text = stats.table({"ringattn W=1": stalled}, list(rows.values()))
    assert "ringattn W=1" in text and "FAIL" in text and "n/a" in text and "12" in text


def test_kv_series_reads_block_samples_only(bench):
    text = ("# HELP ringattn_kv_blocks_used blocks\n# TYPE ringattn_kv_blocks_used gauge\n"
            "ringattn_kv_blocks_used 7\nringattn_kv_blocks_free 25\n"
            "ringattn_running_sequences 2\n")  # fmt: skip
    assert bench.kv_series(text) == {
        "ringattn_kv_blocks_used": 7.0,
        "ringattn_kv_blocks_free": 25.0,
    }
    assert bench.kv_series("ringattn_running_sequences 2\n") is None


def test_sizes_override_names_the_fields(bench):
    sizes = bench.parse_sizes(bench.QUICK, "burst=2,long_tokens=100")
    assert sizes.burst == 2 and sizes.long_tokens == 100 and sizes.late == bench.QUICK.late
    with pytest.raises(SystemExit, match="unknown \\['bursts'\\]"):
        bench.parse_sizes(bench.QUICK, "bursts=2")


@pytest.mark.slow
def test_the_load_against_the_tiny_served_model(bench, stats, tmp_path_factory):
    """Every phase streams through the openai client and the summary has each figure, the KV
    pool's block series scraped from /metrics among them."""
    from serve_model import served_tiny

    sizes = bench.parse_sizes(
        bench.QUICK,
        "long_tokens=100,long_new=4,prefix_tokens=60,"
        "prefix_new=3,burst=2,burst_new=4,stream_new=6,late_new=3",
    )
    with served_tiny(tmp_path_factory) as (server, client, _, tok, _):
        prompts = {"long_alone": bench.long_chat(tok, sizes.long_tokens, seed=1),
                   "long_mixed": bench.long_chat(tok, sizes.long_tokens, seed=2),
                   "prefix": bench.prefix_chats(tok, sizes.prefix_tokens, seed=3)}  # fmt: skip
        assert abs(bench.prompt_tokens(tok, prompts["long_alone"]) - 100) <= 3
        metrics_url = server.url.removesuffix("/v1") + "/metrics"
        phases = bench.run_phases(client, "tiny", sizes, prompts, metrics_url, late_after_s=0.2)
        after = bench.kv_series(urllib.request.urlopen(metrics_url, timeout=30).read().decode())
    summary = stats.summarize(phases)
    for key in ("ttft_p50_s", "ttft_p99_s", "burst_tokens_per_s", "long_alone_ttft_s",
                "long_mixed_ttft_s", "prefix_ratio", "late_ttft_max_s"):  # fmt: skip
        assert summary[key] is not None and summary[key] > 0, key
    used, free = 'ringattn_kv_blocks{state="used"}', 'ringattn_kv_blocks{state="free"}'
    assert after[used] == 0 and after[free] > 0  # every request's blocks are back
    if summary["kv_blocks"] is not None:  # polled each second while the mixed phase ran
        assert summary["kv_blocks"][free] > 0 and summary["kv_blocks"][used] >= 0
    assert all(r["tokens"] >= 1 for r in phases["burst"])
    relative = bench.relative(phases)
    assert len(relative["mixed"]["streams"]) == 2 and relative["alone"]["first_ms"] > 0


def test_paired_bursts_alternate_with_the_idle_server_stopped(stats):
    """serve_pairs.paired over two stand-in servers (real processes in their own sessions): the
    bursts go A B, B A, A B; during each, the other server's process is stopped (state T) and
    the running one is not; the ratios are per round, their median the target's value; both
    servers are stopped at the end, even though one was left stopped."""
    import serve_pairs

    def stopped(server, want: bool) -> bool:
        """Whether the process is stopped (state T) once a pending signal has landed (2 s)."""
        deadline = time.monotonic() + 2.0
        while True:
            text = pathlib.Path(f"/proc/{server.proc.pid}/stat").read_text()
            now = text.split(") ")[1][0] == "T"
            if now == want or time.monotonic() > deadline:
                return now
            time.sleep(0.01)

    up, seen = {}, []
    speed = {"a": [10.0, 12.0, 9.0], "b": [8.0, 12.0, 10.0]}

    def start(kind):
        up[kind] = Stand()
        return up[kind], kind, "model"

    def burst(client, model, i):
        other = "b" if client == "a" else "a"
        seen.append((client, i, stopped(up[client], False), stopped(up[other], True)))
        return speed[client][i]

    out = serve_pairs.paired(start, burst, lambda x: x, 3, names=("a", "b"))
    assert [(k, i) for k, i, _, _ in seen] == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2),
                                               ("b", 2)]  # fmt: skip
    assert all(not mine and other for _, _, mine, other in seen), seen
    assert out["ratios"] == pytest.approx([1.25, 1.0, 0.9]) and out["median_ratio"] == 1.0
    assert all(s.proc.poll() is not None for s in up.values())
    rows = {r["target"]: r for r in stats.targets({}, out["median_ratio"])}
    assert rows["throughput"]["value"] == 1.0 and rows["throughput"]["pass"] is True


def test_paired_prefills_leave_both_servers_running(bench, stats, monkeypatch):
    """--prefill-pairs: paired(pause=False) stops neither server (an idle ringattn serve takes no
    CPU); prefill_pairs turns each round's TTFT into W=2 / W=1 ratios, and their median is the
    w2_prefill target's value."""
    up = {}

    def start(kind, args, warm=False):
        up[kind] = Stand()
        return up[kind], kind, "model", [], 1

    ttfts = {"ringattn:1": [60.0, 62.0, 58.0], "ringattn:2": [36.0, 43.4, 40.6]}
    calls = []

    def stream(client, model, messages, max_tokens, record):
        states = {k: pathlib.Path(f"/proc/{s.proc.pid}/stat").read_text().split(") ")[1][0]
                  for k, s in up.items()}  # fmt: skip
        calls.append((client, messages[0]["content"][:40], states))
        return {"sent": 0.0, "first": ttfts[client][sum(c[0] == client for c in calls) - 1]}

    monkeypatch.setattr(bench, "start", start)
    monkeypatch.setattr(bench, "stream", stream)
    monkeypatch.setattr(bench, "long_chat", lambda tok, n, seed: [{"content": f"seed {seed}"}])
    args = bench.argparse.Namespace(prefill_pairs=3)
    out = bench.prefill_pairs(args, bench.QUICK, tokenizer=None)
    assert [c[0] for c in calls] == ["ringattn:1", "ringattn:2", "ringattn:2", "ringattn:1",
                                     "ringattn:1", "ringattn:2"]  # fmt: skip
    assert len({c[1] for c in calls}) == 3  # a new prompt each round, the same on both servers
    assert all(state != "T" for c in calls for state in c[2].values()), calls
    assert out["ratios"] == pytest.approx([0.6, 0.7, 0.7]) and out["median_ratio"] == 0.7
    assert out["ttft_s"]["ringattn:2"] == pytest.approx(ttfts["ringattn:2"])
    assert all(s.proc.poll() is not None for s in up.values())
    summaries = {
        "ringattn W=1": {"long_alone_ttft_s": 60.0},
        "ringattn W=2": {"long_alone_ttft_s": 45.0},
    }
    rows = {r["target"]: r for r in stats.targets(summaries, None, out["median_ratio"])}
    assert rows["w2_prefill"]["value"] == 0.7 and rows["w2_prefill"]["pass"] is False
    rows = {r["target"]: r for r in stats.targets(summaries)}  # unpaired: the alone phases
    assert rows["w2_prefill"]["value"] == 0.75
