"""Cross-entropy over chunks of rows, so that a rank never holds its whole (tokens, vocab) logits.

    hidden (N, dim) --[chunk of C rows]--> output projection --> logits (C, vocab) float32
                                                             --> loss sum, right predictions
    backward: each chunk's logits are recomputed (activation checkpointing), never stored

`output` is the decoder's nn.Linear, or any module from hidden to logits (a Hugging Face model's
lm_head with its logit scaling or soft-capping: integrations/hf/loss.py).

How many rows a chunk holds, by default (`chunk` = AUTO, -1): `auto_chunk(vocab)`, the most rows
whose float32 logits fit in LOGITS_BUDGET (256 MiB), rounded down to a multiple of 64 (at least
64): 512 rows at a 128,256-id vocabulary, 2,048 at 32,000, the whole of a short sequence at a
small one. A chunk then costs at most ~3 x 256 MiB (logits, log-softmax, their gradient) whatever
the vocabulary, where a fixed row count would grow with it (4,096 rows x 128,256 ids = 2.1 GB).

The result is summed, never averaged: the caller divides by the number of supervised tokens over
all ranks, so the sum over a context-parallel group is the single-device loss. `IGNORE` marks a
token that is not supervised (F.cross_entropy's ignore_index).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["AUTO", "IGNORE", "LOGITS_BUDGET", "auto_chunk", "chunked_cross_entropy",
           "resolve_chunk"]  # fmt: skip

IGNORE = -100  # label of a token that is not supervised (F.cross_entropy's ignore_index)
AUTO = -1  # `chunk`: chosen from the vocabulary (auto_chunk)
LOGITS_BUDGET = 256 << 20  # bytes of one chunk's float32 logits


def auto_chunk(vocab_size: int, budget: int | None = None) -> int:
    """Rows per chunk whose float32 logits (rows x vocab_size x 4 bytes) fit in `budget` (default
    LOGITS_BUDGET): rounded down to a multiple of 64, at least 64."""
    rows = (budget or LOGITS_BUDGET) // (4 * max(1, vocab_size))
    return max(64, rows // 64 * 64)


def resolve_chunk(chunk: int, vocab_size: int) -> int:
    """`chunk` as given (0: whole logits), or auto_chunk(vocab_size) for AUTO (any negative)."""
    return auto_chunk(vocab_size) if chunk < 0 else chunk


def _chunk_loss(
    hidden: torch.Tensor, output: nn.Module, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = output(hidden).float()  # (n, vocab)
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    correct = ((logits.argmax(-1) == labels) & (labels != IGNORE)).sum()
    return loss, correct


def chunked_cross_entropy(
    hidden: torch.Tensor, output: nn.Module, labels: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss sum, supervised count, correct count) of hidden (N, dim) against labels (N,).

    With `chunk` > 0 (AUTO: auto_chunk of the head's vocabulary) the logits exist for `chunk` rows
    at a time, in forward and (recomputed) in
    backward, so the full (N, vocab) float32 logits are never held for backward.
    """
    if chunk < 0:  # AUTO: an nn.Linear head, or one wrapped as `.head` (integrations/hf/loss.py)
        chunk = auto_chunk(getattr(output, "head", output).out_features)
    count = (labels != IGNORE).sum()
    if chunk == 0 or hidden.shape[0] <= chunk:
        loss, correct = _chunk_loss(hidden, output, labels)
        return loss, count, correct
    losses, corrects = [], []
    for start in range(0, hidden.shape[0], chunk):
        part = slice(start, start + chunk)
        if torch.is_grad_enabled():
            loss, correct = checkpoint(
                _chunk_loss, hidden[part], output, labels[part], use_reentrant=False
            )
        else:
            loss, correct = _chunk_loss(hidden[part], output, labels[part])
        losses.append(loss)
        corrects.append(correct)
    return torch.stack(losses).sum(), count, torch.stack(corrects).sum()
