"""`context_parallel`: PyTorch's experimental context manager, built on ringattn.

    with context_parallel(mesh, buffers=(q, k, v), buffer_seq_dims=(2, 2, 2)):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # ringattn.attention
    out.float().square().mean().backward()                            # after the block: fine

It mirrors `torch.distributed.tensor.experimental.context_parallel(mesh, *, buffers,
buffer_seq_dims, no_restore_buffers)` and works where that one does not on torch 2.13: leaf
buffers with requires_grad=True, CPU with gloo, backward after the block, GQA via `enable_gqa`.

Inside the block:

- Each buffer holds this rank's shard along its sequence dim (`ringattn.shard` with the given
  layout: zigzag by default, PyTorch's head-tail balancing). `buffer.shape` is the shard's.
- `F.scaled_dot_product_attention` is `ringattn.attention` on the (sharded) arguments, through a
  TorchFunctionMode active only inside the block (no global is patched): is_causal -> causal,
  scale -> scale, enable_gqa -> K/V with fewer heads. attn_mask and dropout_p > 0 raise.

How a buffer is sharded. `buffer.data` is swapped for the shard under no_grad (PyTorch resizes the
storage in place, which autograd forbids for tensors that require grad). A buffer that requires
grad and is restored on exit gets a stand-in: `shard(buffer)`, a differentiable index_select
taken before the swap, used in its place by every torch function called inside the block (the
mode substitutes it). Its gradient therefore flows into the *full-size* buffer, whose autograd
metadata never changed, so backward after the block, after the buffer is whole again, is ordinary
autograd, and gradient accumulation over several blocks works.

After the block:

- Restored buffers (the default) hold their original full data again (the same tensor object the
  buffer held before; writes made inside the block went to the shard and are dropped).
  `buffer.grad`, after backward, is full-size: the rows this rank held hold this rank's gradient,
  d(sum of every rank's loss)/d(those rows); every other row is zero. A sum over the mesh
  (all_reduce) gives the full gradient of the sum of the per-rank losses, which is what a single
  device computes for that sum.
- Buffers in `no_restore_buffers` keep the shard; one that requires grad is used directly inside
  the block, so its `.grad` is shard-sized, like the buffer.
- The outputs of attention inside the block are shards (this rank's rows, in layout order):
  `ringattn.unshard(out, dim, group=mesh, layout=layout)` gives the full tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ringattn.api import attention
from ringattn.sharding import shard

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {
    "attn_mask": None,
    "dropout_p": 0.0,
    "is_causal": False,
    "scale": None,
    "enable_gqa": False,
}
# getters/setters that must reach the buffer itself, never its stand-in
_OWN_ATTRIBUTES = tuple(getattr(torch.Tensor, name) for name in ("grad", "data", "requires_grad"))


def _sdpa_to_ringattn(args: tuple, kwargs: dict, options: dict) -> torch.Tensor:
    """F.scaled_dot_product_attention's arguments -> ringattn.attention."""
    if len(args) > len(_SDPA_ARGS):
        raise TypeError(f"scaled_dot_product_attention takes at most {len(_SDPA_ARGS)} arguments")
    bound = {**_SDPA_DEFAULTS, **dict(zip(_SDPA_ARGS, args)), **kwargs}
    unknown = set(bound) - set(_SDPA_ARGS)
    if unknown:
        raise TypeError(f"unexpected arguments to scaled_dot_product_attention: {sorted(unknown)}")
    if bound["attn_mask"] is not None:
        raise NotImplementedError(
            "scaled_dot_product_attention with attn_mask inside ringattn.context_parallel: an "
            "arbitrary mask is not sharded with the sequence; use is_causal=True, or call "
            "ringattn.attention with cu_seqlens (packed documents) or window (sliding window)"
        )
    if bound["dropout_p"] != 0:
        raise NotImplementedError(
            f"scaled_dot_product_attention with dropout_p={bound['dropout_p']} inside "
            f"ringattn.context_parallel: attention dropout is not supported; pass dropout_p=0.0"
        )
    q, k, v = bound["query"], bound["key"], bound["value"]
    heads = [x.shape[1] if isinstance(x, torch.Tensor) and x.dim() == 4 else None for x in (q, k)]
    if not bound["enable_gqa"] and None not in heads and heads[0] != heads[1]:
        raise ValueError(
            f"query has {heads[0]} heads and key {heads[1]}: pass enable_gqa=True (as "
            f"scaled_dot_product_attention requires) to share K/V heads"
        )
    return attention(q, k, v, causal=bool(bound["is_causal"]), scale=bound["scale"], **options)


