"""`ringattn.hf.parallelize(tiled_mlp=)` under torch.compile, in one process (W = 1).

A tiled module's backward recomputes each tile with torch.autograd.grad, which dynamo does not
trace: inside a fullgraph=True graph it is refused by name (the ValueError's message rides in
dynamo's Unsupported, as the padding-mask refusal's does in test_compile_hf.py). Without
fullgraph, dynamo breaks the graph there and the tiles run eagerly: the loss and the gradients
equal the untiled eager model's.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ringattn.hf

TILE = 8


def _model_and_batch(tile: int):
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    ringattn.hf.parallelize(model, tiled_mlp=tile)
    ids = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(1))  # 4 tiles
    return model, ringattn.hf.shard_batch({"input_ids": ids, "labels": ids})


def _loss_and_grads(model, run, batch):
    loss = run(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_tiled_mlp_in_a_fullgraph_compile_is_refused_by_name():
    model, batch = _model_and_batch(TILE)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=f"LlamaMLP: tiled_mlp={TILE} cannot run inside a torch"):
        compiled(**batch)


@pytest.mark.slow
def test_tiled_mlp_compiled_without_fullgraph_equals_untiled_eager():
    eager, batch = _model_and_batch(0)
    want_loss, want_grads = _loss_and_grads(eager, eager, batch)
    model, batch = _model_and_batch(TILE)
    compiled = torch.compile(model, backend="aot_eager")
    loss, grads = _loss_and_grads(model, compiled, batch)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-5, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip
