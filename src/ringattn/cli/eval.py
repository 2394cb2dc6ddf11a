"""The `ringattn eval` subcommand: `ringattn eval niah --hf DIR ...` (evals/worker.py does it).

    flags -> EvalConfig -> run_eval: check, launch --nproc ranks, rank 0 writes OUT/niah.json,
    prints the length x depth table and draws OUT/niah.png

transformers is optional (`pip install 'ringattn[hf]'`): without it the command says so and exits
with status 2 before anything is loaded.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

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
    n.add_argument(
        "--hf",
        required=True,
        metavar="DIR",
        help="a local Hugging Face model "
        "directory (config.json, weights, tokenizer; nothing is downloaded)",
    )
    n.add_argument("--task", default=d.task, choices=TASKS, help="which retrieval task")
    n.add_argument(
        "--lengths",
        type=int_list,
        default=d.lengths,
        help="prompt lengths in tokens, e.g. 1024,4096,16384",
    )
    n.add_argument(
        "--depths",
        type=_depths,
        default=d.depths,
        help="a count N (N depths evenly spaced from 0 to 100 %%) or percents such as 0,50,100 "
        "(a single depth: 50, with the comma)",
    )
    n.add_argument(
        "--nproc", type=int, default=d.nproc, help="ranks the prefill and KV cache are split over"
    )
    n.add_argument(
        "--tp",
        type=int,
        default=d.tp,
        help="tensor-parallel degree (the model's own tp plan); cp = nproc / tp",
    )
    n.add_argument(
        "--chat",
        action="store_true",
        help="ask through the tokenizer's chat template "
        "(one user message, then the generation prompt)",
    )
    n.add_argument("--seed", type=int, default=d.seed, help="seed of the needles and the filler")
    n.add_argument(
        "--haystack",
        default=d.haystack,
        metavar="PATH",
        help="filler sentences from "
        "this text file or directory of .txt/.md files (None: generated sentences)",
    )
    n.add_argument(
        "--max-new-tokens",
        type=int,
        default=d.max_new_tokens,
        help="answer budget (0: the task's: 16 for niah and multikey, 48 multivalue, 32 vartrack)",
    )
    n.add_argument("--layout", default=d.layout, choices=LAYOUTS, help="how prompts are sharded")
    n.add_argument("--out", default=d.out, metavar="DIR", help="where niah.json and niah.png go")
    n.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    require("hf", "ringattn eval")  # MissingExtra: one line, exit 2 (cli/main.py)
    names = {f.name for f in fields(EvalConfig)}
    return run_eval(EvalConfig(**{k: v for k, v in vars(args).items() if k in names}))
