"""`ContextParallelConfig(offload_activations=True)`: transformers.Trainer with each checkpointed
layer's input kept in host memory equals the same Trainer without offload or CP (on CPU the
host copy is another CPU tensor: the path runs, exact, and saves nothing).

transformers.Trainer enables activation checkpointing only in `train()`, after the Trainer is
built, so the layers' checkpoint functions are wrapped at each training forward: the test
checks that the last forward really offloaded (its byte count), not only that the losses match.
The arguments it cannot run with are refused in the constructor, naming the setting.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("peft")

from test_hf_trainer import _reference, _same
from workers_hf_trainer import run


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [{"kind": "trainer"}, {"kind": "sft", "lora": True}],
    ids=["trainer", "sft-lora"],
)  # fmt: skip
def test_trainer_offload_cp2_equals_without(pools, tmp_path, case):
    """transformers.Trainer, and TRL's SFTTrainer over PEFT's LoRA (the hook sits on the base
    model, under the adapter's wrappers)."""
    case = {**case, "cp": 2, "offload_activations": True,
            "args": {"gradient_checkpointing": True}}  # fmt: skip
    results = pools(2).run("workers_hf_trainer:run", case, str(tmp_path / "cp"), timeout=600)
    for result in results:  # every rank offloaded its layers' inputs in the last step
        assert result["offloaded_bytes"] > 0, result["offloaded_bytes"]
    assert results[1]["losses"] == results[0]["losses"]
    _same(results[0], _reference(case, tmp_path), "Trainer + activation offload")


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({}, r"offload_activations=True\) moves .*\(activation_checkpointing=True\)"),
        ({"gradient_checkpointing": True,
          "gradient_checkpointing_kwargs": {"use_reentrant": True}}, "non-reentrant"),
        ({"gradient_checkpointing": True,
          "gradient_checkpointing_kwargs": {"offload": True}}, "keep one"),
    ],
    ids=["no-checkpointing", "reentrant", "two-offloads"],
)  # fmt: skip
def test_trainer_offload_refusals_name_the_setting(tmp_path, args, match):
    case = {"kind": "trainer", "cp": 1, "offload_activations": True, "args": args,
            "construct_only": True}  # fmt: skip
    with pytest.raises(ValueError, match=match):
        run(0, 1, case, str(tmp_path))


def test_offload_config_takes_a_bool():
    import ringattn.hf

    with pytest.raises(TypeError, match=r"offload_activations='yes'\): True or False"):
        ringattn.hf.ContextParallelConfig(cp=1, offload_activations="yes")
