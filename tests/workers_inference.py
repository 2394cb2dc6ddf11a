"""Worker functions for tests/test_inference.py, run on every rank of a WorkerPool (harness.py).

Every rank builds the same small decoder from a seed (`build_model`); the test process builds it
too and computes the references on one process without any cache.
"""

from __future__ import annotations

import torch

from ringattn.comm import resolve_group
from ringattn.inference import Sampling, Session
from ringattn.inference.partials import local_partial, merge_across_ranks
from ringattn.kernels import KERNELS
from ringattn.models import Transformer, model_config


def build_model(seed: int = 0, dim: int = 32, heads: int = 4, kv_heads: int = 2) -> Transformer:
    """A tiny decoder with weights large enough that its greedy tokens vary from step to step
    (the default 0.02 init gives nearly uniform logits and one repeated token)."""
    torch.manual_seed(seed)
    model = Transformer(model_config("tiny", dim=dim, n_heads=heads, n_kv_heads=kv_heads))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.25)
    return model.eval()


def greedy(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """For each case (prompt, new, layout, window, merge): the tokens and this rank's cache."""
    model = build_model()
    results = []
    for case in cases:
        session = Session(model, layout=case["layout"], window=case.get("window"),
                          merge=case.get("merge", "allgather"))  # fmt: skip
        tokens, stats = session.generate(case["prompt"], case["new"], eos_id=case.get("eos"))
        results.append({"tokens": tokens, "cache_bytes": stats.cache_bytes,
                        "cache_tokens": stats.cache_tokens})  # fmt: skip
    return results


def follow_up(
    rank: int,
    world_size: int,
    turns: list[list[int]],
    new: int,
    mode: str,
    heads: int = 4,
    kv_heads: int = 2,
) -> dict:
    """A conversation of several turns; every turn's reply and the follow-up modes used."""
    session = Session(build_model(heads=heads, kv_heads=kv_heads), layout="zigzag")
    replies, modes = [], []
    for prompt in turns:
        tokens, stats = session.generate(prompt, new, mode=mode)
        replies.append(tokens)
        modes.append(stats.mode)
    return {"replies": replies, "modes": modes}


def follow_up_logits(rank: int, world_size: int, prompt: list[int], more: list[int]) -> dict:
    """Logits of the last follow-up token by pass-KV and by pass-Q over the same cache state."""
    out = {}
    for mode in ("pass-kv", "pass-q"):
        session = Session(build_model(), layout="striped")
        session.generate(prompt, 0)
        out[mode] = session.engine.extend(0, torch.tensor(more), mode)
    return out


def sampled(rank: int, world_size: int, prompt: list[int], new: int, sampling: dict) -> list[int]:
    session = Session(build_model(), layout="zigzag")
    tokens, _ = session.generate(prompt, new, sampling=Sampling(**sampling))
    return tokens


def merge_case(rank: int, world_size: int, q, k, v, split: list[int], merge: str, shift: float):
    """Partial attention of q over this rank's slice of k, v (slice sizes `split`), merged.

    `shift` lowers the allreduce reference below the true lse (a large value forces its
    overflow fallback)."""
    info = resolve_group(None)
    start = sum(split[:rank])
    keys = slice(start, start + split[rank])
    scale = q.shape[-1] ** -0.5
    out, lse = local_partial(KERNELS["cpu_flash"], q, k[:, :, keys], v[:, :, keys], scale)
    ref = None
    if merge == "allreduce":  # a reference below every row's lse, known to all ranks
        groups = q.shape[1] // k.shape[1]
        scores = q.double() @ k.double().repeat_interleave(groups, 1).transpose(-1, -2) * scale
        ref = (scores.amax(-1) - shift).float()
    return merge_across_ranks(out, lse, info, merge, ref, return_lse=True)


def bad_input(rank: int, world_size: int, case: str) -> str:
    """The error a bad call raises on this rank (its type name and message)."""
    session = Session(build_model())
    prompt, new, kwargs = [1, 2, 3], 4, {}
    if case == "empty":
        prompt = []
    elif case == "negative":
        new = -1
    elif case == "vocab":
        prompt = [1, 256]
    elif case == "top_p":
        kwargs = {"sampling": Sampling(temperature=1.0, top_p=0.0)}
    elif case == "disagree":
        prompt = [1, 2, 3 + rank]
    try:
        session.generate(prompt, new, **kwargs)
    except ValueError as err:
        return f"ValueError: {err}"
    return "no error"


def hf_generate(rank: int, world_size: int, cases: list[dict]) -> list[torch.Tensor]:
    """ringattn.hf.generate for each (arch, prompt, new, layout) case on this rank."""
    import ringattn.hf
    import workers_hf

    return [
        ringattn.hf.generate(
            workers_hf.build(case["arch"]), case["prompt"], case["new"], layout=case["layout"]
        )
        for case in cases
    ]


def count_collectives(rank: int, world_size: int, prompt: list[int], new: int) -> dict:
    """Collectives issued by the inference modules per phase, counted at the names they call."""
    import ringattn.inference.hf.engine as engine_module
    import ringattn.inference.hf.kv_attention as kv_attention_module
    import ringattn.inference.partials as partials_module

    counts = {"n": 0}

    def counting(fn):
        def wrapper(*args, **kwargs):
            counts["n"] += 1
            return fn(*args, **kwargs)

        return wrapper

    saved = {}
    for module in (partials_module, engine_module, kv_attention_module):
        for name in ("all_gather_async", "all_reduce", "all_gather_ints"):
            if hasattr(module, name):
                saved[module, name] = getattr(module, name)
                setattr(module, name, counting(saved[module, name]))
    try:
        out = {}
        for merge in ("allgather", "allreduce"):
            session = Session(build_model(), merge=merge)
            session.generate(prompt, 1)  # prefill and the first token: no decode step yet
            counts["n"] = 0
            for token in range(new):
                session.engine.decode([0], [token])
            out[merge] = counts["n"]
        return out
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)


def engine_batch(rank: int, world_size: int, prompts: list[list[int]], new: int, merge: str,
                 paged: bool = False):  # fmt: skip
    """KVEngine over our decoder: the prompts packed in one prefill, then one batched decode step
    per token for all of them (each sequence at its own position; `paged`: the server's paged
    cache, blocks of 4 rows); each sequence's tokens."""
    from ringattn.inference.hf.engine import KVEngine

    engine = KVEngine(build_model(), layout="zigzag", merge=merge)
    if paged:
        engine.page(64, 4, 16)
    logits = engine.prefill([torch.tensor(p) for p in prompts])  # (n, vocab)
    seqs, outs = list(range(len(prompts))), [[] for _ in prompts]
    for step in range(new):
        tokens = logits.argmax(-1).tolist()
        for out, token in zip(outs, tokens):
            out.append(token)
        if step + 1 < new:
            logits = engine.decode(seqs, tokens)  # (n, vocab)
    return outs
