"""What gloo's collectives cost over the shaped link between two hosts: the facts the planner's
cpu-hosts pricing rests on (planner/cost.py). Needs root.

    sudo .venv/bin/python scripts/bench/two_hosts_link.py        # results/two_hosts_link_cpu.json

2 hosts x 2 ranks (ringattn/testing/hosts.py), one run, side by side, each the fastest of 5
after a warm-up, between barriers, C = 128 KiB per rank:

    ring hop        every rank sends C to rank + 1: one C crosses each direction of the link
    all-gather      all_gather_into_tensor of C per rank: a ring would cross W - 1 = 3 C,
                    every rank gathering at once G (W - G) = 4 C, per direction
    reduce-scatter  reduce_scatter_tensor of W C per rank: a ring 3 C, an all-reduce 6 C
    all-to-all      all_to_all_single of C per peer: 4 C per direction

Each is reported in units of the link time of one C at the rate, so the number is how many C
crossed one direction (plus latency).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from ringattn.bench import record
from ringattn.testing.hosts import TwoHosts, unavailable

CHUNK = 128 * 1024  # bytes per rank (per peer for the all-to-all)

WORKER = r"""
import json, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
n = int(sys.argv[1]) // 4

def best(fn, reps=5):
    times = []
    for _ in range(reps + 1):
        dist.barrier(); start = time.perf_counter(); fn(); dist.barrier()
        times.append(time.perf_counter() - start)
    return min(times[1:])

def hop():
    ops = [dist.P2POp(dist.isend, torch.zeros(n), (r + 1) % w),
           dist.P2POp(dist.irecv, torch.empty(n), (r - 1) % w)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()

out = {"ring hop": best(hop),
       "all-gather": best(lambda: dist.all_gather_into_tensor(torch.empty(w * n), torch.zeros(n))),
       "reduce-scatter": best(lambda: dist.reduce_scatter_tensor(torch.empty(n),
                                                                 torch.zeros(w * n))),
       "all-to-all": best(lambda: dist.all_to_all_single(torch.empty(w * n), torch.zeros(w * n)))}
if r == 0:
    print("RESULT " + json.dumps(out))
dist.destroy_process_group()
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="20mbit", help="the link's rate (tc syntax)")
    p.add_argument("--json", default="results/two_hosts_link_cpu.json")
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(f"two_hosts_link: {why}", file=sys.stderr)
        return 2
    units = {"mbit": 1e6, "gbit": 1e9}
    bits = next(float(args.rate[: -len(u)]) * s for u, s in units.items() if args.rate.endswith(u))
    with tempfile.TemporaryDirectory(prefix="ringattn-link-") as tmp:
        worker = os.path.join(tmp, "worker.py")
        with open(worker, "w") as f:
            f.write(WORKER)
        with TwoHosts(rate=args.rate) as hosts:
            results = hosts.torchrun([worker, str(CHUNK)], timeout=600)
    for host, (code, out) in enumerate(results):
        if code:
            raise RuntimeError(f"host {host} exited with {code}:\n{out[-3000:]}")
    line = next(x for x in results[0][1].splitlines() if x.startswith("RESULT "))
    seconds = json.loads(line[len("RESULT ") :])
    chunk_s = CHUNK * 8 / bits
    rows = {k: {"seconds": v, "chunks": v / chunk_s} for k, v in seconds.items()}
    record.write(args.json, __file__, argv, {
        "rate": args.rate, "chunk_bytes": CHUNK, "chunk_link_s": chunk_s, "rows": rows,
    })  # fmt: skip
    print(f"| collective ({args.rate}, {CHUNK // 1024} KiB) | seconds | C over the link |")
    print("|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['seconds']:.3f} | {row['chunks']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
