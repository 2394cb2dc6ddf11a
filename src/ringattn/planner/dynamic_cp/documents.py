"""`--data docs:MEAN,SIGMA,MIN,MAX`: windows of packed documents with lognormal lengths.

Each window of `seq_len` tokens is filled with documents whose lengths are drawn from a
lognormal distribution of the given MEAN and SIGMA (of the log), clipped to [MIN, MAX]; the last
document is cut where the window ends. A document of L tokens is a copy task: a random prefix of
byte tokens followed by its repetition, so its second half is learnable from its first, which
attention must read, inside the document only:

    window   | doc 0: p q r s p q r s | doc 1: x y x y | doc 2: a b c d e a b c d e a | ...
    labels     the next token of the same document; the last label of a document is its
               (L+1)-th token, so every token is supervised and none predicts across documents

Sample i is a pure function of (seed, i), like data.py's tasks: a resumed run, a run with
another number of ranks, and a dynamic-CP run all read the same windows at the same step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import torch

__all__ = ["DocumentTask", "parse_documents"]

PREFIX = "docs:"


def parse_documents(spec: str, seq_len: int, seed: int) -> DocumentTask:
    """`docs:MEAN,SIGMA,MIN,MAX` -> DocumentTask; a ValueError that shows the form otherwise."""
    body = spec[len(PREFIX) :]
    parts = body.split(",")
    try:
        mean, sigma = float(parts[0]), float(parts[1])
        low, high = int(parts[2]), int(parts[3])
    except (ValueError, IndexError):
        raise ValueError(
            f"--data {spec!r}: expected docs:MEAN,SIGMA,MIN,MAX (lognormal document lengths, "
            f"e.g. docs:1024,1.5,128,8192)"
        ) from None
    if len(parts) != 4 or not (mean > 0 and sigma >= 0 and 1 <= low <= high):
        raise ValueError(
            f"--data {spec!r}: need MEAN > 0, SIGMA >= 0 and 1 <= MIN <= MAX, as in "
            f"docs:1024,1.5,128,8192"
        )
    return DocumentTask(seq_len, mean, sigma, low, high, seed)


@dataclass(frozen=True)
class DocumentTask:
    """Windows of `seq_len` tokens packed with lognormal-length copy-task documents."""

    seq_len: int
    mean: float
    sigma: float
    min_len: int
    max_len: int
    seed: int = 0

    def lengths(self, index: int) -> list[int]:
        """The document lengths of window `index` (they sum to seq_len)."""
        return self._lengths(_generator(self.seed, index))

    def _lengths(self, gen: torch.Generator) -> list[int]:
        mu = math.log(self.mean) - self.sigma**2 / 2  # the lognormal whose mean is `mean`
        out, left = [], self.seq_len
        while left > 0:
            draw = torch.empty(1, device="cpu").log_normal_(mu, self.sigma, generator=gen)
            length = min(max(round(float(draw)), self.min_len), self.max_len, left)
            out.append(length)
            left -= length
        return out

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """(inputs, labels), each (seq_len,) int64, and the window's cu_seqlens."""
        gen = _generator(self.seed, index)
        lengths = self._lengths(gen)  # then the tokens, from the same stream
        inputs, labels = [], []
        for length in lengths:
            half = (length + 2) // 2
            prefix = torch.randint(128, (half,), generator=gen, device="cpu")
            doc = prefix.repeat(2)[: length + 1]  # L + 1 tokens: inputs and their next tokens
            inputs.append(doc[:-1])
            labels.append(doc[1:])
        return torch.cat(inputs), torch.cat(labels), (0, *accumulate(lengths))


def _generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % (2**63))
