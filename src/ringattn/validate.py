"""Checks on user input, run on every rank before any communication.

Local checks (shapes, dtypes, devices, head counts, names, layout divisibility) are pure: each rank
judges its own arguments. Their verdict is not raised at once: `validated` / `agree` share it with
the other ranks, with a hash of the call signature, in one small all-gather, so that every rank
raises the same error naming the rank(s) at fault (one rank with a short shard, another config)
instead of the valid ranks hanging in their first collective. The exchange runs the first time a
rank sees a call signature and is remembered per process group, so a training loop that repeats
the same call pays it once, not per step.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import TypeVar

import torch

from ringattn.comm import GroupInfo, all_gather_ints, all_gather_json
from ringattn.inflight import agreeing, readable, resync
from ringattn.kernels import check_backend_name
from ringattn.layout import Layout

T = TypeVar("T")

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


def validated(
    info: GroupInfo,
    device: object,
    build: Callable[[], tuple[T, tuple]],
    call: int | None = None,
) -> T:
    """Run the local checks in `build` (-> (result, signature)) and agree on them across ranks.

    A ValueError/TypeError from `build` is not raised at once: it is this rank's verdict, which
    `agree` shares with the others, so every rank raises the same error, naming the rank(s) at
    fault, instead of the valid ranks waiting forever in their first collective. `call` is the
    attention call's number (inflight.start_call), published while its agreement runs.
    """
    try:
        result, signature = build()
        error = None
    except (ValueError, TypeError) as err:
        result, signature, error = None, None, err
    agree(signature, info, device, error, call)
    return result


def agree(
    signature: tuple | None,
    info: GroupInfo,
    device: object,
    error: Exception | None = None,
    call: int | None = None,
) -> None:
    """Raise the same error on every rank if any rank's local checks failed (`error`) or the ranks
    called with different signatures ((name, value) pairs).

    Steady state costs one set lookup: a signature this group already agreed on, with no local
    error, returns at once. Otherwise one all-gather of two integers per rank (the verdict and a
    hash of the signature); only when they show a problem, a second gather of each rank's error
    message and readable signature (as JSON) words the error, identically on every rank.

    All ranks must reach this call together the first time they use a signature. A rank that
    changes its arguments while the others repeat an agreed call waits here while they wait in
    the call's collectives. Catching that on the main threads would need a collective on every
    call; instead, with `call` (an attention call's number), the wait is published (inflight.py)
    and the heartbeat threads name the rank within seconds (runtime/mismatch.py).
    """
    if info.world_size == 1:
        if error is not None:
            raise error
        return
    agreed = _AGREED.setdefault(info.key, set())
    if error is None and signature in agreed:
        return
    device = device if isinstance(device, torch.device) else torch.device("cpu")
    # the call's number travels too: the ranks leave every agreement with the same count, even
    # if an earlier call failed on one of them only (a worker pool that outlives a task)
    mine = [0 if error is None else 1, 0 if signature is None else _code(signature), call or 0]
    with agreeing(info, call, signature, error):
        gathered = all_gather_ints(mine, info, device)
        if call is not None:
            resync(info, max(row[2] for row in gathered))
        failed = any(row[0] for row in gathered)
        if failed or len({row[1] for row in gathered}) > 1:
            # every rank saw the same gathered integers, so every rank takes this branch together
            verdict = None if error is None else [type(error).__name__, str(error)]
            shown = None if signature is None else readable(signature)
            rows = all_gather_json({"error": verdict, "signature": shown}, info)
            raise _group_error(rows) if failed else _disagreement(rows)
    if len(agreed) >= _MAX_AGREED:
        agreed.clear()
    agreed.add(signature)


def check_agreement(signature: tuple, info: GroupInfo, device: object) -> None:
    """`agree` for a caller whose local checks have already passed."""
    agree(signature, info, device)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _group_error(rows: list[dict]) -> Exception:
    """One error for the whole group from each rank's verdict; identical on every rank."""
    by_message: dict[tuple[str, str], list[int]] = {}
    for rank, row in enumerate(rows):
        if row["error"] is not None:
            by_message.setdefault(tuple(row["error"]), []).append(rank)
    kinds = {kind for kind, _ in by_message}
    cls = TypeError if kinds == {"TypeError"} else ValueError
    if len(by_message) == 1 and len(next(iter(by_message.values()))) == len(rows):
        return cls(next(iter(by_message))[1])  # every rank made the same mistake
    world = len(rows)
    parts = [f"{_ranks(ranks)} of {world}: {message}" for (_, message), ranks in by_message.items()]
    valid = [r for r, row in enumerate(rows) if row["error"] is None]
    tail = f" ({_ranks(valid)}: arguments valid)" if valid else ""
    return cls("; ".join(parts) + tail)


def _disagreement(rows: list[dict]) -> ValueError:
    """The fields on which the ranks' signatures differ, with each rank's values."""
    signatures = [{n: v for n, v in row["signature"]} for row in rows]
    names = [n for n, _ in rows[0]["signature"]]
    differing = [n for n in names if len({repr(s.get(n)) for s in signatures}) > 1]
    per_rank = "; ".join(
        f"rank {r}: " + ", ".join(f"{n}={_show(s.get(n))}" for n in differing)
        for r, s in enumerate(signatures)
    )
    return ValueError(
        f"ranks disagree on the call ({', '.join(differing)}): {per_rank}. Every rank must "
        f"pass tensors of the same local shape and dtype and the same keyword arguments"
    )


def _show(value: object) -> str:
    """A readable value: shapes as tuples, strings quoted (as repr of the original)."""
    if isinstance(value, list):
        return "(" + ", ".join(_show(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


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
