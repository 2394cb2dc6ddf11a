"""Check `ringattn plan --hardware cpu` against `ringattn train` runs measured on this machine.

    python scripts/bench/plan_check.py                 # writes results/plan_check_cpu.json
    python scripts/bench/plan_check.py --quick         # two configurations, for a smoke test
    python scripts/bench/plan_check.py --only 3,4      # some configurations (indices into CONFIGS)
    python scripts/bench/plan_check.py --published     # docs/plan.md's table of published runs,
                                                       # and the longest sequences (ALST, FPDT)
    python scripts/bench/plan_check.py --sharing       # 2 vs 4 processes on 2 cores, paired

1. `ringattn plan --calibrate` measures this CPU (kernel rates by size, gloo) into a cache file;
2. for each configuration (model, processes, dp, cp, strategy, layout, length), a fresh
   `ringattn train ... --memory-warmup --checkpoint-every -1` run of a few steps: measured
   tokens/s = the median over the steps after the first of tokens / step seconds, and the peak
   memory per rank (peak RSS above the RSS after a warm-up step, as bench/memory.py measures);
3. `ringattn plan --hardware cpu --json` with the same degrees, strategy and layout: predicted
   tokens/s per process and memory per process;
4. the same prediction for the rows of results/memory_cpu.json (scripts/bench/memory.py's figures).

Errors are (predicted - measured) / measured. Both commands run as subprocesses through the CLI,
exactly as a user types them. The machine is shared: the load average before and after each run
is recorded with it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from ringattn.bench import record

# (model, nproc, dp, cp, strategy, layout, seq_len, steps)
CONFIGS = [
    ("small", 2, 1, 2, "ring", "zigzag", 4096, 8),
    ("small", 2, 1, 2, "ring", "contiguous", 8192, 6),
    ("small", 2, 1, 2, "allgather", "zigzag", 8192, 6),
    ("small", 4, 1, 4, "ring", "zigzag", 8192, 6),
    ("small", 4, 2, 2, "ulysses", "striped", 4096, 8),
    ("tiny", 2, 1, 2, "ring", "striped", 16384, 6),
    ("small", 1, 1, 1, "ring", "zigzag", 4096, 8),
]
QUICK = [CONFIGS[0], CONFIGS[2]]


def _ringattn(*args: str, capture: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ringattn", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("OMP_NUM_THREADS", None)  # the launcher gives each process cores // nproc threads
    done = subprocess.run(cmd, capture_output=capture, text=True, env=env, timeout=600, check=False)
    if done.returncode:
        raise RuntimeError(
            f"{shlex.join(cmd)} failed ({done.returncode}):\n{(done.stderr or '')[-3000:]}"
        )
    return done


def wait_for_quiet(max_load: float, max_wait_s: float) -> float:
    """Wait (up to max_wait_s) until the 1-minute load average is below max_load: the machine is
    shared, and another session's processes on its 2 cores slow every step. Returns the load."""
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def measure(model, nproc, dp, cp, strategy, layout, seq_len, steps, out_dir) -> dict:
    args = ["train", "--model", model, "--nproc", str(nproc), "--dp", str(dp), "--cp", str(cp),
            "--strategy", strategy, "--layout", layout, "--seq-len", str(seq_len),
            "--steps", str(steps), "--warmup", "1", "--checkpoint-every", "-1", "--no-resume",
            "--memory-warmup", "--quiet", "--out-dir", out_dir]  # fmt: skip
    if strategy == "hybrid":
        args += ["--ulysses", "2"]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    _ringattn(*args)
    wall = time.perf_counter() - start
    with open(os.path.join(out_dir, "train_log.jsonl")) as f:
        records = [json.loads(line) for line in f]
    history = [r for r in records if "seconds" in r]
    seconds = [h["seconds"] for h in history[1:]]  # the first step pays one-time costs
    peaks = [max(h["peak_mb"][r] for h in history) for r in range(nproc)]
    median_s = statistics.median(seconds)
    return {
        "command": "ringattn " + shlex.join(args[:-2]), "wall_s": wall,
        "step_seconds": [h["seconds"] for h in history], "median_step_s": median_s,
        "tokens_per_s_per_proc": dp * seq_len / median_s / nproc,
        "peak_mb_per_rank": peaks, "peak_mb": max(peaks),
        "load_before": load, "load_after": os.getloadavg()[0],
    }  # fmt: skip


