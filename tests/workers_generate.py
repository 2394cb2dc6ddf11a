"""Rank functions for the `ringattn.hf.generate` contracts (see harness.py and workers_hf.py)."""

from __future__ import annotations

import torch

import ringattn.hf
import workers_hf
from ringattn.comm import group_cache, resolve_group
from ringattn.inference.hf.batching import GREEDY, Request
from ringattn.inference.hf.generate import NonFiniteLogits, decode_loop
from ringattn.inference.session import TurnStats


def batch(rank: int, world_size: int, arch: str, prompts: list, options: dict) -> list:
    """One ragged-batch call on this rank."""
    return ringattn.hf.generate(workers_hf.build(arch), prompts, **options)


def calls(rank: int, world_size: int, arch: str, prompt, calls: list[dict]) -> list:
    """Several single-prompt calls in a row (sampling: streams must not replay)."""
    model = workers_hf.build(arch)
    return [ringattn.hf.generate(model, prompt, **options) for options in calls]


def conversation(rank: int, world_size: int, arch: str, turns: list, new: int, mode: str):
    """A Session over `turns`: each turn's tokens and the mode it used."""
    session = ringattn.hf.Session(workers_hf.build(arch))
    out = []
    for prompt in turns:
        out.append((session.generate(prompt, new, mode=mode), session.last_mode))
    return out


def bad_call(rank: int, world_size: int, options: dict, rank_prompt: bool) -> str:
    """A call whose arguments are bad on every rank (or only rank 1's prompt differs)."""
    model = workers_hf.build("llama")
    prompt = torch.arange(3, 9)[None] + (rank if rank_prompt else 0)
    try:
        ringattn.hf.generate(model, options.pop("input_ids", prompt), **options)
    except (ValueError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def tensor_parallel(rank: int, world_size: int, arch: str, prompts: list, new: int, tp: int):
    """cp = W / tp ranks x tp: a ragged greedy batch and a follow-up turn; this rank's cache."""
    import copy

    from ringattn.integrations.hf.tensor_parallel import tensor_parallel as split

    mesh = group_cache.device_mesh("cpu", (world_size // tp, tp), ("cp", "tp"))
    model = split(copy.deepcopy(workers_hf.build(arch)), mesh["tp"])
    cp, tp_group = mesh["cp"].get_group(), mesh["tp"].get_group()
    out, stats = ringattn.hf.generate(
        model, prompts, new, group=cp, tp_group=tp_group, return_stats=True
    )
    session = ringattn.hf.Session(model, group=cp, tp_group=tp_group)
    turns = [session.generate(prompts[0], new), session.generate(prompts[1], new)]
    weight = model.base_model.layers[0].self_attn.k_proj.weight  # a DTensor: its local shard
    rows = weight.to_local().shape[0]
    return {"batch": out, "turns": turns, "cache_bytes": stats.cache_bytes, "k_rows": rows}


def first_tokens(rank: int, world_size: int, logits: list, cancel: bool = False) -> list:
    """decode_loop's first step over this rank's own logits (rank r: logits[r]); every rank must
    keep rank 0's tokens and verdicts (greedy included: a near-tie must not split the ranks)."""
    mine = torch.tensor(logits[rank], dtype=torch.float32)  # (n, vocab)
    requests = [Request(torch.zeros(1, dtype=torch.int64), 1, GREEDY) for _ in range(len(mine))]
    stop = (lambda i: rank == 0 and i == 0) if cancel else None  # only rank 0 says so
    try:
        return decode_loop(_NoEngine(), list(range(len(mine))), requests, mine, set(), None,
                           TurnStats(), 0.0, [resolve_group(None)], stop)  # fmt: skip
    except NonFiniteLogits as err:
        return ["non-finite", str(err)]


class _NoEngine:
    """decode_loop's engine when no step follows the first: only a cancel's release is called."""

    def release(self, seq: int) -> None:
        pass


def opened_prefill(rank: int, world_size: int, arch: str, prompts: list, split: int) -> list:
    """The server's way in: sequences opened empty, their first `split` tokens packed into one
    `prefill(seqs=...)` (one left empty in between), the rest by `extend`, then one decode step
    inside `holding()`; the logits of each stage (every rank's copy)."""
    from ringattn.inference.hf.engine import KVEngine

    model = workers_hf.build(arch)
    engine = KVEngine(model, layout="zigzag")
    with engine.holding(), torch.no_grad():
        seqs = [engine.open() for _ in prompts]
        idle = engine.open()  # an opened sequence the packed prefill must leave empty
        first = engine.prefill([p[:split] for p in prompts], seqs=seqs)
        assert engine.lengths[idle] == 0 and [engine.lengths[s] for s in seqs] == [split] * len(
            seqs
        )
        rest = [engine.extend(s, p[split:]) for s, p in zip(seqs, prompts)]
        step = engine.decode(seqs, [int(r.argmax()) for r in rest])
    assert model.config._attn_implementation != "ringattn-kv"  # holding() gave the model back
    return [first, torch.stack(rest), step]


def packed_steps(rank: int, world_size: int, arch: str, prompts: list, cuts: list) -> list:
    """The server's steps as single forwards (`KVEngine.step`): first pieces of empty sequences,
    later pieces of cached ones, and decode tokens packed together in every mix; the logits of
    each step, in the order of the test's reference (every rank's copy)."""
    from ringattn.inference.hf.engine import KVEngine

    model = workers_hf.build(arch)
    engine = KVEngine(model, layout="zigzag")
    (a, b, c), (ca, cb, cc) = prompts, cuts
    with engine.holding(), torch.no_grad():
        sa, sb, sc = (engine.open() for _ in prompts)
        _, first = engine.step([], [(sa, a[:ca]), (sb, b[:cb])])  # two documents
        _, second = engine.step([], [(sa, a[ca:]), (sb, b[cb:]), (sc, c[:cc])])  # 2 extends + 1
        ta, tb = (int(x.argmax()) for x in second[:2])
        decoded, third = engine.step([(sa, ta), (sb, tb)], [(sc, c[cc:])])  # decodes + extend
        tc = int(third[0].argmax())
        last, none = engine.step([(sa, int(decoded[0].argmax())), (sb, int(decoded[1].argmax())),
                                  (sc, tc)], [])  # fmt: skip
        assert none == []
    return [torch.stack(first), torch.stack(second), decoded, third[0], last]
