"""Packed documents for `ringattn train --hf`: tokens -> windows -> one rank's kwargs.

    --data text:PATH   documents (sources.py), tokenized once into memory-mapped files
                       (corpus.py): the model's tokenizer plus its EOS, or bytes mod vocab_size
    --data chat:PATH   conversations under the chat template, assistant tokens marked (chat.py)
    stream             the documents' tokens end to end, with the offset where each starts

Text (`PackedDocuments`): windows at random offsets of the stream, cutting documents:

    stream   | doc 0 ........ | doc 1 ... | doc 2 ............ | doc 3 .. |
    sample i          [<------ seq_len tokens ------>]          (a seeded random offset)
    positions          5 6 7 8 9 0 1 2 3 0 1 2 3 4 5 6          restart at 0 at every document
                                                               start and at the window's start

Chat (`PackedConversations`): whole conversations packed in order into windows of at most
seq_len tokens (one longer than seq_len is split into pieces of seq_len), padded to seq_len with
an unsupervised document; labels are the tokens on the assistant's turns, -100 elsewhere.

Sample i is a pure function of (seed, i), as in data.py, so the data position of a run is its
step and a resumed run reads exactly the samples the uninterrupted run would have read.

From samples to one rank's batch (`DocumentLoader`): the `batch_size` windows of this dp row are
laid end to end as ONE row of batch_size x seq_len tokens (each window is already a run of whole
documents, so rows are simply more documents), and `ringattn.hf.shard_batch` does the rest:
documents found where the positions restart, labels shifted on the global sequence (no token
predicts across a document end), this cp rank's tokens in the layout's order, global position_ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ringattn.integrations.hf.batch import shard_batch
from ringattn.models.loss import IGNORE
from ringattn.train.hf.corpus import Corpus, load_corpus

__all__ = ["Corpus", "DocumentBatch", "DocumentLoader", "PackedConversations", "PackedDocuments",
           "load_corpus"]  # fmt: skip


@dataclass(frozen=True)
class PackedDocuments:
    """Windows of `seq_len` tokens of a corpus; `sample(i)` -> (input_ids, position_ids)."""

    corpus: Corpus
    seq_len: int
    seed: int = 0

    def __post_init__(self) -> None:
        total = len(self.corpus.tokens)
        if total < self.seq_len:
            raise ValueError(
                f"the text holds {total} tokens ({self.corpus.tokenized_by}), fewer than "
                f"--seq-len {self.seq_len}; use a shorter --seq-len or more text"
            )

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, positions), each (seq_len,) int64: positions count from each document's
        start, or from the window's start for the document the window cuts into."""
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + index) % (2**63))
        last = len(self.corpus.tokens) - self.seq_len + 1
        first = int(torch.randint(last, (1,), generator=gen, device="cpu"))  # host-side data
        where = torch.arange(first, first + self.seq_len, device="cpu")
        doc = torch.searchsorted(self.corpus.starts, where, right=True) - 1
        begins = self.corpus.starts[doc].clamp(min=first)
        return self.corpus.tokens[where].long(), where - begins


