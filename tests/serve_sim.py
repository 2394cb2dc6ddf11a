"""Rank 0's scheduler driven by a model of the ranks: what every rank would hold, without a model.

`Ranks` executes step plans (runner.py's format, scoring chunks included) as bookkeeping: for
every sequence and every rank, the global positions whose K/V that rank keeps, placed as the
engine places them (inference/hf/engine.py): the first pieces of empty sequences packed as
documents into one placement (`packing.place` over their cu_seqlens), every other piece placed
alone after what the sequence holds, decoded tokens round-robin from rank `seq mod W`, adopted
entries cut at a position. `simulate` runs a seeded scenario (arrivals, prompts sharing
prefixes, lengths, chunks of any size, requests scoring their prompt, a hybrid's pool whose
entries carry state snapshots and whose hits end where an entry ends, cancellations, failed
steps, NaN rows) through the real `Scheduler` and `BlockPool` and checks, after every plan and
every step, that the scheduler's BlockManager is consistent (`check_blocks`: its sequences, ids
and the pool's counts recounted from scratch) and that no rank holds more rows of a sequence or
an entry than the pool counts, and at the end that
every request got one last event (a scoring one its prompt's logprobs first, one per token),
that no block is held, and that every rank's prefix store holds what the pool's index says.
Each rank also runs a real paged store (inference/paged.py) without tensors' contents: its
tables, shared blocks and copies on write, so the check is on every rank's real blocks: a
sequence's own (those no entry holds), each entry's, and the rank's total, against what the
pool counts.
"""

from __future__ import annotations

import queue
import random
from dataclasses import dataclass, field

import torch

from ringattn.inference.paged import PagedStore
from ringattn.layout import get_layout
from ringattn.packing import place
from ringattn.serve.allocation import BlockManager
from ringattn.serve.pool import BlockPool
from ringattn.serve.protocol import Request
from ringattn.serve.scheduler import Scheduler
from ringattn.serve.shares import Shares

VOCAB, EOS = 320, 2  # serve_model.tokenizer()'s size and its <|im_end|>; 0-2 are special


class SimJob:
    """A Job's stand-in: its request, the cancel flag and the events its sink got."""

    def __init__(self, request: Request):
        self.request, self.cancelled, self.arrived = request, False, 0.0
        self.events: list[tuple] = []

    def sink(self, *event: object) -> None:
        if event[0] != "token":
            self.events.append(event)

    @property
    def ended(self) -> bool:
        return bool(self.events) and self.events[-1][0] in ("done", "error")


class Alive:
    """rank_loop's `http` stand-in: the server never stops during a scenario."""

    @staticmethod
    def is_alive() -> bool:
        return True


