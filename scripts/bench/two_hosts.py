"""Topology measured: step time of each strategy over 2 hosts x 2 ranks at two link rates, beside
`ringattn plan --hardware cpu --gpus-per-node 2 --inter-bw RATE`'s prediction. Needs root.

    sudo .venv/bin/python scripts/bench/two_hosts.py            # results/two_hosts_cpu.json
    sudo .venv/bin/python scripts/bench/two_hosts.py --rates 1gbit --steps 4 --calibration C

1. `ringattn plan --calibrate` measures this CPU into a calibration file (or --calibration);
2. for each link rate, two hosts (ringattn/testing/hosts.py: network namespaces, a veth shaped
   by tc tbf in both directions) and for each configuration one `torchrun --nnodes 2
   --nproc-per-node 2 -m ringattn train ...` of a few steps: the median step seconds after
   the first step (rank 0's log);
3. `ringattn plan ... --json` with the same degrees, strategy and layout, the cluster given as
   --gpus-per-node 2 and --inter-bw = the link rate in GB/s: the predicted step seconds.

Errors are (predicted - measured) / measured. The orders are compared per rate on seconds per
sequence (step / dp: the planner's tokens per second per GPU), with ties on both sides
(planner/search.py): two configurations tie in the measurement when their tries' ranges
overlap (the noise, measured: --tries runs of each, round robin), in the prediction when they
are within the planner's error margin. The machine is shared (2 cores, other sessions): the
load average is recorded per run.

    python scripts/bench/two_hosts.py --replan results/two_hosts_cpu_repeats.json

prices the stored measurements again with the current planner (no root, no runs) and rewrites
the predictions, the orders and the check.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from ringattn.bench import record
from ringattn.bench.common import write_json
from ringattn.planner.calibrate import machine_key
from ringattn.planner.search import PLAN_MARGIN, compare_orders, measured_faster, tie_groups
from ringattn.testing.hosts import TwoHosts, unavailable

# (label, dp, cp, strategy, ulysses)
CONFIGS = [
    ("ring", 1, 4, "ring", 0),
    ("allgather", 1, 4, "allgather", 0),
    ("ulysses", 1, 4, "ulysses", 0),
    ("hybrid U2", 1, 4, "hybrid", 2),
    ("dp2 x cp2 ring", 2, 2, "ring", 0),
]
RATES_GBS = {"gbit": 1 / 8, "mbit": 1 / 8000}


def rate_gbs(rate: str) -> float:
    for unit, scale in RATES_GBS.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: give NNmbit or NNgbit")


def train_flags(cfg: tuple, args: argparse.Namespace, out_dir: str) -> list[str]:
    _, dp, cp, strategy, ulysses = cfg
    flags = ["-m", "ringattn", "train", "--model", args.model, "--dp", str(dp), "--cp", str(cp),
             "--strategy", strategy, "--layout", args.layout, "--seq-len", str(args.seq_len),
             "--steps", str(args.steps), "--warmup", "1", "--checkpoint-every", "-1",
             "--no-resume", "--quiet", "--out-dir", out_dir]  # fmt: skip
    return flags + (["--ulysses", str(ulysses)] if ulysses else [])


def measure(hosts: TwoHosts, cfg: tuple, args: argparse.Namespace, out_dir: str) -> dict:
    """One run's step times, or {"failed": ...} with both hosts' exit codes and output tails
    when a host did not finish (it happened once: host 1's torchrun gone, host 0's agent
    waiting for it): such a try is recorded and does not count."""
    flags = train_flags(cfg, args, out_dir)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    results = hosts.torchrun(flags, timeout=300)
    if any(code for code, _ in results):
        return {"failed": [code for code, _ in results], "load_before": load,
                "output_tails": [out[-2000:] for _, out in results]}  # fmt: skip
    with open(os.path.join(out_dir, "train_log.jsonl")) as f:
        history = [r for r in map(json.loads, f) if "seconds" in r]
    seconds = [h["seconds"] for h in history]
    return {"command": "torchrun --nnodes 2 --nproc-per-node 2 ... " + shlex.join(flags[:-2]),
            "step_seconds": seconds, "median_step_s": statistics.median(seconds[1:]),
            "wall_s": time.perf_counter() - start, "load_before": load,
            "load_after": os.getloadavg()[0]}  # fmt: skip


def predict(cfg: tuple, args: argparse.Namespace, inter_gbs: float, calibration: str) -> dict:
    _, dp, cp, strategy, _ = cfg
    argv = ["plan", "--model", args.model, "--hardware", "cpu", "--gpus", "4",
            "--gpus-per-node", "2", "--inter-bw", f"{inter_gbs:g}", "--dp", str(dp), "--cp",
            str(cp), "--tp", "1", "--pp", "1", "--strategy", strategy, "--layout", args.layout,
            "--seq-len", str(args.seq_len), "--calibration", calibration, "--json"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "ringattn", *argv], capture_output=True,
                          text=True, check=True)  # fmt: skip
    plan = json.loads(done.stdout)["plans"][0]
    return {"command": "ringattn " + shlex.join(argv), "step_time_s": plan["step_time_s"],
            "ulysses": plan["ulysses"], "breakdown": plan["breakdown"]}  # fmt: skip


def table(rows: list[dict]) -> str:
    head = ("| link | configuration | measured s/step: tries | spread | predicted s/step | "
            "error (median try) |")  # fmt: skip
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        tries = ", ".join(f"{t:.3f}" for t in r["measured"]["tries_median_step_s"])
        lines.append(f"| {r['rate']} | {r['config']} | {tries} | {r['spread']:.0%} | "
                     f"{r['predicted']['step_time_s']:.3f} | {r['error']:+.0%} |")  # fmt: skip
    return "\n".join(lines)


def measured_order(mine: list[dict]) -> str:
    """Fastest first by the best try; '<' where the tries' ranges part, '~' where they overlap."""
    order = sorted(mine, key=lambda r: r["per_sequence_s"][0])
    text = order[0]["config"]
    for prev, cur in itertools.pairwise(order):
        told = measured_faster(prev["per_sequence_s"][1], cur["per_sequence_s"][1]) == -1
        text += (" < " if told else " ~ ") + cur["config"]
    return text


