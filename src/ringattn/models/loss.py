"""Cross-entropy over chunks of rows, so that a rank never holds its whole (tokens, vocab) logits.

    hidden (N, dim) --[chunk of C rows]--> output projection --> logits (C, vocab) float32
                                                             --> loss sum, right predictions
    backward: each chunk's logits are recomputed (activation checkpointing), never stored

`output` is the decoder's nn.Linear, or any module from hidden to logits (a Hugging Face model's
lm_head with its logit scaling or soft-capping: integrations/hf/loss.py).

The result is summed, never averaged: the caller divides by the number of supervised tokens over
all ranks, so the sum over a context-parallel group is the single-device loss. `IGNORE` marks a
token that is not supervised (F.cross_entropy's ignore_index).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["IGNORE", "chunked_cross_entropy"]

IGNORE = -100  # label of a token that is not supervised (F.cross_entropy's ignore_index)


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

    With `chunk` > 0 the logits exist for `chunk` rows at a time, in forward and (recomputed) in
    backward, so the full (N, vocab) float32 logits are never held for backward.
    """
    count = (labels != IGNORE).sum()
    if chunk <= 0 or hidden.shape[0] <= chunk:
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
