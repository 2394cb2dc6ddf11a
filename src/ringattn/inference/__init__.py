"""Long-context inference: context-parallel prefill and decoding over a sharded KV cache.

    cache.py      each rank's K/V shard per layer; round-robin appends; a window bounds it
    partials.py   a query over one rank's shard -> (out, lse); exact merge across ranks
    turns.py      follow-up turns over the cache: pass-KV, pass-Q and Meta's rule between them
    sampling.py   greedy, temperature, top-k, top-p from one seed shared by the group
    decoder.py    the project's Transformer run over the cache: prefill, step, extend
    session.py    a conversation: checks, agreement, the generation loop, timings
    hf/           the same for transformers models: ringattn.hf.generate and Session

See DESIGN.md §9. An application package: the core never imports it.
"""

from ringattn.inference.cache import ShardedKVCache
from ringattn.inference.decoder import CachedDecoder
from ringattn.inference.partials import MERGES, merge_across_ranks
from ringattn.inference.sampling import Sampling, next_token
from ringattn.inference.session import Session, TurnStats
from ringattn.inference.turns import MODES, choose_mode

__all__ = [
    "MERGES",
    "MODES",
    "CachedDecoder",
    "Sampling",
    "Session",
    "ShardedKVCache",
    "TurnStats",
    "choose_mode",
    "merge_across_ranks",
    "next_token",
]
