"""Serving under a bounded load: `ringattn serve` (W = 1, 2) beside `transformers serve`, one run.

    python scripts/bench/serve.py --hf /tmp/smollm2 [--quick]  # results/serve_bench_cpu*.json
    python scripts/bench/serve.py --hf DIR --serve-args "--max-batch-tokens 512 --kv-cache-gb 1"

Each server in turn, fresh on loopback (same model, cores, OMP_NUM_THREADS = cores / W), gets a
warm-up, then the same chats streamed through the `openai` client (temperature 0), every chunk's
arrival timed. alone: the 8k prompt on an idle server; prefix: two chats sharing a 4k system
prompt, in turn; burst: short chats at once (tokens/s); mixed: short streams, another 8k prompt
once each has its first token, late short chats 1 s after it: the longest gap of a stream that
overlaps the 8k prompt's wait for its first token is the stall its prefill causes (/metrics KV
block series sampled meanwhile). Targets and the table: docs/serving.md#the-serving-benchmark.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from ringattn.bench import record
from ringattn.bench.common import write_json

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from serve_servers import Server, get, ringattn_ready, server_argv
from serve_stats import summarize, table, targets, throughput, ttft

WORDS = ("river", "stone", "quiet", "lantern", "orbit", "velvet", "harbor", "meadow", "signal",
         "copper", "winter", "garden", "paper", "thunder", "silver", "market", "canyon", "violet",
         "engine", "feather", "island", "mirror", "planet", "echo", "summer", "rocket", "candle",
         "forest", "ladder", "marble", "ocean", "pepper", "saddle", "tunnel")  # fmt: skip
TOPICS = ("a lighthouse keeper", "a robot gardener", "a lost map", "a mountain village",
          "a clockmaker", "a desert caravan", "a sleepy dragon", "a river boat")  # fmt: skip
# prompt tokens (the long one's with its template: SmolLM2 has 8192 positions), requests, and
# tokens to generate (*_new) per phase
FULL = SimpleNamespace(long_tokens=8000, long_new=8, prefix_tokens=4000, prefix_new=8, burst=8,
                       burst_new=64, streams=4, stream_new=128, late=2, late_new=16)  # fmt: skip
QUICK = SimpleNamespace(**{**vars(FULL), "long_tokens": 512, "prefix_tokens": 256, "burst": 4,
                           "burst_new": 8, "streams": 2, "stream_new": 16, "late": 1,
                           "late_new": 4})  # fmt: skip


def filler(tokenizer, n_tokens: int, seed: int) -> str:
    """Seeded words cut to about n_tokens tokens of this tokenizer (decode of the first n)."""
    rng = random.Random(seed)
    words = " ".join(rng.choice(WORDS) for _ in range(n_tokens + 16))
    return tokenizer.decode(tokenizer.encode(words, add_special_tokens=False)[: max(n_tokens, 0)])


def prompt_tokens(tokenizer, messages: list[dict]) -> int:
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])  # fmt: skip


def long_chat(tokenizer, n_tokens: int, seed: int) -> list[dict]:
    """A user message whose templated prompt has about n_tokens tokens."""
    ask = "\n\nTell me a long story that uses these words."
    overhead = prompt_tokens(tokenizer, [{"role": "user", "content": "Words: " + ask}])
    words = filler(tokenizer, n_tokens - overhead, seed)
    return [{"role": "user", "content": "Words: " + words + ask}]


def prefix_chats(tokenizer, n_tokens: int, seed: int) -> list[list[dict]]:
    system = "You answer questions about these notes:\n" + filler(tokenizer, n_tokens, seed)
    return [[{"role": "system", "content": system}, {"role": "user", "content": q}]
            for q in ("Which word comes first?", "Which word appears most often?")]  # fmt: skip


def short_chat(i: int, tag: str = "") -> list[dict]:
    return [{"role": "user",
             "content": f"{tag}Tell me a long story about {TOPICS[i % len(TOPICS)]}."}]  # fmt: skip


def burst(client, model: str, sizes: SimpleNamespace, tag: str = "") -> list[dict]:
    """sizes.burst short chats at once (each `tag` + a story request): their records."""
    with ThreadPoolExecutor(sizes.burst) as pool:
        futures = [pool.submit(stream, client, model, short_chat(i, tag), sizes.burst_new, {})
                   for i in range(sizes.burst)]  # fmt: skip
        return [f.result() for f in futures]


def stream(client, model: str, messages: list[dict], max_tokens: int, record: dict) -> dict:
    """One streamed chat; fills `record` as chunks arrive (sent, times, tokens)."""
    record.update(sent=time.perf_counter(), first=None, times=[], tokens=0)
    usage = None
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True})  # fmt: skip
    for chunk in chunks:
        now = time.perf_counter()
        usage = chunk.usage or usage
        choice = chunk.choices[0] if chunk.choices else None
        if choice and (choice.delta.content or choice.finish_reason):
            record["first"] = now if record["first"] is None else record["first"]
        if choice and choice.delta.content:
            record["times"].append(now)
    record["tokens"] = usage.completion_tokens if usage else len(record["times"])
    record["usage"] = usage is not None
    return record


def kv_series(text: str) -> dict[str, float] | None:
    """{series: value} of every Prometheus sample whose name names kv and block; None if none."""
    samples = (re.fullmatch(r"(\S*kv\S*block\S*)\s+(\S+)", line.strip(), flags=re.IGNORECASE)
               for line in text.splitlines() if not line.startswith("#"))  # fmt: skip
    return {m[1]: float(m[2]) for m in samples if m} or None


def run_phases(client, model: str, sizes: SimpleNamespace, prompts: dict, metrics_url: str,
               late_after_s: float = 1.0) -> dict:  # fmt: skip
    """The four phases of the module docstring against one running server."""
    one = lambda messages, new: stream(client, model, messages, new, {})
    one(short_chat(0), 4)  # warm-up, untimed
    phases = {"alone": one(prompts["long_alone"], sizes.long_new)}
    phases["prefix"] = [one(m, sizes.prefix_new) for m in prompts["prefix"]]
    phases["burst"] = burst(client, model, sizes)
    with ThreadPoolExecutor(sizes.streams + sizes.late + 1) as pool:
        records = [{} for _ in range(sizes.streams)]
        futures = [pool.submit(stream, client, model, short_chat(i), sizes.stream_new, rec)
                   for i, rec in enumerate(records)]  # fmt: skip
        while not all(r.get("times") or f.done() for r, f in zip(records, futures)):
            time.sleep(0.02)
        long_record: dict = {}
        futures.append(pool.submit(stream, client, model, prompts["long_mixed"], sizes.long_new,
                                   long_record))  # fmt: skip
        time.sleep(late_after_s)
        late = [pool.submit(one, short_chat(i + 4), sizes.late_new) for i in range(sizes.late)]
        kv: dict[str, float] | None = None
        while not all(f.done() for f in [*futures, *late]):
            for key, value in (kv_series(get(metrics_url) or "") or {}).items():
                kv = kv or {}
                kv[key] = max(kv.get(key, value), value)
            time.sleep(1.0)
        for f in [*futures, *late]:
            f.result()  # raise what a stream raised
        phases["mixed"] = {"streams": records, "long": long_record,
                           "late": [f.result() for f in late], "kv_blocks": kv}  # fmt: skip
    return phases


def relative(phases: dict) -> dict:
    """The records with times in ms after the first send (alone's), for the JSON."""
    ms = lambda t: None if t is None else round((t - phases["alone"]["sent"]) * 1e3, 1)
    each = lambda r: [each(x) for x in r] if isinstance(r, list) else {
        "sent_ms": ms(r["sent"]), "first_ms": ms(r["first"]), "tokens": r["tokens"],
        "usage": r["usage"], "chunk_ms": [ms(t) for t in r["times"]]}  # fmt: skip
    return {k: {m: each(x) for m, x in v.items() if m != "kv_blocks"} if k == "mixed" else each(v)
            for k, v in phases.items()}  # fmt: skip


def start(kind: str, args: argparse.Namespace, warm: bool = False) -> tuple:
    """One server up: (Server, openai client, model name, its argv, OMP_NUM_THREADS)."""
    import openai

    argv, nproc, port = server_argv(kind, args)
    cores = len(args.cpus.split(",")) if args.cpus else len(os.sched_getaffinity(0))
    threads = str(args.threads or max(1, cores // nproc))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "HF_HUB_OFFLINE": "1"}
    base = f"http://127.0.0.1:{port}"  # transformers serve: ready once /health answers
    ready = lambda s: f"{base}/v1" if get(f"{base}/health") is not None else None
    server = Server(argv, env, ringattn_ready if port is None else ready)
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=3600)
        model = args.hf if port is not None else client.models.list().data[0].id
        if warm:
            stream(client, model, short_chat(0), 4, {})
    except BaseException:
        server.stop()
        raise
    return server, client, model, argv, int(threads)


def measure(kind: str, args: argparse.Namespace, sizes: SimpleNamespace, prompts: dict) -> dict:
    """Start one server, run the phases, stop it: {"argv", "summary", "records"}."""
    server, client, model, argv, threads = start(kind, args)
    try:
        metrics_url = server.url.removesuffix("/v1") + "/metrics"
        phases = run_phases(client, model, sizes, prompts, metrics_url)
    finally:
        server.stop()
    return {"argv": argv, "omp_num_threads": threads, "summary": summarize(phases),
            "records": relative(phases)}  # fmt: skip


def pairs(args: argparse.Namespace, sizes: SimpleNamespace) -> dict:
    """--pairs rounds of the burst on ringattn W=1 and transformers serve, up side by side."""
    import serve_pairs

    def up(kind: str) -> tuple:
        return start(kind, args, warm=True)[:3]

    def one(client, model: str, i: int) -> list[dict]:
        return burst(client, model, sizes, tag=f"Story {i + 1}: ")

    return serve_pairs.paired(up, one, throughput, args.pairs)


def prefill_pairs(args: argparse.Namespace, sizes: SimpleNamespace, tokenizer) -> dict:
    """--prefill-pairs rounds of a new 8k prompt alone on ringattn W=1 and W=2, both up, ABBA
    (serve_pairs.py): {"ttft_s": {kind: [per round]}, "ratios": [W=2 / W=1], "median_ratio"}."""
    import serve_pairs

    def one(client, model: str, i: int) -> float:
        messages = long_chat(tokenizer, sizes.long_tokens, seed=100 + i)  # nothing to reuse
        first = ttft(stream(client, model, messages, sizes.long_new, {}))
        if first is None:
            raise RuntimeError(f"round {i}: the 8k prompt got no answer")
        return 1.0 / first  # a speed: paired's ratio W=1 / W=2 of speeds is TTFT W=2 / W=1

    out = serve_pairs.paired(lambda kind: start(kind, args, warm=True)[:3], one, lambda x: x,
                             args.prefill_pairs, names=("ringattn:1", "ringattn:2"),
                             pause=False)  # fmt: skip
    ttfts = {kind: [1.0 / v for v in speeds] for kind, speeds in out["tokens_per_s"].items()}
    return {"order": out["order"], "ratios": out["ratios"], "median_ratio": out["median_ratio"],
            "ttft_s": ttfts}  # fmt: skip


def head(load_before: float, pinned: str | None) -> dict:
    """bench/record.py's block, with the CPUs the run may use, the load around it and the
    commit."""
    block = record.header(__file__, None, ["transformers", "openai"])
    block["machine"].update({"affinity": sorted(os.sched_getaffinity(0)), "pinned": pinned,
                             "load_avg_1m_before": load_before,
                             "load_avg_1m_after": os.getloadavg()[0]})  # fmt: skip
    git = ["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "HEAD"]
    commit = subprocess.run(git, capture_output=True, text=True, check=False)
    block["versions"]["ringattn_commit"] = commit.stdout.strip() or None
    return block


def parse_sizes(base: SimpleNamespace, text: str) -> SimpleNamespace:
    """--sizes "burst=2,long_tokens=120" over the preset."""
    pairs = dict(item.split("=", 1) for item in text.split(",") if item)
    if unknown := set(pairs) - set(vars(base)):
        raise SystemExit(f"--sizes: unknown {sorted(unknown)}; the sizes are {list(vars(base))}")
    return SimpleNamespace(**{**vars(base), **{k: int(v) for k, v in pairs.items()}})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf", required=True, help="the model directory (both servers load it)")
    p.add_argument("--quick", action="store_true", help="smaller prompts, fewer requests")
    p.add_argument("--sizes", default="", help="k=v,... over the preset (FULL's names)")
    p.add_argument("--servers", default="transformers,ringattn:1,ringattn:2", help="in order")
    p.add_argument("--serve-args", default="", help="extra `ringattn serve` flags (one string)")
    p.add_argument("--transformers-args", default="", help="extra `transformers serve` flags")
    p.add_argument("--cpus", default="", help="pin every server with taskset -c CPUS (e.g. 0,1)")
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS (0: cores / W)")
    p.add_argument("--json", default=None, help="default results/serve_bench_cpu[_quick].json")
    p.add_argument("--pairs", type=int, default=0, help="rounds of paired bursts, ringattn W=1 "
                   "and transformers at once (serve_pairs.py): the throughput target")  # fmt: skip
    p.add_argument("--prefill-pairs", type=int, default=0,
                   help="rounds of the 8k prompt alone on ringattn W=1 and W=2, up at once: "
                   "the W=2 prefill target's value")  # fmt: skip
    args = p.parse_args(argv)
    sizes = parse_sizes(QUICK if args.quick else FULL, args.sizes)
    kinds = [k for k in args.servers.split(",") if k]  # none: the pairs only
    if bad := [k for k in kinds if not re.fullmatch(r"transformers|ringattn:[1-9]\d*", k)]:
        raise SystemExit(f"--servers: unknown {bad}; use transformers, ringattn:1, ringattn:2 ...")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.hf)
    prompts = {"long_alone": long_chat(tok, sizes.long_tokens, seed=1),
               "long_mixed": long_chat(tok, sizes.long_tokens, seed=2),
               "prefix": prefix_chats(tok, sizes.prefix_tokens, seed=3)}  # fmt: skip
    counts = {k: [prompt_tokens(tok, m) for m in v] if k == "prefix" else prompt_tokens(tok, v)
              for k, v in prompts.items()}  # fmt: skip
    print(f"prompt tokens {counts}; sizes {vars(sizes)}", flush=True)
    load_before, servers = os.getloadavg()[0], {}
    path = args.json or f"results/serve_bench_cpu{'_quick' if args.quick else ''}.json"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    steps = [*kinds, *(["pairs"] if args.pairs else []),
             *(["prefill pairs"] if args.prefill_pairs else [])]  # fmt: skip
    paired = prefill = None
    for kind in steps:  # the JSON is rewritten after each server: a cut-short run keeps its part
        began, name = time.perf_counter(), kind.replace("ringattn:", "ringattn W=")
        try:
            if kind == "pairs":
                paired = pairs(args, sizes)
            elif kind == "prefill pairs":
                prefill = prefill_pairs(args, sizes, tok)
            else:
                servers[name] = measure(kind, args, sizes, prompts)
        except Exception as err:  # noqa: BLE001 (one server's failure is recorded, the rest run)
            servers[name] = {"error": f"{type(err).__name__}: {err}"[-4000:]}
        error = servers.get(name, {}).get("error", "")
        print(f"{name}: {time.perf_counter() - began:.0f} s {error}", flush=True)
        summaries = {k: v["summary"] for k, v in servers.items() if "summary" in v}
        medians = [x and x["median_ratio"] for x in (paired, prefill)]
        out = {**head(load_before, args.cpus or None), "sizes": vars(sizes),
               "prompt_tokens": counts, "targets": targets(summaries, *medians), "pairs": paired,
               "prefill_pairs": prefill, "servers": servers}  # fmt: skip
        write_json(path, out)
    if paired:
        print(f"paired bursts, ringattn W=1 / transformers per round: "
              f"{', '.join(f'{r:.3f}' for r in paired['ratios'])}")  # fmt: skip
    if prefill:
        print(f"paired 8k prefills, ringattn W=2 / W=1 TTFT per round: "
              f"{', '.join(f'{r:.3f}' for r in prefill['ratios'])}")  # fmt: skip
    print(f"{table(summaries, out['targets'])}\nwrote {path}")
    return 1 if any("error" in v for v in servers.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
