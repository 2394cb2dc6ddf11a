"""Chat SFT and big corpora for `train --hf`: conversations under a ChatML template with the loss
on the assistant's tokens only; CP = 2 equals one process; token files written once and
memory-mapped; .jsonl / .parquet directories.

The tokenizer is built offline in the test (`tokenizers`: one id per character, plus the ChatML
special tokens) with a ChatML Jinja template; the reference for the assistant mask is the
conversation's text itself (the characters of each assistant turn and its <|im_end|>).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ringattn.train.config import TrainConfig
from ringattn.train.hf.chat import render
from ringattn.train.hf.corpus import load_corpus
from ringattn.train.hf.data import PackedConversations
from test_train_hf import LETTERS, _llama_config, _options

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _chat_tokenizer(template: str | None = CHATML):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["[UNK]", "<|im_start|>", "<|im_end|>", "\n", *LETTERS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    out = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>", pad_token="[UNK]",
        additional_special_tokens=["<|im_start|>"],
    )  # fmt: skip
    out.chat_template = template
    return out


def _conversation(i: int, turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "be brief."}]
    for t in range(turns):
        messages += [{"role": "user", "content": f"{i} {t}."},
                     {"role": "assistant", "content": f"it is {i + t}."}]  # fmt: skip
    return messages


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """(model dir with a ChatML tokenizer, conversations.jsonl: 14 of 1-2 turns and one of 12)."""
    root = tmp_path_factory.mktemp("chat")
    torch.manual_seed(2)
    model = transformers.AutoModelForCausalLM.from_config(_llama_config(), dtype=torch.float32)
    model.save_pretrained(root / "model")
    _chat_tokenizer().save_pretrained(root / "model")
    conversations = [_conversation(i, 1 + i % 2) for i in range(14)] + [_conversation(99, 12)]
    with open(root / "chat.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": m}) + "\n" for m in conversations)
    return root / "model", root / "chat.jsonl", conversations


def test_only_the_assistant_turns_and_their_end_of_turn_are_supervised():
    """The supervised tokens spell each assistant reply followed by <|im_end|>, nothing else."""
    tokenizer = _chat_tokenizer()
    messages = _conversation(3, 2)
    ids, _ = render(tokenizer, messages)
    assert ids == tokenizer(tokenizer.apply_chat_template(messages, tokenize=False))["input_ids"]
    assert _supervised_pieces(tokenizer, messages) == ["it is 3.<|im_end|>", "it is 4.<|im_end|>"]
    with pytest.raises(ValueError, match="must be a non-empty list"):
        render(tokenizer, [{"content": "no role"}])


def _supervised_pieces(tokenizer, messages: list[dict]) -> list[str]:
    """The text of each run of supervised tokens of `messages` under `tokenizer`."""
    ids, supervised = render(tokenizer, messages)
    pieces, current = [], []
    for token, keep in zip([*ids, None], [*supervised, False]):
        if keep:
            current.append(token)
        elif current:
            pieces.append("".join(tokenizer.convert_ids_to_tokens(current)))
            current = []
    return pieces


# a default system prompt when the conversation has none: guarded (renders an empty conversation)
# or not (messages[0] of an empty list fails: the header is then found by probing the first turn)
_DEFAULT_SYSTEM = "<|im_start|>system\nbe kind.<|im_end|>\n{% endif %}"
GUARDED = "{% if not messages or messages[0]['role'] != 'system' %}" + _DEFAULT_SYSTEM + CHATML
UNGUARDED = "{% if messages[0]['role'] != 'system' %}" + _DEFAULT_SYSTEM + CHATML


@pytest.mark.parametrize(
    "template", [CHATML, GUARDED, UNGUARDED], ids=["chatml", "guarded", "unguarded"]
)
def test_a_conversation_that_opens_with_the_assistant_supervises_only_its_replies(template):
    """The first turn's span starts after the template's own header for it (and after a system
    prompt the template injects), never at character 0."""
    tokenizer = _chat_tokenizer(template)
    messages = [{"role": "assistant", "content": "hi."}, {"role": "user", "content": "x"},
                {"role": "assistant", "content": "ok."}]  # fmt: skip
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.startswith("<|im_start|>system" if template != CHATML else "<|im_start|>assis")
    assert _supervised_pieces(tokenizer, messages) == ["hi.<|im_end|>", "ok.<|im_end|>"]
    # the injected system prompt of a conversation that opens with the user is not trained on
    assert _supervised_pieces(tokenizer, messages[1:]) == ["ok.<|im_end|>"]


def test_chat_training_at_cp2_equals_one_process(pools, chat, tmp_path):
    """chat:FILE at CP = 2 (zigzag) has one process's losses (1e-5, 2 steps); each step's
    `supervised` is the number of assistant tokens in its windows; the long conversation was
    split, and the record says so."""
    from ringattn.train.hf.run import describe

    model_dir, data, conversations = chat
    cache = str(tmp_path / "tokens")
    options = _options(model_dir, "", tmp_path / "1", data=f"chat:{data}", seq_len=96, steps=2,
                       token_cache=cache)  # fmt: skip
    want = pools(1).run("workers_train:train", options)[0]
    got = pools(2).run("workers_train:train", {**options, "cp": 2, "out_dir": str(tmp_path)})[0]
    torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64),
                               torch.tensor(want["losses"], dtype=torch.float64),
                               rtol=1e-5, atol=0)  # fmt: skip
    assert got["supervised"] == want["supervised"]
    tokenizer = _chat_tokenizer()
    corpus = load_corpus(str(data), str(model_dir), 64, kind="chat", cache_dir=cache)
    mask = [s for m in conversations for s in render(tokenizer, m)[1]]
    assert corpus.supervised.tolist() == mask and corpus.documents == len(conversations)
    windows = PackedConversations(corpus, 96, 0)
    for step, count in enumerate(got["supervised"]):
        samples = [windows.sample(step * 2 + i) for i in range(2)]
        # the assistant tokens, less any that opens a window's document (nothing predicts it)
        assert count == sum(int(((lab != -100) & (pos > 0)).sum()) for _, pos, lab in samples)
        assert count > 0
    record = describe(TrainConfig(**options))
    assert record["longer_than_seq_len"] == 1 and "split" in record["long_conversations"]
    assert record["supervised_tokens"] == sum(mask)


def test_windows_pack_whole_conversations_and_split_long_ones(chat, tmp_path):
    """Every window starts a conversation (or a piece of the long one), holds at most seq_len
    real tokens, pads with an unsupervised document; together the windows cover the corpus."""
    model_dir, data, conversations = chat
    corpus = load_corpus(str(data), str(model_dir), 64, kind="chat", cache_dir=str(tmp_path))
    windows = PackedConversations(corpus, 96, 0, pad_id=0)
    assert windows.split == 1
    lengths = [len(render(_chat_tokenizer(), m)[0]) for m in conversations]
    assert lengths[-1] > 96 and max(lengths[:-1]) <= 96
    covered = 0
    for w in range(len(windows.windows) - 1):
        a, b = int(windows.pieces[windows.windows[w]]), int(windows.pieces[windows.windows[w + 1]])
        covered += b - a
        assert 0 < b - a <= 96
    assert covered == sum(lengths)
    ids, positions, labels = windows.sample(0)
    assert ids.shape == positions.shape == labels.shape == (96,) and positions[0] == 0


def test_token_files_are_written_once_and_memory_mapped(tmp_path):
    """load_corpus tokenizes a directory of .txt, .jsonl ('text') and .parquet ('text') files
    into token files equal to the tokenizer's own output (EOS after each document), reuses them
    (same directory, not rewritten), and tokenizes again when a file changes."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    from test_train_hf import _tokenizer

    model = tmp_path / "model"
    _llama_config().save_pretrained(model)
    _tokenizer().save_pretrained(model)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("the fox.")
    (docs / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in ["a dog", "seven"]))
    pq.write_table(pa.table({"text": ["over a lazy dog", "1 2 3"]}), docs / "c.parquet")
    cache = str(tmp_path / "cache")
    corpus = load_corpus(str(docs), str(model), 64, cache_dir=cache)
    tok = _tokenizer()
    texts = ["the fox.", "a dog", "seven", "over a lazy dog", "1 2 3"]
    want = [i for t in texts for i in tok(t)["input_ids"] + [tok.eos_token_id]]
    assert corpus.tokens.tolist() == want and corpus.documents == 5
    assert corpus.tokens.dtype == torch.int32
    assert os.path.getsize(os.path.join(corpus.directory, "tokens.i32")) == 4 * len(want)
    meta = os.path.join(corpus.directory, "meta.json")
    written = os.stat(meta).st_mtime_ns
    again = load_corpus(str(docs), str(model), 64, cache_dir=cache)
    assert again.directory == corpus.directory and os.stat(meta).st_mtime_ns == written
    (docs / "a.txt").write_text("the quick fox.")
    changed = load_corpus(str(docs), str(model), 64, cache_dir=cache)
    assert changed.directory != corpus.directory and len(changed.tokens) == len(want) + 6


@pytest.mark.parametrize(
    "case, match",
    [
        ("no-template", "has no chat_template"),
        ("bad-json", "chat.jsonl:2: not JSON"),
        ("no-messages", "no 'messages' field"),
        ("unknown-kind", "give --data text:PATH .* or chat:PATH"),
    ],
)
def test_bad_chat_data_is_a_value_error(tmp_path, case, match):
    from ringattn.train.hf.recipe import check

    model = tmp_path / "model"
    _llama_config().save_pretrained(model)
    _chat_tokenizer(None if case == "no-template" else CHATML).save_pretrained(model)
    lines = [json.dumps({"messages": _conversation(1, 1)})]
    lines.append(
        {"bad-json": "{oops", "no-messages": json.dumps({"text": "x"})}.get(case, lines[0])
    )
    (tmp_path / "chat.jsonl").write_text("\n".join(lines))
    data = f"{'dialog' if case == 'unknown-kind' else 'chat'}:{tmp_path / 'chat.jsonl'}"
    cfg = TrainConfig(hf=str(model), data=data, seq_len=32, token_cache=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=match):
        check(cfg, 1)
