"""The chunked loss of a plain nn.Linear head (models/loss.py, linear_cross_entropy): the same loss,
counts and gradients as whole logits, and only one weight gradient and one chunk of logits alive."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ringattn.bench.common import PeakMemory
from ringattn.models.loss import IGNORE, chunked_cross_entropy, fusable

CPU = torch.device("cpu")


def _case(rows: int, dim: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    head = nn.Linear(dim, vocab, bias=False, device=CPU, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, dim, generator=gen) * dim**-0.5)
    hidden = torch.randn(rows, dim, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[::5] = IGNORE
    return head, hidden, labels


def _run(head, hidden, labels, chunk, fused: bool):
    head.weight.grad = hidden.grad = None
    if fused:
        loss, count, correct = chunked_cross_entropy(hidden, head, labels, chunk)
    else:  # whole logits through autograd, in float64: the reference
        logits = F.linear(hidden.double(), head.weight.double())
        loss = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
        count = (labels != IGNORE).sum()
        correct = ((logits.argmax(-1) == labels) & (labels != IGNORE)).sum()
    dloss = torch.tensor(0.37, dtype=loss.dtype)  # not 1: the incoming gradient is used
    (loss * dloss).backward()
    return loss.detach().double(), count, correct, hidden.grad.double(), head.weight.grad.double()


@pytest.mark.parametrize("rows, chunk", [(50, 16), (48, 16), (10, 64)])
def test_the_fused_loss_equals_whole_logits_in_float32(rows, chunk):
    head, hidden, labels = _case(rows, 24, 97, torch.float32)
    assert fusable(head)
    got = _run(head, hidden, labels, chunk, fused=True)
    want = _run(head, hidden, labels, chunk, fused=False)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
    assert got[1] == want[1] and got[2] == want[2]
    for g, w in zip(got[3:], want[3:], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_the_fused_loss_in_bf16_errs_no_more_than_the_checkpointed_chunks():
    """Against float64, the hand-written backward's bf16 error is within 2x that of autograd
    through the checkpointed chunks (the generic path, same dtype)."""
    head, hidden, labels = _case(64, 32, 211, torch.bfloat16, seed=3)
    want = _run(head, hidden, labels, 16, fused=False)
    fused = _run(head, hidden, labels, 16, fused=True)
    wrapped = nn.Sequential(head)  # not a plain nn.Linear: the checkpointed chunks
    assert not fusable(wrapped)
    plain = _run_module(wrapped, head, hidden, labels)
    for i in (0, 3, 4):
        err_fused = (fused[i] - want[i]).abs().max()
        err_plain = (plain[i] - want[i]).abs().max()
        assert err_fused <= 2 * err_plain + 1e-6, (i, err_fused, err_plain)
    assert fused[1] == want[1]


def _run_module(module, head, hidden, labels):
    head.weight.grad = hidden.grad = None
    loss, _, _ = chunked_cross_entropy(hidden, module, labels, 16)
    (loss * torch.tensor(0.37, dtype=loss.dtype)).backward()
    return loss.detach().double(), None, None, hidden.grad.double(), head.weight.grad.double()


def test_only_plain_linear_heads_are_fused():
    head = nn.Linear(8, 16, bias=False)
    assert fusable(head)
    assert not fusable(nn.Linear(8, 16))  # a bias: the checkpointed chunks
    head.register_forward_hook(lambda *args: None)
    assert not fusable(head)  # hooks (tensor parallelism's, others'): the module must run


def test_the_fused_loss_holds_one_weight_gradient_and_one_chunk_of_logits():
    """The backward's peak above its inputs: the weight gradient, one chunk's float32 logits and
    the hidden gradient (and small per-row vectors); the checkpointed chunks held up to three
    weight gradients and three chunks of logits (module docstring of models/loss.py)."""
    rows, dim, vocab, chunk = 512, 64, 4096, 64
    head, hidden, labels = _case(rows, dim, vocab, torch.float32)
    loss, _, _ = chunked_cross_entropy(hidden, head, labels, chunk)
    with PeakMemory(CPU) as peak:
        loss.backward()
    mib = 2**-20
    bound = (vocab * dim + chunk * vocab + rows * dim) * 4 * mib
    assert peak.mb <= 1.1 * bound, (peak.mb, bound)
    wrapped = nn.Sequential(head)
    loss, _, _ = chunked_cross_entropy(hidden, wrapped, labels, chunk)
    with PeakMemory(CPU) as generic:
        loss.backward()
    assert generic.mb > 1.5 * bound  # what the fused path is for: the generic path holds more
