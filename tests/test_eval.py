"""`ringattn eval niah`: retrieval prompts through CP prefill and the sharded KV cache.

A tiny random Llama (hidden 64: its answers depend on the context) with a character-level
tokenizer built offline, saved in a temporary directory. The prompts must be exactly `length`
tokens, a pure function of their arguments, with the needle at its depth; the answers at N = 2
and 4 ranks must equal N = 1's for every task (greedy: the worker pools), and so must the CLI's
at --nproc 2, which writes the JSON (schema checked), the table and the heatmap, and rejects bad
flags before launching.
"""

from __future__ import annotations

import json
import string

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ringattn.cli.main import main
from ringattn.evals.grid import Grid, depth_list, evaluate
from ringattn.evals.haystack import Codec, Filler
from ringattn.evals.tasks import TASKS, build_prompt, score

CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")  # fmt: skip


def _tokenizer():
    """[UNK] <s> </s> then one id per printable character; decoding joins the characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["[UNK]", "<s>", "</s>", *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("eval") / "llama"
    tokenizer = _tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(5)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def test_prompts_are_exact_pure_and_hold_the_needles_at_their_depth(tmp_path):
    codec = Codec(_tokenizer(), 200)
    for task in TASKS:
        for depth in (0.0, 0.5, 1.0):
            prompt = build_prompt(codec, task, 700, depth, 1, Filler(1))
            assert len(prompt.ids) == 700
            assert prompt == build_prompt(Codec(_tokenizer(), 200), task, 700, depth, 1, Filler(1))
            text = codec.decode(prompt.ids)
            assert all(e in text for e in prompt.expected), (task, prompt.expected)
            assert prompt.question in text and text.count("\n") >= 2
    prompts = [build_prompt(codec, "niah", 900, d, 1, Filler(1)) for d in (0.0, 0.5, 1.0)]
    first, middle, last = (p.needle_offsets[0] for p in prompts)
    assert codec.decode(prompts[0].ids[:first]).endswith("afterwards.\n")  # the haystack opens
    assert codec.decode(prompts[2].ids[last:]).startswith(" One of the special magic numbers")
    assert "\nWhat is" in codec.decode(prompts[2].ids[last : last + 80])  # ... and closes it
    assert abs(middle - (first + last) / 2) < 40  # the sentence start nearest half way
    # another seed, other needles; bytes when there is no tokenizer; --chat through the template
    assert build_prompt(codec, "niah", 700, 0.5, 2, Filler(2)).expected != prompt.expected
    raw = build_prompt(Codec(None, 300), "multikey", 700, 0.5, 1, Filler(1))
    assert len(raw.ids) == 700 and max(raw.ids) < 256
    chat_codec = Codec(_tokenizer(), 200)
    chat_codec.tokenizer.chat_template = TEMPLATE
    chat = chat_codec.decode(build_prompt(chat_codec, "niah", 700, 0.5, 1, Filler(1), True).ids)
    assert chat.startswith("user: Some special") and "?\nassistant: The special" in chat
    with pytest.raises(ValueError, match="too short for --task vartrack"):
        build_prompt(codec, "vartrack", 100, 0.5, 1, Filler(1))
    (tmp_path / "essay.txt").write_text("Rivers run far. Mountains stand still!\n\nSo it goes.")
    essay = codec.decode(build_prompt(codec, "niah", 700, 0.5, 1, Filler(0, str(tmp_path))).ids)
    assert "So it goes. Rivers run far. Mountains stand still!" in essay
    assert depth_list("5") == [0, 25, 50, 75, 100] and depth_list("60,10") == [10, 60]
    for bad in ("0", "0,120", "x"):
        with pytest.raises(ValueError, match="--depths"):
            depth_list(bad)
    assert score("it is 123 and 456", ["123", "456", "789"]) == pytest.approx(2 / 3)


@pytest.mark.slow
def test_eval_niah_on_1_and_2_ranks_writes_the_same_answers(tiny, tmp_path, capfd):
    docs = {}
    for n in (1, 2):
        argv = ["eval", "niah", "--hf", tiny, "--lengths", "400,700", "--depths", "3",
                "--nproc", str(n), "--out", str(tmp_path / str(n))]  # fmt: skip
        assert main(argv) == 0
        out, err = capfd.readouterr()
        docs[n] = json.loads((tmp_path / str(n) / "niah.json").read_text())
        assert "depth \\ length    400    700" in out and "mean" in out
        assert "\r[eval niah] 6/6: 700 tokens, depth 100%" in err, err
    one = docs[1]
    assert one["model"] == tiny and one["task"] == "niah" and one["nproc"] == 1
    assert 0 <= one["accuracy"] <= 1 and len(one["results"]) == 6
    for r in one["results"]:
        assert set(r) >= {"length", "depth", "correct", "answer", "expected", "ttft_s"}
        assert r["expected"].isdigit() and len(r["expected"]) == 7 and r["ttft_s"] > 0
        assert r["prompt_tokens"] == r["length"] and isinstance(r["correct"], bool)
    assert [(r["length"], r["depth"]) for r in one["results"]] == [
        (n, d) for n in (400, 700) for d in (0, 50, 100)
    ]
    answers = [r["answer"] for r in one["results"]]
    assert len(set(answers)) > 1  # the model's answers depend on the prompt
    assert [r["answer"] for r in docs[2]["results"]] == answers and docs[2]["nproc"] == 2
    pytest.importorskip("matplotlib")
    assert (tmp_path / "1" / "niah.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_every_task_answers_the_same_on_1_2_and_4_ranks(tiny, pools):
    from ringattn.integrations.hf.source import load_model, model_source

    model = load_model(model_source(tiny)).eval()
    codec = Codec(transformers.AutoTokenizer.from_pretrained(tiny), model.config.vocab_size)
    seen: set[str] = set()
    for task in TASKS:
        grid = Grid(task, [800], [30.0, 90.0], seed=3, max_new_tokens=10)
        want = [(r["answer"], r["expected"], r["score"]) for r in evaluate(model, codec, grid)]
        assert all(isinstance(e, list) for _, e, _ in want) == (task in ("multivalue", "vartrack"))
        seen.update(answer for answer, _, _ in want)
        for world_size in (2, 4):
            got = pools(world_size).run("workers_eval:answers", tiny, grid)
            assert got == [want] * world_size, (task, world_size)
    assert len(seen) > 2  # the answers depend on the prompt: their equality means something


def test_eval_rejects_bad_flags_before_launching(tiny, tmp_path, capfd, monkeypatch):
    base = ["eval", "niah", "--hf", tiny, "--nproc", "2", "--out", str(tmp_path)]
    for extra, needle in [
        (["--tp", "3"], "--tp 3 must divide --nproc 2"),
        (["--lengths", "100"], "--lengths 100 is too short for --task niah"),
        (["--depths", "0,150"], "--depths"),
        (["--task", "nope"], "invalid choice"),
        (["--haystack", str(tmp_path / "nowhere")], "--haystack"),
        (["--chat"], "--chat needs"),
    ]:
        with pytest.raises(SystemExit) as info:
            main([*base, *extra])
        assert info.value.code == 2 and needle in capfd.readouterr().err, extra
    import importlib.util

    real = importlib.util.find_spec
    hide = lambda name, *a: None if name == "transformers" else real(name, *a)
    monkeypatch.setattr(importlib.util, "find_spec", hide)
    with pytest.raises(SystemExit) as info:
        main(base)
    assert info.value.code == 2
    assert "ringattn eval needs the hf extra: pip install 'ringattn[hf]'" in capfd.readouterr().err
