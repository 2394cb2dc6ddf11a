"""The `ringattn eval` subcommand: `ringattn eval niah --hf DIR ...` (evals/worker.py does it).

    flags -> EvalConfig -> run_eval: check, launch --nproc ranks, rank 0 writes OUT/niah.json,
    prints the length x depth table and draws OUT/niah.png

transformers is optional (`pip install 'ringattn[hf]'`): without it the command says so and exits
with status 2 before anything is loaded.
"""

from __future__ import annotations

import argparse

from ringattn.cli.flags import add_flags, from_args
from ringattn.cli.options import LAYOUTS, int_list
from ringattn.evals.grid import depth_list
from ringattn.evals.tasks import TASKS
from ringattn.evals.worker import EvalConfig, run_eval
from ringattn.runtime.extras import require

__all__ = ["add_eval_command"]


def _depths(text: str) -> list[float]:
    try:
        return depth_list(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_eval_command(sub: argparse._SubParsersAction) -> None:
    """The `eval` subcommand (with its `niah` suite) for cli/main.py; defaults from EvalConfig."""
    d = EvalConfig()
    p = sub.add_parser(
        "eval",
        help="does the long context work? needle-in-a-haystack and RULER-style retrieval at any "
        "length through context-parallel prefill and the sharded KV cache",
        description="Retrieval evaluations of a local Hugging Face model over --nproc ranks.",
    )
    suites = p.add_subparsers(dest="suite", required=True)
    n = suites.add_parser(
        "niah",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="a needle (key/value fact) at each depth of a haystack of each length",
        description="For each length and depth, a haystack of that many tokens (filler made "
        "offline) with the task's needles, the question at the end; the greedy answer through "
        "context-parallel prefill over --nproc ranks and the sharded KV cache, scored by whether "
        "the expected values are in it. Writes OUT/niah.json, prints a length x depth table and "
        "draws OUT/niah.png (red to green; needs matplotlib). The prompts depend only on the "
        "tokenizer, length, depth, task and seed: any --nproc answers the same. Tasks: niah (one "
        "needle), multikey (four keys, one asked), multivalue (four values of one key, all "
        "asked), vartrack (a chain of variable assignments, every name asked).",
    )
    # name, type, default and help: EvalConfig's fields (cli/flags.py)
    names = ("hf", "task", "lengths", "depths", "nproc", "tp", "chat", "seed", "haystack",
             "max_new_tokens", "layout", "out")  # fmt: skip
    add_flags(n, d, names, choices={"task": TASKS, "layout": LAYOUTS},
              metavars={"hf": "DIR", "haystack": "PATH", "out": "DIR"},
              types={"lengths": int_list, "depths": _depths}, required=("hf",))  # fmt: skip
    n.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    require("hf", "ringattn eval")  # MissingExtra: one line, exit 2 (cli/main.py)
    return run_eval(from_args(EvalConfig, args))
