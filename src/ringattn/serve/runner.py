"""Every rank: execute one step's plan over this rank's share of the KV cache.

    plan = {"op": "step",
            "evict":  [entry, ...]                     prefix entries to drop from the store
            "free":   [seq, ...]                       sequences that ended (or were preempted)
            "open":   [[seq, [entry, ...], tokens]]    new sequences, each starting from copies
                                                       of the rows of those entries (chunks, in
                                                       order) with position < tokens
            "decode": [[seq, token], ...]              one token fed to each running sequence
            "chunks": [[seq, [ids], keep], ...]}       a prefill piece of a sequence; keep =
                                                       [entry, chunk start]: then store its
                                                       chunk's rows so far under `entry`

The ranks never decide anything: rank 0's scheduler (scheduler.py) made the plan, so every
rank frees, opens, decodes and prefills the same sequences in the same order, and the
collectives inside the forwards line up. The decode step comes first (one forward for all
running sequences), then the first pieces of new sequences that reuse nothing, packed as
documents into one forward (`KVEngine.prefill`: each placed by the layout within itself), then
every other prefill piece (one forward each: `KVEngine.extend`, the piece attending the
sequence's cached rows). A new sequence adopts its entries just before its first
piece, so it may start from an entry that an earlier piece of the same step stores. An entry is
one chunk of a sequence, whatever pieces computed it (a truncated entry it adopted, then an
extend), and an open may cut the last entry it adopts at any block: each rank's rows are in
increasing position order and position p's K/V depend on tokens <= p only, so the rows below a
position are that prefix's cache on every rank (pool.py). Only rank 0 reads the logits (it
samples for all).
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
        self.store: dict[int, list[tuple[torch.Tensor, ...]]] = {}  # prefix entry -> its rows

    def step(self, plan: dict) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Run `plan` (module docstring): the decode logits (L, vocab) or None, and the logits
        (vocab,) of each chunk's last token."""
        engine = self.engine
        for entry in plan["evict"]:
            self.store.pop(entry, None)
        for seq in plan["free"]:
            engine.release(seq)
        adopt = {}
        for seq, reuse, tokens in plan["open"]:
            opened = engine.open()
            assert opened == seq, f"rank out of step: opened {opened}, the plan says {seq}"
            if reuse:
                adopt[seq] = (reuse, tokens)
        decoded = None
        if plan["decode"]:
            seqs, tokens = zip(*plan["decode"])
            decoded = engine.decode(list(seqs), list(tokens))
        chunks: list[torch.Tensor | None] = [None] * len(plan["chunks"])
        first, seen = [], set()
        for j, (seq, _, _) in enumerate(plan["chunks"]):
            if engine.lengths[seq] == 0 and seq not in adopt and seq not in seen:
                first.append(j)  # nothing cached, nothing to adopt: packed with the others
            seen.add(seq)
        if first:
            prompts = [self._ids(plan["chunks"][j][1]) for j in first]
            logits = engine.prefill(prompts, seqs=[plan["chunks"][j][0] for j in first])
            for row, j in enumerate(first):
                chunks[j] = logits[row]
                self._keep(plan["chunks"][j])
        for j, piece in enumerate(plan["chunks"]):
            if chunks[j] is not None:
                continue
            seq, ids, _ = piece
            if seq in adopt:  # at its first piece: an entry may be stored by this step's pieces
                reuse, tokens = adopt.pop(seq)
                engine.adopt(seq, [self.store[entry] for entry in reuse], tokens)
            chunks[j] = engine.extend(seq, self._ids(ids))
            self._keep(piece)
        return decoded, chunks

    def _keep(self, piece: list) -> None:
        """Store the piece's chunk so far under its entry when the plan says to keep it."""
        seq, _, keep = piece
        if keep is not None:
            entry, start = keep
            self.store[entry] = self.engine.rows(seq, start, self.engine.lengths[seq])

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=self.engine.device)
