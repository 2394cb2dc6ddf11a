"""Long-context inference: context-parallel prefill and decoding over a sharded KV cache.

    paged.py      each rank's paged K/V: blocks per layer, tables, prefix entries shared by
                  reference count (the engine's cache; cache.py's contiguous one for offload)
    cache.py      each rank's K/V shard per layer; round-robin appends; a window bounds it
    partials.py   a query over one rank's shard -> (out, lse); exact merge across ranks
    turns.py      follow-up turns over the cache: pass-KV, pass-Q and Meta's rule between them
    sampling.py   greedy, temperature, top-k, top-p from one seed shared by the group
    hf/           the one decoding engine (hf/engine.py `KVEngine`: prefill, batched decode,
                  turns) and transformers models on it: ringattn.hf.generate and Session
    native.py     the project's Transformer as a model KVEngine drives
    session.py    a conversation: checks, agreement, the generation loop, timings

See DESIGN.md §9. An application package: the core never imports it.
"""

from ringattn.inference.cache import ShardedKVCache
from ringattn.inference.partials import MERGES, merge_across_ranks
from ringattn.inference.sampling import Sampling, next_token
from ringattn.inference.session import Session, TurnStats
from ringattn.inference.turns import MODES, choose_mode

__all__ = [
    "MERGES",
    "MODES",
    "Sampling",
    "Session",
    "ShardedKVCache",
    "TurnStats",
    "choose_mode",
    "merge_across_ranks",
    "next_token",
]


def __getattr__(name: str) -> object:
    # a name this package exported until one engine ran both model kinds: refused by name,
    # with the replacement, rather than a bare "cannot import name"
    if name == "CachedDecoder":
        raise ImportError(
            "ringattn.inference.CachedDecoder was removed: KVEngine "
            "(ringattn.inference.hf.engine) runs ringattn's decoder and transformers models "
            "alike; use Session(model, ...) for a conversation, or KVEngine(model, group=..., "
            "layout=..., window=..., merge=..., backend=...) with prefill([tokens]), "
            "decode([0], [token]) and extend(0, tokens) for the old prefill, step and extend"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
