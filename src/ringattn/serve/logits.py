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

__all__ = ["Shaper", "allowed_tokens", "shape_rows"]


def allowed_tokens(matchers: list, vocab: int, device: torch.device) -> torch.Tensor:
    """(len(matchers), vocab) bool on `device`: the tokens each grammar allows next. The
    bitmasks are gathered on the host and cross to `device` once, then expanded there: token
    32 j + i is bit i of 32-bit word j (an arithmetic shift keeps bit i of a negative word)."""
    words = torch.frombuffer(bytearray(b"".join(m.compute_bitmask() for m in matchers)),
                             dtype=torch.int32).view(len(matchers), -1)  # fmt: skip
    words = words.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()  # (n, 32 x words)
    if allowed.shape[1] < vocab:  # logits wider than the tokenizer: never allowed
        allowed = torch.cat([allowed, allowed.new_zeros(len(matchers), vocab - allowed.shape[1])],
                            dim=1)  # fmt: skip
    return allowed[:, :vocab]


def shape_rows(logits: torch.Tensor, shapers: list) -> torch.Tensor:
    """(L, vocab) float32: row j of `logits` shaped by shapers[j] (None: as it is), the grammar
    masks of every constrained row in one transfer and one masked_fill; `logits` is left as it
    is (logprobs are the model's)."""
    out = logits.float().clone()
    masked = []
    for j, shaper in enumerate(shapers):
        if shaper is not None:
            if shaper.adjusts:
                out[j] = shaper(out[j])
            if shaper.matcher is not None:
                masked.append(j)
    if masked:
        matchers = [shapers[j].matcher for j in masked]
        allowed = allowed_tokens(matchers, out.shape[-1], out.device)
        at = torch.tensor(masked, device=out.device)
        out[at] = out[at].masked_fill(~allowed, -torch.inf)
    return out


class Shaper:
    """The logit changes one request asked for (`Request.shaped`), over its tokens so far."""

    def __init__(self, request: Request):
        r = self.request = request
        self.matcher = None if r.grammar is None else r.grammar.deep_copy()  # this choice's
        self.counts: torch.Tensor | None = None  # (vocab,) output token counts
        self.seen: torch.Tensor | None = None  # (vocab,) bool: in the prompt or the output
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, values)
        self.adjusts = bool(r.logit_bias or r.presence_penalty or r.frequency_penalty
                            or r.repetition_penalty != 1)  # fmt: skip

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
        """`row` (vocab,) float32, a copy the caller owns, with the biases and penalties
        (changed in place where it can be; the grammar's mask: shape_rows)."""
        if self.counts is None:
            self._state(row)
        r = self.request
        if self.bias is not None:
            row.index_add_(0, *self.bias)
        if r.repetition_penalty != 1:
            scaled = torch.where(row > 0, row / r.repetition_penalty, row * r.repetition_penalty)
            row = torch.where(self.seen, scaled, row)
        if r.frequency_penalty:
            row -= r.frequency_penalty * self.counts
        if r.presence_penalty:
            row -= r.presence_penalty * (self.counts > 0).float()
        return row

    def accept(self, token: int) -> None:
        """`token` was sampled: count it, and advance the grammar."""
        if self.counts is not None:
            self.counts[token] += 1
            self.seen[token] = True
        if self.matcher is not None and not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}, sampled under its own mask: "
                               f"{self.matcher.get_error()}")  # fmt: skip
