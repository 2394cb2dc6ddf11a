"""The `attention-demo` and `check` commands' flags: attention checked against a reference.

Each `add_*_command(sub)` registers its subcommand on `main.py`'s parser; the work lives in
`attention_demo.py` and `check.py`.
"""

from __future__ import annotations

import argparse

from ringattn.cli.attention_demo import DemoConfig, run_demo
from ringattn.cli.check import CheckConfig, run_check
from ringattn.cli.check_hf import HFCheckConfig, run_check_hf
from ringattn.cli.options import LAYOUTS as _LAYOUTS
from ringattn.cli.options import STRATEGIES as _STRATEGIES
from ringattn.cli.options import int_list as _int_list
from ringattn.cli.options import name_list as _name_list


def add_demo_command(sub) -> None:

    d = DemoConfig()
    p = sub.add_parser(
        "attention-demo",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="attention over one long sequence on W local processes, checked against 1 process",
        description="Shard one long sequence over W local processes (gloo on CPU, NCCL with >= W "
        "GPUs), run ringattn.attention forward and backward, print per-rank time and memory, and "
        "compare outputs and gradients with single-process SDPA. Exits 1 when they disagree.",
    )
    p.add_argument("--nproc", type=int, default=d.nproc, help="number of local processes (ranks)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="total tokens in the sequence")
    p.add_argument("--heads", type=int, default=d.heads, help="query heads")
    p.add_argument("--kv-heads", type=int, default=d.kv_heads, help="key/value heads (GQA/MQA)")
    p.add_argument("--head-dim", type=int, default=d.head_dim, help="dimension per head")
    p.add_argument(
        "--dtype",
        default=d.dtype,
        choices=("float64", "float32", "bfloat16", "float16"),
        help="dtype of q, k, v",
    )
    p.add_argument("--layout", default=d.layout, choices=_LAYOUTS, help="token-to-rank layout")
    p.add_argument("--strategy", default=d.strategy, choices=_STRATEGIES, help="CP strategy")
    p.add_argument(
        "--causal",
        action=argparse.BooleanOptionalAction,
        default=d.causal,
        help="causal mask (--no-causal for full attention)",
    )
    p.add_argument("--backend", default=d.backend, help="kernel backend: auto or a kernel name")
    p.add_argument("--seed", type=int, default=d.seed, help="seed for q, k, v and dout")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    p.set_defaults(run=_run_demo)


def add_check_command(sub) -> None:

    c = CheckConfig()
    p = sub.add_parser(
        "check",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="correctness matrix vs a float64 reference (exit 1 on any failure)",
        description="For each world size, layout, strategy, causal flag, head shape (MHA, GQA, "
        "MQA) and dtype, compare out, lse, dq, dk, dv with float64 attention on the full tensors. "
        "Under torchrun the current world is used and --world-sizes is ignored.",
    )
    p.add_argument(
        "--hf",
        metavar="DIR_OR_CONFIG",
        default=None,
        help="instead of the matrix: a Hugging Face model directory or config.json, built at a "
        "tiny width; cp 1 vs cp W per layout and strategy, one line each: exact, refused "
        "(with ringattn's reason) or WRONG; takes --nproc/--world-sizes, --layouts, "
        "--strategies and --seed (the other flags are the matrix's)",
    )
    p.add_argument(
        "--nproc", type=int, default=None, help="run only this world size (same as --world-sizes N)"
    )
    p.add_argument(
        "--world-sizes",
        type=_int_list,
        default=None,
        help="comma-separated world sizes to launch (default 1,2,3,4; with --hf 2,3,4)",
    )
    p.add_argument(
        "--dtypes",
        type=_name_list(("float64", "float32", "bfloat16", "float16")),
        default=c.dtypes,
        help="comma-separated dtypes, or all (float64,float32,bfloat16,float16)",
    )
    p.add_argument(
        "--layouts",
        type=_name_list(_LAYOUTS),
        default=c.layouts,
        help="comma-separated layouts, or all",
    )
    p.add_argument(
        "--strategies",
        type=_name_list(_STRATEGIES),
        default=c.strategies,
        help="comma-separated strategies, or all (cases a strategy refuses are listed as N/A)",
    )
    p.add_argument("--seq-local", type=int, default=c.seq_local, help="tokens per rank")
    p.add_argument("--head-dim", type=int, default=c.head_dim, help="dimension per head")
    p.add_argument("--backend", default=c.backend, help="kernel backend: auto or a kernel name")
    p.add_argument("--seed", type=int, default=c.seed, help="seed for the inputs")
    # test seam of check_hf.py: this rank's logits scaled by 1 + 1e-3, so the run must end WRONG
    p.add_argument("--inject-fault", type=int, default=None, metavar="RANK", help=argparse.SUPPRESS)
    p.set_defaults(run=_run_check)


def _run_demo(args: argparse.Namespace) -> int:

    options = {k: v for k, v in vars(args).items() if k not in ("command", "json", "run", "argv")}
    return run_demo(DemoConfig(**options), json_path=args.json)


def _run_check(args: argparse.Namespace) -> int:

    world_sizes = [args.nproc] if args.nproc is not None else args.world_sizes
    if args.hf is not None:  # --dtypes, --seq-local, --head-dim, --backend: the matrix's only
        cfg = HFCheckConfig(args.hf, layouts=args.layouts, strategies=args.strategies,
                            seed=args.seed, fault_rank=args.inject_fault)  # fmt: skip
        cfg.world_sizes = world_sizes or cfg.world_sizes
        return run_check_hf(cfg)
    skip = ("command", "argv", "nproc", "run", "hf", "inject_fault", "world_sizes")
    options = {k: v for k, v in vars(args).items() if k not in skip}
    return run_check(CheckConfig(**options, world_sizes=world_sizes or CheckConfig().world_sizes))
