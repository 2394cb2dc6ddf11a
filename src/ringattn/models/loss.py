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

An nn.Linear head (our decoder's, a transformers lm_head without logit post-processing) takes a
hand-written backward instead of the checkpoint (`fusable`, `linear_cross_entropy`). Under
checkpointing each chunk's weight gradient is a new (vocab, dim) tensor that autograd's input
buffer adds to the sum of the chunks before it, sometimes out of place. Measured on CPU
(scripts/bench/long_seq.py --breakdown, SmolLM2-135M's shape): at the loss's peak three
(vocab, dim) tensors were alive, the sum, the new chunk's and their out-of-place sum, beside the
chunk's logits, their log-softmax and its gradient (3 x rows x vocab float32). By hand:

    forward    per chunk, no graph: logits (rows, vocab) float32; argmax, the label's logit,
               then in place max, exp, sum, log: the loss; saved: hidden, labels
    backward   dW = zeros (vocab, dim) in the weight's dtype, once
               per chunk: logits again, in place softmax, minus one at each label, zero on
               unsupervised rows, times the loss's gradient = dlogits (rows, vocab)
               dhidden[chunk] = dlogits @ W;  dW += dlogits^T @ hidden[chunk]  (addmm_)

so a step holds one chunk of float32 logits and one weight gradient. The gradients go back to
autograd as the Function's input gradients, as from the module (DDP, FSDP2 see one per
parameter); only rounding differs from the checkpointed chunks.

The result is summed, never averaged: the caller divides by the number of supervised tokens over
all ranks, so the sum over a context-parallel group is the single-device loss. `IGNORE` marks a
token that is not supervised (F.cross_entropy's ignore_index).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

__all__ = ["AUTO", "IGNORE", "LOGITS_BUDGET", "auto_chunk", "chunked_cross_entropy", "fusable",
           "linear_cross_entropy", "resolve_chunk"]  # fmt: skip

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


def fusable(output: nn.Module) -> bool:
    """Whether `output` is a plain bias-free nn.Linear on local tensors that the hand-written
    backward may stand for: no hooks (tensor parallelism, hooks of other libraries) and no
    DTensor weight; not while torch.compile traces (the checkpointed chunks trace)."""
    if torch.compiler.is_compiling():  # first: nothing below is traced
        return False
    if type(output) is not nn.Linear or output.bias is not None:
        return False
    if output._forward_hooks or output._forward_pre_hooks or output._backward_hooks:
        return False
    return not isinstance(output.weight, DTensor)


def _chunk_forward(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, right predictions) of one chunk; its logits exist once, changed in place."""
    logits = F.linear(hidden, weight).float()  # (rows, vocab)
    supervised = labels != IGNORE
    correct = ((logits.argmax(-1) == labels) & supervised).sum()
    picked = logits.gather(1, labels.clamp(min=0)[:, None])[:, 0]  # (rows,) the label's logit
    top = logits.amax(-1, keepdim=True)  # (rows, 1)
    lse = logits.sub_(top).exp_().sum(-1).log_().add_(top[:, 0])  # (rows,)
    return torch.where(supervised, lse - picked, 0.0).sum(), correct


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk):
        losses, corrects = [], []
        for start in range(0, hidden.shape[0], chunk):
            part = slice(start, start + chunk)
            loss, correct = _chunk_forward(hidden[part], weight, labels[part])
            losses.append(loss)
            corrects.append(correct)
        ctx.chunk = chunk
        ctx.save_for_backward(hidden, weight, labels)
        correct = torch.stack(corrects).sum()
        ctx.mark_non_differentiable(correct)
        return torch.stack(losses).sum(), correct

    @staticmethod
    def backward(ctx, dloss, _):
        hidden, weight, labels = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        dhidden = torch.empty_like(hidden) if want_hidden else None
        dweight = torch.zeros_like(weight) if want_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            part = slice(start, start + ctx.chunk)
            rows, label = hidden[part], labels[part]
            dlogits = F.linear(rows, weight).float()  # (rows, vocab), softmax in place below
            dlogits.sub_(dlogits.amax(-1, keepdim=True)).exp_()
            dlogits.div_(dlogits.sum(-1, keepdim=True))
            supervised = (label != IGNORE).nonzero()[:, 0]  # (n,)
            dlogits[supervised, label[supervised]] -= 1.0
            dlogits.mul_((label != IGNORE)[:, None] * dloss)  # 0 on unsupervised rows
            dlogits = dlogits.to(weight.dtype)
            if want_hidden:
                torch.mm(dlogits, weight, out=dhidden[part])
            if want_weight:
                dweight.addmm_(dlogits.t(), rows)
            del dlogits  # before the next chunk's: one chunk of logits at a time
        return dhidden, dweight, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, output: nn.Linear, labels: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, right predictions) of hidden (N, dim) through `output` against labels (N,),
    `chunk` rows of logits at a time (module docstring); `fusable(output)` must hold."""
    return _LinearCrossEntropy.apply(hidden, output.weight, labels, chunk)


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
    if chunk > 0 and fusable(output):  # a plain nn.Linear head: the hand-written backward
        loss, correct = linear_cross_entropy(hidden, output, labels, chunk)
        return loss, count, correct
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
