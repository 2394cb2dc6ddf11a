"""Every rank: execute one step's plan over this rank's share of the KV cache.

    plan = {"op": "step",
            "evict":  [hash, ...]                  prefix chunks to drop from the store
            "free":   [seq, ...]                   sequences that ended (or were preempted)
            "open":   [[seq, [hash, ...]], ...]    new sequences, and the cached prefix chunks
                                                   each starts from (copied from the store)
            "decode": [[seq, token], ...]          one token fed to each running sequence
            "chunks": [[seq, [ids], hash], ...]}   a prefill chunk of a sequence (its K/V kept
                                                   under `hash` when not null)

The ranks never decide anything: rank 0's scheduler (scheduler.py) made the plan, so every
rank frees, opens, decodes and prefills the same sequences in the same order, and the
collectives inside the forwards line up. The decode step comes first (one forward for all
running sequences), then the first chunks of sequences with nothing cached, packed as documents
into one forward (`KVEngine.prefill`: each placed by the layout within itself), then each later
chunk (one forward each: `KVEngine.extend`, the chunk attending the sequence's cached chunks).
Only rank 0 reads the logits (it samples for all).
"""

from __future__ import annotations

import torch

from ringattn.inference.hf.engine import KVEngine

__all__ = ["Runner"]


class Runner:
    """One rank's engine and prefix store, stepping through plans."""

    def __init__(self, engine: KVEngine, block_size: int | None = None):
        self.engine = engine
        engine.state.granule = block_size
        self.store: dict[str, list[tuple[torch.Tensor, ...]]] = {}  # prefix chunk K/V by hash
        self.chunk_tokens: dict[str, int] = {}  # tokens of the prefix each hash ends

    def step(self, plan: dict) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Run `plan` (module docstring): the decode logits (L, vocab) or None, and the logits
        (vocab,) of each chunk's last token."""
        engine = self.engine
        for h in plan["evict"]:
            self.store.pop(h, None)
            self.chunk_tokens.pop(h, None)
        for seq in plan["free"]:
            engine.release(seq)
        for seq, reuse in plan["open"]:
            opened = engine.open()
            assert opened == seq, f"rank out of step: opened {opened}, the plan says {seq}"
            if reuse:
                engine.adopt(seq, [self.store[h] for h in reuse], self.chunk_tokens[reuse[-1]])
        decoded = None
        if plan["decode"]:
            seqs, tokens = zip(*plan["decode"])
            decoded = engine.decode(list(seqs), list(tokens))
        chunks: list[torch.Tensor | None] = [None] * len(plan["chunks"])
        first = [j for j, (seq, _, _) in enumerate(plan["chunks"]) if engine.lengths[seq] == 0]
        if first:  # sequences with nothing cached: their chunks packed into one forward
            prompts = [self._ids(plan["chunks"][j][1]) for j in first]
            logits = engine.prefill(prompts, seqs=[plan["chunks"][j][0] for j in first])
            for row, j in enumerate(first):
                chunks[j] = logits[row]
        for j, (seq, ids, h) in enumerate(plan["chunks"]):
            start = engine.lengths[seq] - (len(ids) if chunks[j] is not None else 0)
            if chunks[j] is None:  # a later chunk: it attends the sequence's cached ones
                chunks[j] = engine.extend(seq, self._ids(ids))
            if h is not None:
                self.store[h] = engine.rows(seq, start, start + len(ids))
                self.chunk_tokens[h] = start + len(ids)
        return decoded, chunks

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=self.engine.device)
