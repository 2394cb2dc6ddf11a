"""Dynamic vs static context parallelism on a lognormal mix of document lengths (CPU, ratios).

Megatron-LM's benchmark distribution: document lengths lognormal with mean 1024 and sigma 1.5,
clipped to [128, 8192], fixed seed, packed into --seq-len windows (`--data docs:...`). The same
documents are trained with static CP (every document sharded over the whole cp group) and with
--dynamic-cp, side by side in one run, paired ABBA (static, dynamic, dynamic, static, ...), each
run a fresh `ringattn train` of --steps steps whose first --warmup-steps are not timed.

Reported per pair: tokens/s of both (the trainer's own `tokens_per_s`, median of the timed
steps) and their ratio; overall the median ratio, and the planner's prediction beside it:
`ringattn plan --lengths lognormal:... --json` on the same windows (the trainer's scheduler,
priced by the planner for --hardware cpu, dynamic_cp/predict.py), the median static step over the
median dynamic step of the timed steps. On CPU absolute times are noise; the ratio is the figure.

    .venv/bin/python scripts/bench/dynamic_cp.py      # writes results/dynamic_cp_cpu.json

Before the runs the planner's fixed terms (cost per kernel call, ring step and attention call,
dynamic_cp/ringstep.py) are measured on the runs' topology and given to the plan.

`--hosts 2 --rate 100mbit` runs every arm over two network-namespace hosts of dp x cp / 2 ranks
each, joined by a link shaped to that rate (testing/hosts.py, needs root; the namespaces are
deleted after each rate), and the prediction prices that link (--gpus-per-node, --inter-bw).
`scripts/dynamic_cp_bench.py` is the same program under the issue's name. `--replan JSON
--calibration C` prices a stored result's runs again with calibration C (no runs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile

from ringattn.bench import record
from ringattn.planner.dynamic_cp.ringstep import measure_ring_step
from ringattn.testing.hosts import TwoHosts, unavailable

RATES_GBS = {"gbit": 1 / 8, "mbit": 1 / 8000}


def rate_gbs(rate: str) -> float:
    """A tc rate (100mbit, 1gbit) in GB/s, the planner's --inter-bw."""
    for unit, scale in RATES_GBS.items():
        if rate.endswith(unit):
            try:
                return float(rate[: -len(unit)]) * scale
            except ValueError:
                break
    raise ValueError(f"--rate {rate!r}: give NNmbit or NNgbit, e.g. 100mbit or 1gbit")


def train_flags(args: argparse.Namespace, dynamic: bool, out: str) -> list[str]:
    """`ringattn train`'s flags of one arm (without the launcher's)."""
    flags = ["--dp", str(args.dp), "--cp", str(args.cp), "--model", args.model,
             "--data", args.data, "--seq-len", str(args.seq_len), "--batch-size",
             str(args.batch_size), "--steps", str(args.steps), "--out-dir", out, "--no-resume",
             "--checkpoint-every", "-1", "--quiet", "--layout", args.layout,
             "--strategy", args.strategy]  # fmt: skip
    return flags + (["--dynamic-cp"] if dynamic else [])


