"""`ringattn train --hf`: a transformers Llama trained with CP = 2 equals CP = 1, resumes exactly,
exports a directory transformers loads back, and refuses bad inputs before launching.

The model is a tiny random Llama saved with `save_pretrained` (weights, so `from_pretrained`)
beside a character-level tokenizer built offline with `tokenizers` (a WordLevel model wrapped in
PreTrainedTokenizerFast); the CLI case uses a bare config.json (random init, bytes mod vocab).
Multi-rank training runs the real trainer in worker pools (workers_train.train); the CLI case
launches 2 processes.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ringattn.cli.main import main
from ringattn.train.hf.data import PackedDocuments, load_corpus
from ringattn.train.progress import read_log

LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789 ."
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven")


def _llama_config(**overrides):
    options = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
               "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
               "max_position_embeddings": 512, "architectures": ["LlamaForCausalLM"]}  # fmt: skip
    return transformers.LlamaConfig(**{**options, **overrides})


def _tokenizer():
    """A character-level tokenizer, built offline: [UNK] <s> </s> then one id per character."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["[UNK]", "<s>", "</s>", *LETTERS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )


def _text(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(n)) + f" {i}."


def tiny_llama_dir(root, dtype: torch.dtype = torch.float32):
    """(model dir with weights in `dtype` and a tokenizer, corpus dir of 12 one-document files)."""
    return save_with_corpus(root, _llama_config(), dtype)


def save_with_corpus(root, config, dtype: torch.dtype = torch.float32):
    """`config`'s model (seed 1) and the tokenizer in root/model, 12 one-document files in
    root/docs: (model dir, corpus dir)."""
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(root / "model")
    _tokenizer().save_pretrained(root / "model")
    (root / "docs").mkdir()
    for i in range(12):
        (root / "docs" / f"{i:02d}.txt").write_text(_text(i, 2 + i % 5))
    return root / "model", root / "docs"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(model dir with weights and tokenizer, corpus dir of 12 one-document files)."""
    return tiny_llama_dir(tmp_path_factory.mktemp("hf"))


def _options(model_dir, docs, out_dir, **overrides) -> dict:
    return {"hf": str(model_dir), "data": f"text:{docs}", "seq_len": 45, "batch_size": 2,
            "steps": 3, "warmup": 1, "lr": 1e-2, "quiet": True, "checkpoint_every": 0,
            "out_dir": str(out_dir), **overrides}  # fmt: skip


@pytest.fixture(scope="module")
def cp2_run(pools, llama, tmp_path_factory):
    """3 uninterrupted steps at CP = 2 (zigzag, S = 2 x 45 tokens: not a multiple of 4)."""
    out = tmp_path_factory.mktemp("cp2")
    result = pools(2).run("workers_train:train", _options(*llama, out, cp=2))[0]
    return {**result, "out_dir": out}


def test_packed_documents_from_the_tokenizer(llama):
    """Each file is one document, tokenized by the model's tokenizer with EOS after it; window
    positions restart at every document start; labels never cross a document end."""
    import ringattn
    import ringattn.hf

    model_dir, docs = llama
    corpus = load_corpus(str(docs), str(model_dir), 64)
    assert corpus.documents == 12 and "tokenizer" in corpus.tokenized_by
    want = _tokenizer()(_text(0, 2))["input_ids"] + [2]
    assert corpus.tokens[: len(want)].tolist() == want
    data = PackedDocuments(corpus, 45, seed=0)
    ids, positions = data.sample(3)
    assert torch.equal(ids, data.sample(3)[0]) and not torch.equal(ids, data.sample(4)[0])
    assert positions[0] == 0 and 2 in ids[:-1].tolist()  # the window holds a document end
    for t in range(1, 45):  # a document starts right after an EOS, nowhere else
        assert positions[t] == (0 if ids[t - 1] == 2 else positions[t - 1] + 1)
    local = ringattn.hf.shard_batch({"input_ids": ids[None], "labels": ids[None],
                                     "position_ids": positions[None]})  # fmt: skip
    bounds = [*(positions == 0).nonzero().flatten().tolist(), 45]
    index = ringattn.positions(45, cu_seqlens=bounds)  # global token of each local row, -1: pad
    nexts = [-100 if t == 44 or positions[t + 1] == 0 else int(ids[t + 1]) for t in range(45)]
    want = [nexts[t] if t >= 0 else -100 for t in index.tolist()]
    assert local["labels"][0].tolist() == want and want.count(-100) >= len(bounds) - 1


@pytest.mark.parametrize("dp, cp", [(1, 2), (2, 1), (2, 2)])
@pytest.mark.slow
def test_parallel_training_equals_one_process(pools, llama, tmp_path, cp2_run, dp, cp):
    """fp32, the pretrained tiny Llama: CP = 2 (zigzag), DP = 2 and DP 2 x CP 2 (striped) losses
    equal one process's on the same documents (1e-5), and so do the trained weights; training
    moved them far more than the tolerance."""
    sgd = {"optimizer": "sgd", "lr": 1.0}  # weights exact by construction (workers_train.build)
    single = _options(*llama, tmp_path / "1", cp=1, batch_size=2 * dp, **sgd)
    want = pools(1).run("workers_train:train", single)[0]
    if (dp, cp) == (1, 2):
        got = pools(2).run("workers_train:train", _options(*llama, tmp_path, cp=2, **sgd))[0]
    else:
        options = _options(*llama, tmp_path, dp=dp, cp=cp, layout="striped", **sgd)
        got = pools(dp * cp).run("workers_train:train", options)[0]
    assert got["dp_cp"] == (dp, cp) and len(got["losses"]) == 3
    torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64),
                               torch.tensor(want["losses"], dtype=torch.float64),
                               rtol=1e-5, atol=0)  # fmt: skip
    assert got["losses"][0] != got["losses"][-1]
    start = transformers.AutoModelForCausalLM.from_pretrained(llama[0])
    initial = dict(start.named_parameters())
    assert got["params"].keys() == want["params"].keys()
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    moved = want["params"]["model.lm_head.weight"] - initial["lm_head.weight"]
    assert moved.abs().max() > 100 * 1e-6


@pytest.mark.slow
def test_resume_continues_exactly(pools, llama, tmp_path, cp2_run):
    """Stopped after step 2 and rerun: step 3 and the weights equal the uninterrupted run's."""
    options = _options(*llama, tmp_path, cp=2)
    first = pools(2).run("workers_train:train", {**options, "stop_at": 2})[0]
    second = pools(2).run("workers_train:train", options)[0]
    assert (first["start_step"], second["start_step"]) == (0, 2)
    assert first["losses"] + second["losses"] == cp2_run["losses"]  # bitwise
    for name, value in cp2_run["params"].items():
        assert torch.equal(second["params"][name], value), name


