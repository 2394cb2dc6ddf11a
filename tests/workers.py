"""Functions that run on every rank of a WorkerPool (see harness.py): fn(rank, world_size, ...).

Each builds the full tensors from a seed (the same on every rank), shards them, runs ringattn, and
compares this rank's part with the independent float64 reference on the full tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import ringattn
from ringattn.testing.yardstick import (
    allclose_gate,
    compare,
    reference_attention,
    relative_gate,
    sdpa_attention,
    tolerance,
)

QUANTITIES = ("out", "lse", "dq", "dk", "dv")


def make_inputs(batch, hq, hkv, seq_len, head_dim, dtype, seed):
    """q, k, v, dout from randn in float64, rounded once to `dtype` (the problem both sides see)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [
        (batch, hq, seq_len, head_dim),
        (batch, hkv, seq_len, head_dim),
        (batch, hkv, seq_len, head_dim),
        (batch, hq, seq_len, head_dim),
    ]
    return [torch.randn(shape, dtype=torch.float64, generator=gen).to(dtype) for shape in shapes]


def _non_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Same values, stored as (B, S, H, D) and viewed as (B, H, S, D)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def run_attention(
    q,
    k,
    v,
    dout,
    *,
    layout,
    causal,
    strategy="ring",
    backend="auto",
    non_contiguous=False,
    scale=None,
):
    """Shard, run fwd + bwd, return this rank's out, lse, dq, dk, dv."""
    local = [ringattn.shard(x, 2, layout=layout) for x in (q, k, v)]
    if non_contiguous:
        local = [_non_contiguous(x) for x in local]
    leaves = [x.detach().requires_grad_() for x in local]
    out, lse = ringattn.attention(
        *leaves,
        causal=causal,
        layout=layout,
        strategy=strategy,
        backend=backend,
        scale=scale,
        return_lse=True,
    )
    out.backward(ringattn.shard(dout, 2, layout=layout))
    return {
        "out": out.detach(),
        "lse": lse,
        "dq": leaves[0].grad,
        "dk": leaves[1].grad,
        "dv": leaves[2].grad,
    }


def attention_case(
    rank,
    world_size,
    *,
    layout,
    causal,
    hq,
    hkv,
    head_dim,
    dtype,
    backend="auto",
    local_len=8,
    batch=2,
    seed=0,
    non_contiguous=False,
    strategy="ring",
    scale=None,
):
    """Gate every quantity of this rank against the fp64 reference. Returns rows for a table."""
    dtype = getattr(torch, dtype)
    q, k, v, dout = make_inputs(batch, hq, hkv, local_len * world_size, head_dim, dtype, seed)
    got = run_attention(
        q,
        k,
        v,
        dout,
        layout=layout,
        causal=causal,
        strategy=strategy,
        backend=backend,
        non_contiguous=non_contiguous,
        scale=scale,
    )
    ref = reference_attention(q, k, v, dout, causal=causal, scale=scale)
    baseline = None
    if dtype in (torch.bfloat16, torch.float16):
        baseline = sdpa_attention(q, k, v, dout, causal=causal, scale=scale, with_lse=True)
    rows = {}
    full_out = ringattn.unshard(got["out"], 2, layout=layout)  # the contract: equals 1-device
    checks = [
        (
            name,
            got[name],
            ringattn.shard(getattr(ref, name), 2, layout=layout),
            baseline and ringattn.shard(getattr(baseline, name), 2, layout=layout),
        )
        for name in QUANTITIES
    ]
    checks.append(("unshard", full_out, ref.out, baseline and baseline.out))
    for name, actual, expected, base in checks:
        assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
        lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        assert actual.dtype == (lse_dtype if name == "lse" else dtype), (name, actual.dtype)
        errors = compare(actual, expected)
        if base is None:
            gate_name = "out" if name == "unshard" else name
            passed, ratio = allclose_gate(actual, expected, *tolerance(dtype, gate_name))
        else:
            passed, ratio = relative_gate(errors, compare(base, expected))
        rows[name] = (passed, errors.max, errors.mean, ratio)
    return rows


def count_transfers(rank, world_size, *, layout, causal):
    """Patch the transport entry point and count ring messages in one forward and one backward."""
    calls = []
    original = dist.batch_isend_irecv

    def counting(ops):
        calls.append([(op.op.__name__, op.tensor.dtype, tuple(op.tensor.shape)) for op in ops])
        return original(ops)

    q, k, v, dout = make_inputs(1, 4, 2, 4 * world_size, 16, torch.float32, 0)
    local = [ringattn.shard(x, 2, layout=layout).requires_grad_() for x in (q, k, v)]
    ringattn.attention(*local, causal=causal, layout=layout)  # agreement check, once
    dist.batch_isend_irecv = counting
    try:
        out = ringattn.attention(*local, causal=causal, layout=layout)
        forward_calls = list(calls)
        calls.clear()
        out.backward(ringattn.shard(dout, 2, layout=layout))
        backward_calls = list(calls)
    finally:
        dist.batch_isend_irecv = original
    return forward_calls, backward_calls


