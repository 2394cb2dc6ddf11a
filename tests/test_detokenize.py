"""Incremental detokenizing (serve/text.py's TextStream over inference/detokenize.py): each
token's text costs O(1) decoding, and the pieces add up to the whole decode, for byte-level BPE
and SentencePiece-style tokenizers, with and without a stop string."""

from __future__ import annotations

import random

import pytest

transformers = pytest.importorskip("transformers")

from ringattn.serve.text import TextStream
from serve_model import CORPUS, tokenizer


class _Counting:
    """A tokenizer whose decode counts the ids it is given."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _sentencepiece():
    """A SentencePiece-style tokenizer (Metaspace, byte fallback, the first space stripped)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator([*CORPUS, "é ü € 日本"], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>")  # fmt: skip


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_text_stream_is_incremental_and_equals_the_whole_decode(kind):
    tok = tokenizer() if kind == "byte-level" else _sentencepiece()
    rng = random.Random(0)
    pieces = ("Ã", "©", "â", "Ĥ", "¬") if kind == "byte-level" else ("<s>", "</s>", "\u2581")
    byte = [tok.convert_tokens_to_ids(c) for c in pieces]  # UTF-8 pieces; specials, a space
    for trial in range(20):
        ids = [rng.choice(byte) if rng.random() < 0.3 else rng.randrange(len(tok))
               for _ in range(300)]  # fmt: skip
        counting = _Counting(tok)
        stream = TextStream(counting, ["zz"] if trial % 2 else [])
        pieces = [stream.push(t) for t in ids] + [stream.flush()]
        whole = tok.decode(ids, skip_special_tokens=True)
        if not stream.stopped:
            assert "".join(pieces) == whole == stream.text
            assert counting.decoded < 20 * len(ids)  # O(1) per token (a re-decode: ~45 000)
        else:
            assert "".join(pieces) == whole[: whole.find("zz")]
