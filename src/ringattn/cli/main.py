"""The `ringattn` command (also `python -m ringattn`): parses flags and dispatches.

    ringattn demo            train a small decoder with CP = 4 on CPU: loss, accuracy, memory, plot
    ringattn train           train the decoder over a dp x cp mesh (local processes or torchrun)
    ringattn generate        decoding from a checkpoint over a KV cache sharded across ranks
    ringattn serve           an OpenAI-compatible HTTP server over that sharded decoding
    ringattn attention-demo  one long sequence on W processes: time, memory, error vs 1 process
    ringattn check    the correctness matrix against a float64 reference; --hf DIR: is a
                      Hugging Face model family exact under CP (check_hf.py)
    ringattn layout   per-rank tokens and attention work for a layout, documents and window
    ringattn bench    one rank's share of an emulated W-way ring vs monolithic attention

The work lives in `demo.py`, `check.py`, `layout_report.py`, ...; this module only turns flags
into their config dataclasses (whose defaults are the flags' defaults). Each subcommand's parser
sets `run`, the function main() calls with the parsed flags. The commands that start processes
also run under `torchrun`: they then use that world instead of launching their own.
"""

from __future__ import annotations

import argparse
import sys

from ringattn import __version__
from ringattn.bench.million import MillionConfig, run_million
from ringattn.bench.sweep import BenchConfig, run_bench
from ringattn.cli.correctness import add_check_command
from ringattn.cli.correctness import add_demo_command as add_attention_demo_command
from ringattn.cli.eval import add_eval_command
from ringattn.cli.generate import add_generate_command
from ringattn.cli.layout_report import layout_report
from ringattn.cli.options import LAYOUTS as _LAYOUTS
from ringattn.cli.options import int_list as _int_list
from ringattn.cli.options import name_list as _name_list
from ringattn.cli.plan import add_parser as add_plan_command
from ringattn.cli.serve import add_serve_command
from ringattn.cli.train import add_demo_command as add_train_demo_command
from ringattn.cli.train import add_train_command
from ringattn.runtime.extras import MissingExtra, require
from ringattn.runtime.launch import LaunchError


def _layout_parser(sub) -> None:
    p = sub.add_parser(
        "layout",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="per-rank tokens and attention work for a layout, documents and window",
        description="Print, for W ranks, each rank's token count (real and padding) and "
        "attention work (visible query-key pairs) with max/mean, for a layout, optional packed "
        "documents (--cu-seqlens) and sliding window. No processes are started.",
    )
    p.add_argument("--world-size", type=int, default=4, help="number of ranks W")
    p.add_argument("--seq-len", type=int, default=None, help="total tokens (dense sequence)")
    p.add_argument(
        "--cu-seqlens",
        type=_int_list,
        default=None,
        help="document boundaries 0,e1,...,S (replaces --seq-len)",
    )
    p.add_argument("--layout", default="zigzag", choices=_LAYOUTS, help="token-to-rank layout")
    p.add_argument(
        "--causal", action=argparse.BooleanOptionalAction, default=True, help="causal mask"
    )
    p.add_argument(
        "--window", type=_int_list, default=None, help="sliding window LEFT,RIGHT (-1 = unbounded)"
    )
    p.add_argument("--json", metavar="PATH", default=None, help="also write the table as JSON")
    p.set_defaults(run=_run_layout)


def _run_layout(args: argparse.Namespace) -> int:

    return layout_report(
        world_size=args.world_size,
        seq_len=args.seq_len,
        cu_seqlens=args.cu_seqlens,
        layout=args.layout,
        causal=args.causal,
        window=args.window,
        json_path=args.json,
    )


def _pairs(sep: str):
    """Parse "8x4096,4x16384" (sep "x") or "32:32,32:8" (sep ":") into a list of int pairs."""

    def parse(text: str) -> list[tuple[int, int]]:
        try:
            pairs = [tuple(int(x) for x in p.split(sep)) for p in text.split(",") if p.strip()]
        except ValueError:
            pairs = []
        if not pairs or any(len(pair) != 2 for pair in pairs):
            raise argparse.ArgumentTypeError(f"expected A{sep}B[,A{sep}B...], got {text!r}")
        return pairs

    return parse


