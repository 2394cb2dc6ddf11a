"""The haystack: filler text made offline, as token ids, and needles spliced into it at a depth.

    Codec        text <-> token ids: the model's tokenizer (no special tokens), or, for a model
                 directory without one, bytes mod vocab_size (decoded back as bytes)
    Filler       an endless stream of sentences: generated from a small seeded grammar
                 ("The grass is green. A quiet river keeps the old mill turning. ..."), or the
                 sentences of the text files given by --haystack, in order, again and again
    fill(...)    the first n tokens of that stream, and where each sentence starts
    splice(...)  needles inserted at sentence starts nearest their depths (0: the first
                 sentence, 1: after the last); several needles at one place keep their order

Every sentence is encoded once, with a leading space, and the haystack is the concatenation of
those ids, so that it is a pure function of (codec, filler, n): the same ids whatever else is
asked, and the same prefix at every length.
"""

from __future__ import annotations

import glob
import os
import random
import re
from collections.abc import Iterator

__all__ = ["Codec", "Filler", "fill", "splice"]

_SUBJECTS = ("The grass", "The sky", "The old river", "A quiet town", "The north wind",
             "Every morning", "The small garden", "A tall lighthouse", "The long road",
             "The harbour", "A wooden bridge", "The mountain lake", "The evening train",
             "A grey cat", "The village bakery", "The summer rain")  # fmt: skip
_PREDICATES = ("is green", "is calm today", "keeps the mill turning", "smells of fresh bread",
               "waits for the travellers", "is quiet after sunset", "glows in the distance",
               "carries the fishing boats home", "sleeps under the stars", "is painted blue",
               "sings in the trees", "brings the first snow", "opens before dawn",
               "follows the valley", "is full of old stories", "shines on the water")  # fmt: skip
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


class Codec:
    """Text to token ids and back: `tokenizer` (a transformers tokenizer), or with None the
    bytes of the text mod `vocab_size`."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._cache: dict[str, list[int]] = {}

    @property
    def name(self) -> str:
        if self.tokenizer is None:
            return f"bytes mod vocab_size {self.vocab_size}"
        return type(self.tokenizer).__name__

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, without special tokens (cached: the filler repeats its sentences)."""
        ids = self._cache.get(text)
        if ids is None:
            if self.tokenizer is None:
                ids = [b % self.vocab_size for b in text.encode()]
            else:
                ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            if len(self._cache) < 100_000:
                self._cache[text] = ids
        return ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode(errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def start(self) -> list[int]:
        """The special tokens the tokenizer puts before a text (BOS), if any."""
        if self.tokenizer is None:
            return []
        return list(self.tokenizer("", add_special_tokens=True)["input_ids"])

    def chat(self, marker: str) -> tuple[str, str]:
        """The chat template's text before and after one user message (generation prompt on)."""
        template = getattr(self.tokenizer, "chat_template", None) if self.tokenizer else None
        if not template:
            raise ValueError("--chat needs the model's tokenizer and its chat template, and this "
                             "model has none; drop --chat")  # fmt: skip
        messages = [{"role": "user", "content": marker}]
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        before, found, after = text.partition(marker)
        if not found:
            raise ValueError("the chat template does not show the user's message; drop --chat")
        return before, after


class Filler:
    """The haystack's sentences: generated (seeded) or read from --haystack files, endless."""

    def __init__(self, seed: int, paths: str | None = None):
        self.seed, self.paths = seed, paths
        self._sentences = _read_sentences(paths) if paths else None

    def describe(self) -> str:
        if self._sentences is None:
            return f"generated sentences (seed {self.seed})"
        return f"{len(self._sentences)} sentences of {self.paths}"

    def sentences(self) -> Iterator[str]:
        if self._sentences is not None:
            while True:
                yield from self._sentences
        rng = random.Random(f"ringattn-haystack/{self.seed}")
        while True:
            yield f"{rng.choice(_SUBJECTS)} {rng.choice(_PREDICATES)}."


def _read_sentences(paths: str) -> list[str]:
    """The sentences of a text file, or of every .txt/.md file under a directory (sorted)."""
    if os.path.isdir(paths):
        files = sorted(
            f
            for pattern in ("**/*.txt", "**/*.md")
            for f in glob.glob(os.path.join(paths, pattern), recursive=True)
        )
    elif os.path.isfile(paths):
        files = [paths]
    else:
        raise ValueError(f"--haystack {paths}: no such file or directory")
    sentences = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = " ".join(f.read().split())
        sentences += [s for s in _SENTENCE_END.split(text) if s]
    if not sentences:
        raise ValueError(f"--haystack {paths}: no text found (give .txt or .md files)")
    return sentences


def fill(codec: Codec, filler: Filler, n: int) -> tuple[list[int], list[int]]:
    """The first `n` ids of the filler stream, and the offset where each whole sentence starts
    (the last sentence may be cut at n)."""
    ids: list[int] = []
    starts: list[int] = []
    if n <= 0:
        return ids, starts
    for sentence in filler.sentences():
        starts.append(len(ids))
        ids += codec.encode(" " + sentence)
        if len(ids) >= n:
            break
    return ids[:n], starts


def splice(haystack: list[int], starts: list[int], needles: list[tuple[float, list[int]]]):
    """`haystack` with each needle (depth in [0, 1], ids) inserted at the sentence start nearest
    its depth (depth 1: at the end); returns (ids, the offset of each needle in them)."""
    places = [*starts, len(haystack)]
    spots = []
    for order, (depth, ids) in enumerate(needles):
        target = depth * len(haystack)
        place = min(places, key=lambda p: (abs(p - target), p))
        spots.append((place, order, ids))
    out: list[int] = []
    offsets = [0] * len(needles)
    last = 0
    for place, order, ids in sorted(spots):
        out += haystack[last:place]
        offsets[order] = len(out)
        out += ids
        last = place
    out += haystack[last:]
    return out, offsets
