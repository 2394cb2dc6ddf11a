"""Softcapped attention against uncapped: the cost of `attention(..., softcap=c)` on CPU.

One process, one block kernel call pair (forward, then backward from its own out and lse), causal,
B = 1, 8 heads x 64, float32, at several lengths. Uncapped: the fused CPU flash op (`cpu_flash`,
what `auto` runs on CPU) and the plain-PyTorch reference kernel (the same math as the softcap
kernel, without the tanh); capped: the softcap kernel (kernels/softcap.py). Median of repeats,
after a warm-up. On CPU absolute times are noise between machines: the ratios are the result.

    PYTHONPATH=src python scripts/bench/softcap.py        # writes results/softcap_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ringattn.bench import record
from ringattn.kernels import KERNELS, softcap_kernel


def _time(kernel, q, k, v, dout, repeats: int) -> dict[str, float]:
    """Median seconds of forward and of backward (from the forward's out and lse)."""
    scale = q.shape[-1] ** -0.5
    fwd, bwd = [], []
    for i in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        out, lse = kernel.forward(q, k, v, True, scale)
        mid = time.perf_counter()
        kernel.backward(dout, q, k, v, out.to(q.dtype), lse, True, scale)
        end = time.perf_counter()
        if i:
            fwd.append(mid - start)
            bwd.append(end - mid)
    return {"forward_s": statistics.median(fwd), "backward_s": statistics.median(bwd)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048],
                        help="sequence lengths (one block of Sq = Sk tokens)")  # fmt: skip
    parser.add_argument("--heads", type=int, default=8, help="query = key/value heads")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case")
    parser.add_argument("--softcap", type=float, default=50.0, help="the cap c (Gemma 2: 50)")
    parser.add_argument("--out", default="results/softcap_cpu.json", help="JSON output path")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    kernels = {"cpu_flash": KERNELS["cpu_flash"], "reference": KERNELS["reference"],
               "softcap": softcap_kernel("auto", args.softcap)}  # fmt: skip
    rows = []
    print(f"{'S':>6} {'kernel':>10} {'fwd ms':>9} {'bwd ms':>9} {'x cpu_flash':>12} {'x ref':>7}")
    for seq_len in args.lengths:
        q, k, v, dout = (torch.randn(1, args.heads, seq_len, args.head_dim) for _ in range(4))
        times = {name: _time(kern, q, k, v, dout, args.repeats) for name, kern in kernels.items()}
        for name, t in times.items():
            total = t["forward_s"] + t["backward_s"]
            row = {
                "seq_len": seq_len,
                "kernel": name,
                **t,
                "vs_cpu_flash": total / sum(times["cpu_flash"].values()),
                "vs_reference": total / sum(times["reference"].values()),
            }
            rows.append(row)
            print(f"{seq_len:>6} {name:>10} {t['forward_s'] * 1e3:>9.1f} "
                  f"{t['backward_s'] * 1e3:>9.1f} {row['vs_cpu_flash']:>12.2f} "
                  f"{row['vs_reference']:>7.2f}")  # fmt: skip
    result = {
        "what": "causal block forward + backward, float32, B=1, one process; ratios of "
        "fwd+bwd time to the uncapped kernels",
        "threads": torch.get_num_threads(),
        "heads": args.heads,
        "head_dim": args.head_dim,
        "softcap": args.softcap,
        "repeats": args.repeats,
        "rows": rows,
    }
    return record.write(args.out, __file__, argv, result)


if __name__ == "__main__":
    main()
