"""bench/breakdown.py and PeakMemory on CPU: the peak from the raw allocation events, and what is
alive then, named by the op and autograd node that allocated it."""

from __future__ import annotations

import torch

from ringattn.bench.breakdown import Breakdown
from ringattn.bench.common import PeakMemory

CPU = torch.device("cpu")
ROWS = 1024  # "tokens" of the breakdown: a (ROWS, 256) float32 tensor is 256 floats per token


class _Scratch(torch.autograd.Function):
    """Backward allocates a 4 MiB scratch, frees it, then returns a 1 MiB gradient: a free
    inside one long op, which the ops' netted self memory places before the allocation."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        scratch = torch.ones(ROWS, 1024, device=CPU)  # 4 MiB
        total = scratch.sum()
        del scratch
        return grad * total


def _step():
    x = torch.randn(ROWS, 256, device=CPU, requires_grad=True)  # 1 MiB
    _Scratch.apply(x).sum().backward()
    return x


def test_peak_memory_sees_a_free_inside_a_long_op():
    with PeakMemory(CPU) as peak:
        _step()
    assert peak.mb >= 4.0  # the scratch; the ops' netted self memory read 2.0 MiB


def test_the_breakdown_names_what_is_alive_at_the_peak():
    with Breakdown(ROWS) as seen:
        _step()
    assert seen.mb >= 4.0
    assert seen.at[0] == "_ScratchBackward"  # the peak is inside that node's backward
    biggest = seen.live[0]
    assert (biggest["node"], biggest["op"]) == ("_ScratchBackward", "aten::empty")  # in ones
    assert abs(biggest["mb"] - 4.0) < 1e-3  # the scratch (and the 4-byte sum beside it)
    forward = [g for g in seen.live if g["node"] == ""]
    assert any(g["per_token"] == 256.0 for g in forward)  # x and its clone, made in forward
