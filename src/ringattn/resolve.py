"""From the user's arguments to one validated `Call`: the local checks every attention call runs.

    call, signature = build_call(q, k, info, causal=..., scale=..., layout=..., strategy=...,
                                 backend=..., cu_seqlens=..., window=..., softcap=...)

`build_call` is pure (no communication): it raises ValueError/TypeError for this rank's own
mistakes and returns the resolved plan with the signature that the ranks must agree on. The
caller shares its verdict with `validate.validated`, so every rank raises the same error before
any collective. The eager path (`api.attention`) and the compiled path (`ops.py`, inside the
custom op) run exactly this code, so both accept and refuse the same calls.
"""

from __future__ import annotations

import math

import torch

from ringattn.comm import GroupInfo, MeshInfo
from ringattn.kernels import select_kernel, softcap_kernel
from ringattn.layout import get_layout
from ringattn.packing import check_window
from ringattn.plan import Call
from ringattn.sharding import local_placement
from ringattn.strategies import STRATEGIES
from ringattn.validate import call_signature, check_names, check_qkv


def build_call(
    q: object,
    k: object,
    v: object,
    info: GroupInfo,
    *,
    causal: bool,
    scale: float | None,
    layout: str,
    strategy: str,
    backend: str,
    cu_seqlens: object,
    window: object,
    softcap: object = None,
) -> tuple[Call, tuple]:
    """The Call of one attention call and its (name, value) signature; raises on bad input.

    `softcap` (a number > 0) caps the scores (c * tanh(s / c)): the call runs the softcap kernel
    (kernels/softcap.py), whatever `auto` would pick.
    """
    layout_obj = get_layout(layout)
    check_names(strategy, STRATEGIES, backend)
    check_qkv(q, k, v, scale)
    checked_window = check_window(window)
    check_group(info, strategy)
    placement = None
    if cu_seqlens is not None or checked_window is not None:
        if cu_seqlens is not None and q.shape[0] != 1:
            raise ValueError(
                f"cu_seqlens packs documents along the sequence of a single batch row, but q "
                f"has batch size {q.shape[0]}; concatenate the batch along the sequence"
            )
        placement = local_placement(layout_obj, info, q.shape[2], cu_seqlens)
    else:
        layout_obj.check_local_len(q.shape[2])
    check_device(info, q)
    resolved_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    STRATEGIES[strategy].check(q, k, info)
    if softcap is None:
        kernel = select_kernel(backend, q, k)
    else:
        kernel = softcap_kernel(backend, softcap)
    signature = call_signature(q, k, causal, resolved_scale, layout_obj, strategy, backend)
    bounds = None if placement is None else placement.bounds
    # the kernel `auto` picked: a probe that differs between ranks must not split them
    signature += (
        ("window", checked_window),
        ("cu_seqlens", bounds),
        ("kernel", kernel.name),
        ("softcap", None if softcap is None else float(softcap).hex()),
    )
    call = Call(info, layout_obj, kernel, bool(causal), resolved_scale, placement, checked_window,
                signature=signature)  # fmt: skip
    return call, signature


def check_group(info: GroupInfo, strategy: str) -> None:
    """A 2-D mesh's flattened world is for the hybrid strategy only."""
    if isinstance(info, MeshInfo) and strategy != "hybrid":
        raise ValueError(
            f"strategy={strategy!r} needs a 1-D process group, got a 2-D DeviceMesh "
            f"({info.ring.world_size} x {info.ulysses.world_size}, dims 'ring' and 'ulysses'); "
            f"pass mesh[dim_name] or use strategy='hybrid'"
        )


def check_device(info: GroupInfo, q: torch.Tensor) -> None:
    """NCCL groups need CUDA tensors on this rank's current device."""
    if info.group is None or info.world_size == 1:
        return
    import torch.distributed as dist

    backend = str(dist.get_backend(info.group)).lower()
    if backend != "nccl":
        return
    if q.device.type != "cuda":
        raise ValueError(
            f"the process group uses NCCL, which needs CUDA tensors, but q is on {q.device}; "
            f"move the tensors to the GPU or use a gloo group"
        )
    current = torch.cuda.current_device()
    if q.device.index is not None and q.device.index != current:
        raise ValueError(
            f"q is on {q.device} but this rank's current CUDA device is cuda:{current}; NCCL "
            f"would use the wrong GPU. Call torch.cuda.set_device(local_rank) once at start-up "
            f"(before init_process_group), with the tensors on that device"
        )
