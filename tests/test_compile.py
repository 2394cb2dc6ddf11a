"""torch.compile(fullgraph=True) through ringattn: the custom ops, our decoder, an HF Llama.

The attention forward and backward are `torch.library` custom ops (ringattn/ops.py). Here:
- opcheck (schema, fake implementation, autograd registration) on dense and packed calls, and
  one inductor compile on one process that equals eager;
- on W ranks: zero graph breaks (torch._dynamo.explain), compiled loss and gradients equal to the
  same model on the full sequence in one process (fp32 gates), packed documents whose layouts and
  lengths change between calls without a recompile per call, and errors still raised on every
  rank from inside the op.

Multi-rank cases compile with "aot_eager" (the same dynamo and AOTAutograd graphs as inductor,
without its ~30 s of code generation per graph on this machine); the one-process case and the
benchmark (scripts/bench/compile.py) use inductor.
"""

from __future__ import annotations

import pytest
import torch

import ringattn
from ringattn import ops

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


def _qkv(s=16, dtype=torch.float64, heads=(4, 2), dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads[0], s, dim, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(1, heads[1], s, dim, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(1, heads[1], s, dim, generator=gen, dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("cu_seqlens", [None, [0, 6, 6, 16]], ids=["dense", "packed"])
@pytest.mark.slow
def test_ops_pass_opcheck(cu_seqlens):
    """Schema, fake (meta) implementation, autograd registration and dispatch all agree."""
    q, k, v = _qkv()
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    statics = ("", "zigzag", "ring", "auto", True, None, None)
    torch.library.opcheck(ops.attention_forward, (q, k, v, cu, *statics))
    out, lse = ops.attention_forward(q, k, v, cu, *statics)
    dout = torch.randn_like(out)
    args = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, cu, *statics)
    torch.library.opcheck(ops.attention_backward, args)


def test_fake_shapes_and_dtypes():
    """The fake implementation promises what the real op returns: out in q's dtype and shape,
    lse (B, Hq, S) in the accumulator dtype, both contiguous."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for dtype, lse_dtype in ((torch.float64, torch.float64), (torch.bfloat16, torch.float32)):
        q, k, v = (x.detach().to(dtype) for x in _qkv())
        real = ops.attention_forward(q, k, v, None, "", "zigzag", "ring", "auto", True, None, None)
        with FakeTensorMode() as mode:
            fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
            fake = ops.attention_forward(fq, fk, fv, None, "", "zigzag", "ring", "auto", True,
                                         None, None)  # fmt: skip
        for r, f in zip(real, fake):
            assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())
        assert real[1].dtype == lse_dtype


@pytest.mark.slow
def test_inductor_one_process_equals_eager():
    """fullgraph=True with inductor, forward and backward, equals eager; no graph break."""
    q, k, v = _qkv(dtype=torch.float32)

    def attend(q, k, v):
        return ringattn.attention(q, k, v, causal=True, window=(5, 0)) * 2.0

    report = torch._dynamo.explain(attend)(q, k, v)
    assert report.graph_break_count == 0, report.break_reasons
    torch._dynamo.reset()
    out = torch.compile(attend, fullgraph=True)(q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want = attend(q, k, v)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=2e-5)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_group_spec_round_trip_one_process():
    assert ops.group_spec(None) == ""
    assert ops.resolve_spec("").world_size == 1
    with pytest.raises(TypeError, match="ProcessGroup, a 1-D DeviceMesh or None"):
        ops.group_spec("world")


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.slow
def test_decoder_compiles_whole_and_equals_one_process(pools, world_size):
    """Our decoder under CP, torch.compile(model, fullgraph=True): no graph break, one graph,
    the summed loss and gradients of one process on the full sequence."""
    for breaks, reasons, loss_error, grad_error, graphs in pools(world_size).run(
        "workers_compile:decoder_case", compiler="aot_eager", timeout=600
    ):
        assert breaks == 0, reasons
        assert graphs == 1
        assert loss_error <= LOSS_RTOL and grad_error <= GRAD_RTOL, (loss_error, grad_error)


@pytest.mark.slow
def test_hybrid_decoder_compiles_whole_and_equals_one_process(pools):
    """strategy="hybrid" over a 2 x 2 ("ring", "ulysses") mesh of W = 4 ranks (Ulysses inside
    pairs, a ring across them): explain finds no graph break, one graph, the loss and
    gradients of one process on the full sequence."""
    for breaks, reasons, loss_error, grad_error, graphs in pools(4).run(
        "workers_compile:decoder_case", strategy="hybrid", compiler="aot_eager", explain=True,
        timeout=600,
    ):  # fmt: skip
        assert breaks == 0, reasons
        assert graphs == 1
        assert loss_error <= LOSS_RTOL and grad_error <= GRAD_RTOL, (loss_error, grad_error)


@pytest.mark.slow
def test_packed_documents_change_without_recompiling(pools):
    """cu_seqlens is data of the op: new document layouts (and lengths) reuse the graph. Each
    input dim that changes recompiles once (dynamo's automatic dynamic shapes: the number of
    bounds at call 2, the local length, padding included, at call 3), then never again."""
    layouts = [(0, 7, 8, 20), (0, 3, 20), (0, 1, 2, 9, 25, 31), (0, 12, 13, 40), (0, 40)]
    for breaks, graphs, out_error, grad_error in pools(2).run(
        "workers_compile:packed_case", layouts=layouts, timeout=600
    ):
        assert breaks == 0
        assert graphs == [1, 2, 3, 3, 3], graphs
        assert out_error <= 1e-9 and grad_error <= 1e-9, (out_error, grad_error)


def test_errors_are_raised_on_every_rank_inside_the_op(pools):
    """A rank-local mistake is still every rank's ValueError under compile: the checks and the
    agreement run inside the op at run time."""
    pools(2).run_expect_error(
        "workers_compile:disagreeing_ranks", match="ranks disagree", exc_type=ValueError
    )
