"""One-time probe of a fused kernel before `backend="auto"` relies on it.

A fused op can be present in the build and still refuse a case at run time (an old cuDNN, an
unsupported head dim on this GPU, a changed op signature between torch releases). Finding that out
inside the ring, on one rank, would leave the others waiting. So the first time `auto` considers a
kernel for a (device, dtype, head dim, GQA) combination it runs a tiny causal forward and backward
locally, compares with the reference kernel, and remembers the verdict for the process.
"""

from __future__ import annotations

import math

import torch

from ringattn.kernels.base import Kernel
from ringattn.kernels.reference import ReferenceKernel

# verdicts per (kernel, device, dtype, head dim, grouped): pure function of the machine and torch
_VERDICTS: dict[tuple, bool] = {}


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-9, torch.float32: 1e-4}.get(dtype, 5e-2)


def kernel_works(kernel: Kernel, q: torch.Tensor, k: torch.Tensor) -> bool:
    """True when `kernel` runs a tiny case shaped like (q, k) and matches the reference."""
    if kernel.name == "reference":
        return True
    key = (kernel.name, str(q.device), q.dtype, q.shape[-1], q.shape[1] != k.shape[1])
    if key not in _VERDICTS:
        _VERDICTS[key] = _probe(kernel, q, k)
    return _VERDICTS[key]


def _probe(kernel: Kernel, q: torch.Tensor, k: torch.Tensor) -> bool:
    gen = torch.Generator(device="cpu").manual_seed(0)
    groups = q.shape[1] // k.shape[1]
    shape_q, shape_kv = (1, 2 * groups, 16, q.shape[-1]), (1, 2, 16, q.shape[-1])

    def rand(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device="cpu").to(device=q.device, dtype=q.dtype)

    pq, pk, pv, pdout = rand(shape_q), rand(shape_kv), rand(shape_kv), rand(shape_q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    reference = ReferenceKernel()
    try:
        out, lse = kernel.forward(pq, pk, pv, True, scale)
        ref_out, ref_lse = reference.forward(pq, pk, pv, True, scale)
        grads = kernel.backward(pdout, pq, pk, pv, ref_out, ref_lse, True, scale)
        ref_grads = reference.backward(pdout, pq, pk, pv, ref_out, ref_lse, True, scale)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False
    tol = _tolerance(q.dtype)
    pairs = [(out, ref_out), (lse, ref_lse), *zip(grads, ref_grads)]
    return all(
        a.shape == b.shape and torch.allclose(a.double(), b.double(), atol=tol, rtol=tol)
        for a, b in pairs
    )
