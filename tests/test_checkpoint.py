"""Checkpoints: atomic (a crash mid-write never leaves a complete-looking one), keep the last K,
restore model, optimizer and RNG exactly. One process; multi-rank save/resume is in test_train.py.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ringattn.runtime import checkpoint as ckpt

# DCP without a process group says it assumes a single process: it is right
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).square().sum().backward()
    optimizer.step()  # the optimizer has state to save
    return model, optimizer


def test_save_keeps_the_last_k_and_latest_is_the_newest(tmp_path):
    model, optimizer = _model_and_optimizer()
    root = str(tmp_path)
    assert ckpt.latest(root) is None
    for step in (1, 2, 3):
        path = ckpt.save(root, step, model, optimizer, {"step": step}, keep=2)
        assert path == os.path.join(root, f"step-{step:08d}")
    assert sorted(os.listdir(root)) == ["step-00000002", "step-00000003"]
    assert ckpt.latest(root).endswith("step-00000003")
    assert ckpt.read_state(ckpt.latest(root)) == {"step": 3}


def test_a_crash_mid_write_leaves_no_complete_checkpoint(tmp_path, monkeypatch):
    model, optimizer = _model_and_optimizer()
    root = str(tmp_path)
    ckpt.save(root, 1, model, optimizer, {"step": 1})

    def crash(state, checkpoint_id):
        with open(os.path.join(checkpoint_id, "__0_0.distcp"), "wb") as f:
            f.write(b"half a shard")  # what a killed writer leaves behind
        raise RuntimeError("killed mid-write")

    monkeypatch.setattr(dcp, "save", crash)
    with pytest.raises(RuntimeError, match="killed mid-write"):
        ckpt.save(root, 2, model, optimizer, {"step": 2})
    assert ckpt.latest(root).endswith("step-00000001")  # the half-written one is not "complete"
    assert ".tmp-step-00000002" in os.listdir(root)
    monkeypatch.undo()
    ckpt.save(root, 3, model, optimizer, {"step": 3})  # the next save clears the debris
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000003"]


def test_load_restores_model_optimizer_and_rng(tmp_path):
    model, optimizer = _model_and_optimizer(seed=0)
    torch.manual_seed(123)
    path = ckpt.save(str(tmp_path), 5, model, optimizer, {"step": 5, "note": "x"})
    expected_random = torch.rand(3)
    expected_params = [p.detach().clone() for p in model.parameters()]
    expected_state = {k: v.clone() for k, v in optimizer.state[model[0].weight].items()}

    other, other_optimizer = _model_and_optimizer(seed=1)  # different weights and moments
    torch.manual_seed(999)
    state = ckpt.load(path, other, other_optimizer)
    assert state == {"step": 5, "note": "x"}
    assert torch.equal(torch.rand(3), expected_random)  # the RNG continues where it was saved
    for got, want in zip(other.parameters(), expected_params):
        assert torch.equal(got, want)
    for key, value in other_optimizer.state[other[0].weight].items():
        assert torch.equal(value, expected_state[key]), key
