"""Attention as two `torch.library` custom ops, so that `torch.compile(fullgraph=True)` traces it.

    torch.ops.ringattn.attention_forward(q, k, v, cu_seqlens, group, layout, strategy, backend,
                                         causal, scale, window, softcap) -> (out, lse)
    torch.ops.ringattn.attention_backward(dout, q, k, v, out, lse, cu_seqlens, <same statics>)
                                                                            -> (dq, dk, dv)

This is PyTorch's own pattern for its context-parallel collectives: the distributed work is one
opaque node that the compiler neither traces nor reorders, described to it by

- a fake (meta) implementation: out has q's shape and dtype, lse is (B, Hq, S_local) in the
  accumulator dtype (float32; float64 for float64), both contiguous, for any symbolic S_local;
- `register_autograd` + `setup_context`: forward saves q, k, v, out, lse (and cu_seqlens); the
  backward op receives them. lse is marked non-differentiable, as in eager.

Everything that is not a tensor is a static argument the graph keeps as a constant: the group as a
string (`group_spec`: "" = the default group, "pg:<group name>", "mesh:<ulysses>,<ring>" for the
hybrid strategy's 2-D mesh; resolved back with `resolve_spec` at run time), the names, `causal`,
`scale`, `window`, `softcap`. Packed documents travel as the `cu_seqlens` tensor itself (on the
CPU, as `shard_batch` makes it): the op reads it when it runs, so no `.item()` is on the traced
path and a new document layout is new data, not a new graph.

Inside the forward op everything the eager path does happens, at run time, with real values:
`resolve.build_call` (the local checks) and `validate.validated` (the ranks' agreement, one
all-gather per new signature, then a set lookup), then the strategy. The backward op rebuilds
the same Call without a second agreement (the forward's covers it). A strategy whose backward
keeps other tensors than the local q, k, v, out, lse (Ulysses and hybrid keep head-sharded ones)
rebuilds them in the backward (`Strategy.saved_from_local`): one all-to-all more than eager.
"""

import torch
import torch.distributed as dist
from torch import Tensor

from ringattn.comm import GroupInfo, MeshInfo, resolve_group
from ringattn.inflight import running, start_call
from ringattn.merge import accumulator_dtype
from ringattn.resolve import build_call
from ringattn.strategies import STRATEGIES
from ringattn.validate import validated

# no `from __future__ import annotations` here: torch.library reads the op schemas from the
# annotations, which must stay real types (torch 2.11 does not evaluate strings)


def group_spec(group: object) -> str:
    """The static string that names `group` for the ops (traceable: no collective, no tensor)."""
    from torch.distributed.device_mesh import DeviceMesh

    if group is None:
        return ""
    if isinstance(group, DeviceMesh):
        if group.ndim == 2 and sorted(group.mesh_dim_names or ()) == ["ring", "ulysses"]:
            ulysses, ring = group.get_group("ulysses"), group.get_group("ring")
            return f"mesh:{ulysses.group_name},{ring.group_name}"
        if group.ndim != 1:
            resolve_group(group, allow_2d=True)  # the eager path's ValueError for a bad mesh
        group = group.get_group()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, "
            f"got {type(group).__name__}"
        )
    return f"pg:{group.group_name}"


def resolve_spec(spec: str) -> GroupInfo:
    """The GroupInfo that `group_spec` named (looked up by group name, as funcol does)."""
    if not spec:
        return resolve_group(None)
    kind, _, names = spec.partition(":")
    lookup = dist.distributed_c10d._resolve_process_group
    if kind == "pg":
        return resolve_group(lookup(names))
    ulysses_name, ring_name = names.split(",")
    ulysses, ring = resolve_group(lookup(ulysses_name)), resolve_group(lookup(ring_name))
    rank = ring.rank * ulysses.world_size + ulysses.rank
    return MeshInfo(ulysses.group, rank, ring.world_size * ulysses.world_size, ulysses, ring)


def _own(outputs: tuple[Tensor, ...], inputs: tuple) -> tuple[Tensor, ...]:
    """The outputs, contiguous (the strides the fake implementation promises), each cloned if
    its storage is that of an input or an earlier output (dk and dv are halves of one buffer):
    a custom op's outputs may alias neither. Storages are compared by address, which holds
    under the dispatch modes that opcheck and the compiler run the op in."""
    seen = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, Tensor)}
    owned = []
    for x in outputs:
        x = x.contiguous()
        if x.untyped_storage().data_ptr() in seen:
            x = x.clone()
        seen.add(x.untyped_storage().data_ptr())
        owned.append(x)
    return tuple(owned)