class _ContextParallelMode(TorchFunctionMode):
    """SDPA -> ringattn.attention; buffers that have a stand-in are replaced by it everywhere."""

    def __init__(self, options: dict, stand_ins: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        super().__init__()
        self.options, self.stand_ins = options, stand_ins

    def _swap(self, x: object) -> object:
        if isinstance(x, torch.Tensor):
            entry = self.stand_ins.get(id(x))
            return entry[1] if entry is not None and entry[0] is x else x
        if isinstance(x, (list, tuple)):
            return type(x)(self._swap(y) for y in x)
        if isinstance(x, dict):
            return {key: self._swap(y) for key, y in x.items()}
        return x

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.stand_ins and getattr(func, "__self__", None) not in _OWN_ATTRIBUTES:
            args, kwargs = self._swap(args), self._swap(kwargs)
        if func is F.scaled_dot_product_attention:
            return _sdpa_to_ringattn(args, kwargs, self.options)
        return func(*args, **kwargs)


def _check_buffers(buffers, buffer_seq_dims, no_restore_buffers) -> None:
    if len(buffers) != len(buffer_seq_dims):
        raise ValueError(
            f"got {len(buffers)} buffers but {len(buffer_seq_dims)} buffer_seq_dims; give one "
            f"sequence dim per buffer"
        )
    for i, (buffer, dim) in enumerate(zip(buffers, buffer_seq_dims)):
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"buffers[{i}] must be a torch.Tensor, got {type(buffer).__name__}")
        if not isinstance(dim, int) or not -buffer.dim() <= dim < buffer.dim():
            raise ValueError(
                f"buffer_seq_dims[{i}] = {dim!r} is out of range for buffers[{i}] of shape "
                f"{tuple(buffer.shape)}"
            )
        if any(other is buffer for other in buffers[:i]):
            raise ValueError(f"buffers[{i}] is the same tensor as an earlier buffer; list it once")
    for buffer in no_restore_buffers:
        if not any(buffer is b for b in buffers):
            raise ValueError("no_restore_buffers must be a subset of buffers (by identity)")


@contextlib.contextmanager
def context_parallel(
    mesh: object,
    buffers: Sequence[torch.Tensor] | None = None,
    buffer_seq_dims: Sequence[int] | None = None,
    no_restore_buffers: set[torch.Tensor] | None = None,
    *,
    layout: str = "zigzag",
    strategy: str = "ring",
    backend: str = "auto",
) -> Iterator[None]:
    """Shard `buffers` along `buffer_seq_dims` over `mesh` and make SDPA context-parallel inside.

    `mesh` is a 1-D DeviceMesh or ProcessGroup (a 2-D "ulysses" x "ring" mesh with
    strategy="hybrid"); `layout`, `strategy` and `backend` are ringattn.attention's. See the
    module docstring for what each buffer and its .grad hold during and after the block.
    """
    buffers = list(buffers or ())
    buffer_seq_dims = list(buffer_seq_dims or ())
    no_restore = list(no_restore_buffers or ())
    _check_buffers(buffers, buffer_seq_dims, no_restore)
    options = {"group": mesh, "layout": layout, "strategy": strategy, "backend": backend}
    shard_kw = {"group": mesh, "layout": layout}
    # every shard is computed (and every error raised) before any buffer changes
    restore = [not any(buffer is b for b in no_restore) for buffer in buffers]
    shards = []
    for buffer, dim, keep in zip(buffers, buffer_seq_dims, restore):
        if keep and buffer.requires_grad:
            shards.append(shard(buffer, dim, **shard_kw))  # the differentiable stand-in
        else:
            with torch.no_grad():
                shards.append(shard(buffer, dim, **shard_kw))
    originals = [buffer.data for buffer in buffers]
    stand_ins = {
        id(buffer): (buffer, piece)
        for buffer, piece, keep in zip(buffers, shards, restore)
        if keep and buffer.requires_grad
    }
    with torch.no_grad():
        for buffer, piece in zip(buffers, shards):
            buffer.data = piece.detach()  # shares storage with the stand-in
    try:
        with _ContextParallelMode(options, stand_ins):
            yield
    finally:
        with torch.no_grad():
            for buffer, original, keep in zip(buffers, originals, restore):
                if keep:
                    buffer.data = original
