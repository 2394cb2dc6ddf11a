"""Rank functions for the all-gather, Ulysses and hybrid strategies and their collectives.

Like workers.py (whose input and gate helpers these reuse): each builds the full tensors from a
seed, shards them, runs ringattn and compares this rank's part with the float64 reference. Hybrid
cases build a 2-D DeviceMesh over the pool's world; meshes are cached per shape, because each one
creates process groups that live as long as the worker.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import ringattn
from ringattn.comm import all_to_all, reduce_scatter, resolve_group
from ringattn.testing.yardstick import (
    allclose_gate,
    compare,
    reference_attention,
    relative_gate,
    sdpa_attention,
    tolerance,
)
from workers import QUANTITIES, make_inputs
from workers_packed import packed_reference

_MESHES: dict[tuple, object] = {}


def mesh(shape: tuple[int, int], names: tuple[str, str] = ("ulysses", "ring")):
    """A cached 2-D DeviceMesh over the whole world (every rank must ask for the same one)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (tuple(shape), tuple(names))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
    return _MESHES[key]


def _group(mesh_shape, names):
    return None if mesh_shape is None else mesh(mesh_shape, names)


def strategy_case(
    rank,
    world_size,
    *,
    strategy,
    layout,
    causal,
    hq,
    hkv,
    head_dim,
    dtype,
    mesh_shape=None,
    names=("ulysses", "ring"),
    backend="auto",
    local_len=8,
    batch=2,
    seed=0,
    softcap=None,
):
    """workers.attention_case with a `group` (a 2-D mesh for hybrid): gate every quantity."""
    dtype = getattr(torch, dtype)
    group = _group(mesh_shape, names)
    kw = {"group": group, "layout": layout}
    q, k, v, dout = make_inputs(batch, hq, hkv, local_len * world_size, head_dim, dtype, seed)
    leaves = [ringattn.shard(x, 2, **kw).detach().requires_grad_() for x in (q, k, v)]
    out, lse = ringattn.attention(
        *leaves,
        causal=causal,
        strategy=strategy,
        backend=backend,
        return_lse=True,
        softcap=softcap,
        **kw,
    )
    out.backward(ringattn.shard(dout, 2, **kw))
    got = {
        "out": out.detach(),
        "lse": lse,
        "dq": leaves[0].grad,
        "dk": leaves[1].grad,
        "dv": leaves[2].grad,
    }
    ref = reference_attention(q, k, v, dout, causal=causal, softcap=softcap)
    low = dtype in (torch.bfloat16, torch.float16)
    base = sdpa_attention(q, k, v, dout, causal=causal, with_lse=True) if low else None
    checks = [
        (
            name,
            got[name],
            ringattn.shard(getattr(ref, name), 2, **kw),
            base and ringattn.shard(getattr(base, name), 2, **kw),
        )
        for name in QUANTITIES
    ]
    checks.append(("unshard", ringattn.unshard(got["out"], 2, **kw), ref.out, base and base.out))
    rows = {}
    for name, actual, expected, baseline in checks:
        assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
        lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        assert actual.dtype == (lse_dtype if name == "lse" else dtype), (name, actual.dtype)
        errors = compare(actual, expected)
        if baseline is None:
            atol, rtol = tolerance(dtype, "out" if name == "unshard" else name)
            passed, ratio = allclose_gate(actual, expected, atol, rtol)
        else:
            passed, ratio = relative_gate(errors, compare(baseline, expected))
        rows[name] = (passed, errors.max, errors.mean, ratio)
    return rows


# ---- counting collectives -----------------------------------------------------------------------

_COLLECTIVES = (
    "batch_isend_irecv",
    "all_to_all_single",
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_gather",
    "all_reduce",
    "broadcast",
)


def _sent_bytes(name, args, kwargs):
    """Bytes this rank puts on the wire in one call (its own all-to-all part excluded)."""
    if name == "batch_isend_irecv":
        return sum(
            op.tensor.numel() * op.tensor.element_size()
            for op in args[0]
            if op.op.__name__ == "isend"
        )
    if name == "all_to_all_single":
        send, splits = args[1], args[3]
        own = splits[dist.get_rank(kwargs["group"])]
        return send.numel() * send.element_size() - own
    tensor = args[1] if len(args) > 1 else args[0]
    return tensor.numel() * tensor.element_size()