def predict(model, nproc, dp, cp, strategy, layout, seq_len, calibration) -> dict:
    args = ["plan", "--model", model, "--hardware", "cpu", "--gpus", str(nproc), "--dp", str(dp),
            "--cp", str(cp), "--tp", "1", "--pp", "1", "--strategy", strategy, "--layout", layout,
            "--seq-len", str(seq_len), "--batch-size", "1", "--calibration", calibration,
            "--json"]  # fmt: skip
    plan = json.loads(_ringattn(*args).stdout)["plans"][0]
    return {"command": "ringattn " + shlex.join(args[:-3] + ["--json"]),
            "tokens_per_s_per_proc": plan["tokens_per_s_per_gpu"],
            "memory_mb": plan["memory_gib_per_gpu"] * 1024, "step_time_s": plan["step_time_s"],
            "breakdown": plan["breakdown"]}  # fmt: skip


def sharing_check(path: str, rounds: int) -> dict:
    """The processes-sharing-cores model, checked in pairs: `ringattn train` with `cores` and with
    2 x cores processes (small, ring / zigzag, 8,192 tokens, cp = processes), alternating with
    the calibration's sharing measurement, so all three see the same load. The measured ratio of
    step times against the one the planner predicts from the measured cost."""
    from ringattn.planner.oversubscribe import measure_oversubscription

    cores = len(os.sched_getaffinity(0))
    tmp = tempfile.mkdtemp(prefix="ringattn-sharing-")
    rounds_out = []
    for r in range(rounds):
        runs = {}
        for nproc in (cores, 2 * cores):
            runs[nproc] = measure("small", nproc, 1, nproc, "ring", "zigzag", 8192, 6,
                                  out_dir=os.path.join(tmp, f"r{r}n{nproc}"))  # fmt: skip
        bench = measure_oversubscription(cores, rounds=1)
        step_ratio = runs[2 * cores]["median_step_s"] / runs[cores]["median_step_s"]
        rounds_out.append({"runs": {str(k): v for k, v in runs.items()}, "bench": bench,
                           "trainer_step_ratio": step_ratio})  # fmt: skip
        print(f"round {r}: trainer step {2 * cores} / {cores} processes = {step_ratio:.2f}; "
              f"measured sharing cost {bench['cost'][str(2 * cores)]:.2f}; load "
              f"{bench['load_average']}", flush=True)  # fmt: skip
    return record.write(path, __file__, None, {"cores": cores, "rounds": rounds_out})


def published_table() -> str:
    """docs/plan.md's table: each published figure, the prediction, the error."""
    from ringattn.planner.published import (
        check_published,
        llama3_virtual_sensitivity,
        titan_sensitivity,
    )

    lines = ["| run | quantity | published | predicted | error |", "|---|---|---|---|---|"]
    for r in check_published():
        lines.append(f"| {r['name']} | {r['quantity']} | {r['published']:.4g} | "
                     f"{r['predicted']:.4g} | {r['error']:+.0%} |")  # fmt: skip
    sens = llama3_virtual_sensitivity()
    lines += ["", "Llama 3 rows by virtual stages " + str(sens["virtual_stages"]) + ":"]
    for key, values in sens["rows"].items():
        lines.append(f"    {key}: " + ", ".join(f"{v:.0f}" for v in values))
    titan = titan_sensitivity()
    fit, implied = titan["fitted"], titan["implied_by_8b_256k"]
    lines.append("")
    lines.append(f"torchtitan attention scale: {fit:.3f} fitted on the 405B 256k row, "
                 f"{implied:.3f} implied by the 8B 256k row (not fitted)")  # fmt: skip
    for scale, tables in titan["absolute_errors"].items():
        lines.append(f"    absolute tokens/s per GPU at scale {scale:.3f}:")
        for name, errors in tables.items():
            lines.append(f"        {name}: " + ", ".join(f"{e:+.0%}" for e in errors))
    lines.append("    8B 64k -> 128k fall's error by scale: " + ", ".join(
        f"{s}: {e:+.1%}" for s, e in titan["fall_64k_128k_error_by_scale"].items()))  # fmt: skip
    return "\n".join(lines)


