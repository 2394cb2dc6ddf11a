"""Logits never whole: `ringattn.hf.loss` and `train --hf --loss-chunk` against the model's own
loss on one process; bf16 training with float32 master weights; the export's dtype.

The reference is transformers' own forward (`model(**batch).loss`, whole logits) on the same
model and batch: the chunked loss and every parameter gradient must equal it, while lm_head
never sees more than `chunk` rows at once (a forward hook counts them, recomputation included).
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ringattn.hf
from test_train_hf import _llama_config, _options, tiny_llama_dir


def _batch(vocab: int, seq_len: int = 61):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(vocab, (1, seq_len), generator=gen)
    positions = torch.cat([torch.arange(20), torch.arange(seq_len - 20)])[None]  # 2 documents
    labels = ids.clone()
    labels[:, 5:9] = -100  # some unsupervised tokens
    return ringattn.hf.shard_batch({"input_ids": ids, "labels": labels, "position_ids": positions})


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("family", ["llama", "gemma3-softcap"])
def test_chunked_loss_equals_the_model_loss(family):
    """ringattn.hf.loss(chunk=7) equals model(**batch).loss and its gradients (fp32, 1e-6), and
    lm_head only ever sees 7 rows at a time; Gemma's final soft-capping is followed too."""
    torch.manual_seed(0)
    if family == "llama":
        config = _llama_config(vocab_size=97)
    else:
        config = transformers.Gemma3TextConfig(
            vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, final_logit_softcapping=3.0,
            sliding_window=8, max_position_embeddings=256,
        )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    batch = _batch(97)
    want = model(**batch).loss
    want.backward()
    want_grads = _grads(model)
    rows = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda m, args, out: rows.append(args[0].shape[0])
    )
    got = ringattn.hf.loss(model, batch, chunk=7)
    got.backward()
    hook.remove()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert max(rows) == 7 and sum(rows) == 2 * batch["input_ids"].shape[1]  # + recomputation
    got_grads = _grads(model)
    assert got_grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="shift_labels and num_items_in_batch"):
        ringattn.hf.loss(model, {"input_ids": batch["input_ids"]})


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    """A tiny Llama saved in bfloat16 (config dtype bfloat16) with a tokenizer, and documents."""
    return tiny_llama_dir(tmp_path_factory.mktemp("bf16"), torch.bfloat16)


def test_chunked_training_at_cp2_equals_whole_logits_on_one_process(pools, bf16_model, tmp_path):
    """train --hf --loss-chunk 8 at CP = 2 has the losses of --loss-chunk 0 (the model's own,
    whole logits) on one process: 1e-5 over 3 steps in float32."""
    whole = _options(*bf16_model, tmp_path / "a", cp=1, loss_chunk=0)
    chunked = _options(*bf16_model, tmp_path / "b", cp=2, loss_chunk=8)
    want = pools(1).run("workers_train:train", whole)[0]["losses"]
    got = pools(2).run("workers_train:train", chunked)[0]["losses"]
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64),
        torch.tensor(want, dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )
    assert got[0] != got[-1]


def test_bf16_keeps_float32_master_weights_and_exports_the_source_dtype(
    pools, bf16_model, tmp_path
):
    """--dtype bfloat16 at CP = 2: the sharded parameters stay float32 (master weights), the
    losses follow float32 training to bf16 precision; the export is bfloat16 (the dtype the model
    came in), or float32 with --export-dtype float32."""
    from ringattn.train.config import TrainConfig
    from ringattn.train.hf.run import export

    fp32 = pools(2).run("workers_train:train", _options(*bf16_model, tmp_path / "f", cp=2))[0]
    opts = _options(*bf16_model, tmp_path / "b", cp=2, dtype="bfloat16")
    bf16 = pools(2).run("workers_train:train", opts)[0]
    assert all(p.dtype == torch.float32 for p in bf16["params"].values())
    torch.testing.assert_close(torch.tensor(bf16["losses"]), torch.tensor(fp32["losses"]),
                               rtol=2e-2, atol=0)  # fmt: skip
    assert bf16["losses"] != fp32["losses"]  # the forward really ran in bfloat16
    checkpoint = str(tmp_path / "b" / "checkpoints" / "step-00000003")
    for export_dtype, want in (("", torch.bfloat16), ("float32", torch.float32)):
        cfg = TrainConfig(**{**opts, "export_dtype": export_dtype})
        out = tmp_path / f"x{export_dtype}"
        export(cfg, checkpoint, str(out))
        model = transformers.AutoModelForCausalLM.from_pretrained(out)
        assert {p.dtype for p in model.parameters()} == {want}
        with open(out / "config.json") as f:
            assert json.load(f)["dtype"] == str(want).removeprefix("torch.")
        for name, p in model.named_parameters():  # the trained weights, rounded once
            torch.testing.assert_close(p, bf16["params"][f"model.{name}"].to(want), rtol=0, atol=0)


@pytest.mark.parametrize("vocab, rows", [(256, 262144), (32000, 2048), (128256, 512),
                                         (152064, 384), (262144, 256), (1 << 22, 64)])  # fmt: skip
def test_the_default_loss_chunk_keeps_a_chunks_logits_within_256_mib(vocab, rows):
    """--loss-chunk's default (and ringattn.hf.loss's) is chosen from the vocabulary: the most
    rows, a multiple of 64, whose float32 logits fit in 256 MiB (at least 64 rows)."""
    from ringattn.models.loss import LOGITS_BUDGET, resolve_chunk
    from ringattn.train.config import TrainConfig

    chunk = resolve_chunk(TrainConfig().loss_chunk, vocab)
    assert chunk == rows and chunk % 64 == 0
    assert chunk * vocab * 4 <= LOGITS_BUDGET or chunk == 64
    assert 2 * chunk * vocab * 4 > LOGITS_BUDGET  # not needlessly small


def test_hf_loss_default_chunk_follows_the_vocabulary(monkeypatch):
    """With the budget shrunk to 64 rows of a 97-id vocabulary, ringattn.hf.loss's default chunk
    gives lm_head at most 64 rows at a time (a fixed default would give it all 200)."""
    from ringattn.models import loss as models_loss

    monkeypatch.setattr(models_loss, "LOGITS_BUDGET", 64 * 97 * 4 + 100)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_llama_config(vocab_size=97),
                                                          dtype=torch.float32)  # fmt: skip
    batch = _batch(97, seq_len=200)
    rows = []
    model.get_output_embeddings().register_forward_hook(
        lambda m, args, out: rows.append(args[0].numel() // args[0].shape[-1])
    )
    got = ringattn.hf.loss(model, batch)
    torch.testing.assert_close(got, model(**batch).loss, rtol=1e-6, atol=1e-6)
    assert rows[:-1] == [64, 64, 64, 8] and rows[-1] == 200  # then the reference's whole logits