def test_export_of_a_pretrained_model_with_its_tokenizer(llama, tmp_path, cp2_run):
    """--export of the CP = 2 run: transformers loads the model (the trained weights, exactly)
    and the tokenizer (the same ids) from the exported directory."""
    from ringattn.train.config import TrainConfig
    from ringattn.train.hf.run import export

    cfg = TrainConfig(**_options(*llama, cp2_run["out_dir"], cp=2))
    export(cfg, str(cp2_run["out_dir"] / "checkpoints" / "step-00000003"), str(tmp_path / "x"))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "x")
    for name, p in model.named_parameters():
        assert torch.equal(p, cp2_run["params"][f"model.{name}"]), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "x")
    assert tokenizer("a fox 7.")["input_ids"] == _tokenizer()("a fox 7.")["input_ids"]


@pytest.mark.slow
def test_cli_trains_a_bare_config_and_exports(tmp_path, capfd):
    """`ringattn train --hf config.json` on 2 processes (random init, bytes mod vocab, tied
    embeddings, blank-line documents), --export: transformers loads the export, and its weights
    are the final checkpoint's (read by torch's own DCP converter), not the initial ones."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    config = _llama_config(vocab_size=200, tie_word_embeddings=True)
    config.save_pretrained(tmp_path / "cfg")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(_text(i, 3 + i % 4) for i in range(10)))
    out, export = tmp_path / "run", tmp_path / "export"
    argv = ["train", "--hf", str(tmp_path / "cfg" / "config.json"), "--data", f"text:{corpus}",
            "--nproc", "2", "--seq-len", "40", "--steps", "2", "--warmup", "1", "--lr", "1e-2",
            "--out-dir", str(out), "--export", str(export), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    stdout = capfd.readouterr().out
    assert "random init from config.json" in stdout and "bytes mod vocab_size 200" in stdout
    log = read_log(str(out / "train_log.jsonl"))
    assert log[0]["event"] == "hf" and log[0]["documents"] == 10
    assert [r["step"] for r in log if "loss" in r] == [1, 2]
    exported = transformers.AutoModelForCausalLM.from_pretrained(export)
    dcp_to_torch_save(str(out / "checkpoints" / "step-00000002"), str(tmp_path / "ckpt.pt"))
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)["model"]
    torch.manual_seed(0)  # --seed 0: the ranks' initial weights
    initial = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init = dict(initial.named_parameters())
    for name, p in exported.named_parameters():
        torch.testing.assert_close(p, saved[f"model.{name}"], rtol=0, atol=0, msg=name)
        assert not torch.equal(p, init[name]), name
    assert exported.config.tie_word_embeddings
    with open(export / "config.json") as f:
        assert "ringattn" not in json.dumps(json.load(f))  # a plain model, loadable anywhere
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "train.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing", "no such directory or file"),
        ("no-config", "the directory has no config.json"),
        ("vit", "model_type 'vit' .* has no causal-LM architecture"),
        ("dropout", "attention_dropout=0.1 is not supported"),
        ("key-value", "--hf trains on packed text documents: give --data text:PATH"),
        ("short", "fewer than --seq-len 4096"),
        ("export-only", "--export writes a Hugging Face model directory: it needs --hf"),
    ],
)
def test_bad_inputs_fail_before_launching(tmp_path, capfd, case, match):
    """Each mistake is a ValueError in the parent (exit 2, the fix in the message): no rank was
    started, so nothing is written under --out-dir."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("some text\n\nand more")
    (tmp_path / "empty").mkdir()
    hf = str(tmp_path / "cfg")
    if case == "vit":
        transformers.ViTConfig().save_pretrained(hf)
    elif case == "dropout":
        _llama_config(attention_dropout=0.1).save_pretrained(hf)
    elif case in ("key-value", "short", "export-only"):
        _llama_config().save_pretrained(hf)
    hf = {"missing": str(tmp_path / "nowhere"), "no-config": str(tmp_path / "empty")}.get(case, hf)
    argv = ["train", "--hf", hf, "--data", f"text:{corpus}", "--seq-len", "8", "--nproc", "2",
            "--out-dir", str(tmp_path / "out")]  # fmt: skip
    if case == "key-value":
        argv += ["--data", "key-value"]
    elif case == "short":
        argv += ["--seq-len", "4096"]
    elif case == "export-only":
        argv = [a for a in argv if a not in ("--hf", hf)] + ["--export", str(tmp_path / "x")]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert re.search(match, capfd.readouterr().err)
    assert not (tmp_path / "out").exists()
