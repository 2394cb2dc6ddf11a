"""One decode step's attention over a paged cache: pages read in place, gathered, or contiguous.

    python scripts/bench/paged_decode.py            # results/paged_decode_cpu.json

L sequences share a `--prefix`-token prompt (an entry's blocks) and each has `--own` rows of
its own, in a real PagedStore (inference/paged.py) of one layer. Three ways to compute every
sequence's partial (out, lse) for one query token, timed side by side (medians of
`--repeats`, interleaved):
  in place   ringattn's decode (paged.parts): each sequence's long shared run read as a view
             of the pages, its own rows gathered, two calls merged by lse
             (kv_attention._decode_paged)
  gathered   every sequence's rows copied into one (L, Hkv, N, D) batch padded to the longest,
             one masked call of the same fused kernel (what "one call per layer" costs here)
  contiguous each sequence's rows already in a contiguous buffer of its own (the copying
             cache before the pages), one call per sequence: the floor
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from ringattn.bench import record
from ringattn.inference.paged import PagedStore, PagedView, parts
from ringattn.inference.partials import local_partial, merge_stacked
from ringattn.kernels import select_kernel


def build(args, device: torch.device):
    store = PagedStore(args.sequences * (args.prefix + args.own) // args.block + 64, args.block,
                       args.prefix, device)  # fmt: skip
    hkv, d = args.kv_heads, args.head_dim

    def fill(seq: int, positions: list[int]) -> None:
        table = store.table(seq)
        at = table.rows
        store.assign(table, positions, decoded=False)
        k = torch.randn(1, hkv, len(positions), d, device=device)
        store.write(0, table, at, k, torch.randn_like(k))

    fill(0, list(range(args.prefix)))
    store.keep(0, 0, 0, args.prefix)
    views = []
    for seq in range(1, args.sequences + 1):
        store.adopt(seq, [0], args.prefix)
        fill(seq, list(range(args.prefix, args.prefix + args.own)))
        view = PagedView(store, 0, seq, None, 0)
        view.length = store.tables[seq].rows
        views.append(view)
    return store, views


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--own", type=int, default=64)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--groups", type=int, default=2, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="results/paged_decode_cpu.json")
    args = parser.parse_args(argv)
    device = torch.device("cpu")  # the gathered way calls the CPU flash op
    torch.manual_seed(0)
    store, views = build(args, device)
    q = torch.randn(len(views), args.kv_heads * args.groups, 1, args.head_dim, device=device)
    k0 = store.k[0]
    kernel = select_kernel("auto", q[:1], k0[:1].transpose(0, 1)[None])
    scale = args.head_dim**-0.5
    counts = [view.tokens for view in views]

    def in_place():
        out = []
        for j, view in enumerate(views):
            done = [local_partial(kernel, q[j : j + 1], k, v, scale)
                    for k, v in parts(store, 0, view)]  # fmt: skip
            out.append(done[0] if len(done) == 1 else merge_stacked(
                torch.stack([o for o, _ in done]), torch.stack([x for _, x in done])))  # fmt: skip
        return out

    def gathered():
        index = torch.zeros(len(views), max(counts), dtype=torch.int64, device=device)
        for j, view in enumerate(views):
            index[j, : counts[j]] = view.table.index(view.start, view.length)
        k = store.k[0][index].transpose(1, 2).contiguous()  # (L, Hkv, N, D)
        v = store.v[0][index].transpose(1, 2).contiguous()
        width = torch.arange(max(counts), device=device)[None]
        padding = width >= torch.tensor(counts, device=device)[:, None]  # (L, N)
        bias = torch.zeros(padding.shape, device=device).masked_fill(padding, float("-inf"))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias[:, None, None, :], scale=scale
        )[:2]  # the CPU flash kernel (`auto` on a CPU), masked: one call

    contiguous = [tuple(x.contiguous() for x in view.kept()[:2]) for view in views]

    def copied():
        return [local_partial(kernel, q[j : j + 1], k, v, scale)
                for j, (k, v) in enumerate(contiguous)]  # fmt: skip

    ways = {"in place": in_place, "gathered": gathered, "contiguous": copied}
    times = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    calls = sum(len(parts(store, 0, view)) for view in views)
    print(f"{len(views)} sequences x ({args.prefix} shared + {args.own} own) rows, one layer, "
          f"{device.type}; in place: {calls} kernel calls")  # fmt: skip
    print(f"{'way':12} {'ms (median)':>12} {'x in place':>11}")
    for name, ms in medians.items():
        print(f"{name:12} {ms:12.2f} {ms / medians['in place']:11.2f}")
    result = {"config": vars(args), "device": device.type, "kernel": kernel.name,
              "in_place_calls": calls, "median_ms": medians, "times_s": times}  # fmt: skip
    record.write(args.out, __file__, sys.argv[1:] if argv is None else argv, result)
    return result


if __name__ == "__main__":
    main()
