"""Rank functions for packed documents, padding and windows (see harness.py).

The reference is independent of the library: float64 attention on the full sequence with an
explicit mask built from document ids and the window, one document at a time (attention is
block-diagonal by document), gradients by autograd.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

import ringattn
from ringattn.testing.yardstick import allclose_gate, compare, relative_gate, tolerance
from workers import QUANTITIES, make_inputs


def doc_mask(length: int, causal: bool, window) -> torch.Tensor:
    """(length, length) visibility inside one document: causal and/or window (-1 unbounded)."""
    i = torch.arange(length).unsqueeze(1)
    j = torch.arange(length).unsqueeze(0)
    visible = torch.ones(length, length, dtype=torch.bool)
    if causal:
        visible &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            visible &= j >= i - left
        if right >= 0:
            visible &= j <= i + right
    return visible


def packed_reference(q, k, v, dout, bounds, causal, window, dtype=torch.float64, softcap=None):
    """out, lse, dq, dk, dv on full (1, H, S, D) tensors, computed per document in `dtype`
    (scores capped to c * tanh(s / c) when `softcap = c`).

    float64 is the reference; the inputs' own low-precision dtype gives the yardstick for the
    ratio gates (a single-device implementation in that dtype: explicit-mask matmul attention).
    """
    groups = q.shape[1] // k.shape[1]
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    outs, lses = [], []
    for start, stop in itertools.pairwise(bounds):
        if stop == start:
            continue
        rows = slice(start, stop)
        qd = leaves[0][:, :, rows]
        kd = leaves[1][:, :, rows].repeat_interleave(groups, 1)
        vd = leaves[2][:, :, rows].repeat_interleave(groups, 1)
        scores = qd @ kd.transpose(-1, -2)  # in `dtype`; softmax in at least float32
        scores = (scores if dtype == torch.float64 else scores.float()) * q.shape[-1] ** -0.5
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~doc_mask(stop - start, causal, window), float("-inf"))
        lses.append(torch.logsumexp(scores, -1))
        outs.append(torch.softmax(scores, -1).to(dtype) @ vd)
    out, lse = torch.cat(outs, 2), torch.cat(lses, 2)
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    return {
        "out": out.detach(),
        "lse": lse.detach(),
        "dq": grads[0],
        "dk": grads[1],
        "dv": grads[2],
    }


def packed_case(
    rank,
    world_size,
    *,
    bounds,
    layout,
    causal,
    window=None,
    hq=4,
    hkv=2,
    head_dim=16,
    dtype="float64",
    seed=0,
    backend="auto",
    strategy="ring",
    softcap=None,
):
    """Gate this rank's real rows against the reference; padding rows must be exactly zero."""
    dtype = getattr(torch, dtype)
    seq_len = bounds[-1]
    q, k, v, dout = make_inputs(1, hq, hkv, seq_len, head_dim, dtype, seed)
    kw = {"layout": layout, "cu_seqlens": torch.tensor(bounds)}
    local = [ringattn.shard(x, 2, **kw).detach().requires_grad_() for x in (q, k, v)]
    out, lse = ringattn.attention(
        *local,
        causal=causal,
        window=window,
        backend=backend,
        strategy=strategy,
        return_lse=True,
        softcap=softcap,
        **kw,
    )
    out.backward(ringattn.shard(dout, 2, **kw))
    got = {
        "out": out.detach(),
        "lse": lse,
        "dq": local[0].grad,
        "dk": local[1].grad,
        "dv": local[2].grad,
    }
    ref = packed_reference(q, k, v, dout, bounds, causal, window, softcap=softcap)
    base = None
    if dtype in (torch.bfloat16, torch.float16):
        base = packed_reference(q, k, v, dout, bounds, causal, window, dtype, softcap)
    index = ringattn.positions(seq_len, **kw)
    real = index >= 0
    rows = {}
    for name in QUANTITIES:
        value = got[name]
        assert bool(torch.isfinite(value).all()), f"{name} has NaN/Inf"
        if not bool(real.all()):  # padding rows: exactly zero, gradients included
            assert bool((value[:, :, ~real] == 0).all()), f"{name} is not zero on padding rows"
        expected = ref[name][:, :, index[real]]
        actual = value[:, :, real]
        errors = compare(actual, expected)
        if base is None:
            passed, ratio = allclose_gate(actual, expected, *tolerance(dtype, name))
        else:
            passed, ratio = relative_gate(errors, compare(base[name][:, :, index[real]], expected))
        rows[name] = (passed, errors.max, errors.mean, ratio)
    full = ringattn.unshard(got["out"], 2, **kw)
    assert full.shape[2] == seq_len
    errors = compare(full, ref["out"])
    if base is None:
        passed, ratio = allclose_gate(full, ref["out"], *tolerance(dtype, "out"))
    else:
        passed, ratio = relative_gate(errors, compare(base["out"], ref["out"]))
    rows["unshard"] = (passed, errors.max, errors.mean, ratio)
    return rows


def packed_transfers(rank, world_size, *, bounds, layout, causal, window):
    """Ring messages in one forward (after the one-time agreement check)."""
    q, k, v, _ = make_inputs(1, 2, 1, bounds[-1], 8, torch.float32, 0)
    kw = {"layout": layout, "cu_seqlens": torch.tensor(bounds)}
    local = [ringattn.shard(x, 2, **kw) for x in (q, k, v)]
    ringattn.attention(*local, causal=causal, window=window, **kw)
    calls = []
    original = dist.batch_isend_irecv

    def counting(ops):
        calls.append(len(ops))
        return original(ops)

    dist.batch_isend_irecv = counting
    try:
        ringattn.attention(*local, causal=causal, window=window, **kw)
    finally:
        dist.batch_isend_irecv = original
    return len(calls)


def packed_determinism(rank, world_size, *, bounds, layout):
    q, k, v, dout = make_inputs(1, 4, 2, bounds[-1], 16, torch.bfloat16, 4)
    kw = {"layout": layout, "cu_seqlens": bounds}
    results = []
    for _ in range(2):
        local = [ringattn.shard(x, 2, **kw).detach().requires_grad_() for x in (q, k, v)]
        out = ringattn.attention(*local, causal=True, window=(7, 0), **kw)
        out.backward(ringattn.shard(dout, 2, **kw))
        results.append([out.detach(), *(x.grad for x in local)])
    return all(torch.equal(a, b) for a, b in zip(*results))