def count_collectives(
    rank,
    world_size,
    *,
    strategy,
    layout,
    causal,
    hq=4,
    hkv=2,
    head_dim=16,
    local_len=4,
    dtype="float32",
    mesh_shape=None,
    names=("ulysses", "ring"),
    bounds=None,
    window=None,
):
    """(forward calls, backward calls) after the agreement check: lists of (name, bytes sent)."""
    dtype = getattr(torch, dtype)
    kw = {"group": _group(mesh_shape, names), "layout": layout, "cu_seqlens": bounds}
    seq_len = local_len * world_size if bounds is None else bounds[-1]
    q, k, v, dout = make_inputs(1, hq, hkv, seq_len, head_dim, dtype, 0)
    local = [ringattn.shard(x, 2, **kw).requires_grad_() for x in (q, k, v)]
    dout = ringattn.shard(dout, 2, **kw)
    kw["window"] = window
    ringattn.attention(*local, causal=causal, strategy=strategy, **kw)  # agreement, once
    calls: list = []
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls.append((name, _sent_bytes(name, args, kwargs)))
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, counting(name, fn))
    try:
        out = ringattn.attention(*local, causal=causal, strategy=strategy, **kw)
        forward_calls = list(calls)
        calls.clear()
        out.backward(dout)
        backward_calls = list(calls)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return forward_calls, backward_calls