def check(rows: list[dict], rates: list[str]) -> dict:
    """Per rate: the noise, both orders and the pairwise verdicts (module docstring)."""
    result = {}
    for rate in rates:
        mine = [r for r in rows if r["rate"] == rate]
        for r in mine:
            dp, tries = r["dp"], r["measured"]["tries_median_step_s"]
            r["per_sequence_s"] = (min(tries) / dp, [t / dp for t in tries])
            r["spread"] = max(tries) / min(tries) - 1
        predicted = {r["config"]: r["predicted"]["step_time_s"] / r["dp"] for r in mine}
        verdicts = compare_orders({r["config"]: r["per_sequence_s"][1] for r in mine}, predicted)
        errors = [1 + r["error"] for r in mine]
        result[rate] = {
            "noise": {"median_spread": statistics.median(r["spread"] for r in mine),
                      "max_spread": max(r["spread"] for r in mine)},
            "measured_order": measured_order(mine),
            "predicted_order": " < ".join(" = ".join(g) for g in tie_groups(predicted)),
            "margin": PLAN_MARGIN,
            "error_ratio_span": max(errors) / min(errors) - 1,
            **{k: [list(p) for p in v] for k, v in verdicts.items()},
        }  # fmt: skip
    return result


def replan(result: dict, calibration: str) -> dict:
    """Price `result`'s measured rows with the current planner: predictions, errors, check."""
    args = argparse.Namespace(model=result["model"], seq_len=result["seq_len"],
                              layout=result["layout"])  # fmt: skip
    configs = {cfg[0]: cfg for cfg in CONFIGS}
    rates = list(dict.fromkeys(r["rate"] for r in result["rows"]))
    for r in result["rows"]:
        cfg = configs[r["config"]]
        r["dp"] = cfg[1]
        r["predicted"] = predict(cfg, args, rate_gbs(r["rate"]), calibration)
        # the median try: the calibration was measured under load too, so the fastest try is
        # not the one to compare with; the range of the tries is the noise
        tries = r["measured"]["tries_median_step_s"]
        pred, typical = r["predicted"]["step_time_s"], statistics.median(tries)
        r["error"] = (pred - typical) / typical
        r["error_range"] = [(pred - max(tries)) / max(tries), (pred - min(tries)) / min(tries)]
    rows = result["rows"]
    result["within_25_percent"] = sum(abs(r["error"]) <= 0.25 for r in rows)
    result["of"] = len(rows)
    result["check"] = check(rows, rates)
    return result


