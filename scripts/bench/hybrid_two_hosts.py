"""A hybrid model's mixer schemes over two hosts: state passing against heads and whole. Root.

    sudo .venv/bin/python scripts/bench/hybrid_two_hosts.py               # 1gbit, S 16k
    sudo .venv/bin/python scripts/bench/hybrid_two_hosts.py --rates 100mbit,1gbit --steps 4

Two "hosts" on this machine (ringattn/testing/hosts.py: network namespaces joined by a veth link
shaped by tc tbf), one rank each, cp 2, zigzag, ring attention: `torchrun --nnodes 2 -m ringattn
train --hf DIR` of the Qwen3.5-style model of scripts/bench/hybrid.py (8 layers, 6 gated
DeltaNet with 4 key heads: every scheme can run it at cp 2) on a text file read as bytes, once
per --mixer-scheme. The median step seconds after the first step (rank 0's train_log.jsonl) and
the bytes each rank sends per mixer layer (the planner's count for the scheme) are recorded per
scheme and rate, beside the load average. Prints a table, writes JSON to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hybrid import _config  # the sibling bench's model

from ringattn.bench import record
from ringattn.testing.hosts import TwoHosts, unavailable

SCHEMES = ("state", "heads", "whole")


def _model_dir(root: str, seq_len: int) -> str:
    config = _config("qwen3_5", seq_len)
    config.architectures = ["Qwen3_5ForCausalLM"]
    path = os.path.join(root, "model")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config.to_dict(), f)
    words = ["the", "state", "passes", "between", "ranks", "of", "a", "long", "sequence"]
    with open(os.path.join(root, "text.txt"), "w") as f:
        lines = (" ".join(words[(i * j) % len(words)] for j in range(1, 9)) for i in range(40000))
        f.writelines(line + ".\n" for line in lines)
    return path


def _run(hosts: TwoHosts, model: str, text: str, scheme: str, args, out: str) -> dict:
    flags = ["-m", "ringattn", "train", "--hf", model, "--data", f"text:{text}", "--cp", "2",
             "--layout", "zigzag", "--strategy", "ring", "--seq-len", str(args.seq_len),
             "--batch-size", "1", "--steps", str(args.steps), "--warmup", "1",
             "--mixer-scheme", scheme, "--checkpoint-every", "-1", "--no-resume", "--quiet",
             "--out-dir", out]  # fmt: skip
    load = os.getloadavg()[0]
    start = time.perf_counter()
    results = hosts.torchrun(flags, nproc_per_node=1, timeout=args.timeout)
    if any(code for code, _ in results):
        return {"failed": [code for code, _ in results],
                "output_tails": [o[-2000:] for _, o in results]}  # fmt: skip
    with open(os.path.join(out, "train_log.jsonl")) as f:
        seconds = [r["seconds"] for r in map(json.loads, f) if "seconds" in r]
    return {"command": "torchrun --nnodes 2 --nproc-per-node 1 ... " + shlex.join(flags[:-2]),
            "step_seconds": seconds, "median_step_s": statistics.median(seconds[1:]),
            "wall_s": time.perf_counter() - start, "load_before": load,
            "load_after": os.getloadavg()[0]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="1gbit", help="link rates, comma-separated (tc tbf)")
    p.add_argument("--seq-len", type=int, default=16384, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=3, help="steps per run (the first not timed)")
    p.add_argument("--schemes", default=",".join(SCHEMES), help="mixer schemes to run")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    p.add_argument("--json", default="results/hybrid_two_hosts_cpu.json", help="where results go")
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(f"hybrid_two_hosts: {why}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as root:
        model = _model_dir(root, args.seq_len)
        for rate in args.rates.split(","):
            with TwoHosts(rate=rate) as hosts:
                for scheme in args.schemes.split(","):
                    out = os.path.join(root, f"{rate}-{scheme}")
                    got = _run(hosts, model, os.path.join(root, "text.txt"), scheme, args, out)
                    rows.append({"rate": rate, "scheme": scheme, **got})
                    print(json.dumps({k: v for k, v in rows[-1].items()
                                      if k != "output_tails"}), flush=True)  # fmt: skip
    print(f"{'link':>8} {'scheme':>7} {'s/step':>8} {'vs state':>9} {'load':>5}")
    for r in rows:
        state = next((x for x in rows if x["rate"] == r["rate"] and x["scheme"] == "state"), {})
        if "median_step_s" not in r:
            print(f"{r['rate']:>8} {r['scheme']:>7} {'failed':>8}")
            continue
        ratio = r["median_step_s"] / state["median_step_s"] if "median_step_s" in state else 0
        print(f"{r['rate']:>8} {r['scheme']:>7} {r['median_step_s']:>8.2f} {ratio:>9.2f} "
              f"{r['load_before']:>5.1f}")  # fmt: skip
    record.write(args.json, __file__, argv, {
        "method": "2 hosts x 1 rank (network namespaces, tc tbf), cp 2 zigzag ring, train --hf "
                  "of the Qwen3.5-style bench model; median step seconds after the first",
        "rows": rows,
    }, packages=["transformers"])  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
