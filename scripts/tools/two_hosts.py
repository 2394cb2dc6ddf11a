"""Run a torchrun job over two "hosts" on this machine: two network namespaces joined by a veth
link shaped to --rate (ringattn/testing/hosts.py). Needs root. Always removes the namespaces.

    sudo .venv/bin/python scripts/tools/two_hosts.py --rate 100mbit --logs runs/two -- \\
        -m ringattn train --cp 4 --strategy hybrid --ulysses 2 --model tiny --steps 5

Everything after `--` follows `torchrun --nnodes 2 --nproc-per-node N --node-rank I
--rdzv-endpoint 10.213.0.1:29500 --local-addr <host I>`; gloo is bound to the veth end
(GLOO_SOCKET_IFNAME). Each host's output goes to LOGS/host-I.log and is echoed at the end; the
exit code is the first non-zero host's.
"""

from __future__ import annotations

import argparse
import os
import sys

from ringattn.testing.hosts import TwoHosts, unavailable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit", help="link rate between the hosts (tc tbf)")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="ranks on each host")
    parser.add_argument("--logs", default="two-hosts-logs", help="where host-0.log, host-1.log go")
    parser.add_argument(
        "--timeout", type=float, default=1800, help="seconds before both hosts are killed"
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then torchrun's script/-m args")
    args = parser.parse_args(argv)
    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    if not rest:
        parser.error("give the command after --, e.g. -- -m ringattn train --cp 4")
    why = unavailable()
    if why:
        print(f"two_hosts: {why}", file=sys.stderr)
        return 2
    os.makedirs(args.logs, exist_ok=True)
    with TwoHosts(rate=args.rate) as hosts:
        print(f"two_hosts: {hosts.names[0]} ({hosts.addresses[0]}) <-> {hosts.names[1]} "
              f"({hosts.addresses[1]}), link {args.rate}", flush=True)  # fmt: skip
        procs = hosts.start_torchrun(rest, args.nproc_per_node)
        results = hosts.finish(procs, args.timeout)
    code = 0
    for host, (rc, out) in enumerate(results):
        with open(os.path.join(args.logs, f"host-{host}.log"), "w") as f:
            f.write(out)
        print(f"===== host {host}: exit code {rc} =====\n{out}", flush=True)
        code = code or rc
    return code


if __name__ == "__main__":
    sys.exit(main())