def _bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="one rank's share of an emulated W-way ring vs monolithic attention, one device",
        description="Time one rank's share of a W-way ring (all ranks' blocks on this device, "
        "K/V transfers as copies on a side stream) against monolithic SDPA over the same global "
        "sequence, in the same run; efficiency = (monolithic / W) / rank time. Prints a table and "
        "writes JSON and a PNG. Defaults depend on the device (GPU: the H200 sweep in bf16; CPU: "
        "small sizes in float32). --million runs the emulated 8-way 1M-token causal check.",
    )
    p.add_argument(
        "--sizes",
        type=_pairs("x"),
        default=None,
        help="WxTOKENS_PER_RANK pairs, e.g. 8x4096,4x16384 (default: per device)",
    )
    p.add_argument(
        "--heads",
        type=_pairs(":"),
        default=None,
        help="HQ:HKV pairs (GPU 32:32,32:8; CPU 8:8,8:2; --million: one pair)",
    )
    p.add_argument("--head-dim", type=int, default=None, help="per-head dim (GPU 128, CPU 64)")
    p.add_argument(
        "--masks",
        type=_name_list(("causal", "full")),
        default=["causal", "full"],
        help="causal,full",
    )
    p.add_argument(
        "--passes",
        type=_name_list(("fwd", "fwd+bwd")),
        default=["fwd", "fwd+bwd"],
        help="fwd,fwd+bwd",
    )
    p.add_argument("--layout", default="zigzag", choices=_LAYOUTS, help="token-to-rank layout")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="dtype of q, k, v (GPU bfloat16, CPU float32; --million bfloat16)",
    )
    p.add_argument("--backend", default="auto", help="block kernel of the ring: auto or a name")
    p.add_argument(
        "--baselines",
        type=_name_list(("cudnn", "flash", "efficient", "math")),
        default=None,
        help="monolithic SDPA backends (GPU cudnn,flash; CPU flash)",
    )
    p.add_argument(
        "--merge",
        default="auto",
        choices=("auto", "torch", "triton", "none"),
        help="merge of the ring: auto (Triton on CUDA when it works), torch, triton, "
        "none (kernels only: timing, wrong results)",
    )
    p.add_argument("--ranks", default="ends", help="ranks to time: ends, all, or 0,3,...")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before timing")
    p.add_argument("--repeats", type=int, default=5, help="timed calls; the median is reported")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads (default 1 on a CPU: robust ratios on a shared machine)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for q, k, v and dout")
    p.add_argument(
        "--documents",
        type=int,
        default=None,
        metavar="N",
        help="also run the same tokens as N packed documents (random boundaries, fresh plan "
        "every step): time per step, host-plan share, attention FLOPs actually needed",
    )
    p.add_argument(
        "--window",
        type=int,
        default=None,
        metavar="L",
        help="sliding window of L keys back for the packed case (alone: one document)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG (needs matplotlib)")
    p.add_argument(
        "--million",
        action="store_true",
        help="the emulated 1M-token causal ring check instead of the sweep",
    )
    p.add_argument(
        "--seq-len", type=int, default=None, help="--million: total tokens (GPU 1048576, CPU 4096)"
    )
    p.add_argument("--world-size", type=int, default=8, help="--million: ring size W")
    p.add_argument(
        "--sample-rows",
        type=int,
        default=8,
        help="--million: query rows per rank checked against float64",
    )
    p.set_defaults(run=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    if args.plot:
        require("plot", "ringattn bench --plot")
    common = {"device": args.device, "backend": args.backend, "merge": args.merge,
              "seed": args.seed, "head_dim": args.head_dim, "json_path": args.json}  # fmt: skip
    if args.million:
        heads = args.heads[0] if args.heads else None
        return run_million(MillionConfig(seq_len=args.seq_len, world_size=args.world_size,
                                         heads=heads, dtype=args.dtype or "bfloat16",
                                         sample_rows=args.sample_rows, threads=args.threads,
                                         **common), args.argv)  # fmt: skip

    cfg = BenchConfig(sizes=args.sizes, masks=args.masks, passes=args.passes, layout=args.layout,
                      dtype=args.dtype, baselines=args.baselines, ranks=args.ranks,
                      warmup=args.warmup, repeats=args.repeats, plot_path=args.plot,
                      heads=args.heads, threads=args.threads, documents=args.documents,
                      window=args.window, **common)  # fmt: skip
    return run_bench(cfg, args.argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringattn", description="Exact context-parallel (ring) attention for PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"ringattn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    # each subcommand's parser sets `run`, the function that takes the parsed args
    add_train_demo_command(sub)
    add_train_command(sub)
    add_generate_command(sub)
    add_serve_command(sub)
    add_eval_command(sub)
    add_attention_demo_command(sub)
    add_check_command(sub)
    _layout_parser(sub)
    _bench_parser(sub)
    add_plan_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what the run records as its command
    try:
        return args.run(args)
    except MissingExtra as err:  # an optional extra this command or flag needs: one line
        parser.exit(2, f"{err}\n")
    except ValueError as err:  # a bad flag value, found before any process started
        parser.exit(2, f"ringattn {args.command}: error: {err}\n")
    except LaunchError as err:  # a rank failed; the message names it and quotes its error
        parser.exit(1, f"ringattn {args.command}: FAIL: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
