"""Every rank: execute one step's plan over this rank's share of the KV cache.

    plan = {"op": "step",
            "evict":  [entry, ...]                     prefix entries to drop from the store
            "free":   [seq, ...]                       sequences that ended (or were preempted)
            "open":   [[seq, [entry, ...], tokens]]    new sequences, each starting from the
                                                       rows of those entries (chunks, in order)
                                                       with position < tokens: their blocks
                                                       shared, a cut block copied (paged.py)
            "decode": [[seq, token], ...]              one token fed to each running sequence
            "chunks": [[seq, [ids], keep], ...]       a prefill piece of a sequence; keep =
                                                       [entry, chunk start]: then store its
                                                       chunk's rows so far under `entry`; a
                                                       4th item k: score the piece's prompt
                                                       tokens, k alternatives each (`scores`)
           }

The ranks never decide anything: rank 0's scheduler (scheduler.py) made the plan, so every
rank frees, opens, decodes and prefills the same sequences in the same order, and the
collectives inside the forwards line up. A step is one forward (`KVEngine.step`): the decode
tokens, the first pieces of new sequences packed as documents, and every other piece attending
its sequence's cached rows, all in one pass over the weights. Only a piece that must follow
another of the same step waits for a second forward (a "wave"): a second piece of its sequence,
or a new sequence adopting an entry that an earlier piece stores (it adopts just before its
first piece). An entry is
one chunk of a sequence, whatever pieces computed it (a truncated entry it adopted, then an
extend), and an open may cut the last entry it adopts at any block: each rank's rows are in
increasing position order and position p's K/V depend on tokens <= p only, so the rows below a
position are that prefix's cache on every rank (pool.py). Only rank 0 reads the logits (it
samples for all).
"""

from __future__ import annotations

import torch

from ringattn.inference.hf.engine import KVEngine
from ringattn.inference.hf.scoring import PromptScores

__all__ = ["Runner"]


class Runner:
    """One rank's engine over its paged cache (prefix entries included), stepping through
    plans."""

    def __init__(self, engine: KVEngine, block_size: int, chunk: int, n_blocks: int = 4096):
        self.engine = engine
        engine.page(n_blocks, block_size, chunk)  # this rank's paged cache (inference/paged.py)
        self.scores: dict[int, PromptScores] = {}  # the last step's, by index in plan["chunks"]

    def step(self, plan: dict) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Run `plan` (module docstring): the decode logits (L, vocab) or None, and the logits
        (vocab,) of each chunk's last token; the prompt logprobs of the chunks that asked
        for them (a 4th item) in `self.scores`."""
        engine, self.scores = self.engine, {}
        for entry in plan["evict"]:
            engine.evict(entry)
        for seq in plan["free"]:
            engine.release(seq)
        adopt = {}
        for seq, reuse, tokens in plan["open"]:
            opened = engine.open()
            assert opened == seq, f"rank out of step: opened {opened}, the plan says {seq}"
            if reuse:
                adopt[seq] = (reuse, tokens)
        decode = [tuple(d) for d in plan["decode"]]
        decoded, chunks = None, [None] * len(plan["chunks"])
        todo = list(range(len(plan["chunks"])))
        while decode or todo:
            wave, todo = self._wave(plan["chunks"], todo, adopt)
            for j in wave:  # at its first piece: an entry may be stored by an earlier wave
                seq = plan["chunks"][j][0]
                if seq in adopt:
                    reuse, tokens = adopt.pop(seq)
                    engine.adopt(seq, reuse, tokens)
            pieces = [(plan["chunks"][j][0], self._ids(plan["chunks"][j][1])) for j in wave]
            score = {i: plan["chunks"][j][3] for i, j in enumerate(wave)
                     if len(plan["chunks"][j]) > 3}  # fmt: skip
            out, logits = engine.step(decode, pieces, score)
            self.scores.update({wave[i]: scores for i, scores in engine.scores.items()})
            decoded, decode = decoded if out is None else out, []
            for j, row in zip(wave, logits):
                chunks[j] = row
                self._keep(plan["chunks"][j])
        return decoded, chunks

    @staticmethod
    def _wave(chunks: list, todo: list[int], adopt: dict) -> tuple[list[int], list[int]]:
        """The pieces of `todo` (in plan order) that can go in one forward, and the rest: a
        piece waits for any earlier piece of its sequence, and for those that store an entry
        it adopts (every earlier piece that still has to run counts)."""
        wave, rest, seqs, entries = [], [], set(), set()
        for j in todo:
            seq, keep = chunks[j][0], chunks[j][2]
            if seq in seqs or entries.intersection(adopt.get(seq, ((), 0))[0]):
                rest.append(j)
            else:
                wave.append(j)
            seqs.add(seq)
            if keep is not None:
                entries.add(keep[0])
        return wave, rest

    def _keep(self, piece: list) -> None:
        """Store the piece's chunk so far under its entry when the plan says to keep it."""
        seq, keep = piece[0], piece[2]
        if keep is not None:
            entry, start = keep
            self.engine.keep(entry, seq, start)

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=self.engine.device)
