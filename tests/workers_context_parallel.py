"""Rank functions for ringattn.context_parallel (see harness.py for the conventions).

Every rank builds the same full q, k, v (seeded), enters the context manager with them as
buffers, calls F.scaled_dot_product_attention inside, and takes its own loss on its output after
the block: loss_r = mean(out_r ** 2). The reference is float64 attention on the full tensors with
L = sum over ranks of loss_r, so each rank's gradient rows must equal dL/d(those rows).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ringattn
from ringattn.testing.yardstick import compare
from workers import make_inputs
from workers_strategies import mesh

_MESHES_1D: dict[int, object] = {}


def _mesh_1d(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    if world_size not in _MESHES_1D:
        _MESHES_1D[world_size] = init_device_mesh("cpu", (world_size,))
    return _MESHES_1D[world_size]


def _reference(q, k, v, causal, index_by_rank):
    """float64 out and grads of L = sum_r mean(out[rows of rank r] ** 2)."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    groups = leaves[0].shape[1] // leaves[1].shape[1]
    keys, values = (x.repeat_interleave(groups, dim=1) for x in leaves[1:])
    scores = leaves[0] @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        scores = scores.masked_fill(~visible, -math.inf)
    out = torch.softmax(scores, dim=-1) @ values
    loss = sum(out.index_select(2, index).square().mean() for index in index_by_rank)
    return out.detach(), torch.autograd.grad(loss, leaves)


def cp_case(
    rank,
    world_size,
    *,
    strategy="ring",
    layout="zigzag",
    causal=True,
    hq=4,
    hkv=4,
    local_len=8,
    mesh_shape=None,
    no_restore=(),
    repeats=1,
):
    """Run the founding example's pattern; return errors and the facts the test asserts."""
    group = _mesh_1d(world_size) if mesh_shape is None else mesh(mesh_shape)
    seq_len = local_len * world_size
    q, k, v, _ = make_inputs(1, hq, hkv, seq_len, 16, torch.float64, 7)
    qkv = [x.clone().requires_grad_() for x in (q, k, v)]
    labels = torch.arange(seq_len)  # a buffer without grad, sharded along dim 0
    storage = [x.data_ptr() for x in qkv]
    restored = [i not in no_restore for i in range(3)]
    kept = {qkv[i] for i in no_restore}
    inside = {}
    for _ in range(repeats):
        with ringattn.context_parallel(
            group,
            buffers=(*qkv, labels),
            buffer_seq_dims=(2, 2, 2, 0),
            no_restore_buffers=kept,
            layout=layout,
            strategy=strategy,
        ):
            inside["shapes"] = [tuple(x.shape) for x in (*qkv, labels)]
            inside["labels"] = labels.clone()
            scaled = qkv[0] * 1.0  # an op on a buffer: must reach the buffer's gradient too
            out = F.scaled_dot_product_attention(
                scaled, qkv[1], qkv[2], is_causal=causal, enable_gqa=hq != hkv
            )
        out.square().mean().backward()
    mine = ringattn.positions(seq_len, group=group, layout=layout)  # this rank's rows
    parts = [torch.empty_like(mine) for _ in range(world_size)]  # every rank's, for the loss
    dist.all_gather(parts, mine)
    ref_out, ref_grads = _reference(q, k, v, causal, parts)
    result = {
        "inside_shapes": inside["shapes"],
        "labels_inside_ok": torch.equal(inside["labels"], mine),
        "labels_restored": torch.equal(labels, torch.arange(seq_len)),
        "out_error": compare(out, ref_out.index_select(2, mine)).max,
        "shapes_after": [tuple(x.shape) for x in qkv],
        "same_storage": [x.data_ptr() == p for x, p in zip(qkv, storage)],
        "grad_shapes": [tuple(x.grad.shape) for x in qkv],
    }
    grad_errors, other_rows, summed_errors = [], [], []
    for x, ref, keep in zip(qkv, ref_grads, restored):
        ref = ref * repeats
        if keep:
            grad_errors.append(compare(x.grad.index_select(2, mine), ref.index_select(2, mine)).max)
            others = torch.ones(seq_len, dtype=torch.bool)
            others[mine] = False
            other_rows.append(x.grad[:, :, others].abs().max().item() if others.any() else 0.0)
            total = x.grad.clone()
            dist.all_reduce(total)
            summed_errors.append(compare(total, ref).max)
        else:
            grad_errors.append(compare(x.grad, ref.index_select(2, mine)).max)
    result.update(grad_errors=grad_errors, other_rows=other_rows, summed_errors=summed_errors)
    return result


def cp_error(rank, world_size, *, case):
    """Bad uses: (exception type name, message, buffers restored afterwards)."""
    group = _mesh_1d(world_size)
    q, k, v, _ = make_inputs(1, 4, 2, 4 * world_size, 8, torch.float32, 1)
    qkv = [x.clone().requires_grad_() for x in (q, k, v)]
    kwargs = {"buffers": qkv, "buffer_seq_dims": (2, 2, 2)}
    sdpa = {"is_causal": True, "enable_gqa": True}
    if case == "mask":
        sdpa["attn_mask"] = torch.ones(4 * world_size, 4 * world_size, dtype=torch.bool)
    elif case == "dropout":
        sdpa["dropout_p"] = 0.1
    elif case == "gqa":
        sdpa["enable_gqa"] = False
    elif case == "dims":
        kwargs["buffer_seq_dims"] = (2, 2)
    elif case == "no_restore":
        kwargs["no_restore_buffers"] = {torch.zeros(1)}
    elif case == "seq_dim":
        kwargs["buffer_seq_dims"] = (2, 2, 4)
    try:
        with ringattn.context_parallel(group, **kwargs):
            F.scaled_dot_product_attention(*qkv, **sdpa)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which checks it
        restored = all(tuple(x.shape) == (1, h, 4 * world_size, 8) for x, h in zip(qkv, (4, 2, 2)))
        return type(exc).__name__, str(exc), restored
    return None, "", True


def sdpa_after_exit(rank, world_size):
    """Outside the block F.scaled_dot_product_attention is PyTorch's again."""
    group = _mesh_1d(world_size)
    q, k, v, _ = make_inputs(1, 2, 2, 4 * world_size, 8, torch.float32, 2)
    with ringattn.context_parallel(group, buffers=(q,), buffer_seq_dims=(2,)):
        pass
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return tuple(out.shape)