class Ranks:
    """Every rank's K/V positions per sequence and per stored entry (module docstring)."""

    def __init__(self, layout: str, world_size: int, blocks: int, block: int, chunk: int,
                 whole: bool = False):  # fmt: skip
        self.layout, self.world_size = get_layout(layout), world_size
        self.whole = whole  # a hybrid's: an adoption ends where its last entry ends
        self.ends: dict[int, int] = {}  # entry -> the position it ends at
        self.seqs: dict[int, list[list[int]]] = {}  # seq -> per rank, positions held
        self.decoded: dict[int, int] = {}
        self.decoded_at: dict[int, set[int]] = {}  # seq -> positions it decoded
        self.store: dict[int, list[list[int]]] = {}  # entry -> per rank, positions kept
        self.opened = 0
        cpu = torch.device("cpu")
        self.paged = [PagedStore(blocks, block, chunk, cpu) for _ in range(world_size)]

    def _sync(self, seq: int) -> None:
        """Every rank's table of `seq` takes the rows the bookkeeping added (in order)."""
        for rank, store in enumerate(self.paged):
            table = store.table(seq)
            for p in sorted(self.seqs[seq][rank])[table.rows :]:
                store.assign(table, [p], decoded=p in self.decoded_at[seq])

    def length(self, seq: int) -> int:
        return sum(len(r) for r in self.seqs[seq])

    def prologue(self, plan: dict) -> None:
        """What a rank does before its forward: evict, free, open (also when the step fails)."""
        for entry in plan["evict"]:
            self.store.pop(entry, None)
            for store in self.paged:
                store.evict(entry)
        for seq in plan["free"]:
            self.seqs.pop(seq, None)
            for store in self.paged:
                store.release(seq)
        for seq, _, _ in plan["open"]:
            assert seq == self.opened, f"opened {self.opened}, the plan says {seq}"
            self.opened += 1
            self.seqs[seq], self.decoded[seq] = [[] for _ in range(self.world_size)], 0
            self.decoded_at[seq] = set()

    def forward(self, plan: dict) -> None:
        """The step's decodes and pieces, in the runner's order (adopt at a first piece)."""
        adopt = {seq: (reuse, tokens) for seq, reuse, tokens in plan["open"] if reuse}
        for seq, _ in plan["decode"]:
            rank = (self.decoded[seq] + seq) % self.world_size
            self.decoded_at[seq].add(self.length(seq))
            self.seqs[seq][rank].append(self.length(seq))
            self.decoded[seq] += 1
            self._sync(seq)
        fresh = [(seq, len(ids)) for seq, ids, *_ in plan["chunks"] if seq not in adopt
                 and self.length(seq) == 0]  # fmt: skip
        self._packed(fresh)
        for seq, ids, keep, *_ in plan["chunks"]:  # (a 4th item: the piece's scores asked)
            if seq in adopt:
                reuse, tokens = adopt.pop(seq)
                assert not self.whole or tokens == self.ends[reuse[-1]], (tokens, reuse)
                for store in self.paged:
                    store.adopt(seq, reuse, tokens)
                for entry in reuse:
                    for rank, kept in enumerate(self.store[entry]):
                        self.seqs[seq][rank] += [p for p in kept if p < tokens]
            if (seq, len(ids)) not in fresh or self.length(seq) != len(ids):
                cached = self.length(seq)
                alone = place(self.layout, self.world_size, (0, len(ids)))
                for rank in range(self.world_size):
                    got = [g for g in alone.global_indices(rank).tolist() if g >= 0]
                    self.seqs[seq][rank] += [cached + g for g in got]
            self._sync(seq)
            if keep is not None:
                entry, start = keep
                self.store[entry] = [[p for p in r if p >= start] for r in self.seqs[seq]]
                self.ends[entry] = self.length(seq)
                for store in self.paged:
                    store.keep(entry, seq, start, self.length(seq))
        for rows in self.seqs.values():
            for r in rows:
                r.sort()

    def _packed(self, fresh: list[tuple[int, int]]) -> None:
        if not fresh:
            return
        bounds = [0]
        for _, n in fresh:
            bounds.append(bounds[-1] + n)
        placement = place(self.layout, self.world_size, tuple(bounds))
        for rank in range(self.world_size):
            for g in placement.global_indices(rank).tolist():
                if g < 0:
                    continue
                d = next(i for i in range(len(fresh)) if g < bounds[i + 1])
                self.seqs[fresh[d][0]][rank].append(g - bounds[d])

    def check(self, pool: BlockPool, freed: list[int]) -> None:
        """No rank holds more blocks than the pool counts: a sequence's own (blocks no entry
        references), an entry's, and the rank's total (a sequence the pool has freed since its
        last plan, `freed`, and an entry it evicted go with the next plan)."""
        live_entries = [e for e in self.store if e not in pool.evicted]
        for rank, store in enumerate(self.paged):
            in_entries = {b for e in live_entries for b in store.entries[e][0]}
            for e in live_entries:
                counted = pool.cached[e].blocks if e in pool.cached else 0
                base = pool.cached[e].base if e in pool.cached else None
                own = set(store.entries[e][0])  # less those of the entry it shares blocks of
                own -= set(store.entries[base][0]) if base is not None else set()
                assert len(own) <= counted, (rank, e, counted)
            held = set(in_entries)
            for seq, table in store.tables.items():
                if seq in freed:
                    continue
                own = set(table.blocks) - in_entries
                assert len(own) <= pool.held.get(seq, 0), (
                    f"rank {rank}, sequence {seq}: {len(own)} blocks of its own, the pool "
                    f"counts {pool.held.get(seq, 0)}"
                )
                held |= set(table.blocks)
            assert len(held) <= pool.n_blocks - pool.free, (rank, len(held), pool.free)