def _run(args: argparse.Namespace, dynamic: bool, out: str, hosts=None) -> dict:
    flags = train_flags(args, dynamic, out)
    if hosts is None:
        nproc = str(args.dp * args.cp)
        subprocess.run([sys.executable, "-m", "ringattn", "train", "--nproc", nproc, *flags],
                       check=True)  # fmt: skip
    else:  # a two-host launch failed once in a while (a rank aborted at start): one retry
        for attempt in (1, 2):
            done = hosts.torchrun(["-m", "ringattn", "train", *flags],
                                  nproc_per_node=args.dp * args.cp // 2, timeout=480)  # fmt: skip
            if not any(code for code, _ in done):
                break
            tails = "\n".join(text[-1500:] for _, text in done)
            print(f"two-host run failed (attempt {attempt}): exit codes "
                  f"{[c for c, _ in done]}\n{tails}", file=sys.stderr, flush=True)  # fmt: skip
            if attempt == 2:
                raise RuntimeError("two-host run failed twice; see above")
            shutil.rmtree(out, ignore_errors=True)
    with open(os.path.join(out, "train_log.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if "loss" in r]
    timed = steps[args.warmup_steps :]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "step_tokens_per_s": [r["tokens_per_s"] for r in steps], "load": os.getloadavg()[0],
            "losses": [r["loss"] for r in steps], "cp_groups": [r["cp_groups"] for r in steps],
            "imbalance": [r["imbalance"] for r in steps]}  # fmt: skip


def measure_fixed(args: argparse.Namespace, hosts) -> dict:
    """The planner's fixed terms (dynamic_cp/ringstep.py) measured now, on the runs' topology:
    dp x cp local processes, or the same ranks over the two hosts and their link."""
    if hosts is None:
        return measure_ring_step(args.dp * args.cp)
    done = hosts.torchrun(["-m", "ringattn.planner.dynamic_cp.ringstep"],
                          nproc_per_node=args.dp * args.cp // 2, timeout=300)  # fmt: skip
    lines = [line for line in done[0][1].splitlines() if line.startswith('{"ring_step_s"')]
    if any(code for code, _ in done) or not lines:
        raise RuntimeError(f"measuring the fixed terms over two hosts failed: "
                           f"{[c for c, _ in done]}\n{done[0][1][-2000:]}")  # fmt: skip
    return json.loads(lines[-1])


def plan_argv(args: argparse.Namespace, fixed: dict | None = None) -> list[str]:
    """`ringattn plan --lengths` for the bench's documents, dp x cp, link and fixed terms."""
    argv = ["plan", "--model", args.model, "--hardware", "cpu", "--gpus",
            str(args.dp * args.cp), "--dp", str(args.dp), "--cp", str(args.cp), "--strategy",
            args.strategy, "--layout", args.layout, "--seq-len", str(args.seq_len),
            "--batch-size", str(args.batch_size), "--lengths",
            "lognormal:" + args.data.removeprefix("docs:"), "--lengths-steps", str(args.steps),
            "--json"]  # fmt: skip
    if args.calibration:
        argv += ["--calibration", args.calibration]
    if args.hosts == 2:
        argv += ["--gpus-per-node", str(args.dp * args.cp // 2), "--inter-bw",
                 f"{rate_gbs(args.rate):g}"]  # fmt: skip
    for key, value in (fixed or {}).items():
        argv += [f"--{key[:-2].replace('_', '-')}-s", f"{value:.6g}"]
    return argv


def _predicted(args: argparse.Namespace, fixed: dict) -> dict:
    """The planner's figures on the timed steps: median static over median dynamic step."""
    argv = plan_argv(args, fixed)
    done = subprocess.run([sys.executable, "-m", "ringattn", *argv], capture_output=True,
                          text=True, check=True)  # fmt: skip
    result = json.loads(done.stdout)["dynamic_cp"]
    timed = result["per_step"][args.warmup_steps :]
    static_s = statistics.median(s["static_s"] for s in timed)
    dynamic_s = statistics.median(s["dynamic_s"] for s in timed)
    return {"command": shlex.join(["ringattn", *argv]), "static_s": static_s,
            "dynamic_s": dynamic_s, "ratio": static_s / dynamic_s, "terms": result["terms"],
            "per_step": result["per_step"]}  # fmt: skip


def replan(path: str, calibration: str) -> int:
    """Price a stored result's runs again with another calibration file (its fixed terms as
    measured then, no runs) and add it as "replanned", beside the first prediction."""
    with open(path) as f:
        result = json.load(f)
    args = argparse.Namespace(**{**result["args"], "calibration": calibration})
    terms = result["predicted"]["terms"]
    fixed = {k: terms[k] for k in ("ring_step_s", "piece_s", "call_s")}
    again = _predicted(args, fixed)
    with open(calibration) as f:
        again["calibration"] = json.load(f)
    result["replanned"] = again
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{path}: measured {result['ratio_median']:.2f}, predicted at the run "
          f"{result['predicted']['ratio']:.2f}, replanned {again['ratio']:.2f}")  # fmt: skip
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--data", default="docs:1024,1.5,128,8192")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=2, help="ABBA pairs (2 runs each)")
    parser.add_argument("--layout", default="zigzag")
    parser.add_argument("--strategy", default="ring")
    parser.add_argument(
        "--out",
        default=None,
        help="default results/dynamic_cp_cpu.json (hosts: ..._2hosts_RATE.json)",
    )
    parser.add_argument(
        "--hosts",
        type=int,
        choices=(1, 2),
        default=1,
        help="2: two network-namespace hosts on a shaped link (needs root)",
    )
    parser.add_argument("--rate", default=None, help="--hosts 2: the link, e.g. 100mbit, 1gbit")
    parser.add_argument(
        "--calibration",
        default=None,
        help="the planner's cpu calibration file (default: its cache)",
    )
    parser.add_argument("--replan", default=None, metavar="JSON",
                        help="price its runs again with --calibration (no runs)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.replan and not args.calibration:
        parser.error("--replan needs --calibration (the file to price with)")
    if args.hosts == 2:
        if args.rate is None:
            parser.error("--hosts 2 needs --rate (e.g. 100mbit or 1gbit)")
        try:
            rate_gbs(args.rate)
        except ValueError as why:
            parser.error(str(why))
        if (args.dp * args.cp) % 2:
            parser.error(f"--hosts 2 needs an even dp x cp, got {args.dp} x {args.cp}")
    elif args.rate is not None:
        parser.error("--rate shapes the link between hosts: give it with --hosts 2")
    if args.out is None:
        tail = f"_2hosts_{args.rate}" if args.hosts == 2 else ""
        args.out = f"results/dynamic_cp_cpu{tail}.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replan:
        return replan(args.replan, args.calibration)
    if args.hosts == 2 and unavailable():
        print(f"dynamic_cp bench: {unavailable()}", file=sys.stderr)
        return 2
    runs = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        hosts = stack.enter_context(TwoHosts(rate=args.rate)) if args.hosts == 2 else None
        # first: the fixed terms, on the same topology and as loaded a machine as the runs
        fixed = measure_fixed(args, hosts)
        print(f"fixed terms: {fixed}", flush=True)
        predicted = _predicted(args, fixed)
        for p in range(args.pairs):
            order = (False, True) if p % 2 == 0 else (True, False)  # ABBA
            pair = {}
            for dynamic in order:
                name = "dynamic" if dynamic else "static"
                pair[name] = _run(args, dynamic, os.path.join(tmp, f"{p}-{name}"), hosts)
            pair["ratio"] = pair["dynamic"]["tokens_per_s"] / pair["static"]["tokens_per_s"]
            runs.append(pair)
            print(f"pair {p}: static {pair['static']['tokens_per_s']:.0f} tok/s, dynamic "
                  f"{pair['dynamic']['tokens_per_s']:.0f} tok/s, ratio {pair['ratio']:.3f}",
                  flush=True)  # fmt: skip
    ratio = statistics.median(r["ratio"] for r in runs)
    base = runs[0]["static"]["losses"]  # the same documents: every run's losses agree
    drift = max(abs(a - b) / abs(b) for r in runs for k in ("static", "dynamic")
                for a, b in zip(r[k]["losses"], base))  # fmt: skip
    link = f"2 hosts, {args.rate}" if args.hosts == 2 else "1 host"
    pairs = ", ".join(f"{r['ratio']:.2f}" for r in runs)
    print(f"\n| link | dp x cp | ABBA pairs: dynamic / static tokens/s | median | planner's "
          f"prediction |\n|---|---|---|---|---|\n| {link} | {args.dp} x {args.cp} | {pairs} | "
          f"{ratio:.2f} | {predicted['ratio']:.2f} |")  # fmt: skip
    result = {"args": vars(args), "link": link, "pairs": runs, "ratio_median": ratio,
              "predicted": predicted, "max_loss_rel_diff": drift}  # fmt: skip
    if args.calibration:  # the figures the prediction priced with, for a later look
        with open(args.calibration) as f:
            result["calibration"] = json.load(f)
    print(f"losses of every run within {drift:.1e} (relative) of the first static run's")
    record.write(args.out, __file__, argv, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
