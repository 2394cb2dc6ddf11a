"""Overlap, proven on CPU: a ring step costs max(compute, transfer), not their sum.

Every transfer of a W = 2 ring is made to take a known time d (workers_bench.delayed_transfers:
its wait() returns no earlier than post + d, using no CPU), with d set to the measured compute of
one ring step. Per forward, on each rank:

    window    post of the K/V exchange -> the exchange complete (the ring's step with a transfer)
    compute   post -> the ring's first wait: the block work done while the transfer is in flight

A ring that overlaps has window ~ max(compute, d); one that waits first has window ~ d and its
compute after (then `compute` ~ 0, and the whole call grows by d). The test asserts, from medians
of interleaved runs on both ranks:

    window <= 1.15 x max(compute, d)   and   window <= compute + d - 0.5 x min(compute, d)
    compute >= 0.3 x a step's compute (forward without delay / W)  (the work is in the window)
    call(d) - call(0) - max(0, d - compute) <= 0.5 d, paired runs   (the delay is hidden)

This is the one timing assertion in the suite (DESIGN §6 keeps benchmarks out of tests): every
number is a ratio within one run on the same ranks, so a loaded machine slows both sides alike.
"""

from __future__ import annotations

import statistics

import pytest

REPEATS = 9


def _medians(results, delay, index):
    """Median over runs of item `index`, per rank; the slower rank's."""
    return max(statistics.median(run[index] for run in rank[delay]) for rank in results)


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_ring_step_time_is_max_of_compute_and_transfer(pool):
    calibrate = pool.run("workers_bench:ring_forward_steps", delays=[0.0], repeats=5)
    # one step's compute, whatever the ring's structure: a forward without delay over W steps
    delay = _medians(calibrate, 0.0, 0) / pool.world_size
    assert delay > 0.005, f"a ring step of {delay * 1e3:.2f} ms is too short to time; grow it"
    results = pool.run("workers_bench:ring_forward_steps", delays=[0.0, delay], repeats=REPEATS)
    compute_0 = _medians(results, 0.0, 0) / pool.world_size
    ratios, hiddens, inside, extra = [], [], [], []
    for rank in results:
        for (call_0, _, _), (call_d, window, compute) in zip(rank[0.0], rank[delay]):
            ratios.append(window / max(compute, delay))
            hiddens.append((compute + delay - window) / min(compute, delay))  # share hidden
            inside.append(compute / compute_0)
            # paired runs, back to back: what the delay added beyond max(compute, d) - compute
            extra.append((call_d - call_0 - max(0.0, delay - compute)) / delay)
    ratio, hidden, share, added = (statistics.median(x) for x in (ratios, hiddens, inside, extra))
    report = (
        f"step compute {compute_0 * 1e3:.1f} ms, delay {delay * 1e3:.1f} ms: window / max = "
        f"{ratio:.3f}, hidden = {hidden:.2f} of min(compute, d), compute inside the window "
        f"{share:.2f}x, the delay adds {added:.2f} d to a forward beyond max(compute, d)"
    )
    print(report)
    assert ratio <= 1.15, report
    assert hidden >= 0.5, report
    assert share >= 0.3, report
    assert added <= 0.5, report
