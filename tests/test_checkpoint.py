"""Checkpoints: atomic (a crash mid-write never leaves a complete-looking one), keep the last K,
restore model, optimizer and RNG exactly. One process; multi-rank save/resume is in test_train.py.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ringattn.runtime import checkpoint as ckpt
from ringattn.train.config import TrainConfig, validate

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


def test_a_failed_write_is_a_checkpoint_error_and_leaves_no_complete_checkpoint(
    tmp_path, monkeypatch
):
    model, optimizer = _model_and_optimizer()
    root = str(tmp_path)
    ckpt.save(root, 1, model, optimizer, {"step": 1})

    def crash(state, checkpoint_id):
        with open(os.path.join(checkpoint_id, "__0_0.distcp"), "wb") as f:
            f.write(b"half a shard")  # what a failed writer leaves behind
        raise RuntimeError("failed mid-write")

    monkeypatch.setattr(dcp, "save", crash)
    with pytest.raises(ckpt.CheckpointError, match="rank 0: RuntimeError: failed mid-write.*"
                       "newest complete checkpoint is .*step-00000001"):  # fmt: skip
        ckpt.save(root, 2, model, optimizer, {"step": 2})
    assert ckpt.latest(root).endswith("step-00000001")  # the half-written one is not "complete"
    assert os.listdir(root) == ["step-00000001"]  # rank 0 removed the temporary directory
    monkeypatch.undo()
    os.makedirs(os.path.join(root, ".tmp-step-00000002"))  # what a killed save leaves
    ckpt.save(root, 3, model, optimizer, {"step": 3})  # the next save clears the debris
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000003"]


def test_torch_save_runtime_error_is_shared_as_a_checkpoint_error(tmp_path, monkeypatch):
    """torch.save raises RuntimeError (not OSError) when a full disk cuts a write short: still a
    CheckpointError, and beside a full disk it says so."""
    model, optimizer = _model_and_optimizer()
    root = str(tmp_path)
    ckpt.save(root, 1, model, optimizer, {"step": 1})

    real_save = torch.save

    def full(obj, f):
        if "rng" not in str(getattr(f, "name", "")):  # DCP's own uses of torch.save
            return real_save(obj, f)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(ckpt.CheckpointError, match="rank 0: RuntimeError: .*unexpected pos") as e:
        ckpt.save(root, 2, model, optimizer, {"step": 2})
    assert ckpt.latest(root).endswith("step-00000001")
    assert "No space" not in str(e.value)  # the disk has room: no guess about the cause

    # torch.save's error on a full disk names no cause: one beside < 1 MiB free says it
    usage = shutil.disk_usage(root)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=4096))
    with pytest.raises(ckpt.CheckpointError, match="rank 0: RuntimeError: .*unexpected pos 64 "
                       rf"\[No space left on device: 4096 bytes free under {root}\]"):  # fmt: skip
        ckpt.save(root, 2, model, optimizer, {"step": 2})
    assert ckpt.latest(root).endswith("step-00000001")


def test_pruning_keeps_the_checkpoint_just_written_whatever_its_step(tmp_path):
    """An older run's steps 900 and 1000, then step 200 written: 200 is the newest (latest) and
    survives the pruning; the oldest-written (900) goes."""
    model, optimizer = _model_and_optimizer()
    root = str(tmp_path)
    for step in (900, 1000, 200):
        path = ckpt.save(root, step, model, optimizer, {"step": step}, keep=2)
    assert sorted(os.listdir(root)) == ["step-00000200", "step-00001000"]
    assert ckpt.latest(root) == path and ckpt.read_state(path) == {"step": 200}
    ckpt.save(root, 300, model, optimizer, {"step": 300}, keep=1)
    assert os.listdir(root) == ["step-00000300"]


def test_saving_a_step_again_replaces_it_and_an_interrupted_replacement_recovers(tmp_path):
    """The old step-N is renamed aside, the new one committed, then the old deleted; a crash
    between the two renames leaves the old one aside, which is still the newest checkpoint."""
    model, optimizer = _model_and_optimizer()
    root = str(tmp_path)
    ckpt.save(root, 5, model, optimizer, {"step": 5, "run": "old"}, keep=1)
    points = []

    def stop_at_aside(point):
        points.append(point)
        if point == "aside":
            raise KeyboardInterrupt  # not an Exception: leaves the save where a kill would

    with pytest.raises(KeyboardInterrupt):
        ckpt.save(root, 5, model, optimizer, {"step": 5, "run": "new"}, keep=1,
                  fault=stop_at_aside)  # fmt: skip
    assert points == ["start", "directory", "model", "rng", "state", "shared", "aside"]
    assert sorted(os.listdir(root)) == [".replaced-step-00000005", ".tmp-step-00000005"]
    assert ckpt.read_state(ckpt.latest(root)) == {"step": 5, "run": "old"}
    ckpt.load(ckpt.latest(root), *_model_and_optimizer(seed=1))  # whole: it loads
    ckpt.save(root, 5, model, optimizer, {"step": 5, "run": "new"}, keep=1)
    assert os.listdir(root) == ["step-00000005"]
    assert ckpt.read_state(ckpt.latest(root)) == {"step": 5, "run": "new"}


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


def test_no_resume_into_a_directory_with_checkpoints_is_refused(tmp_path):
    """--no-resume would write a new run's checkpoints beside an earlier run's: refused, with the
    fix named, on the parent and every rank (validate); the old checkpoints are untouched."""
    model, optimizer = _model_and_optimizer()
    root = tmp_path / "checkpoints"
    for step in (900, 1000):
        ckpt.save(str(root), step, model, optimizer, {"step": step})
    cfg = TrainConfig(model="tiny", seq_len=64, out_dir=str(tmp_path), resume=False)
    with pytest.raises(ValueError, match=r"--no-resume: .* holds the checkpoints of an earlier "
                       r"run \(steps 900, 1000; .*use another --checkpoint-dir"):  # fmt: skip
        validate(cfg, 1)
    validate(replace(cfg, checkpoint_every=-1), 1)  # writes no checkpoint: nothing to mix
    validate(replace(cfg, resume=True), 1)  # continues that run
    validate(replace(cfg, checkpoint_dir=str(tmp_path / "fresh")), 1)
    assert sorted(os.listdir(root)) == ["step-00000900", "step-00001000"]


def test_non_finite_weights_or_a_failing_state_dict_write_nothing(tmp_path, monkeypatch):
    """NaN in the weights: NonFiniteWeights; an error while collecting the state: CheckpointError
    (shared like any other); in both cases nothing is written and step 1 stays the newest."""
    model, optimizer = _model_and_optimizer()
    root = str(tmp_path)
    ckpt.save(root, 1, model, optimizer, {"step": 1})
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    with pytest.raises(ckpt.NonFiniteWeights, match=r"rank 0: non-finite values in 1\.weight"):
        ckpt.save(root, 2, model, optimizer, {"step": 2})
    with torch.no_grad():
        model[1].weight[0, 0] = 0.0

    def broken(*args, **kwargs):
        raise KeyError("no such parameter")

    monkeypatch.setattr("torch.distributed.checkpoint.state_dict.get_state_dict", broken)
    with pytest.raises(ckpt.CheckpointError, match="rank 0: KeyError: 'no such parameter'"):
        ckpt.save(root, 2, model, optimizer, {"step": 2})
    assert os.listdir(root) == ["step-00000001"]


def test_a_run_start_removes_what_a_killed_save_or_prune_left(tmp_path):
    """A kill inside the last save's prune (the old checkpoint renamed, not yet deleted) or
    inside a save leaves directories no save follows to remove: the next run's start (rank 0,
    train/run.py's _resume) removes them and resumes from the newest complete checkpoint; an
    aside copy (a replacement cut short) waits for the next save, as other ranks may read it."""
    from ringattn.train.run import _resume

    model, optimizer = _model_and_optimizer()
    cfg = TrainConfig(model="tiny", seq_len=64, out_dir=str(tmp_path))
    root = cfg.checkpoint_path
    for step in (1, 2):
        ckpt.save(root, step, model, optimizer, {"step": step})
    os.rename(os.path.join(root, "step-00000001"), os.path.join(root, ".pruned-step-00000001"))
    os.makedirs(os.path.join(root, ".tmp-step-00000003", "rng"))
    shutil.copytree(
        os.path.join(root, "step-00000002"), os.path.join(root, ".replaced-step-00000002")
    )
    assert _resume(cfg, model, optimizer) == (2, os.path.join(root, "step-00000002"))
    assert sorted(os.listdir(root)) == [".replaced-step-00000002", "step-00000002"]
    ckpt.save(root, 3, model, optimizer, {"step": 3})  # a save recovers the aside one
    assert sorted(os.listdir(root)) == ["step-00000002", "step-00000003"]
