"""Structured outputs under load: JSON-schema answers parse and validate; their cost in tokens/s.

    python scripts/bench/structured.py --hf /tmp/smollm2   # results/structured_bench_cpu.json
    python scripts/bench/structured.py --hf DIR --servers ringattn:1 --requests 20 --rounds 1
    python scripts/bench/structured.py --hf DIR --step-cost --json results/x.json  # no server
    python scripts/bench/structured.py --hf DIR --servers ringattn:1 --max-tokens 64 \
        --concurrency 16 --threads 1 --json results/structured_bench_cpu_w1.json  # shared CPU

Each `ringattn serve --nproc W` in turn (fresh, on loopback, OMP_NUM_THREADS = --threads or
cores / W) gets a warm-up, then rounds of the same --requests chats (a fictional person each,
greedy, --concurrency at a time, --max-tokens each), alternately with `response_format`
json_schema (the keys required, their types and ranges, no other keys: SCHEMA) and without it,
in the order C U U C ... so that a drift of the machine's load falls on both alike. Every
constrained answer must parse and follow SCHEMA (the check is written out here). Tokens/s =
completion tokens / the round's wall time; the cost is unconstrained tokens/s over constrained
tokens/s, per round pair and overall. The issue's targets: 100 % valid, and constrained at most
1.15x slower.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from ringattn.bench import record
from ringattn.bench.common import write_json

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from serve_servers import Server, ringattn_ready, server_argv

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "city", "hobbies"],
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 16}},
    },
}  # bounded: at most about 170 characters, so max_tokens 200 always lets the JSON close
MAX_TOKENS = 200  # --max-tokens: both kinds of request alike
TOOL = {"name": "lookup", "parameters": SCHEMA}  # --step-cost --step-grammar tools
CITIES = ("Paris", "Oslo", "Lima", "Kyoto", "Cairo", "Quito", "Perth", "Turin", "Dakar", "Hanoi")
HOBBIES = ("chess", "sailing", "pottery", "running", "jazz")


def chats(n: int) -> list[list[dict]]:
    """n chats, each asking for a different fictional person as JSON."""
    return [[{"role": "user", "content": f"Invent a person who lives in {CITIES[i % 10]} and "
              f"likes {HOBBIES[(i // 10) % 5]}. Answer in JSON with the keys name, age, city "
              f"and hobbies."}] for i in range(n)]  # fmt: skip


def follows(answer: str) -> bool:
    """Whether `answer` is JSON with exactly SCHEMA's keys, each of its type and bounds."""
    try:
        value = json.loads(answer)
    except ValueError:
        return False
    if not isinstance(value, dict) or set(value) != set(SCHEMA["required"]):
        return False
    name, age, city, hobbies = (value[k] for k in ("name", "age", "city", "hobbies"))
    return (isinstance(name, str) and len(name) <= 24 and type(age) is int and 0 <= age <= 120
            and isinstance(city, str) and len(city) <= 24 and isinstance(hobbies, list)
            and len(hobbies) <= 3
            and all(isinstance(h, str) and len(h) <= 16 for h in hobbies))  # fmt: skip


