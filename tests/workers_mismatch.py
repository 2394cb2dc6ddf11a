"""Rank 1 changes its attention arguments after the ranks agreed (tests/test_mismatch.py).

Run by `launch` (as a function) and by an external torchrun (as a script): both ranks make call 1
with the same shapes (one agreement), then rank 1 calls with half the local sequence while rank 0
repeats call 1's arguments (the fast path, straight into the ring's collectives).
"""

from __future__ import annotations

import sys

import torch

import ringattn
from ringattn.runtime.launch import init_distributed


def change_on_second_call(timeout_s: float = 120.0) -> None:
    device = init_distributed(timeout_s=timeout_s)
    rank = torch.distributed.get_rank()
    for call in (1, 2):
        local = 16 if call == 2 and rank == 1 else 32
        q, k, v = (torch.randn(1, 2, local, 8, device=device) for _ in range(3))
        ringattn.attention(q, k, v, causal=True, layout="zigzag")


if __name__ == "__main__":
    change_on_second_call(float(sys.argv[1]) if len(sys.argv) > 1 else 120.0)
