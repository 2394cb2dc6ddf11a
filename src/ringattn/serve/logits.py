"""Rank 0: one sequence's logits shaped before sampling, with vLLM's semantics and order.

    row (vocab,) float32, the model's logits (logprobs are reported from these, unshaped)
      + logit_bias[t]                                   the request's biases
      repetition_penalty r, for t in prompt or output:  row[t] / r if row[t] > 0 else row[t] * r
      - frequency_penalty x count[t] - presence_penalty x (count[t] > 0)    output tokens only
      row[t] = -inf where the grammar does not allow t  (response_format, tool_choice)
    -> greedy argmax, or temperature, min_p, top_k, top_p and one draw (inference/sampling.py)

The counts of the output tokens and the set of the prompt's and output's tokens live on the
logits' device and grow by one token per step (`accept`), as does the grammar's matcher. The
scheduler keeps a sequence (and so this) across a preemption: its tokens so far stay counted.
"""

from __future__ import annotations

import torch

from ringattn.serve.protocol import Request

__all__ = ["Shaper", "allowed_tokens"]


def allowed_tokens(matcher, vocab: int, device: torch.device) -> torch.Tensor:
    """(vocab,) bool on `device`: the tokens the grammar allows next. Its bitmask has token
    32 j + i at bit i of 32-bit word j, little-endian: bit b of byte k is token 8 k + b."""
    bits = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8)
    allowed = ((bits.unsqueeze(1) >> shifts) & 1).flatten().bool()  # (8 x bytes,)
    if allowed.numel() < vocab:  # logits wider than the tokenizer: never allowed
        allowed = torch.cat([allowed, allowed.new_zeros(vocab - allowed.numel())])
    return allowed[:vocab].to(device, non_blocking=True)


class Shaper:
    """The logit changes one request asked for (`Request.shaped`), over its tokens so far."""

    def __init__(self, request: Request):
        r = self.request = request
        self.matcher = None if r.grammar is None else r.grammar.deep_copy()  # this choice's
        self.counts: torch.Tensor | None = None  # (vocab,) output token counts
        self.seen: torch.Tensor | None = None  # (vocab,) bool: in the prompt or the output
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, values)

    def _state(self, row: torch.Tensor) -> None:
        vocab, device = row.shape[-1], row.device
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.seen[torch.tensor(self.request.ids, device=device)] = True
        if self.request.logit_bias:
            ids, values = zip(*sorted(self.request.logit_bias.items()))
            self.bias = (torch.tensor(ids, device=device),
                         torch.tensor(values, dtype=torch.float32, device=device))  # fmt: skip

    def __call__(self, row: torch.Tensor) -> torch.Tensor:
        """The shaped copy of `row` (vocab,); `row` itself is left as it is."""
        if self.counts is None:
            self._state(row)
        r = self.request
        row = row.float().clone()
        if self.bias is not None:
            row.index_add_(0, *self.bias)
        if r.repetition_penalty != 1:
            scaled = torch.where(row > 0, row / r.repetition_penalty, row * r.repetition_penalty)
            row = torch.where(self.seen, scaled, row)
        if r.frequency_penalty:
            row -= r.frequency_penalty * self.counts
        if r.presence_penalty:
            row -= r.presence_penalty * (self.counts > 0).float()
        if self.matcher is not None:
            row.masked_fill_(~allowed_tokens(self.matcher, row.shape[-1], row.device), -torch.inf)
        return row

    def accept(self, token: int) -> None:
        """`token` was sampled: count it, and advance the grammar."""
        if self.counts is not None:
            self.counts[token] += 1
            self.seen[token] = True
        if self.matcher is not None and not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}, sampled under its own mask: "
                               f"{self.matcher.get_error()}")  # fmt: skip