@dataclass(frozen=True)
class PackedConversations:
    """Whole conversations packed into windows of at most `seq_len` tokens, padded to `seq_len`;
    `sample(i)` -> (input_ids, position_ids, labels), labels -100 off the assistant's tokens.

    A conversation longer than seq_len is split into pieces of seq_len tokens (each piece a
    document of its own: it does not see the pieces before it); `split` counts them for the log.
    Windows take pieces in corpus order while they fit (greedy); sample i is window
    randint(windows) seeded by (seed, i). Padding is one more document of `pad_id` tokens, never
    supervised."""

    corpus: Corpus
    seq_len: int
    seed: int = 0
    pad_id: int = 0

    def __post_init__(self) -> None:
        starts = self.corpus.starts.numpy()
        lengths = np.diff(starts, append=len(self.corpus.tokens))
        count = -(-lengths // self.seq_len)  # pieces per conversation
        first = np.repeat(starts, count)
        within = np.arange(len(first)) - np.repeat(np.cumsum(count) - count, count)
        pieces = first + within * self.seq_len  # (P,) where each piece starts
        ends = np.minimum(pieces + self.seq_len, np.repeat(starts + lengths, count))
        windows, used = [0], 0
        for p, size in enumerate((ends - pieces).tolist()):
            if used + size > self.seq_len:
                windows.append(p)
                used = 0
            used += size
        windows.append(len(pieces))
        object.__setattr__(self, "pieces", torch.from_numpy(np.append(pieces, ends[-1])))
        # (windows + 1,) the first piece of each window, then P
        object.__setattr__(self, "windows", torch.tensor(windows, device="cpu"))
        object.__setattr__(self, "split", int((count > 1).sum()))

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, positions, labels), each (seq_len,) int64."""
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + index) % (2**63))
        w = int(torch.randint(len(self.windows) - 1, (1,), generator=gen, device="cpu"))
        bounds = self.pieces[self.windows[w] : self.windows[w + 1] + 1]  # piece starts, end
        a, b = int(bounds[0]), int(bounds[-1])
        where = torch.arange(a, b, device="cpu")  # the corpus is host data
        ids = self.corpus.tokens[a:b].long()
        positions = where - bounds[torch.searchsorted(bounds, where, right=True) - 1]
        labels = torch.where(self.corpus.supervised[a:b].bool(), ids, IGNORE)
        pad = self.seq_len - (b - a)
        return (torch.cat([ids, torch.full((pad,), self.pad_id, dtype=torch.int64, device="cpu")]),
                torch.cat([positions, torch.arange(pad, device="cpu")]),
                torch.cat([labels, torch.full((pad,), IGNORE, dtype=torch.int64,
                                              device="cpu")]))  # fmt: skip


@dataclass
class DocumentBatch:
    """One rank's share of its dp row's documents, in the trainer's Batch shape.

    `inputs` is the model's keyword arguments from `ringattn.hf.shard_batch` (input_ids,
    position_ids, cu_seq_lens_q/k, use_cache), `labels` (1, S_local) the globally shifted labels,
    `positions` (1, S_local) the global RoPE positions (also in `inputs`).
    """

    inputs: dict
    labels: torch.Tensor
    positions: torch.Tensor


@dataclass(frozen=True)
class DocumentLoader:
    """`batch(step)`: this rank's DocumentBatch at `step` (the same interface as data.Loader)."""

    dataset: PackedDocuments | PackedConversations
    batch_size: int
    dp_rank: int
    dp: int
    group: object
    layout: str
    device: torch.device

    def full(self, step: int) -> tuple[torch.Tensor, ...]:
        """(input_ids, position_ids, labels), each (1, batch_size * seq_len): this dp row's
        windows (samples step*B*dp + dp_rank*B + i, as data.global_batch)."""
        first = (step * self.dp + self.dp_rank) * self.batch_size
        samples = [self.dataset.sample(first + i) for i in range(self.batch_size)]
        ids, positions = (torch.cat([s[k] for s in samples])[None] for k in (0, 1))  # (1, B * S)
        labels = torch.cat([s[2] for s in samples])[None] if len(samples[0]) > 2 else ids
        return ids, positions, labels

    def batch(self, step: int) -> DocumentBatch:
        ids, positions, labels = self.full(step)
        full = {"input_ids": ids, "labels": labels, "position_ids": positions}
        local = shard_batch(full, group=self.group, layout=self.layout)
        labels = local.pop("labels").to(self.device)
        for unused in ("shift_labels", "num_items_in_batch"):  # step.py divides by the global count
            local.pop(unused)
        for name in ("input_ids", "position_ids"):  # cu_seq_lens stay on the CPU (batch.py)
            local[name] = local[name].to(self.device)
        return DocumentBatch(local, labels, local["position_ids"])
