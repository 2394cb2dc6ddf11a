"""RMSNorm, computed in float32 whatever the activations' dtype (cast back once at the end)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: torch.device | None = None):
        super().__init__()
        self.eps = eps
        # device None: the default device (a `with torch.device("meta")` block included)
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight
