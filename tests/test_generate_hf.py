"""`ringattn generate --hf DIR`: a local transformers model over a sharded KV cache.

A tiny random Llama saved with `save_pretrained` in tmp_path. Without a tokenizer (bytes mod
vocab_size), W = 2 launched ranks must stream exactly the ids of transformers' own
`model.generate(do_sample=False)` on this process; with a character-level tokenizer built offline
(one process), the streamed text must be that of the same ids decoded. Bad flags exit 2 before
any launch.
"""

from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ringattn.cli.main import main

LETTERS = "abcdefghijklmnopqrstuvwxyz .,"


def _tokenizer():
    """[UNK] <s> </s> then one id per character (offline, as in test_train_hf.py)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["[UNK]", "<s>", "</s>", *LETTERS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )


def _save_llama(directory, vocab_size: int):
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    return model.eval()


def _reference(model, ids: list[int], new: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new)
    return out[0, len(ids) :].tolist()


@pytest.mark.slow
def test_generate_hf_on_two_ranks_streams_model_generate(tmp_path, capfd):
    model = _save_llama(tmp_path / "llama", vocab_size=100)
    prompt = b"a 23-byte prompt: odd!!"  # 23 tokens, not a multiple of 2W = 4
    (tmp_path / "prompt.txt").write_bytes(prompt)
    argv = ["generate", "--nproc", "2", "--hf", str(tmp_path / "llama"), "--prompt-file",
            str(tmp_path / "prompt.txt"), "--max-new-tokens", "6"]  # fmt: skip
    assert main(argv) == 0
    out, err = capfd.readouterr()
    want = _reference(model, [b % 100 for b in prompt], 6)
    assert out.strip().splitlines()[-1] == "generated ids: " + " ".join(map(str, want))
    assert "bytes mod vocab_size 100" in err and "[prefill] layer 2/2" in err
    figures = re.search(r"time to first token [\d.]+ ms .* decode [\d.]+ tokens/s; KV cache per "
                        r"rank: ([\d.]+), ([\d.]+) MB", err)  # fmt: skip
    assert figures, err
    # 23 prompt + 5 fed tokens, 2 layers x (k, v) x 1 kv head x 8 dims x 4 bytes, over 2 ranks
    total_mb = 28 * 2 * 2 * 1 * 8 * 4 / 2**20
    assert float(figures[1]) + float(figures[2]) == pytest.approx(total_mb, abs=2e-3)


def test_generate_hf_with_a_tokenizer_streams_decoded_text(tmp_path, capfd):
    tokenizer = _tokenizer()
    model = _save_llama(tmp_path / "llama", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(tmp_path / "llama")
    text = "the quick brown fox"
    argv = ["generate", "--hf", str(tmp_path / "llama"), "--prompt", text,
            "--max-new-tokens", "5"]  # fmt: skip
    assert main(argv) == 0
    out, err = capfd.readouterr()
    want = _reference(model, tokenizer(text)["input_ids"], 5)
    assert out.strip().splitlines()[-1] == text + "|" + tokenizer.decode(want)
    assert "prompt tokens by the model's tokenizer (" in err, err


def test_generate_hf_loads_the_checkpoint_dtype_or_dtype(tmp_path, capfd):
    model = _save_llama(tmp_path / "llama", vocab_size=64)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "llama")
    for flags, want in (([], "bfloat16"), (["--dtype", "float32"], "float32")):
        argv = ["generate", "--hf", str(tmp_path / "llama"), "--prompt", "abc",
                "--max-new-tokens", "2", *flags]  # fmt: skip
        assert main(argv) == 0
        err = capfd.readouterr().err
        assert f"(weights from_pretrained, {want})" in err, err


def test_generate_hf_rejects_bad_flags_before_launching(tmp_path, capfd):
    _save_llama(tmp_path / "llama", vocab_size=50)
    good = str(tmp_path / "llama")
    for argv, needle in [
        (["--hf", str(tmp_path / "nowhere"), "--prompt", "x"], "no such directory or file"),
        (["--hf", str(tmp_path), "--prompt", "x"], "has no config.json"),
        (["--hf", good], "--hf needs a prompt"),
        (["--hf", good, "--prompt", "x", "--tp", "3"], "--tp 3 must divide --nproc 2"),
        (["--hf", good, "--prompt", "x", "--chat"], "--chat needs the model's tokenizer"),
        (["--hf", good, "--prompt", "x", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["--hf", good, "--checkpoint", good, "--prompt", "x"], "not allowed with argument"),
    ]:
        with pytest.raises(SystemExit) as info:
            main(["generate", "--nproc", "2", *argv])
        assert info.value.code == 2
        assert needle in capfd.readouterr().err


@pytest.mark.parametrize("tied", [True, False])
def test_the_head_is_laid_out_column_major_for_cpu_decoding(tied):
    """lay_out_for_decode: the float32 head's bytes become column-major in place (same values,
    Parameter and tie), logits within float32 rounding and the same greedy tokens; once only; a
    bfloat16 model and a GPU device are left as they are."""
    from ringattn.inference.hf.weights import lay_out_for_decode

    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
        eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    head = model.get_output_embeddings().weight
    before, ids = head.detach().clone(), torch.randint(3, 300, (1, 40))
    with torch.no_grad():
        logits = model(ids).logits
    tokens = _reference(model, ids[0].tolist(), 8)
    assert lay_out_for_decode(model, torch.device("cpu"))
    assert model.get_output_embeddings().weight is head and head.stride() == (1, 300)
    assert torch.equal(head, before) and not head.is_contiguous()
    assert (model.get_input_embeddings().weight is head) == tied
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, logits, rtol=1e-5, atol=1e-5)
    assert _reference(model, ids[0].tolist(), 8) == tokens
    assert not lay_out_for_decode(model, torch.device("cpu"))  # already column-major

    half = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert not lay_out_for_decode(half, torch.device("cpu"))  # its AMX path: slower so
    assert half.get_output_embeddings().weight.is_contiguous()
    fresh = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert not lay_out_for_decode(fresh, torch.device("cuda", 0))
    assert fresh.get_output_embeddings().weight.is_contiguous()
