"""The step rank 0 is planning: the message every rank runs (runner.py's plan format) and the
sequences behind its entries, so that after the step each row of logits finds its sequence.

    message   {"op": "step", "open": [...], "decode": [...], "chunks": [...], "new": n}
    decode    the sequences of "decode", in order (one row each)
    chunks    (sequence, tokens) of "chunks", in order (each piece's last row)

A sequence preempted while the step is planned leaves it (`drop`, by the id it had), so a plan
never frees a sequence it also runs.
"""

from __future__ import annotations

from ringattn.serve.sequence import Seq

__all__ = ["Step"]


class Step:
    """One step's plan being built (module docstring)."""

    def __init__(self):
        self.message: dict = {"op": "step", "open": [], "decode": [], "chunks": [], "new": 0}
        self.decode: list[Seq] = []
        self.chunks: list[tuple[Seq, int]] = []
        self.fresh = False  # it starts a sequence from scratch (Scheduler.packs)

    @property
    def sequences(self) -> list[Seq]:
        """Every sequence the step runs: the decodes, then the pieces' (in the rows' order)."""
        return self.decode + [seq for seq, _ in self.chunks]

    @property
    def empty(self) -> bool:
        return not (self.message["open"] or self.message["decode"] or self.message["chunks"])

    def add_decode(self, seq: Seq) -> None:
        """seq takes one token: the one it sampled last."""
        self.message["decode"].append([seq.id, seq.tokens[-1]])
        self.decode.append(seq)

    def add_chunk(self, seq: Seq, n: int, keep: list[int] | None, fresh: bool) -> None:
        """seq's next `n` prompt tokens, kept as prefix entry `keep` ([entry, chunk start]);
        `fresh`: its first piece, nothing cached before it."""
        self.message["chunks"].append([seq.id, seq.tokens[seq.done : seq.done + n], keep])
        if seq.logprobs.scoring:  # echo: this piece's prompt logprobs (scoring.py)
            self.message["chunks"][-1].append(seq.logprobs.prompt_k)
        self.fresh |= fresh
        self.chunks.append((seq, n))

    def add_open(self, seq: Seq, entries: list[int]) -> None:
        """seq is new to the ranks, starting from the rows of `entries` below `seq.done`."""
        self.message["open"].append([seq.id, entries, seq.done])
        self.message["new"] += not seq.started
        seq.started = True

    def drop(self, seq: Seq, sid: int) -> None:
        """Take `seq` (id `sid` when it was planned) out: its decode and its piece."""
        assert sid not in [s for s, _, _ in self.message["open"]], "a new one is never dropped"
        self.message["decode"] = [d for d in self.message["decode"] if d[0] != sid]
        self.decode = [s for s in self.decode if s is not seq]
        self.message["chunks"] = [c for c in self.message["chunks"] if c[0] != sid]
        self.chunks = [(s, n) for s, n in self.chunks if s is not seq]
