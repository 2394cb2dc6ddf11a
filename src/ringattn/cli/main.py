"""The `ringattn` command (also `python -m ringattn`): parses flags and dispatches.

    ringattn demo            train a small decoder with CP = 4 on CPU: loss, accuracy, memory, plot
    ringattn train           train the decoder over a dp x cp mesh (local processes or torchrun)
    ringattn generate        decoding from a checkpoint over a KV cache sharded across ranks
    ringattn attention-demo  one long sequence on W processes: time, memory, error vs 1 process
    ringattn check    the correctness matrix against a float64 reference
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

from ringattn.runtime.launch import LaunchError

_LAYOUTS = ("contiguous", "zigzag", "striped")
_STRATEGIES = ("ring", "allgather", "ulysses", "hybrid")


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def _name_list(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        return list(choices) if text == "all" else [p.strip() for p in text.split(",") if p.strip()]

    return parse


def _demo_parser(sub) -> None:
    from ringattn.cli.attention_demo import DemoConfig

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


def _check_parser(sub) -> None:
    from ringattn.cli.check import CheckConfig

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
        "--nproc", type=int, default=None, help="run only this world size (same as --world-sizes N)"
    )
    p.add_argument(
        "--world-sizes",
        type=_int_list,
        default=c.world_sizes,
        help="comma-separated world sizes to launch, e.g. 1,2,3,4",
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
    p.set_defaults(run=_run_check)


def _run_demo(args: argparse.Namespace) -> int:
    from ringattn.cli.attention_demo import DemoConfig, run_demo

    options = {k: v for k, v in vars(args).items() if k not in ("command", "json", "run")}
    return run_demo(DemoConfig(**options), json_path=args.json)


def _run_check(args: argparse.Namespace) -> int:
    from ringattn.cli.check import CheckConfig, run_check

    options = {k: v for k, v in vars(args).items() if k not in ("command", "nproc", "run")}
    if args.nproc is not None:
        options["world_sizes"] = [args.nproc]
    return run_check(CheckConfig(**options))


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
    from ringattn.cli.layout_report import layout_report

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
    common = {"device": args.device, "backend": args.backend, "merge": args.merge,
              "seed": args.seed, "head_dim": args.head_dim, "json_path": args.json}  # fmt: skip
    if args.million:
        from ringattn.bench.million import MillionConfig, run_million

        heads = args.heads[0] if args.heads else None
        return run_million(MillionConfig(seq_len=args.seq_len, world_size=args.world_size,
                                         heads=heads, dtype=args.dtype or "bfloat16",
                                         sample_rows=args.sample_rows, threads=args.threads,
                                         **common))  # fmt: skip
    from ringattn.bench.sweep import BenchConfig, run_bench

    cfg = BenchConfig(sizes=args.sizes, masks=args.masks, passes=args.passes, layout=args.layout,
                      dtype=args.dtype, baselines=args.baselines, ranks=args.ranks,
                      warmup=args.warmup, repeats=args.repeats, plot_path=args.plot,
                      heads=args.heads, threads=args.threads, **common)  # fmt: skip
    return run_bench(cfg)


def _train_demo_parser(sub) -> None:
    from ringattn.train.flags import add_demo_command  # the trainer's flags live with it

    add_demo_command(sub)


def _train_parser(sub) -> None:
    from ringattn.train.flags import add_train_command

    add_train_command(sub)


def _generate_parser(sub) -> None:
    from ringattn.train.generate import GenerateConfig

    d = GenerateConfig()
    p = sub.add_parser(
        "generate",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="decoding from a training checkpoint over a KV cache sharded across --nproc ranks",
        description="Load a checkpoint written by `ringattn train` or `ringattn demo` on --nproc "
        "local processes (or torchrun's ranks), prefill the prompt context-parallel (each rank "
        "keeps its shard of the KV cache) and decode, streaming the tokens; prints the time to "
        "first token, decode tokens/s and each rank's KV-cache MB. Without --prompt or "
        "--prompt-file, a run trained on the key-value task is asked a fresh sample's last "
        "query, and the right answer is shown.",
    )
    p.add_argument(
        "--checkpoint",
        default=d.checkpoint,
        help="a step-N checkpoint or a directory of them (the newest is used)",
    )
    p.add_argument("--prompt", default=d.prompt, help="text to continue (bytes are tokens)")
    p.add_argument("--prompt-file", default=d.prompt_file, help="a file whose bytes are the prompt")
    p.add_argument(
        "--max-new-tokens", type=int, default=d.max_new_tokens, help="tokens to generate"
    )
    p.add_argument(
        "--sample",
        type=int,
        default=d.sample,
        help="which fresh key-value sample to ask (without --prompt)",
    )
    p.add_argument("--nproc", type=int, default=d.nproc, help="ranks the KV cache is sharded over")
    p.add_argument("--layout", choices=_LAYOUTS, default=d.layout, help="how the prompt is sharded")
    p.add_argument(
        "--merge",
        choices=("allgather", "allreduce"),
        default=d.merge,
        help="the one collective per layer that merges the ranks' partial attention per token",
    )
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    p.add_argument(
        "--top-k", type=int, default=d.top_k, help="sample among the k likeliest (0: all)"
    )
    p.add_argument("--top-p", type=float, default=d.top_p, help="nucleus sampling mass (1: all)")
    p.add_argument("--seed", type=int, default=d.seed, help="sampling seed, shared by all ranks")
    p.add_argument("--eos-id", type=int, default=d.eos_id, help="stop after this token id")
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from ringattn.train.generate import GenerateConfig, run_generate

    return run_generate(
        GenerateConfig(**{f.name: getattr(args, f.name) for f in fields(GenerateConfig)})
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringattn", description="Exact context-parallel (ring) attention for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # each subcommand's parser sets `run`, the function that takes the parsed args
    _train_demo_parser(sub)
    _train_parser(sub)
    _generate_parser(sub)
    _demo_parser(sub)
    _check_parser(sub)
    _layout_parser(sub)
    _bench_parser(sub)
    __import__("ringattn.cli.plan", fromlist=["add_parser"]).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ValueError as err:  # a bad flag value, found before any process started
        parser.exit(2, f"ringattn {args.command}: error: {err}\n")
    except LaunchError as err:  # a rank failed; the message names it and quotes its error
        parser.exit(1, f"ringattn {args.command}: FAIL: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
