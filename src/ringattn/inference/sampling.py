"""Choosing the next token: greedy, or sampling with temperature, min-p, top-k and top-p.

Every rank holds the same logits (the decode merge gives every rank the same bits) and draws from
a generator seeded with the same seed, so every rank picks the same token without communicating.

    temperature < GREEDY_BELOW (0 included)   argmax (greedy)
    otherwise         softmax((logits - max) / temperature) in float64 (the max subtracted first:
                      no temperature overflows it, 1e-310 included), drop the tokens less likely
                      than min_p x the most likely (0: none; vLLM's min_p), keep the top_k most
                      likely (0: all), then the smallest set of most likely tokens whose probability
                      reaches top_p (1: all), renormalise and draw once with torch.multinomial
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5  # a temperature under this decodes greedily (the draw is an argmax anyway)
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class Sampling:
    """How to pick each token; the defaults are greedy decoding."""

    temperature: float = 0.0
    """0 (or under GREEDY_BELOW) means greedy (argmax); otherwise logits are divided by it."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p; 1 keeps all."""
    seed: int = 0
    """Seed of the generator every rank draws from (the same on every rank)."""
    min_p: float = 0.0
    """Drop tokens whose probability is under min_p x the most likely one's; 0 keeps all."""

    def check(self) -> None:
        """Raise ValueError naming the field that is out of range."""
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be finite, got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an int >= 0 (0 = no limit), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = no limit), got {self.top_p!r}")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1] (0 = no limit), got {self.min_p!r}")
        if not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {self.seed!r}")
        if not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise ValueError(f"seed must be in [-2**63, 2**64) (a torch.Generator seed), got "
                             f"{self.seed}")  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator seeded with `seed` on `device` (the logits' device: multinomial needs
        them together; CPU by default, for host-side logits)."""
        return torch.Generator(device=device).manual_seed(self.seed)


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token from logits (vocab,) float32 (finite: the caller checks)."""
    if sampling.greedy:
        return int(logits.argmax())
    logits = logits.double()
    logits = (logits - logits.max()) / sampling.temperature  # <= 0, the max 0: exp never overflows
    if sampling.min_p > 0:  # p / p_max = exp(logit - 0): keep logit >= log(min_p)
        logits = logits.masked_fill(logits < math.log(sampling.min_p), -math.inf)
    if sampling.top_k and sampling.top_k < logits.numel():
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(sorted_probs, dim=0) - sorted_probs  # mass of the likelier tokens
        drop = order[before >= sampling.top_p]
        probs = probs.index_fill(0, drop, 0.0)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