def saved_bytes(rank, world_size, *, layout, dtype):
    """Bytes autograd keeps for backward, against the bytes of local q, k, v, out and lse."""
    dtype = getattr(torch, dtype)
    q, k, v, _ = make_inputs(1, 8, 2, 16 * world_size, 32, dtype, 0)
    local = [ringattn.shard(x, 2, layout=layout).requires_grad_() for x in (q, k, v)]
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, lse = ringattn.attention(*local, causal=True, layout=layout, return_lse=True)
    budget = sum(x.numel() * x.element_size() for x in (*local, out, lse))
    return sum(saved), budget


def stale_state(rank, world_size, *, layout):
    """Two forwards, then backward through the first: gradients must be the first call's."""
    layout_kw = {"layout": layout, "causal": True}
    first = make_inputs(1, 4, 2, 4 * world_size, 16, torch.float64, 1)
    second = make_inputs(1, 4, 2, 4 * world_size, 16, torch.float64, 2)
    leaves = [ringattn.shard(x, 2, layout=layout).requires_grad_() for x in first[:3]]
    out1 = ringattn.attention(*leaves, **layout_kw)
    others = [ringattn.shard(x, 2, layout=layout).requires_grad_() for x in second[:3]]
    out2 = ringattn.attention(*others, **layout_kw)
    out1.backward(ringattn.shard(first[3], 2, layout=layout))
    ref = reference_attention(*first, causal=True)
    errors = [
        compare(leaf.grad, ringattn.shard(expected, 2, layout=layout)).max
        for leaf, expected in zip(leaves, (ref.dq, ref.dk, ref.dv))
    ]
    assert all(other.grad is None for other in others)
    del out2
    return max(errors)


def determinism(rank, world_size, *, layout, dtype):
    """Two identical runs give bitwise identical out and grads."""
    dtype = getattr(torch, dtype)
    q, k, v, dout = make_inputs(2, 4, 2, 8 * world_size, 24, dtype, 3)
    first = run_attention(q, k, v, dout, layout=layout, causal=True)
    second = run_attention(q, k, v, dout, layout=layout, causal=True)
    return all(torch.equal(first[name], second[name]) for name in QUANTITIES)


def call_attention(
    rank,
    world_size,
    *,
    per_rank=None,
    shapes=((1, 4, 8, 16),) * 3,
    dtypes=("float32",) * 3,
    **kwargs,
):
    """Call attention with the given shapes/dtypes; `per_rank` overrides kwargs on some ranks.

    Used by error tests: every rank is expected to raise, before any communication.
    """
    if per_rank and rank in per_rank:
        overrides = dict(per_rank[rank])
        shapes = overrides.pop("shapes", shapes)
        dtypes = overrides.pop("dtypes", dtypes)
        kwargs = {**kwargs, **overrides}
    tensors = [torch.randn(shape).to(getattr(torch, dt)) for shape, dt in zip(shapes, dtypes)]
    return ringattn.attention(*tensors, **kwargs)


def call_shard(rank, world_size, *, seq_len, layout, per_rank_len=None):
    """shard / unshard with a given global length (and optionally a different local one)."""
    if per_rank_len is not None:
        return ringattn.unshard(torch.randn(1, 2, per_rank_len[rank], 4), 2, layout=layout)
    return ringattn.shard(torch.randn(1, 2, seq_len, 4), 2, layout=layout)


def after_error_still_works(rank, world_size):
    """A clean call after an error call: the group is not poisoned."""
    q, k, v, dout = make_inputs(1, 2, 2, 4 * world_size, 8, torch.float64, 5)
    got = run_attention(q, k, v, dout, layout="zigzag", causal=True)
    ref = reference_attention(q, k, v, dout, causal=True)
    return compare(got["out"], ringattn.shard(ref.out, 2, layout="zigzag")).max


def call_unshard_one_rank_wrong(rank, world_size):
    """unshard where only the last rank passes a bad dim."""
    dim = 7 if rank == world_size - 1 else 2
    return ringattn.unshard(torch.randn(1, 2, 4, 4), dim, layout="zigzag")


def call_with_probe_failing_on(rank, world_size, *, bad_rank):
    """`auto` on `bad_rank` sees cpu_flash fail its probe (and picks the reference kernel)."""
    from ringattn.kernels import probe

    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    key = ("cpu_flash", str(q.device), q.dtype, q.shape[-1], False)
    saved = dict(probe._VERDICTS)
    if rank == bad_rank:
        probe._VERDICTS[key] = False
    try:
        return ringattn.attention(q, k, v, causal=True)
    finally:
        probe._VERDICTS.clear()
        probe._VERDICTS.update(saved)