def check_blocks(blocks: BlockManager, planned: bool = False) -> None:
    """The block manager's state agrees with itself and with the pool, recounted from scratch:
    each running sequence has a distinct id and the pool holds blocks for exactly those ids,
    within what its rows need (but while a step is `planned`: a piece that completes a kept
    chunk moved that chunk's blocks to the entry already); freed ids are held by none; every
    entry's users are running and every entry's base is kept before it; the index names
    exactly the entries' points; and the pool's used, cached, shared and free blocks equal a
    count over the references (an entry is used while a sequence references it or an entry
    that shares its blocks)."""
    pool, block = blocks.pool, blocks.pool.block_size
    ids = [seq.id for seq in blocks.running]
    assert len(set(ids)) == len(ids) and all(0 <= i < blocks.next_id for i in ids), ids
    assert set(pool.held) == set(ids), (pool.held, ids)
    for seq in blocks.running:
        rows = blocks.rows(seq)
        assert planned or rows <= pool.held[seq.id] * block, (seq.id, rows, pool.held[seq.id])
        assert seq.done <= len(seq.tokens) and seq.target <= len(seq.tokens)
    assert len(set(blocks.freed)) == len(blocks.freed) and not set(blocks.freed) & set(ids)
    users: dict[int, set[int]] = {entry: set() for entry in pool.cached}
    for entry, seqs in pool.users.items():
        assert seqs and seqs <= set(ids) and entry in pool.cached, (entry, seqs, ids)
        while entry is not None:  # an entry's users keep its base, and the base's base
            users[entry] |= seqs
            entry = pool.cached[entry].base
    for entry, kept in pool.cached.items():
        assert kept.base is None or (kept.base < entry and kept.base in pool.cached), entry
        for _, h in kept.points:
            assert entry in pool.index[h], (entry, h)
    for h, holders in pool.index.items():
        assert holders and all(h in {p for _, p in pool.cached[e].points} for e in holders), h
    assert set(blocks.kept) <= set(pool.cached), (blocks.kept, pool.cached)
    used = sum(pool.held.values()) + sum(pool.cached[e].blocks for e, u in users.items() if u)
    cached = sum(pool.cached[e].blocks for e, u in users.items() if not u)
    shared = sum(pool.cached[e].blocks for e, u in users.items() if len(u) > 1)
    counts = {"used": used, "cached": cached, "shared": shared,
              "free": pool.n_blocks - used - cached}  # fmt: skip
    assert pool.counts() == counts and counts["free"] >= 0, (pool.counts(), counts)


@dataclass
class Scenario:
    """One seeded run's settings (see `scenario`)."""

    layout: str
    world_size: int
    chunk: int
    block: int
    blocks: int
    max_running: int
    prefix_cache: bool
    jobs: list[tuple[int, Request]] = field(default_factory=list)  # (arrival step, request)
    cancel: dict[int, int] = field(default_factory=dict)  # job -> step it is cancelled at
    fail_p: float = 0.0  # chance that a step raises
    nan_p: float = 0.0  # chance that a row's logits are NaN
    snapshot: int = 0  # a hybrid's pool: blocks each entry's states snapshot takes (0: none)


def scenario(seed: int, layouts: tuple[str, ...]) -> Scenario:
    """A random small case: W 1-4, blocks of 1-4 tokens, chunks of any size from 1 to 3 blocks
    x W (so a chunk's rows on a rank need not fill whole blocks), a pool from barely one
    request's size up, prompts that share a few system prefixes, some scoring their prompt
    (echo: prompt logprobs, with or without a completion)."""
    rng = random.Random(seed)
    world_size, block = rng.randint(1, 4), rng.randint(1, 4)
    chunk = rng.randint(1, 3 * block * world_size)
    s = Scenario(rng.choice(layouts), world_size, chunk, block, 0, rng.randint(1, 4),
                 rng.random() < 0.8, fail_p=rng.choice([0, 0, 0.05]),
                 nan_p=rng.choice([0, 0, 0.03]))  # fmt: skip
    systems = [
        [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 3 * chunk))] for _ in range(2)
    ]
    step = 0
    for _ in range(rng.randint(1, 8)):
        step += rng.choice([0, 0, 1, 3])
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 2 * chunk))]
        if rng.random() < 0.7:
            prompt = rng.choice(systems) + prompt
        scored = rng.random() < 0.2  # echo: every prompt token's logprob, k alternatives
        new = rng.choice([0, 1, 3]) if scored else rng.randint(1, 12)
        k = rng.randint(0, 2) if scored else None
        s.jobs.append((step, Request(prompt, new, prompt_logprobs=k)))
        if rng.random() < 0.15:
            s.cancel[len(s.jobs) - 1] = step + rng.randint(0, 6)
    shares = Shares(s.layout, world_size)
    need = max(shares.blocks(len(r.ids), chunk, r.max_new_tokens, block) for _, r in s.jobs)
    s.blocks = need + rng.choice([-1, 0, 0, 1, 2, 4, 8])  # -1: one is refused
    s.snapshot = rng.choice([0, 0, 0, 1, 2])  # a hybrid: hits end at an entry's end
    return s