def max_seq_table(path: str | None = None, argv: list[str] | None = None) -> str:
    """The longest sequences published (ALST, FPDT) beside `ringattn plan --max-seq`'s, with and
    without the model-state offload what-if; written to `path` (JSON) when given."""
    from ringattn.planner.max_seq.search import check_published_max_seq

    runs = {"with model-state offload": check_published_max_seq(True),
            "ringattn's own (no model-state offload)": check_published_max_seq(False)}  # fmt: skip
    head = (
        "| run | published | predicted (model-state offload) | error | predicted (ringattn "
        "as it runs) | error | plan |"
    )
    lines = [head, "|---|---|---|---|---|---|---|"]
    for a, b in zip(*runs.values(), strict=True):
        plan = a["plan"]
        label = " ".join(f"{k}{plan[k]}" for k in ("dp", "cp", "tp", "pp") if plan[k] > 1)
        lines.append(f"| {a['name']} | {a['published']:,} | {a['predicted']:,} | "
                     f"{a['error']:+.0%} | {b['predicted']:,} | {b['error']:+.0%} | "
                     f"{label or '1 gpu'} {plan['strategy']}/{plan['layout']} |")  # fmt: skip
    if path:
        record.write(path, "scripts/bench/plan_check.py", argv, {"max_seq": runs})
    return "\n".join(lines)


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="results/plan_check_cpu.json", help="where results go")
    p.add_argument("--memory-json", default="results/memory_cpu.json", help="memory.py's file")
    p.add_argument("--quick", action="store_true", help="two configurations only")
    p.add_argument("--only", default=None, help="comma-separated indices into CONFIGS")
    p.add_argument(
        "--sharing",
        action="store_true",
        help="only the paired 2 x cores vs cores processes check (writes --json)",
    )
    p.add_argument(
        "--published",
        action="store_true",
        help="print the published-runs table (no measurement) and exit",
    )
    p.add_argument("--max-seq-json", default="results/plan_max_seq.json",
                   help="--published: where the longest-sequence check goes")  # fmt: skip
    p.add_argument("--calibration", default=None, help="reuse this calibration file")
    p.add_argument("--max-load", type=float, default=1.0, help="wait for a load average below")
    p.add_argument("--max-wait", type=float, default=90, help="seconds to wait for it, per run")
    p.add_argument("--tries", type=int, default=2, help="runs per configuration; the fastest "
                   "counts (other sessions' load only ever slows a run down)")  # fmt: skip
    args = p.parse_args(argv)
    if args.published:
        print(published_table())
        print()
        print(max_seq_table(args.max_seq_json, argv))
        return 0
    if args.sharing:
        sharing_check(args.json, args.tries)
        return 0
    tmp = tempfile.mkdtemp(prefix="ringattn-plan-check-")
    calibration = args.calibration or os.path.join(tmp, "calibration.json")
    if not args.calibration:
        wait_for_quiet(args.max_load, args.max_wait)
        print("[plan-check] calibrating...", flush=True)
        _ringattn("plan", "--calibrate", "--calibration", calibration, capture=False)
    rows = []
    chosen = QUICK if args.quick else CONFIGS
    if args.only:
        chosen = [CONFIGS[int(i)] for i in args.only.split(",")]
    for i, cfg in enumerate(chosen):
        model, nproc, dp, cp, strategy, layout, seq_len, steps = cfg
        print(f"[plan-check] {model} nproc={nproc} dp={dp} cp={cp} {strategy}/{layout} "
              f"S={seq_len}...", flush=True)  # fmt: skip
        tries = []
        for t in range(args.tries):
            wait_for_quiet(args.max_load, args.max_wait)
            tries.append(measure(*cfg, out_dir=os.path.join(tmp, f"run{i}-{t}")))
        meas = min(tries, key=lambda m: m["median_step_s"])
        meas["tries_median_step_s"] = [m["median_step_s"] for m in tries]
        pred = predict(model, nproc, dp, cp, strategy, layout, seq_len, calibration)
        rows.append({
            "model": model, "nproc": nproc, "dp": dp, "cp": cp, "strategy": strategy,
            "layout": layout, "seq_len": seq_len, "steps": steps, "measured": meas,
            "predicted": pred,
            "tokens_per_s_error": _err(pred["tokens_per_s_per_proc"],
                                       meas["tokens_per_s_per_proc"]),
            "memory_error": _err(pred["memory_mb"], meas["peak_mb"]),
        })  # fmt: skip
        r = rows[-1]
        print(f"    tokens/s per process: measured {meas['tokens_per_s_per_proc']:.0f}, "
              f"predicted {pred['tokens_per_s_per_proc']:.0f} ({r['tokens_per_s_error']:+.0%}); "
              f"peak MB: measured {meas['peak_mb']:.0f}, predicted {pred['memory_mb']:.0f} "
              f"({r['memory_error']:+.0%})", flush=True)  # fmt: skip
    memory_rows = []
    if os.path.exists(args.memory_json):
        with open(args.memory_json) as f:
            mem = json.load(f)
        for row in mem["rows"]:
            w = row["world_size"]
            pred = predict(mem["model"], w, 1, w, mem["strategy"], mem["layout"], mem["seq_len"],
                           calibration)  # fmt: skip
            memory_rows.append({"world_size": w, "seq_len": mem["seq_len"],
                                "measured_peak_mb": row["peak_mb"],
                                "predicted_mb": pred["memory_mb"],
                                "error": _err(pred["memory_mb"], row["peak_mb"])})  # fmt: skip
    with open(calibration) as f:
        calib = json.load(f)
    within = [abs(r["tokens_per_s_error"]) <= 0.25 for r in rows]
    mem_within = [abs(r["memory_error"]) <= 0.25 for r in rows] + [
        abs(r["error"]) <= 0.25 for r in memory_rows]  # fmt: skip
    result = record.write(args.json, __file__, argv, {
        "calibration": calib, "rows": rows,
        "memory_py_rows": memory_rows,
        "tokens_per_s_within_25pct": f"{sum(within)} of {len(within)}",
        "memory_within_25pct": f"{sum(mem_within)} of {len(mem_within)}",
    })  # fmt: skip
    print(f"\n{'config':<44} {'tok/s meas':>10} {'pred':>7} {'err':>6} {'MB meas':>8} "
          f"{'pred':>6} {'err':>6}")  # fmt: skip
    for r in rows:
        name = (f"{r['model']} n{r['nproc']} dp{r['dp']} cp{r['cp']} {r['strategy']}/"
                f"{r['layout']} S{r['seq_len']}")  # fmt: skip
        print(f"{name:<44} {r['measured']['tokens_per_s_per_proc']:>10.0f} "
              f"{r['predicted']['tokens_per_s_per_proc']:>7.0f} {r['tokens_per_s_error']:>+6.0%} "
              f"{r['measured']['peak_mb']:>8.0f} {r['predicted']['memory_mb']:>6.0f} "
              f"{r['memory_error']:>+6.0%}")  # fmt: skip
    for r in memory_rows:
        print(f"memory.py W={r['world_size']} S={r['seq_len']}: measured "
              f"{r['measured_peak_mb']:.0f} MB, predicted {r['predicted_mb']:.0f} MB "
              f"({r['error']:+.0%})")  # fmt: skip
    print(f"tokens/s within 25%: {result['tokens_per_s_within_25pct']}; memory within 25%: "
          f"{result['memory_within_25pct']}; wrote {args.json}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