@torch.library.custom_op("ringattn::attention_forward", mutates_args=())
def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor | None,
    group: str,
    layout: str,
    strategy: str,
    backend: str,
    causal: bool,
    scale: float | None,
    window: list[int] | None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """(out, lse) of `ringattn.attention` (see api.py); checks and agreement run here."""
    info = resolve_spec(group)
    statics = (group, layout, strategy, backend, causal, scale, window, softcap)
    number = start_call(info)
    call = validated(info, q.device, lambda: _checked(q, k, v, cu_seqlens, *statics), number)
    with running(info, "forward", call.signature):
        result = STRATEGIES[strategy].forward(q, k, v, call)
    lse = result.lse
    if call.placement is not None and call.placement.has_padding:
        lse = lse.masked_fill(torch.isneginf(lse), 0.0)  # padding rows see no key
    return _own((result.out, lse), (q, k, v, cu_seqlens))


def _checked(q, k, v, cu_seqlens, group, layout, strategy, backend, causal, scale, window,
             softcap):  # fmt: skip
    """(call, signature) for `validated`: the eager path's checks on the op's arguments."""
    return build_call(
        q, k, v, resolve_spec(group),
        causal=causal, scale=scale, layout=layout, strategy=strategy, backend=backend,
        cu_seqlens=cu_seqlens, window=None if window is None else tuple(window), softcap=softcap,
    )  # fmt: skip


@attention_forward.register_fake
def _(q, k, v, cu_seqlens, group, layout, strategy, backend, causal, scale, window, softcap=None):
    b, h, s, _ = q.shape
    out = q.new_empty(q.shape)  # (B, Hq, S_local, D), contiguous
    return out, q.new_empty((b, h, s), dtype=accumulator_dtype(q.dtype))  # (B, Hq, S_local)


@torch.library.custom_op("ringattn::attention_backward", mutates_args=())
def attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor | None,
    group: str,
    layout: str,
    strategy: str,
    backend: str,
    causal: bool,
    scale: float | None,
    window: list[int] | None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) from the local tensors the forward op saw and returned."""
    statics = (group, layout, strategy, backend, causal, scale, window, softcap)
    call, _ = _checked(q, k, v, cu_seqlens, *statics)  # the forward agreed on these
    strategy_obj = STRATEGIES[strategy]
    with running(call.info, "backward", call.signature):
        saved = strategy_obj.saved_from_local(q, k, v, out, lse, call)
        dq, dk, dv = strategy_obj.backward(dout.contiguous(), saved, call)
    return _own((dq, dk, dv), (dout, q, k, v, out, lse, cu_seqlens))


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens, group, layout, strategy, backend, causal, scale, window,
      softcap=None):  # fmt: skip
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, *statics = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.statics = tuple(statics)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, cu_seqlens, *ctx.statics)
    return (dq, dk, dv) + (None,) * 9


attention_forward.register_autograd(_backward, setup_context=_setup_context)


def compiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    scale: float | None,
    group: object,
    layout: str,
    strategy: str,
    backend: str,
    cu_seqlens: object,
    window: object,
    softcap: object = None,
) -> tuple[Tensor, Tensor]:
    """(out, lse) through the custom op: what `ringattn.attention` runs under torch.compile.

    Only what the op schema cannot carry is handled here, at trace time: the group becomes its
    spec, a cu_seqlens list a CPU tensor, the window a list. Everything else is checked inside.
    """
    for name, value in (("layout", layout), ("strategy", strategy), ("backend", backend)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))):
        raise TypeError(f"softcap must be a number > 0 or None, got {softcap!r}")
    if cu_seqlens is not None and not isinstance(cu_seqlens, Tensor):
        cu_seqlens = torch.tensor(list(cu_seqlens), dtype=torch.int64, device="cpu")  # host data
    if window is not None and not isinstance(window, (tuple, list)):
        raise ValueError(
            f"window must be (left, right) with ints >= -1 (-1 = unbounded), got {window!r}"
        )
    return attention_forward(
        q, k, v, cu_seqlens, group_spec(group), layout, strategy, backend, bool(causal),
        None if scale is None else float(scale), None if window is None else list(window),
        None if softcap is None else float(softcap),
    )  # fmt: skip