def packed_mesh_case(
    rank,
    world_size,
    *,
    mesh_shape,
    bounds,
    layout,
    causal,
    window=None,
    hq=4,
    hkv=2,
    head_dim=16,
    strategy="hybrid",
    softcap=None,
):
    """workers_packed.packed_case on a 2-D mesh: real rows exact (float64), padding rows zero."""
    group = mesh(mesh_shape)
    q, k, v, dout = make_inputs(1, hq, hkv, bounds[-1], head_dim, torch.float64, 0)
    kw = {"group": group, "layout": layout, "cu_seqlens": list(bounds)}
    local = [ringattn.shard(x, 2, **kw).detach().requires_grad_() for x in (q, k, v)]
    out, lse = ringattn.attention(
        *local,
        causal=causal,
        window=window,
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
    index = ringattn.positions(bounds[-1], **kw)
    real = index >= 0
    rows = {}
    for name in QUANTITIES:
        assert bool((got[name][:, :, ~real] == 0).all()), f"{name} is not zero on padding rows"
        expected = ref[name][:, :, index[real]]
        passed, ratio = allclose_gate(got[name][:, :, real], expected, 1e-9, 1e-9)
        errors = compare(got[name][:, :, real], expected)
        rows[name] = (passed, errors.max, errors.mean, ratio)
    full = ringattn.unshard(got["out"], 2, **kw)
    passed, ratio = allclose_gate(full, ref["out"], 1e-9, 1e-9)
    rows["unshard"] = (passed, compare(full, ref["out"]).max, 0.0, ratio)
    return rows


# ---- memory, stale state, determinism -----------------------------------------------------------


def saved_bytes(rank, world_size, *, strategy, hq, hkv, dtype, mesh_shape=None):
    """Bytes autograd keeps for backward, against the bytes of local q, k, v, out and lse."""
    dtype = getattr(torch, dtype)
    kw = {"group": _group(mesh_shape, ("ulysses", "ring")), "layout": "zigzag"}
    q, k, v, _ = make_inputs(1, hq, hkv, 8 * world_size, 32, dtype, 0)
    local = [ringattn.shard(x, 2, **kw).requires_grad_() for x in (q, k, v)]
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, lse = ringattn.attention(*local, causal=True, strategy=strategy, return_lse=True, **kw)
    budget = sum(x.numel() * x.element_size() for x in (*local, out, lse))
    return sum(saved), budget


def stale_state(rank, world_size, *, strategy, hq=4, hkv=2, mesh_shape=None):
    """Two forwards, then backward through the first: gradients must be the first call's."""
    kw = {"group": _group(mesh_shape, ("ulysses", "ring")), "layout": "zigzag"}
    first = make_inputs(1, hq, hkv, 4 * world_size, 16, torch.float64, 1)
    second = make_inputs(1, hq, hkv, 4 * world_size, 16, torch.float64, 2)
    leaves = [ringattn.shard(x, 2, **kw).requires_grad_() for x in first[:3]]
    out1 = ringattn.attention(*leaves, causal=True, strategy=strategy, **kw)
    others = [ringattn.shard(x, 2, **kw).requires_grad_() for x in second[:3]]
    out2 = ringattn.attention(*others, causal=True, strategy=strategy, **kw)
    out1.backward(ringattn.shard(first[3], 2, **kw))
    ref = reference_attention(*first, causal=True)
    errors = [
        compare(leaf.grad, ringattn.shard(expected, 2, **kw)).max
        for leaf, expected in zip(leaves, (ref.dq, ref.dk, ref.dv))
    ]
    assert all(other.grad is None for other in others)
    del out2
    return max(errors)


def determinism(rank, world_size, *, strategy, dtype, hq=4, hkv=2, mesh_shape=None):
    """Two identical runs give bitwise identical out and grads."""
    dtype = getattr(torch, dtype)
    kw = {"group": _group(mesh_shape, ("ulysses", "ring")), "layout": "striped"}
    q, k, v, dout = make_inputs(2, hq, hkv, 8 * world_size, 24, dtype, 3)

    def run():
        leaves = [ringattn.shard(x, 2, **kw).requires_grad_() for x in (q, k, v)]
        out = ringattn.attention(*leaves, causal=True, strategy=strategy, **kw)
        out.backward(ringattn.shard(dout, 2, **kw))
        return [out.detach(), *(leaf.grad for leaf in leaves)]

    return all(torch.equal(a, b) for a, b in zip(run(), run()))


# ---- comm building blocks -----------------------------------------------------------------------


def reduce_scatter_case(rank, world_size, *, native, shape=(2, 3, 5)):
    """comm.reduce_scatter against all_reduce + slice, bitwise where the order is fixed."""
    info = resolve_group(None)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn((world_size, *shape), generator=gen)
    total = x.clone()
    dist.all_reduce(total)
    got = reduce_scatter(x, info, native=native)
    assert torch.equal(x, x.clone()), "input modified"
    return compare(got, total[rank]).max


def all_to_all_case(rank, world_size):
    """Mixed dtypes and shapes by destination, odd byte counts included."""
    info = resolve_group(None)

    def piece(src, dst, kind):
        seed = 1000 * src + 10 * dst + kind
        gen = torch.Generator().manual_seed(seed)
        if kind == 0:  # bfloat16, odd byte count, size depends on the pair
            return torch.randn(1, src + 1, dst + 1, 3, generator=gen).to(torch.bfloat16)
        if kind == 1:  # float32
            return torch.randn(2, dst + 2, generator=gen)
        return torch.randint(0, 100, (src + dst,), generator=gen)  # int64, sometimes empty

    sends = [[piece(rank, d, kind) for kind in range(3)] for d in range(world_size)]
    specs = [
        [(tuple(piece(s, rank, kind).shape), piece(s, rank, kind).dtype) for kind in range(3)]
        for s in range(world_size)
    ]
    received = all_to_all(sends, specs, info)
    return all(
        torch.equal(received[s][kind], piece(s, rank, kind))
        for s in range(world_size)
        for kind in range(3)
    )


def mesh_sharding(rank, world_size, *, mesh_shape, names, layout, seq_len):
    """shard/positions/unshard with a 2-D mesh: (positions, flattened rank, round trip ok)."""
    group = mesh(mesh_shape, names)
    info = resolve_group(group, allow_2d=True)
    x = torch.arange(seq_len, dtype=torch.float64).reshape(1, 1, seq_len, 1).expand(2, 3, -1, 4)
    local = ringattn.shard(x, 2, group=group, layout=layout)
    pos = ringattn.positions(seq_len, group=group, layout=layout)
    flat = ringattn.positions(seq_len, layout=layout)  # the 1-D world: rank order
    assert torch.equal(local[0, 0, :, 0].long(), pos), "shard and positions disagree"
    full = ringattn.unshard(local, 2, group=group, layout=layout)
    coords = group.get_coordinate()
    u, g = (coords[names.index("ulysses")], coords[names.index("ring")])
    return pos, flat, info.rank, (u, g), torch.equal(full, x)


# ---- bad input ----------------------------------------------------------------------------------


def call_with_mesh(
    rank,
    world_size,
    *,
    mesh_shape,
    names=("ulysses", "ring"),
    hq=4,
    hkv=2,
    strategy="hybrid",
    use_mesh=True,
    seq_local=4,
):
    """attention with a 2-D mesh (or the default group); error tests expect every rank to raise."""
    group = mesh(mesh_shape, names) if use_mesh else None
    q = torch.randn(1, hq, seq_local, 8)
    k, v = torch.randn(1, hkv, seq_local, 8), torch.randn(1, hkv, seq_local, 8)
    return ringattn.attention(q, k, v, group=group, strategy=strategy, causal=True)


def shard_with_mesh(rank, world_size, *, mesh_shape, names):
    return ringattn.shard(torch.randn(1, 2, 8 * world_size, 4), 2, group=mesh(mesh_shape, names))