def simulate(s: Scenario, tokenizer, seed: int = 0, most_steps: int = 5000) -> list[SimJob]:
    """Run `s` to its end (module docstring) with `tokenizer` (serve_model.tokenizer()); every
    job, with its events."""
    rng = random.Random(seed)
    pool = BlockPool(s.blocks, s.block, s.snapshot, 1)  # (a snapshot of `snapshot` blocks)
    jobs_q: queue.Queue = queue.Queue()
    sched = Scheduler(jobs_q, Alive(), tokenizer, [EOS], pool, Shares(s.layout, s.world_size),
                      s.chunk, s.max_running, s.prefix_cache,
                      make_sink=lambda job: job.sink)  # fmt: skip
    ranks = Ranks(s.layout, s.world_size, max(1, s.blocks), s.block, s.chunk, s.snapshot > 0)
    jobs = [SimJob(r) for _, r in s.jobs]
    arrived = 0
    for step in range(most_steps):
        while arrived < len(jobs) and (s.jobs[arrived][0] <= step or _quiet(sched, jobs_q)):
            jobs_q.put(jobs[arrived])
            arrived += 1
        for j, at in s.cancel.items():
            if at == step:
                jobs[j].cancelled = True
        if arrived == len(jobs) and _quiet(sched, jobs_q):
            break
        plan = sched.plan()
        check_blocks(sched.blocks, planned=True)
        if plan["op"] != "step" and not _quiet(sched, jobs_q):
            stuck = [j.request.ids[:4] for j in jobs if not j.ended]
            raise AssertionError(f"step {step}: nothing to run while {len(stuck)} requests "
                                 f"wait (a deadlock): {s}")  # fmt: skip
        if plan["op"] != "step":
            continue  # only cancelled requests were in line
        ranks.prologue(plan)
        if (plan["decode"] or plan["chunks"]) and rng.random() < s.fail_p:
            sched.failed(torch.OutOfMemoryError("simulated"))
            check_blocks(sched.blocks)
            ranks.check(pool, sched.freed)
            continue
        ranks.forward(plan)
        ranks.check(pool, sched.freed)
        sched.after(*_logits(plan, rng, s.nan_p), _scores(plan))
        check_blocks(sched.blocks)
    else:
        raise AssertionError(f"not done after {most_steps} steps: {s}")
    _final(sched, pool, ranks, jobs)
    return jobs


def _quiet(sched: Scheduler, jobs_q: queue.Queue) -> bool:
    return not sched.running and not sched.waiting and jobs_q.empty()


def _logits(plan: dict, rng: random.Random, nan_p: float):
    def row() -> torch.Tensor:
        out = torch.zeros(VOCAB)
        if rng.random() < nan_p:
            return out.fill_(float("nan"))
        out[EOS if rng.random() < 0.05 else rng.randrange(3, VOCAB)] = 1.0
        return out

    n = len(plan["decode"])
    return (torch.stack([row() for _ in range(n)]) if n else None), [row() for _ in plan["chunks"]]


def _scores(plan: dict) -> dict:
    """Runner.scores' stand-in for the chunks that ask (a 4th item, k): zero logprobs."""
    out = {}
    for j, (_, ids, _, *asked) in enumerate(plan["chunks"]):
        if asked:
            n, k = len(ids), asked[0]
            out[j] = (torch.zeros(n - 1), torch.zeros(n - 1, k),
                      torch.zeros(n - 1, k, dtype=torch.int64))  # fmt: skip
    return out


def _prompt_scored(job: SimJob) -> None:
    """A scoring request that ended with an answer sent its prompt's logprobs once, before any
    token: one entry per prompt token (none for the first), each naming its own token."""
    prompts = [e for e in job.events if e[0] == "prompt"]
    ids = job.request.ids
    assert len(prompts) == 1 and job.events[0][0] == "prompt", job.events[:3]
    entries = prompts[0][1]
    assert len(entries) == len(ids) and entries[0] is None, (len(entries), len(ids))
    assert [e[0] for e in entries[1:]] == ids[1:]


def _final(sched: Scheduler, pool: BlockPool, ranks: Ranks, jobs: list[SimJob]) -> None:
    ranks.prologue({"evict": pool.evicted, "free": sched.freed, "open": []})  # the next plan's
    for j in jobs:
        ends = [e for e in j.events if e[0] in ("done", "error")]
        assert len(ends) == 1 or (j.cancelled and not ends), j.events
        if ends and ends[0][0] == "error":
            assert ends[0][2] in (400, 500) and len(ends[0][1]) > 40, ends
        elif ends and j.request.prompt_logprobs is not None and not j.cancelled:
            _prompt_scored(j)
    assert pool.held == {} and pool.used == 0, pool.held
    assert pool.free + pool.cached_blocks == pool.n_blocks
    assert not sched.running and not sched.waiting
    assert ranks.seqs == {} and set(ranks.store) == set(pool.cached)
