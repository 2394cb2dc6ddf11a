"""Shared fixtures: worker pools for multi-rank tests (see harness.py for the conventions).

def test_sum(pools):
    assert pools(2).run(my_worker_fn, 3.0) == [...]

@pytest.mark.parametrize("pool", [1, 2, 3], indirect=True)
def test_every_world_size(pool):
    pool.run("workers:attention_case", causal=True, ...)
"""

from __future__ import annotations

import os
import sys
from collections import OrderedDict
from collections.abc import Iterator
from typing import IO, Any

import pytest

# pytest's default "prepend" import mode already puts tests/ (no __init__.py) on sys.path; doing it
# here too keeps `from harness import ...` working under --import-mode=importlib.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import basetemp
import bytecode
import schedule
from harness import WorkerPool

_LOCK = pytest.StashKey[IO]()


def pytest_configure(config: pytest.Config) -> None:
    """This run's own --basetemp (tests/basetemp.py), unless one was given; pytest-xdist's
    workers inherit their controller's, and each computes on one thread (`schedule.one_thread`).
    The sources' bytecode is written first, for every process the tests start (bytecode.py)."""
    if hasattr(config, "workerinput"):
        schedule.one_thread()
        return
    bytecode.compile_tree(os.path.join(os.path.dirname(_TESTS_DIR), "src"), _TESTS_DIR)
    if config.option.basetemp:
        return
    config.option.basetemp, lock = basetemp.claim()
    config.stash[_LOCK] = lock  # held (open) until this process ends


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: long files first (schedule.py)
        schedule.longest_first(items)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, called only under -n
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    return schedule.by_file(config, log)


class PoolCache:
    """Pools by world size, at most `max_pools` alive at once; the least recently used is evicted.

    A pool that was shut down (deadline, dead rank) is replaced by a fresh one on the next call.
    """

    def __init__(self, max_pools: int = 2, **pool_kwargs: Any) -> None:
        self.max_pools = max_pools
        self._pool_kwargs = pool_kwargs
        self._pools: OrderedDict[int, WorkerPool] = OrderedDict()

    def __call__(self, world_size: int) -> WorkerPool:
        pool = self._pools.pop(world_size, None)
        if pool is None or pool.closed:
            while len(self._pools) >= self.max_pools:  # evict first: fewer processes at peak
                self._pools.popitem(last=False)[1].shutdown()
            pool = WorkerPool(world_size, **self._pool_kwargs)
        self._pools[world_size] = pool  # most recently used last
        return pool

    def recycle_crowded(self, max_groups: int) -> list[int]:
        """Shut down every pool whose workers hold more than `max_groups` gloo groups (the next
        call spawns it afresh); return their world sizes.

        Why: the groups a test module builds (meshes, sub-groups, the library's group cache)
        live as long as the worker, and each costs CPU while idle: its gloo device's loop
        thread wakes up in epoll_wait every few milliseconds. A 4-rank pool's workers held 60
        groups late in the suite and burned 8 % of a core each doing nothing; over the suite's
        18 pool workers that was a third of this 2-core machine. A fresh pool costs about as
        much CPU per rank as 16 such groups burn in two minutes.
        """
        crowded = [w for w, pool in self._pools.items() if pool.gloo_groups() > max_groups]
        for world_size in crowded:
            self._pools.pop(world_size).shutdown()
        return crowded

    def close(self) -> None:
        while self._pools:
            self._pools.popitem()[1].shutdown()


@pytest.fixture(scope="session")
def pools() -> Iterator[PoolCache]:
    """`pools(W)` returns a cached WorkerPool of W ranks; at most 5 pools live at once."""
    cache = PoolCache(max_pools=5)  # one per world size used: each spawned once
    yield cache
    cache.close()


MAX_GROUPS = 16  # gloo groups a pool's worker may keep past a test module (recycle_crowded)


@pytest.fixture(scope="module", autouse=True)
def _recycle_crowded_pools(pools: PoolCache) -> Iterator[None]:
    """After each test module, respawn the pools its tests left crowded with process groups."""
    yield
    pools.recycle_crowded(MAX_GROUPS)


@pytest.fixture
def pool(request: pytest.FixtureRequest, pools: PoolCache) -> WorkerPool:
    """The pool for the world size given indirectly: parametrize("pool", [2, 4], indirect=True)."""
    world_size = getattr(request, "param", None)
    if not isinstance(world_size, int):
        raise TypeError(
            f"the `pool` fixture needs an int world size, got {world_size!r}; use "
            '@pytest.mark.parametrize("pool", [1, 2, ...], indirect=True) or the `pools` fixture'
        )
    return pools(world_size)
