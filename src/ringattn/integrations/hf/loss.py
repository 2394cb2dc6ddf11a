"""The causal-LM loss of a transformers model without its whole (tokens, vocab) logits.

    model(**inputs).logits        (S_local, vocab) float32 at once: 4,096 tokens x 128,256 ids
                                  = 2.1 GB, and as much again for log-softmax and its gradient
    here                          base model -> hidden (S_local, dim); then models/loss.py's
                                  chunked_cross_entropy: `chunk` rows of lm_head + cross-entropy
                                  at a time (default: as many as fit 256 MiB of float32
                                  logits), each chunk recomputed in backward

    decoder, head = model.get_decoder(), model.get_output_embeddings()
    hidden = decoder(**inputs).last_hidden_state          # what ForCausalLM.forward does first
    loss_sum, count, correct = chunked_cross_entropy(hidden, head, labels, chunk)

The result is a SUM over this rank's tokens (plus the supervised count and right predictions), so
a caller can add other terms (a MoE router's auxiliary loss) before dividing by the global count.
Models whose forward post-processes the logits are followed exactly: Gemma's final logit
soft-capping (`cap * tanh(logits / cap)`), Cohere's `logit_scale`, Granite's `logits_scaling`.

`loss(model, batch, chunk=...)` is the public face (`ringattn.hf.loss`): the same value as
`model(**batch).loss` for a batch of `ringattn.hf.shard_batch`, i.e. this rank's share of the
single-device mean, whose sum over the CP group is the single-device loss.
"""

from __future__ import annotations

import torch
from torch import nn

from ringattn.models.loss import AUTO, IGNORE, chunked_cross_entropy, resolve_chunk

__all__ = ["LogitHead", "logits_loss", "loss", "loss_sum", "output_head"]

_NOT_INPUTS = ("labels", "shift_labels", "num_items_in_batch")


class LogitHead(nn.Module):
    """lm_head followed by the model's own logit post-processing (scale, soft-capping)."""

    def __init__(self, head: nn.Module, scale: float = 1.0, softcap: float | None = None) -> None:
        super().__init__()
        self.head, self.scale, self.softcap = head, scale, softcap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def output_head(model: nn.Module) -> nn.Module:
    """The module that turns the model's last hidden states into its logits (LogitHead or lm_head).

    TypeError when the model has no separate base model and output projection."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or not hasattr(model, "get_decoder"):
        raise TypeError(
            f"{type(model).__name__} has no nn.Linear output head (get_output_embeddings) beside "
            f"its base model (get_decoder); use chunk=0 (the model's own logits)"
        )
    config = model.config.get_text_config()
    scale = float(getattr(config, "logit_scale", None) or 1.0)  # Cohere multiplies
    scaling = getattr(config, "logits_scaling", None)  # Granite divides
    if scaling:
        scale /= float(scaling)
    softcap = getattr(config, "final_logit_softcapping", None)
    if scale == 1.0 and not softcap:
        return head
    return LogitHead(head, scale, softcap)


def logits_loss(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss sum, supervised tokens, right predictions) of whole logits (..., vocab), in float32."""
    logits = logits.float().flatten(0, -2)  # (S_local, vocab)
    labels = labels.flatten()  # (S_local,)
    loss = nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    correct = ((logits.argmax(-1) == labels) & (labels != IGNORE)).sum()
    return loss, (labels != IGNORE).sum(), correct


def loss_sum(
    model: nn.Module, inputs: dict, labels: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of the token cross-entropies, supervised tokens, right argmax predictions).

    `inputs` are the model's keyword arguments for this rank's tokens (no labels), `labels`
    (1, S_local) already shifted (-100: unsupervised). `chunk` > 0: rows of logits at a time;
    AUTO (-1): as many rows as fit models/loss.py's LOGITS_BUDGET at this model's vocabulary;
    0: the model's own forward, whole logits (any model)."""
    labels = labels.flatten()  # (S_local,)
    if chunk == 0:
        return logits_loss(model(**inputs).logits, labels)
    head = output_head(model)
    chunk = resolve_chunk(chunk, model.get_output_embeddings().out_features)
    hidden = model.get_decoder()(**inputs).last_hidden_state.flatten(0, 1)  # (S_local, dim)
    return chunked_cross_entropy(hidden, head, labels, chunk)


def loss(model: nn.Module, batch: dict, *, chunk: int = AUTO) -> torch.Tensor:
    """`model(**batch).loss` for a `ringattn.hf.shard_batch` batch, the logits `chunk` rows at a
    time (AUTO: the most rows whose float32 logits fit in 256 MiB at this vocabulary; 0: whole):
    this rank's loss sum over the batch's `num_items_in_batch` (the global count)."""
    if "shift_labels" not in batch or "num_items_in_batch" not in batch:
        raise ValueError(
            "ringattn.hf.loss takes a batch of ringattn.hf.shard_batch with labels (it needs "
            f"shift_labels and num_items_in_batch); got the keys {sorted(batch)}"
        )
    inputs = {k: v for k, v in batch.items() if k not in _NOT_INPUTS}
    total, _, _ = loss_sum(model, inputs, batch["shift_labels"], chunk)
    return total / batch["num_items_in_batch"].clamp(min=1)
