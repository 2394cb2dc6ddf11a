"""Activation offload (models/offload.py, integrations/hf/levers/offload.py): the checkpointed layer
inputs, and only those, go to host memory; training is unchanged (on CPU bitwise: the path copies
and copies back). The GPU case (pinned memory, side-stream prefetch, lower device peak) runs where
CUDA is."""

from __future__ import annotations

import copy

import pytest
import torch

from ringattn.models import Transformer, model_config
from ringattn.models import offload as offload_module
from ringattn.models.offload import ActivationOffload


def _spy(monkeypatch) -> list[ActivationOffload]:
    made = []
    init = ActivationOffload.__post_init__

    def spy(self):
        made.append(self)
        init(self)

    monkeypatch.setattr(offload_module.ActivationOffload, "__post_init__", spy)
    return made


def _decoder_run(model, device="cpu"):
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (2, 256), generator=gen).to(device)
    labels = torch.randint(0, 256, (2, 256), generator=gen).to(device)
    model.zero_grad(set_to_none=True)
    loss = model(tokens, torch.arange(256, device=device), labels)[0]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_decoder_offload_keeps_exactly_the_block_inputs_and_changes_nothing(monkeypatch):
    torch.manual_seed(0)
    model = Transformer(model_config("tiny"))
    model.checkpoint_blocks = True
    offloaded = copy.deepcopy(model)
    offloaded.offload_activations = True
    made = _spy(monkeypatch)
    loss, grads = _decoder_run(model)
    assert made == []  # no offload without the flag
    got_loss, got = _decoder_run(offloaded)
    assert len(made) == 1
    layers, dim = model.cfg.n_layers, model.cfg.dim
    assert made[0].offloaded_bytes == layers * 2 * 256 * dim * 4  # one (B, S, dim) per block
    assert torch.equal(got_loss, loss)
    for name, grad in grads.items():
        assert torch.equal(got[name], grad), name


def _hf_llama(checkpointing: bool):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    return model


def test_hf_offload_changes_nothing(monkeypatch):
    from ringattn.integrations.hf.levers.offload import offload_activations

    model = _hf_llama(True)
    offloaded = copy.deepcopy(model)
    assert offload_activations(offloaded) >= 3  # the layers (and the model, which keeps one too)
    made = _spy(monkeypatch)
    ids = torch.randint(0, 64, (1, 300), generator=torch.Generator().manual_seed(2))
    results = []
    for m in (model, offloaded):
        m.train()
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    assert len(made) == 1 and made[0].offloaded_bytes == 3 * 300 * 64 * 4  # 3 layer inputs
    (loss, grads), (got_loss, got) = results
    assert torch.equal(got_loss, loss)
    for name, grad in grads.items():
        assert torch.equal(got[name], grad), name


def test_offload_without_checkpointing_is_refused():
    from ringattn.integrations.hf.levers.offload import offload_activations
    from ringattn.train.config import TrainConfig, validate

    with pytest.raises(ValueError, match="enable gradient checkpointing first"):
        offload_activations(_hf_llama(False))
    with pytest.raises(ValueError, match="add --activation-checkpointing"):
        validate(TrainConfig(offload_activations=True, nproc=1, cp=1), 1)


def test_train_with_every_lever_logs_the_same_losses(pools, tmp_path):
    """The contract: `ringattn train ... --tiled-mlp TOKENS --offload-activations` logs the same
    loss records as without them (CP 2, FSDP2, checkpointed blocks)."""
    from test_train import SGD_OPTIONS, _assert_same_training, _options

    base = _options(tmp_path / "plain", cp=2, batch_size=2, activation_checkpointing=True,
                    **SGD_OPTIONS)  # fmt: skip
    want = pools(2).run("workers_train:train", base)[0]
    levers = {**base, "tiled_mlp": 16, "offload_activations": True,
              "out_dir": str(tmp_path / "levers")}  # fmt: skip
    got = pools(2).run("workers_train:train", levers)[0]
    _assert_same_training(got, want, rtol=1e-6)


def test_hf_train_with_offload_logs_the_same_losses(pools, tmp_path):
    pytest.importorskip("transformers")
    from test_train import _assert_same_training
    from test_train_hf import _options as hf_options
    from test_train_hf import tiny_llama_dir

    model_dir, docs = tiny_llama_dir(tmp_path)
    base = hf_options(model_dir, docs, tmp_path / "plain", cp=2, activation_checkpointing=True,
                      optimizer="sgd", lr=1.0)  # fmt: skip
    want = pools(2).run("workers_train:train", base)[0]
    levers = {**base, "offload_activations": True, "tiled_mlp": 4,
              "out_dir": str(tmp_path / "levers")}  # fmt: skip
    got = pools(2).run("workers_train:train", levers)[0]
    _assert_same_training(got, want, rtol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_is_pinned_exact_and_lowers_the_device_peak(monkeypatch):
    torch.manual_seed(0)
    cfg = model_config("base", n_layers=8)
    model = Transformer(cfg).cuda()
    model.checkpoint_blocks = True
    offloaded = copy.deepcopy(model)
    offloaded.offload_activations = True
    made = _spy(monkeypatch)
    peaks, results = [], []
    for m in (model, offloaded):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        results.append(_decoder_run(m, "cuda"))
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    assert all(r.host.is_pinned() for r in made[0].records if r.host is not None)
    (loss, grads), (got_loss, got) = results
    assert torch.equal(got_loss, loss)
    for name, grad in grads.items():
        assert torch.equal(got[name], grad), name
    assert peaks[1] < peaks[0], peaks