def one_round(
    client,
    model: str,
    messages: list,
    constrained: bool,
    concurrency: int,
    max_tokens: int = MAX_TOKENS,
) -> dict:
    """Every chat once, `concurrency` at a time: tokens, wall time, the answers' validity."""
    extra = {"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA, "strict": True}}} if constrained else {}  # fmt: skip

    def ask(m: list[dict]):
        reply = client.chat.completions.create(model=model, messages=m, max_tokens=max_tokens,
                                               temperature=0, **extra)  # fmt: skip
        return reply.choices[0], reply.usage.completion_tokens

    began = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(ask, messages))
    wall = time.perf_counter() - began
    tokens = sum(n for _, n in answers)
    texts = [c.message.content or "" for c, _ in answers]
    parsed = sum(1 for t in texts if _parses(t))
    return {"constrained": constrained, "requests": len(texts), "completion_tokens": tokens,
            "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
            "parsed": parsed, "valid": sum(map(follows, texts)),
            "stopped": sum(c.finish_reason == "stop" for c, _ in answers),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "example": texts[0][:200],
            "invalid": [{"finish_reason": c.finish_reason, "tokens": n, "text": c.message.content}
                        for c, n in answers if constrained and not follows(c.message.content
                                                                           or "")][:5]}  # fmt: skip


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def measure(kind: str, args: argparse.Namespace, report) -> dict:
    """One server up, a warm-up, --rounds pairs of rounds (C U, U C, ...), down; `report` gets
    the result so far after each round (a run cut short keeps what it measured)."""
    import openai

    argv, nproc, _ = server_argv(kind, args)
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // nproc)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    server = Server(argv, env, ringattn_ready)
    # a SIGTERM (a `timeout`) takes the server down with us: requests in flight would keep
    # the worker threads, and so a plain exit, waiting
    signal.signal(signal.SIGTERM, lambda *_: (server.stop(), os._exit(143)))
    try:
        client = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0, timeout=3600)
        model = client.models.list().data[0].id
        messages = chats(args.requests)
        one_round(
            client, model, messages[: args.concurrency], True, args.concurrency, args.max_tokens
        )  # warm-up
        rounds = []
        for i in range(args.rounds):
            for constrained in (True, False) if i % 2 == 0 else (False, True):
                rounds.append(
                    one_round(
                        client, model, messages, constrained, args.concurrency, args.max_tokens
                    )
                )
                r = rounds[-1]
                report({"argv": argv, "omp_num_threads": threads, "rounds": rounds,
                        "complete": False, **summary(rounds)})  # fmt: skip
                print(f"  {kind} {'constrained  ' if constrained else 'unconstrained'} "
                      f"{r['tokens_per_s']:8.1f} tok/s  valid {r['valid']}/{r['requests']}",
                      flush=True)  # fmt: skip
    finally:
        server.stop()
    return {"argv": argv, "omp_num_threads": threads, "rounds": rounds, "complete": True,
            **summary(rounds)}  # fmt: skip


def summary(rounds: list[dict]) -> dict:
    """Validity over the constrained rounds; the slowdown per pair and overall."""
    c = [r for r in rounds if r["constrained"]]
    u = [r for r in rounds if not r["constrained"]]

    def speed(rs: list[dict]) -> float | None:
        return (
            sum(r["completion_tokens"] for r in rs) / sum(r["wall_s"] for r in rs) if rs else None
        )

    pairs = [round(b["tokens_per_s"] / a["tokens_per_s"], 3) for a, b in zip(c, u)]
    asked = sum(r["requests"] for r in c)
    return {"valid_fraction": sum(r["valid"] for r in c) / asked if c else None,
            "parsed_fraction": sum(r["parsed"] for r in c) / asked if c else None,
            "constrained_tokens_per_s": round(speed(c), 2) if c else None,
            "unconstrained_tokens_per_s": round(speed(u), 2) if u else None,
            "slowdown": round(speed(u) / speed(c), 3) if c and u else None,
            "slowdown_per_pair": pairs}  # fmt: skip


def step_cost(args: argparse.Namespace) -> dict:
    """Rank 0's per-step cost of the grammar against the model's, side by side in one process:
    batch --concurrency decode steps of the model (transformers' forward with its KV cache,
    float32) and, each step, the shaping of every row (serve/logits.py: the grammar's mask) and
    the sampled token's accept, timed step by step. (forward + shaping) / forward bounds the
    tokens/s slowdown of a batch whose every request is constrained. --step-grammar tools: the
    grammar of a strict tool under tool_choice "auto" (free text, calls held to TOOL), with
    which the model answers in text: the cost an agent's text answer pays."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ringattn.serve.api.grammar import Grammars
    from ringattn.serve.logits import Shaper, shape_rows
    from ringattn.serve.protocol import Request

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.hf)
    model = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    grammars = Grammars(tok, vocab, [tok.eos_token_id])
    if args.step_grammar == "tools":
        grammar = grammars.text_or_tool_calls([TOOL], several=True)
    else:
        grammar = grammars.json_schema(SCHEMA, "bench")
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, return_dict=False)
               for m in chats(args.concurrency)]  # fmt: skip
    width = min(len(p) for p in prompts)  # the same length: no padding in the batch
    ids = torch.tensor([p[-width:] for p in prompts])
    shapers = [Shaper(Request(p[-width:], MAX_TOKENS, grammar=grammar)) for p in prompts]
    forward_s, shape_s, cache = [], [], None
    with torch.no_grad():
        for _ in range(args.steps):
            began = time.perf_counter()
            out = model(ids, past_key_values=cache, use_cache=True)
            logits, cache = out.logits[:, -1].float(), out.past_key_values  # (B, vocab)
            middle = time.perf_counter()
            tokens = shape_rows(logits, shapers).argmax(-1).tolist()
            for s, t in zip(shapers, tokens):
                if not s.matcher.is_stopped():  # (a finished answer's row is masked still)
                    s.accept(t)
            forward_s.append(middle - began)
            shape_s.append(time.perf_counter() - middle)
            ids = torch.tensor([[t] for t in tokens])
    median = lambda xs: sorted(xs)[len(xs) // 2]
    f, g = median(forward_s[1:]), median(shape_s[1:])  # the first step is the prefill
    return {"grammar": args.step_grammar, "batch": args.concurrency, "steps": args.steps,
            "vocab": vocab, "threads": torch.get_num_threads(),
            "forward_ms_median": round(f * 1e3, 3), "shaping_ms_median": round(g * 1e3, 3),
            "shaping_per_row_us": round(g / args.concurrency * 1e6, 1),
            "slowdown_bound": round((f + g) / f, 4)}  # fmt: skip


def table(servers: dict) -> str:
    head = ("| server | valid | parsed | constrained tok/s | unconstrained tok/s | slowdown "
            "(target <= 1.15) | per pair |")  # fmt: skip
    rows = [head, "|---|---|---|---|---|---|---|"]
    for name, s in servers.items():
        if "error" in s:
            rows.append(f"| {name} | error: {s['error'][:80]} | | | | | |")
            continue
        rows.append(
            f"| {name} | {s['valid_fraction']:.0%} | {s['parsed_fraction']:.0%} | "
            f"{s['constrained_tokens_per_s']:.1f} | {s['unconstrained_tokens_per_s']:.1f}"
            f" | {s['slowdown']:.3f}x | {', '.join(map(str, s['slowdown_per_pair']))} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf", required=True, help="the model directory (SmolLM2-135M-Instruct)")
    p.add_argument("--servers", default="ringattn:1,ringattn:2", help="ringattn:W, in order")
    p.add_argument("--requests", type=int, default=50, help="chats per round")
    p.add_argument("--rounds", type=int, default=2, help="pairs of rounds (C U, then U C ...)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=MAX_TOKENS,
        help="max_tokens of every request, constrained or not (below about 100 a "
        "constrained answer may be cut before its JSON closes)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="OMP_NUM_THREADS of each rank (0: cores / W); on a shared, loaded machine 1 "
        "avoids OpenMP's oversubscription (a batch-8 SmolLM2 step: 0.25 s with 1, 1.2 to 7.9 "
        "s with 2, at load average 7)",
    )
    p.add_argument("--serve-args", default="", help="extra `ringattn serve` flags (one string)")
    p.add_argument("--json", default="results/structured_bench_cpu.json")
    p.add_argument(
        "--step-cost",
        action="store_true",
        help="only the per-step cost of the "
        "grammar beside the model's forward, in this process (no server)",
    )
    p.add_argument("--steps", type=int, default=40, help="decode steps of --step-cost")
    p.add_argument("--step-grammar", choices=["schema", "tools"], default="schema",
                   help="--step-cost's grammar: SCHEMA's, or a strict tool's under "
                   "tool_choice auto (the model then writes text)")  # fmt: skip
    args = p.parse_args(argv)
    args.cpus = ""  # (serve_servers.server_argv's pinning: not used here)
    if args.step_cost:
        head = record.header(__file__, argv, ["transformers", "llguidance"])
        result = step_cost(args)
        print(json.dumps(result, indent=1))
        write_json(args.json, {**head, "step_cost": result})
        print(f"wrote {args.json}")
        return 0
    load_before, servers = os.getloadavg()[0], {}

    def save() -> None:
        head = record.header(__file__, argv, ["transformers", "openai", "llguidance"])
        head["machine"].update({"load_avg_1m_before": load_before,
                                "load_avg_1m_after": os.getloadavg()[0]})  # fmt: skip
        sizes = SimpleNamespace(requests=args.requests, rounds=args.rounds,
                                concurrency=args.concurrency, max_tokens=args.max_tokens,
                                threads=args.threads)  # fmt: skip
        write_json(args.json, {**head, "sizes": vars(sizes), "schema": SCHEMA,
                               "servers": servers})  # fmt: skip

    for kind in [k for k in args.servers.split(",") if k]:
        name = kind.replace("ringattn:", "ringattn W=")
        began = time.perf_counter()

        def report(part: dict, name: str = name) -> None:
            servers[name] = part
            save()

        try:
            servers[name] = measure(kind, args, report)
        except Exception as err:  # noqa: BLE001 (one server's failure is recorded)
            servers[name] = {"error": f"{type(err).__name__}: {err}"[-4000:]}
        print(f"{name}: {time.perf_counter() - began:.0f} s", flush=True)
        save()
    print(f"{table(servers)}\nwrote {args.json}")
    return 1 if any("error" in s for s in servers.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
