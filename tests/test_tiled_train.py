"""The memory levers through the trainers: `ringattn train` (our decoder, and --hf) with
--tiled-mlp logs the same losses and reaches the same weights as without; ringattn.hf's Trainer
with ContextParallelConfig(tiled_mlp=...) equals one process. All at CP = 2 under FSDP2 or DDP,
with activation checkpointing where the trainer has it."""

from __future__ import annotations

import pytest

from test_train import SGD_OPTIONS, _assert_same_training, _options


@pytest.mark.parametrize("checkpointing", [False, True])
def test_decoder_train_tiled_logs_the_same_losses(pools, tmp_path, checkpointing):
    base = _options(tmp_path / "plain", cp=2, batch_size=2, activation_checkpointing=checkpointing,
                    **SGD_OPTIONS)  # fmt: skip
    want = pools(2).run("workers_train:train", base)[0]
    tiled = {**base, "tiled_mlp": 5, "out_dir": str(tmp_path / "tiled")}  # 32 rows a rank
    got = pools(2).run("workers_train:train", tiled)[0]
    _assert_same_training(got, want, rtol=1e-6)
    assert want["losses"][0] != want["losses"][-1]


@pytest.mark.slow
def test_hf_train_tiled_logs_the_same_losses(pools, tmp_path):
    pytest.importorskip("transformers")
    from test_train_hf import _options as hf_options
    from test_train_hf import tiny_llama_dir

    model_dir, docs = tiny_llama_dir(tmp_path)
    base = hf_options(model_dir, docs, tmp_path / "plain", cp=2, activation_checkpointing=True,
                      optimizer="sgd", lr=1.0)  # fmt: skip
    want = pools(2).run("workers_train:train", base)[0]
    tiled = {**base, "tiled_mlp": 4, "out_dir": str(tmp_path / "tiled")}
    got = pools(2).run("workers_train:train", tiled)[0]
    _assert_same_training(got, want, rtol=1e-6)


@pytest.mark.slow
def test_trainer_tiled_mlp_cp2_equals_one_process(pools, tmp_path):
    """transformers.Trainer over Qwen3-MoE (experts tiled after routing, router loss in the
    objective) with gradient checkpointing, ContextParallelConfig(tiled_mlp=3)."""
    pytest.importorskip("transformers")
    from test_hf_trainer import _reference, _same

    case = {"kind": "trainer", "cp": 2, "arch": "qwen3_moe", "tiled_mlp": 3,
            "args": {"gradient_checkpointing": True}}  # fmt: skip
    results = pools(2).run("workers_hf_trainer:run", case, str(tmp_path / "cp"), timeout=600)
    _same(results[0], _reference(case, tmp_path), "Trainer + tiled MLP")


def test_bad_tiled_mlp_settings_are_refused():
    from ringattn.train.config import TrainConfig, validate

    with pytest.raises(ValueError, match="tiled-mlp"):
        validate(TrainConfig(tiled_mlp=-2, nproc=1, cp=1), 1)
    with pytest.raises(ValueError, match="--tiled-mlp 8 is not supported with --tp 2"):
        validate(TrainConfig(tiled_mlp=8, tp=2, nproc=2, cp=1), 2)
    pytest.importorskip("transformers")
    import ringattn.hf

    with pytest.raises(ValueError, match=r"ContextParallelConfig\(tiled_mlp\)=-1"):
        ringattn.hf.ContextParallelConfig(cp=1, tiled_mlp=-1)


def test_hf_train_tiled_experts_over_ep2_equals_one_process(pools, tmp_path):
    """`train --hf --ep 2 --tiled-mlp` on a MoE model (cp 2, checkpointed): the experts module
    of each rank runs over the rows the expert exchange brought it, in tiles; losses and aux
    losses equal one untiled process's."""
    pytest.importorskip("transformers")
    import torch

    from test_hf_experts import _train_options

    options = {**_train_options(tmp_path), "steps": 2, "lr": 2.0, "optimizer": "sgd",
               "checkpoint_every": -1}  # fmt: skip
    want = pools(1).run("workers_hf_experts:train", {**options, "out_dir": str(tmp_path / "one")},
                        timeout=600)[0]  # fmt: skip
    got = pools(2).run("workers_hf_experts:train", {**options, "cp": 2, "ep": 2, "tiled_mlp": 3,
                       "activation_checkpointing": True, "out_dir": str(tmp_path / "ep2")},
                       timeout=600)[0]  # fmt: skip
    torch.testing.assert_close(torch.tensor(got["history"], dtype=torch.float64),
                               torch.tensor(want["history"], dtype=torch.float64),
                               rtol=1e-5, atol=0)  # fmt: skip
