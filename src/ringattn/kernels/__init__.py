"""Block attention kernels: one (query block, key block) pair, forward and backward.

    base.py       the Kernel interface (see there), causal and band masks
    reference.py  explicit-mask attention in plain PyTorch (any mask, any dtype)
    cpu.py        PyTorch's fused CPU flash op
    cuda.py       cuDNN, FlashAttention-2 and memory-efficient SDPA ops
    softcap.py    capped scores (c * tanh(s / c), Gemma 2) in plain PyTorch, for `softcap=c`
    probe.py      the one-time check that a fused kernel works before `auto` relies on it
    triton_merge  the fused online-softmax merge (Triton on CUDA, torch elsewhere)

This module is the registry: `KERNELS` by name, `select_kernel` for `backend="auto"`, and
`softcap_kernel` for a call with `softcap` (only the softcap kernel caps scores).
"""

from __future__ import annotations

import math
import warnings

import torch

from ringattn.kernels.base import Kernel
from ringattn.kernels.cpu import CpuFlashKernel
from ringattn.kernels.cuda import CudnnKernel, EfficientKernel, FlashKernel
from ringattn.kernels.probe import kernel_works
from ringattn.kernels.reference import ReferenceKernel
from ringattn.kernels.softcap import SoftcapKernel


def _registry() -> dict[str, Kernel]:
    kernels = [ReferenceKernel(), CpuFlashKernel(), CudnnKernel(), FlashKernel(), EfficientKernel()]
    return {kernel.name: kernel for kernel in kernels}


KERNELS: dict[str, Kernel] = _registry()
BACKENDS = ("auto", *KERNELS)

# `auto` tries these in order and takes the first that supports the case and passes its probe
AUTO_ORDER = {
    "cpu": ("cpu_flash", "reference"),
    "cuda": ("cudnn", "flash", "efficient", "reference"),
}


def check_backend_name(backend: str) -> None:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {list(BACKENDS)}")


def select_kernel(backend: str, q: torch.Tensor, k: torch.Tensor) -> Kernel:
    """The kernel for `backend` on tensors like q, k.

    An explicit name must support the case (ValueError with its reason otherwise). `auto` takes
    the first kernel in AUTO_ORDER for the device that supports the case and whose one-time probe
    (a tiny forward and backward checked against the reference) succeeds, so a fused op that is
    missing or broken on this machine falls back instead of failing inside the ring.
    """
    check_backend_name(backend)
    if backend != "auto":
        kernel = KERNELS[backend]
        reason = kernel.supports(q, k)
        if reason is not None:
            raise ValueError(
                f"backend {backend!r} cannot run this case: {reason}; use backend='auto'"
            )
        return kernel
    for name in AUTO_ORDER.get(q.device.type, ("reference",)):
        kernel = KERNELS[name]
        if kernel.supports(q, k) is None and kernel_works(kernel, q, k):
            break
    else:
        kernel = KERNELS["reference"]
    if kernel.name == "reference" and q.device.type == "cuda":
        # the warnings module shows this once per call site, not once per block
        warnings.warn(
            f"no fused CUDA attention kernel runs {q.dtype} with head dim {q.shape[-1]}; "
            f"ringattn falls back to the reference kernel, which keeps each block's full score "
            f"matrix in memory (O(block^2)). Use bfloat16/float16 (cuDNN, flash) or float32 "
            f"(efficient) for long sequences",
            RuntimeWarning,
            stacklevel=3,
        )
    return kernel


def softcap_kernel(backend: str, softcap: object) -> SoftcapKernel:
    """The kernel of a call with attention logit softcapping `softcap` (a number > 0).

    Only SoftcapKernel caps scores: `backend` must be "auto" (or "reference", whose plain
    PyTorch math it shares); naming a fused kernel is a ValueError, not a silently uncapped run.
    """
    check_backend_name(backend)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a number > 0 or None, got {softcap!r}")
    if not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(
            f"softcap must be finite and > 0 (scores become c * tanh(s / c)), got {softcap}; "
            f"pass softcap=None for no capping"
        )
    if backend not in ("auto", "reference"):
        raise ValueError(
            f"backend {backend!r} cannot softcap attention scores (softcap={softcap}); use "
            f"backend='auto', which runs the softcap kernel"
        )
    return SoftcapKernel(softcap)