def report(result: dict) -> None:
    print(table(result["rows"]))
    for rate, c in result["check"].items():
        print(f"{rate}: measured {c['measured_order']}; predicted {c['predicted_order']} "
              f"(margin {c['margin']:.0%}); tries spread median {c['noise']['median_spread']:.0%}"
              f", max {c['noise']['max_spread']:.0%}; agree {len(c['agree'])}, open "
              f"{len(c['open'])} {c['open']}, contradict {len(c['contradict'])} "
              f"{c['contradict']}")  # fmt: skip
    print(f"within 25 %: {result['within_25_percent']} of {result['of']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="1gbit,20mbit", help="link rates, comma-separated")
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tries", type=int, default=3, help="runs per configuration (round robin)")
    p.add_argument("--only", default=None, help="comma-separated indices into CONFIGS")
    p.add_argument("--calibration", default=None, help="reuse this calibration file")
    p.add_argument("--json", default="results/two_hosts_cpu_repeats.json")
    p.add_argument("--replan", default=None, metavar="JSON",
                   help="price its measurements again (no runs) and rewrite it")  # fmt: skip
    args = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="ringattn-two-hosts-")
    if args.replan:
        with open(args.replan) as f:
            result = json.load(f)
        calibration = os.path.join(tmp, "calibration.json")
        with open(calibration, "w") as f:  # the stored one, as this machine's (same figures)
            json.dump({**result["calibration"], **machine_key()}, f)
        result = replan(result, calibration)
        result["replanned"] = shlex.join(["python", *sys.argv])
        with open(args.replan, "w") as f:
            json.dump(result, f, indent=1)
        report(result)
        return 0
    why = unavailable()
    if why:
        print(f"two_hosts_bench: {why}", file=sys.stderr)
        return 2
    calibration = args.calibration or os.path.join(tmp, "calibration.json")
    if not args.calibration:
        print("[two-hosts] calibrating...", flush=True)
        subprocess.run([sys.executable, "-m", "ringattn", "plan", "--calibrate",
                        "--calibration", calibration], check=True)  # fmt: skip
    chosen = [CONFIGS[int(i)] for i in args.only.split(",")] if args.only else CONFIGS
    rows = []
    for rate in args.rates.split(","):
        with TwoHosts(rate=rate) as hosts:
            # round robin over the configurations: a neighbour's load drifts over minutes, and
            # the tries' spread is the noise the orders are judged against
            tries: dict[int, list[dict]] = {i: [] for i in range(len(chosen))}
            for t in range(args.tries):
                for i, cfg in enumerate(chosen):
                    print(f"[two-hosts] {rate} {cfg[0]} (try {t + 1})...", flush=True)
                    run_dir = os.path.join(tmp, f"{rate}-{i}-{t}")
                    tries[i].append(measure(hosts, cfg, args, run_dir))
                    got = tries[i][-1]
                    print(f"    failed: exit codes {got['failed']}" if "failed" in got
                          else f"    {got['median_step_s']:.3f} s", flush=True)  # fmt: skip
            for i, cfg in enumerate(chosen):
                done = [m for m in tries[i] if "failed" not in m]
                meas = dict(min(done, key=lambda m: m["median_step_s"]))
                meas["tries_median_step_s"] = [m["median_step_s"] for m in done]
                meas["tries"] = tries[i]
                rows.append({"rate": rate, "config": cfg[0], "measured": meas})
    with open(calibration) as f:
        calib = json.load(f)
    result = {
        **record.header(__file__, argv), "model": args.model, "seq_len": args.seq_len,
        "layout": args.layout, "steps": args.steps, "tries": args.tries,
        "hosts": "2 network namespaces x 2 ranks, veth shaped by tc tbf both ways, gloo, "
        "OMP_NUM_THREADS=1", "rows": rows, "calibration": calib,
    }  # fmt: skip
    result = replan(result, calibration)
    write_json(args.json, result)
    report(result)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
