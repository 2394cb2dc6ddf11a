"""Tiled MLP: a row-wise module run over its rows in tiles, each tile recomputed in backward.

An MLP (and an experts module after routing) treats every row (token) on its own, so

    out = cat([fn(x[0:T]), fn(x[T:2T]), ...])                  rows in tiles of T

equals fn(x). Only one tile's intermediates (for a SwiGLU MLP about 3 x T x intermediate) are
ever alive, against 3 x rows x intermediate untiled: at long sequences that working set, not the
checkpointed layer inputs, sets the peak (DeepSpeed ALST's TiledMLP).

    forward    no graph: each tile's output under no_grad, concatenated; saved: the inputs
    backward   tile by tile: recompute fn(tile) with a graph, torch.autograd.grad of that tile's
               output gradient to the tile's inputs and to the module's parameters; the input
               gradients fill their rows, the parameter gradients are summed over the tiles

The parameter gradients go back to autograd as this Function's own input gradients (never
written to `.grad` here), so DDP, FSDP2 and activation checkpointing see one gradient per
parameter, as from the untiled module. Exact: only the summation order of the weight gradients
differs from the untiled module (the float32 gate of the tests is 1e-6 relative).

`fn` must be row-wise and deterministic (no dropout in training: the recompute would draw other
numbers); the allow-lists in models/decoder.py (our SwiGLU) and integrations/hf/levers/tiled.py
(transformers' MLP and experts classes) say which modules are. Inputs are tensors whose first
dimension is the rows (an experts module's hidden states, top-k indices and weights); the
output's first dimension is the rows too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["check_tile", "tiled_rows"]


def check_tile(tile: int, what: str = "tiled_mlp") -> None:
    """ValueError unless `tile` is an int >= 0 (0 = off)."""
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 0:
        raise ValueError(
            f"{what}={tile!r}: give the tokens per tile as an int >= 1 (e.g. 1024), or 0 for off"
        )


class _TiledRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable, tile: int, n_params: int, *args: torch.Tensor) -> torch.Tensor:
        params, inputs = args[:n_params], args[n_params:]
        rows = inputs[0].shape[0]
        with torch.no_grad():
            out = torch.cat([fn(*(t[i : i + tile] for t in inputs)) for i in range(0, rows, tile)])
        ctx.fn, ctx.tile, ctx.n_params = fn, tile, n_params
        ctx.params = params  # parameters: held by the module anyway, no copy
        ctx.save_for_backward(*inputs)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = ctx.saved_tensors
        wants = ctx.needs_input_grad[3:]
        want_params, want_inputs = wants[: ctx.n_params], wants[ctx.n_params :]
        params = [p for p, want in zip(ctx.params, want_params, strict=True) if want]
        dparams: list[torch.Tensor | None] = [None] * len(params)
        dinputs = [torch.empty_like(t) if want else None for t, want in zip(inputs, want_inputs)]
        rows, tile = inputs[0].shape[0], ctx.tile
        for i in range(0, rows, tile):
            pieces = [
                t[i : i + tile].detach().requires_grad_(want)
                for t, want in zip(inputs, want_inputs, strict=True)
            ]
            with torch.enable_grad():
                out = ctx.fn(*pieces)
            wrt = [*params, *(p for p, want in zip(pieces, want_inputs) if want)]
            grads = torch.autograd.grad(out, wrt, dout[i : i + tile], allow_unused=True)
            for j, grad in enumerate(grads[: len(params)]):
                if grad is not None:  # summed in float32 (or wider) over the tiles, cast once
                    grad = grad.to(torch.promote_types(grad.dtype, torch.float32))
                    dparams[j] = grad if dparams[j] is None else dparams[j].add_(grad)
            wanted = iter(grads[len(params) :])
            for dinput, want in zip(dinputs, want_inputs, strict=True):
                if want:
                    grad = next(wanted)
                    dinput[i : i + tile] = 0 if grad is None else grad
        cast = iter(None if g is None else g.to(p.dtype) for g, p in zip(dparams, params))
        dall = [next(cast) if want else None for want in want_params]
        return None, None, None, *dall, *dinputs


def tiled_rows(
    fn: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    tile: int,
    params: Sequence[nn.Parameter],
) -> torch.Tensor:
    """fn(*inputs) computed over the rows (dim 0) in tiles of `tile`, each recomputed in backward.

    `params` are the parameters `fn` reads (their gradients are computed here, summed over the
    tiles). With rows <= tile it is just fn(*inputs); with no gradient needed, the tiles'
    outputs concatenated (the same working set, nothing saved)."""
    rows = inputs[0].shape[0]
    if rows <= tile:
        return fn(*inputs)
    needs_grad = torch.is_grad_enabled() and (
        any(t.requires_grad for t in inputs) or any(p.requires_grad for p in params)
    )
    if not needs_grad:
        return torch.cat([fn(*(t[i : i + tile] for t in inputs)) for i in range(0, rows, tile)])
    return _TiledRows.apply(fn, tile, len(params), *params, *inputs)
