"""Checks on user input, run on every rank before any communication.

Local checks (shapes, dtypes, devices, head counts, names, layout divisibility) are pure: each rank
raises the same ValueError/TypeError from its own arguments. Agreement across ranks (one rank with a
different local length, dtype, layout...) needs one small all-gather; it runs the first time a rank
sees a call signature and is remembered per process group, so a training loop that repeats the same
call pays it once, not per step.
"""

from __future__ import annotations

import hashlib
import math

import torch

from ringattn.comm import GroupInfo, all_gather_ints, all_gather_objects
from ringattn.kernels import check_backend_name
from ringattn.layout import Layout

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)

# signatures already agreed on, per process group name; bounded so it never grows without end
_AGREED: dict[str, set[tuple]] = {}
_MAX_AGREED = 256


def check_qkv(q: object, k: object, v: object, scale: float | None) -> None:
    """Raise TypeError/ValueError with the values and the fix for malformed q, k, v."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, heads, seq_local, head_dim) as in "
                f"F.scaled_dot_product_attention, got shape {tuple(x.shape)}"
            )
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{name} has dtype {x.dtype}; use one of {[str(d) for d in FLOAT_DTYPES]}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; cast them"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    bq, hq, sq, dq = q.shape
    bk, hkv, sk, dk = k.shape
    if bq != bk:
        raise ValueError(f"batch sizes differ: q has {bq}, k/v have {bk}")
    if dq != dk:
        raise ValueError(f"head dims differ: q has {dq}, k/v have {dk}")
    if sq != sk:
        raise ValueError(
            f"local sequence lengths differ: q has {sq}, k/v have {sk}; shard q, k, v with the "
            f"same ringattn.shard(..., layout=...) call"
        )
    if sq == 0 or dq == 0 or bq == 0 or hq == 0 or hkv == 0:
        raise ValueError(f"empty input: q has shape {tuple(q.shape)}, k/v {tuple(k.shape)}")
    if hq % hkv:
        raise ValueError(
            f"query heads {hq} must be a multiple of key/value heads {hkv} (GQA/MQA); "
            f"valid K/V head counts divide {hq}"
        )
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")


def check_names(strategy: str, strategies: dict, backend: str) -> None:
    if not isinstance(strategy, str) or strategy not in strategies:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {list(strategies)}")
    check_backend_name(backend)


def _code(value: object) -> int:
    """A stable 56-bit hash of a value's text (the same on every rank, unlike hash())."""
    return int.from_bytes(hashlib.blake2b(str(value).encode(), digest_size=7).digest(), "little")


def check_agreement(signature: tuple, info: GroupInfo, device: torch.device) -> None:
    """Raise the same ValueError on every rank if ranks called with different signatures.

    `signature` is a tuple of (name, value) pairs. The all-gather runs once per new signature per
    group. All ranks must reach this call together the first time they use a signature: a rank
    that silently changes its arguments while the others repeat an agreed call cannot be caught
    without a collective on every call, and surfaces as the process-group timeout instead.
    """
    if info.world_size == 1:
        return
    agreed = _AGREED.setdefault(info.key, set())
    if signature in agreed:
        return
    codes = [_code(value) for _, value in signature]
    gathered = all_gather_ints(codes, info, device)
    differing = [
        (name, index)
        for index, (name, _) in enumerate(signature)
        if len({row[index] for row in gathered}) > 1
    ]
    if differing:
        # every rank saw the same gathered codes, so every rank takes this branch together
        readable = all_gather_objects([value for _, value in signature], info)
        per_rank = "; ".join(
            f"rank {r}: " + ", ".join(f"{name}={row[i]!r}" for name, i in differing)
            for r, row in enumerate(readable)
        )
        names = ", ".join(name for name, _ in differing)
        raise ValueError(
            f"ranks disagree on the attention call ({names}): {per_rank}. Every rank must pass "
            f"tensors of the same local shape and dtype and the same keyword arguments"
        )
    if len(agreed) >= _MAX_AGREED:
        agreed.clear()
    agreed.add(signature)


def call_signature(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    scale: float,
    layout: Layout,
    strategy: str,
    backend: str,
) -> tuple:
    """What every rank must agree on for one attention call, as (name, value) pairs."""
    return (
        ("q.shape", tuple(q.shape)),
        ("k.shape", tuple(k.shape)),
        ("dtype", str(q.dtype)),
        ("device type", q.device.type),
        ("causal", bool(causal)),
        ("scale", float(scale).hex()),
        ("layout", layout.name),
        ("strategy", strategy),
        ("backend", backend),
        ("requires_grad", torch.is_grad_enabled() and any(x.requires_grad for x in (q, k))),
    )
