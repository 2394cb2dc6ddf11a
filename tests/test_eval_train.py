"""Context extension in `train --hf`: --rope-scaling and --max-position-embeddings reach the
model that trains and the exported config.json; --eval-niah-every answers a needle grid with the
model being trained (FSDP2 over cp = 2), and its answers are those of the exported model on one
process.

Tiny Llamas built in the test (test_eval.py's character-level tokenizer); nothing downloaded.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ringattn.train.config import TrainConfig
from ringattn.train.hf.context import ROPE_TYPES, extended_config
from ringattn.train.progress import read_log
from test_eval import _tokenizer


def _llama(directory, **overrides) -> str:
    tokenizer = _tokenizer()
    options = {"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
               "max_position_embeddings": 256, "pad_token_id": 0, **overrides}  # fmt: skip
    torch.manual_seed(2)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**options))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("kind", ROPE_TYPES)
def test_rope_scaling_builds_the_models_own_scaled_rope(tmp_path, kind):
    hf = _llama(tmp_path / "m")
    config = extended_config(TrainConfig(hf=hf, rope_scaling=f"{kind}:4"))
    text = config.get_text_config()
    assert text.rope_parameters["rope_type"] == kind and text.rope_parameters["factor"] == 4.0
    assert text.max_position_embeddings == 1024 and text.rope_parameters["rope_theta"] == 10000.0
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, config=config)
    assert model.model.rotary_emb.rope_type == kind
    plain = transformers.AutoModelForCausalLM.from_pretrained(hf)
    torch.testing.assert_close(model.lm_head.weight, plain.lm_head.weight)  # the same weights
    if kind == "linear":  # position interpolation: position p rotates as p / 4 did
        ids = torch.arange(8)[None]
        cos, _ = model.model.rotary_emb(torch.zeros(1), ids * 4)
        want, _ = plain.model.rotary_emb(torch.zeros(1), ids)
        torch.testing.assert_close(cos, want)
    longer = extended_config(TrainConfig(hf=hf, rope_scaling="yarn:2", max_position_embeddings=600))
    assert longer.max_position_embeddings == 600
    assert longer.rope_parameters["original_max_position_embeddings"] == 256
    assert extended_config(TrainConfig(hf=hf)) is None


@pytest.mark.parametrize(
    "flags, match",
    [
        ({"rope_scaling": "cubic:2"}, "TYPE one of linear, dynamic, yarn, llama3"),
        ({"rope_scaling": "linear:0.5"}, "FACTOR >= 1"),
        ({"rope_scaling": "linear"}, "give TYPE:FACTOR"),
        ({"max_position_embeddings": -3}, "must be >= 1"),
    ],
)
def test_bad_rope_flags_are_value_errors(tmp_path, flags, match):
    hf = _llama(tmp_path / "m")
    with pytest.raises(ValueError, match=match):
        extended_config(TrainConfig(hf=hf, **flags))


def test_rope_flags_and_the_niah_probe_need_hf(tmp_path, capfd):
    from ringattn.cli.main import main

    for flag in (["--rope-scaling", "linear:2"], ["--eval-niah-every", "5"]):
        with pytest.raises(SystemExit) as info:
            main(["train", "--nproc", "1", "--steps", "1", "--out-dir", str(tmp_path), *flag])
        assert info.value.code == 2 and "it needs --hf DIR" in capfd.readouterr().err


@pytest.mark.slow
def test_extended_training_probes_and_exports(pools, tmp_path):
    from ringattn.evals.grid import evaluate
    from ringattn.evals.haystack import Codec
    from ringattn.train.hf.probe import niah_grid
    from ringattn.train.hf.run import export

    hf = _llama(tmp_path / "m")
    (tmp_path / "docs").mkdir()
    for i in range(4):
        words = ("the quick brown fox jumps over a lazy dog " * 40).split()[i:]
        (tmp_path / "docs" / f"{i}.txt").write_text(" ".join(words))
    options = {"hf": hf, "data": f"text:{tmp_path / 'docs'}", "seq_len": 400, "batch_size": 1,
               "steps": 2, "warmup": 1, "lr": 1e-2, "quiet": True, "checkpoint_every": 0,
               "out_dir": str(tmp_path / "run"), "cp": 2, "rope_scaling": "linear:2",
               "eval_niah_every": 5, "token_cache": str(tmp_path / "tokens")}  # fmt: skip
    pools(2).run("workers_train:train", options, timeout=600)
    probes = [r for r in read_log(str(tmp_path / "run" / "train_log.jsonl"))
              if r.get("event") == "niah"]  # fmt: skip
    assert [p["step"] for p in probes] == [2]  # every 5 steps, and after the last
    record = probes[0]
    assert set(record) >= {"niah_accuracy", "niah_score_400", "niah_answers"}
    assert "niah_score_200" not in record  # 200 tokens cannot hold the prompt: left out
    cfg = TrainConfig(**options)
    export(cfg, str(tmp_path / "run" / "checkpoints" / "step-00000002"), str(tmp_path / "x"))
    with open(tmp_path / "x" / "config.json") as f:
        saved = json.load(f)
    assert saved["rope_parameters"] == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    assert saved["max_position_embeddings"] == 512
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "x").eval()
    assert model.model.rotary_emb.rope_type == "linear"
    codec = Codec(transformers.AutoTokenizer.from_pretrained(tmp_path / "x"), 256)
    answers = [[r["length"], r["depth"], r["answer"], r["expected"]]
               for r in evaluate(model, codec, niah_grid(cfg))]  # fmt: skip
    assert answers == record["niah_answers"]  # the probe over cp = 2 = the export on one process
