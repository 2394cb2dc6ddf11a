"""Run inside the bare environment of test_bare_install.py: each CLI command once, in-process.

    python bare_driver.py RESULTS.json      (working directory: a scratch folder)

For each case: `ringattn.cli.main.main(argv)`'s exit code, what it printed to stdout and stderr
from this process (the ranks it launches print from theirs), and whether the files it should
write exist. Written as JSON for the test to judge; this script asserts nothing itself.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

from ringattn.cli.main import main

SMALL_RUN = ["--nproc", "2", "--steps", "2", "--seq-len", "512", "--copies", "4", "--model", "tiny"]

CASES: dict[str, tuple[list[str], list[str]]] = {
    # name: (argv, files it writes)
    "layout": (
        ["layout", "--world-size", "4", "--seq-len", "64", "--json", "layout.json"],
        ["layout.json"],
    ),
    "plan": (
        [
            "plan",
            "--model",
            "llama3-8b",
            "--hardware",
            "h100",
            "--gpus",
            "8",
            "--seq-len",
            "131072",
            "--json",
        ],
        [],
    ),
    "check": (
        [
            "check",
            "--world-sizes",
            "1,2",
            "--dtypes",
            "float64",
            "--layouts",
            "zigzag",
            "--seq-local",
            "16",
        ],
        [],
    ),
    "attention-demo": (
        ["attention-demo", "--nproc", "2", "--seq-len", "512", "--json", "attention.json"],
        ["attention.json"],
    ),
    "bench": (
        [
            "bench",
            "--sizes",
            "2x128",
            "--masks",
            "causal",
            "--passes",
            "fwd",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--json",
            "bench.json",
        ],
        ["bench.json"],
    ),
    "demo": (["demo", *SMALL_RUN, "--out-dir", "demo"], ["demo/demo.json"]),
    "train": (["train", *SMALL_RUN, "--out-dir", "train"], ["train/train_log.jsonl"]),
    # the commands and flags that need an extra: one line, exit 2, before any process starts
    "serve": (["serve", "--hf", "model"], []),
    "generate --hf": (["generate", "--hf", "model"], []),
    "train --hf": (["train", "--hf", "model", "--data", "text:model", "--nproc", "1"], []),
    "train --tensorboard": (["train", *SMALL_RUN, "--tensorboard", "--out-dir", "tb"], []),
    "bench --plot": (["bench", "--plot", "bench.png"], []),
    "eval niah": (["eval", "niah", "--hf", "model", "--lengths", "1024", "--out", "niah"], []),
}


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stop:  # argparse's exit, with the code it was given
            code = stop.code if isinstance(stop.code, int) else 1
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            code, err = 99, io.StringIO(f"Traceback: {type(exc).__name__}: {exc}")
    return int(code or 0), out.getvalue(), err.getvalue()


def main_() -> None:
    os.makedirs("model", exist_ok=True)  # a directory that exists: the check is the extra's
    results = {}
    for name, (argv, files) in CASES.items():
        code, out, err = run(argv)
        results[name] = {
            "argv": argv,
            "code": code,
            "out": out,
            "err": err,
            "files": {f: os.path.exists(f) for f in files},
        }
        print(f"{name}: exit {code}", file=sys.__stdout__, flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main_()
