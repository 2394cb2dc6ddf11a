"""The decoder on one process: memory levers change nothing numerically, RoPE follows positions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ringattn.models import MODEL_SIZES, Transformer, model_config
from ringattn.train.data import IGNORE


def _model_and_batch(seed: int = 0):
    torch.manual_seed(seed)
    model = Transformer(model_config("tiny", dim=32))
    tokens = torch.randint(0, 256, (2, 40))
    labels = torch.randint(0, 256, (2, 40))
    labels[:, ::3] = IGNORE
    return model, tokens, labels


def _loss_and_grads(model, tokens, labels):
    model.zero_grad()
    loss, count, correct = model(tokens, torch.arange(tokens.shape[1]), labels)
    loss.backward()
    return loss.detach(), count, correct, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunk, checkpoint_blocks", [(7, False), (0, True), (16, True)])
def test_chunked_loss_and_activation_checkpointing_change_nothing(chunk, checkpoint_blocks):
    model, tokens, labels = _model_and_batch()
    want = _loss_and_grads(model, tokens, labels)
    logits = model(tokens, torch.arange(40))  # (2, 40, vocab)
    mask = labels != IGNORE
    direct = F.cross_entropy(logits[mask], labels[mask], reduction="sum")
    assert want[0].item() == pytest.approx(direct.item(), rel=1e-6)
    assert want[1] == mask.sum() and want[2] == (logits.argmax(-1)[mask] == labels[mask]).sum()
    model.loss_chunk, model.checkpoint_blocks = chunk, checkpoint_blocks
    got = _loss_and_grads(model, tokens, labels)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
    assert got[1] == want[1] and got[2] == want[2]
    for name, grad in want[3].items():
        torch.testing.assert_close(got[3][name], grad, rtol=1e-5, atol=1e-6)


def test_rope_uses_the_positions_given():
    """RoPE is relative: shifting every position changes nothing, spacing them out does."""
    model, tokens, _ = _model_and_batch()
    dense = model(tokens, torch.arange(40))
    shifted = model(tokens, torch.arange(40) + 1000)
    torch.testing.assert_close(shifted, dense, rtol=1e-4, atol=1e-5)
    spread = model(tokens, torch.arange(40) * 3)  # tokens 3 apart: other relative distances
    assert (spread - dense).abs().max() > 1e-3


def test_model_config_errors():
    with pytest.raises(ValueError, match="unknown model size 'huge'; choose from tiny"):
        model_config("huge")
    with pytest.raises(ValueError, match="4 heads are not a multiple of 3 kv heads"):
        model_config("tiny", n_kv_heads=3)
    assert set(MODEL_SIZES) == {"tiny", "small", "base", "large"}
