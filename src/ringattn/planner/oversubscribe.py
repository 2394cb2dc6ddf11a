"""What more local processes than cores cost beyond sharing the cores (`--calibrate`).

With nproc > cores the launcher gives each process one thread, and the cores are shared: compute
is stretched by nproc / cores at best. It is stretched more in a training step, because every
collective (a ring hop, an FSDP gather) waits for a peer that the scheduler may have put to sleep,
and a woken process starts on cold caches. The planner measured that cost instead of guessing it:

    the same ring loop on `cores` processes and on 2 x cores processes, one thread each:
        repeat: a compute chunk (matmuls, ~5 ms on one core), then send a 256 KB buffer to the
                next rank and receive one from the previous (torch.distributed gloo)
    cost(2 x cores) = time per iteration(2 x cores) / (2 x time per iteration(cores))

cost = 1 means the processes take turns for free; the planner multiplies its nproc / cores
stretch by it (hardware.Hardware.slowdown), linearly from 1 at nproc = cores to the measured
value at 2 x cores, and the measured value beyond. Each process keeps the fastest of its samples
(other sessions' load only ever slows a sample down), the ring runs at its slowest rank, and the
two sizes are launched alternately, twice each, the fastest launch of each counting.

Other processes on the machine make this meaningless: with L other busy processes, 2 x cores
ring processes get a larger share of the cores than `cores` do, so the ratio drifts towards
(L + 2 cores) / (2 (L + cores)) < 1. The load average before and after is recorded, and
`busy` is set when it exceeded the core count (`ringattn plan --calibrate` then says so).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from ringattn.runtime.launch import init_distributed, launch

__all__ = ["measure_oversubscription", "oversubscription_cost"]

CHUNK = (256, 512)  # rows, width of the matmul chunk
CPU = "cpu"  # on purpose: this measures the CPU (gloo), whatever accelerator the machine has
MESSAGE = 1 << 16  # float32 elements per ring message (256 KB)


def oversubscription_cost(calibration: dict, nproc: int) -> float:
    """The measured cost factor for `nproc` local processes (1.0 when not measured or
    nproc <= cores), interpolated as the module docstring says."""
    measured = calibration.get("oversubscription")
    cores = calibration["cores"]
    if not measured or nproc <= cores:
        return 1.0
    at, cost = max((int(k), v) for k, v in measured.items())
    if nproc >= at:
        return max(1.0, cost)
    return max(1.0, 1.0 + (cost - 1.0) * (nproc - cores) / (at - cores))


def _ring_worker(iters: int, repeats: int, matmuls: int) -> float:
    init_distributed("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    a, b = torch.randn(*CHUNK, device=CPU), torch.randn(CHUNK[1], CHUNK[1], device=CPU)
    send, recv = torch.randn(MESSAGE, device=CPU), torch.empty(MESSAGE, device=CPU)
    best = float("inf")
    for _ in range(repeats + 1):  # the first round warms up
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            for _ in range(matmuls):
                a = torch.tanh(a @ b)
            ops = [dist.P2POp(dist.isend, send, (rank + 1) % world),
                   dist.P2POp(dist.irecv, recv, (rank - 1) % world)]  # fmt: skip
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        best = min(best, (time.perf_counter() - start) / iters)
    slowest = torch.tensor([best], device=CPU)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    return float(slowest)


def _matmuls_for(target_s: float = 5e-3) -> int:
    """Matmul chunks per iteration for ~target_s of compute on one thread."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(*CHUNK, device=CPU), torch.randn(CHUNK[1], CHUNK[1], device=CPU)
        torch.tanh(a @ b)
        start = time.perf_counter()
        for _ in range(20):
            a = torch.tanh(a @ b)
        once = (time.perf_counter() - start) / 20
    finally:
        torch.set_num_threads(saved)
    return max(1, round(target_s / once))


def measure_oversubscription(
    cores: int, iters: int = 10, repeats: int = 12, rounds: int = 2
) -> dict:
    """{"2 x cores": cost} (see the module docstring), with the two times it comes from."""
    if cores < 2:  # a ring of `cores` processes needs two
        return {"cost": {}, "iteration_s": {}, "matmuls_per_iteration": 0, "busy": False}
    load = [os.getloadavg()[0]]
    matmuls = _matmuls_for()
    times = {cores: float("inf"), 2 * cores: float("inf")}
    for _ in range(rounds):
        for n in (cores, 2 * cores):
            times[n] = min(times[n], launch(_ring_worker, n, iters, repeats, matmuls)[0])
    load.append(os.getloadavg()[0])
    ratio = times[2 * cores] / (2 * times[cores])
    return {"cost": {str(2 * cores): ratio}, "iteration_s": {str(k): v for k, v in times.items()},
            "matmuls_per_iteration": matmuls, "load_average": load,
            "busy": max(load) > cores}  # fmt: skip
