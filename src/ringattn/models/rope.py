"""Rotary position embeddings from GLOBAL positions.

Angles are computed per call from the positions passed in, never from a table indexed by local
row: under context parallelism, local row i of rank r holds global token positions[i], and that is
the rotation it must get for attention to equal the single-device model's. The angles are taken in
float64 so that they stay exact at long positions (64k and beyond), then rounded to float32.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "rope_angles"]


def rope_angles(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (S, head_dim/2) in float32 for integer positions (S,); padding (-1) gets 0."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device) / head_dim)
    angles = positions.clamp(min=0).double()[:, None] * inv_freq.double()[None]  # (S, D/2)
    return angles.cos().float(), angles.sin().float()  # float64 angles: exact at 64k positions


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x (B, H, S, D) by the angles for each row."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # each (B, H, S, D/2)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, H, S, D/2, 2)
    return out.flatten(-2).type_as(x)  # (B, H, S, D)
