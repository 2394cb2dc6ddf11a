"""How `pytest -n N` (pytest-xdist) splits the suite, for machines with cores to spare.

The README's command runs in one process: on the 2-core VM two workers were slower, not faster
(measured 2026-12-07, docs/testing.md "Timings"), because two multi-rank tests at once put 4-8
gloo ranks on 2 cores and every collective waits for a descheduled peer.

Under xdist each worker runs whole files (`by_file`): a module's fixtures (a Slurm cluster,
two network namespaces, a server, a tmpfs) are built once, on one worker, and never on two at
once, which they could not share; a file's tests also share its worker's pools. Files go out
longest first (`LONGEST_FIRST`, then the rest in name order), the longest-processing-time rule:
a long file started last would run as the suite's tail alone. Without -n the order is pytest's.
"""

from __future__ import annotations

import os

import pytest
import torch

# Over about 40 s each in a full serial run on the 2-core VM (docs/testing.md "Timings", the
# durations log), longest first. A file missing here only runs later; nothing else changes.
LONGEST_FIRST = (
    "test_two_hosts.py",
    "test_slurm.py",
    "test_bare_install.py",
    "test_compile_train.py",
    "test_strategies.py",
    "test_hf_trainer.py",
    "test_dynamic_cp_hf.py",
    "test_compile_hf.py",
    "test_dynamic_cp.py",
    "test_hf_hybrid.py",
    "test_train.py",
    "test_cluster.py",
)


def longest_first(items: list[pytest.Item]) -> None:
    """Sort `items` in place: the files of LONGEST_FIRST in its order, then every other file
    in name order; a file's own tests keep their order (the sort is stable)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), str(item.path)))


def by_file(config: pytest.Config, log: object) -> object:
    """xdist's file-by-file scheduler, keeping the collection's order (xdist's default reorders
    files by their number of tests, which would start the long, few-test files last)."""
    from xdist.scheduler import LoadFileScheduling  # present whenever xdist calls this

    config.option.loadscopereorder = False
    return LoadFileScheduling(config, log)


def one_thread() -> None:
    """One intra-op thread in this xdist worker and the processes it starts (unless a test sets
    its own): with a worker per core, torch's default of a thread per core would put two
    threads on each core, and OpenMP threads spin while they wait for each other."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
