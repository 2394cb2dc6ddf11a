"""Packed documents for `ringattn train --hf`: text -> tokens -> windows -> one rank's kwargs.

    --data text:PATH   a directory: one document per file (sorted by path, recursively)
                       a file:      one document per blank-line-separated block
    tokens             the model's tokenizer when its directory has one (plus its EOS after
                       each document), else every byte mod vocab_size
    stream             the documents' tokens end to end, with the offset where each starts

    stream   | doc 0 ........ | doc 1 ... | doc 2 ............ | doc 3 .. |
    sample i          [<------ seq_len tokens ------>]          (a seeded random offset)
    positions          5 6 7 8 9 0 1 2 3 0 1 2 3 4 5 6          restart at 0 at every document
                                                               start and at the window's start

Sample i is a pure function of (seed, i), as in data.py, so the data position of a run is its
step and a resumed run reads exactly the samples the uninterrupted run would have read.

From samples to one rank's batch (`DocumentLoader`): the `batch_size` windows of this dp row are
laid end to end as ONE row of batch_size x seq_len tokens (each window is already a run of whole
documents, so rows are simply more documents), and `ringattn.hf.shard_batch` does the rest:
documents found where the positions restart, labels shifted on the global sequence (no token
predicts across a document end), this cp rank's tokens in the layout's order, global position_ids.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

import torch

import ringattn.hf
from ringattn.integrations.hf.source import load_tokenizer
from ringattn.train.data import global_batch

__all__ = ["Corpus", "DocumentBatch", "DocumentLoader", "PackedDocuments", "load_corpus"]

_BLANK_LINE = re.compile(rb"\r?\n[ \t]*\r?\n")


def read_documents(path: str) -> list[bytes]:
    """The documents of `path`: one per file of a directory, one per blank-line block of a file."""
    if os.path.isdir(path):
        files = sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names)
        docs = []
        for name in files:
            with open(name, "rb") as f:
                docs.append(f.read().strip())
    elif os.path.isfile(path):
        with open(path, "rb") as f:
            docs = [block.strip() for block in _BLANK_LINE.split(f.read())]
    else:
        raise ValueError(f"--data text:{path}: no such file or directory")
    docs = [d for d in docs if d]
    if not docs:
        raise ValueError(f"--data text:{path} holds no text (every document is empty)")
    return docs


@dataclass(frozen=True)
class Corpus:
    """Every document's tokens, end to end: `tokens` (N,) int64, `starts` (D,) their offsets."""

    tokens: torch.Tensor
    starts: torch.Tensor
    tokenized_by: str
    """How the text became tokens, for the log: the tokenizer's class, or bytes mod vocab."""

    @property
    def documents(self) -> int:
        return len(self.starts)


def load_corpus(path: str, tokenizer_dir: str | None, vocab_size: int) -> Corpus:
    """Tokenize the documents of `path` with the tokenizer in `tokenizer_dir` (None: bytes).

    Cached per process (the parent validates twice, a rank loads once) for as long as no file
    under `path` changes size or modification time."""
    return _load_corpus(path, tokenizer_dir, vocab_size, _signature(path))


def _signature(path: str) -> tuple:
    names = ([os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
             if os.path.isdir(path) else [path])  # fmt: skip
    stats = [os.stat(n) for n in sorted(names) if os.path.exists(n)]
    return tuple((s.st_size, s.st_mtime_ns) for s in stats)


@functools.lru_cache(maxsize=4)
def _load_corpus(path: str, tokenizer_dir: str | None, vocab_size: int, _files: tuple) -> Corpus:
    docs = read_documents(path)
    if tokenizer_dir is None:
        pieces = [torch.frombuffer(bytearray(d), dtype=torch.uint8).long() % vocab_size
                  for d in docs]  # fmt: skip
        how = f"bytes mod vocab_size {vocab_size} (no tokenizer in the model directory)"
    else:
        tokenizer = load_tokenizer(tokenizer_dir)
        eos = tokenizer.eos_token_id
        pieces = []
        for doc in docs:
            ids = tokenizer(doc.decode("utf-8", errors="replace"))["input_ids"]
            if eos is not None and (not ids or ids[-1] != eos):
                ids = [*ids, eos]  # the model learns where a document ends
            pieces.append(torch.tensor(ids, dtype=torch.int64, device="cpu"))
        how = f"the model's tokenizer ({type(tokenizer).__name__}, {len(tokenizer)} tokens)"
        top = max(int(p.max()) for p in pieces if len(p))
        if top >= vocab_size:
            raise ValueError(
                f"the tokenizer in {tokenizer_dir} produced token id {top}, but the model's "
                f"vocab_size is {vocab_size}; use the tokenizer the model was made for, or "
                f"raise vocab_size in config.json"
            )
    lengths = torch.tensor([len(p) for p in pieces], device="cpu")  # the corpus is host data
    starts = torch.cumsum(lengths, 0) - lengths
    return Corpus(torch.cat(pieces), starts, how)


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
        first = int(
            torch.randint(
                len(self.corpus.tokens) - self.seq_len + 1, (1,), generator=gen, device="cpu"
            )
        )
        where = torch.arange(first, first + self.seq_len, device="cpu")
        doc = torch.searchsorted(self.corpus.starts, where, right=True) - 1
        begins = self.corpus.starts[doc].clamp(min=first)
        return self.corpus.tokens[where], where - begins


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

    dataset: PackedDocuments
    batch_size: int
    dp_rank: int
    dp: int
    group: object
    layout: str
    device: torch.device

    def full(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, position_ids), each (1, batch_size * seq_len): this dp row's windows."""
        ids, positions = global_batch(self.dataset, step, self.batch_size, self.dp_rank, self.dp)
        return ids.reshape(1, -1), positions.reshape(1, -1)  # (1, B * S)

    def batch(self, step: int) -> DocumentBatch:

        ids, positions = self.full(step)
        full = {"input_ids": ids, "labels": ids, "position_ids": positions}
        local = ringattn.hf.shard_batch(full, group=self.group, layout=self.layout)
        labels = local.pop("labels").to(self.device)
        for unused in ("shift_labels", "num_items_in_batch"):  # step.py divides by the global count
            local.pop(unused)
        for name in ("input_ids", "position_ids"):  # cu_seq_lens stay on the CPU (batch.py)
            local[name] = local[name].to(self.device)
        return DocumentBatch(local, labels, local["position_ids"])
