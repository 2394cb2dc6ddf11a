"""The retrieval tasks, RULER-style: each prompt is exactly `length` tokens, a pure function of
(codec, task, length, depth, seed, filler, chat), so any number of ranks gets the same ids.

    [BOS] [chat: template before the message]
    intro        "Some special magic numbers are hidden within the following text. ..."
    haystack     filler sentences with the task's needles spliced in (haystack.py)
    question     "What is the special magic number for quiet-harbor mentioned in ...?"
    [chat: template after the message, the generation prompt]
    answer lead  "The special magic number for quiet-harbor mentioned in the provided text is"

    task        needles                                               asked       expected
    niah        1 key: value, at the depth                            its value   one value
    multikey    4 keys (3 distractors at seeded depths), 1 at depth   one key     one value
    multivalue  4 values of one key, the first at the depth           the key     all 4 values
    vartrack    VAR A = 12345, VAR B = VAR A, ... 4 hops, the first   the value   all 5 names
                at the depth, the rest later

The filler takes whatever the fixed parts leave, so the haystack grows with the length; a length
that leaves fewer than 16 filler tokens is a ValueError. The needles' keys and values come from a
seeded generator per (task, seed, length, depth); the filler's stream from the seed alone.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from ringattn.evals.haystack import Codec, Filler, fill, splice

__all__ = ["TASKS", "Prompt", "build_prompt", "score"]

TASKS = ("niah", "multikey", "multivalue", "vartrack")
"""--task choices; `niah` (one needle) is the default."""

NEW_TOKENS = {"niah": 16, "multikey": 16, "multivalue": 48, "vartrack": 32}
"""Tokens each task's answer may use by default (--max-new-tokens overrides)."""

_INTRO = {
    "niah": "Some special magic numbers are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the numbers afterwards.\n",
    "vartrack": "Memorize and track the chain(s) of variable assignment hidden in the following "
    "text.\n",
}
_WORDS = ("quiet", "brave", "amber", "silver", "rapid", "gentle", "hollow", "crimson", "lucky",
          "frozen", "golden", "tidy", "wild", "humble", "bright", "misty")  # fmt: skip
_NOUNS = ("harbor", "falcon", "meadow", "lantern", "canyon", "orchard", "compass", "glacier",
          "violin", "pepper", "beacon", "saddle", "kettle", "marble", "thistle",
          "anchor")  # fmt: skip
_MIN_FILLER = 16


@dataclass
class Prompt:
    """One prompt of a task: its ids, what the answer must contain, where the needles went."""

    ids: list[int]
    expected: list[str]
    needle_offsets: list[int] = field(default_factory=list)
    question: str = ""


def _key(rng: random.Random, taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(_WORDS)}-{rng.choice(_NOUNS)}"
        if key not in taken:
            taken.add(key)
            return key


def _number(rng: random.Random, taken: set[str]) -> str:
    while True:
        value = str(rng.randint(1_000_000, 9_999_999))
        if value not in taken:
            taken.add(value)
            return value


def _variable(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in taken:
            taken.add(name)
            return name


def _magic(key: str, value: str) -> str:
    return f" One of the special magic numbers for {key} is: {value}."


def _needles(task: str, depth: float, rng: random.Random):
    """(needles as (depth, text), expected answers, question, answer lead) of one prompt."""
    taken: set[str] = set()
    if task == "niah":
        key, value = _key(rng, taken), _number(rng, taken)
        needles = [(depth, _magic(key, value))]
        expected = [value]
    elif task == "multikey":
        keys = [_key(rng, taken) for _ in range(4)]
        values = [_number(rng, taken) for _ in keys]
        needles = [(depth, _magic(keys[0], values[0]))]
        needles += [(rng.random(), _magic(k, v)) for k, v in zip(keys[1:], values[1:])]
        key, expected = keys[0], [values[0]]
    elif task == "multivalue":
        key = _key(rng, taken)
        expected = [_number(rng, taken) for _ in range(4)]
        later = sorted(depth + (1 - depth) * rng.random() for _ in expected[1:])
        needles = [(d, _magic(key, v)) for d, v in zip([depth, *later], expected)]
    elif task == "vartrack":
        value = str(rng.randint(10_000, 99_999))
        names = [_variable(rng, taken) for _ in range(5)]
        later = sorted(depth + (1 - depth) * rng.random() for _ in names[1:])
        texts = [f" VAR {names[0]} = {value}."]
        texts += [f" VAR {b} = VAR {a}." for a, b in itertools.pairwise(names)]
        needles = list(zip([depth, *later], texts))
        question = (f"\nQuestion: Find all variables that are assigned the value {value} in the "
                    f"text above.")  # fmt: skip
        lead = (f" Answer: According to the chain(s) of variable assignment in the text above, "
                f"{len(names)} variables are assigned the value {value}, they are:")  # fmt: skip
        return needles, names, question, lead
    else:
        raise ValueError(f"unknown --task {task!r}; choose from {', '.join(TASKS)}")
    many = task == "multivalue"
    what, verb = ("are all the", "are") if many else ("is the", "is")
    numbers = f"special magic number{'s' if many else ''} for {key}"
    question = f"\nWhat {what} {numbers} mentioned in the provided text?"
    lead = f" The {numbers} mentioned in the provided text {verb}"
    return needles, expected, question, lead


def build_prompt(
    codec: Codec,
    task: str,
    length: int,
    depth: float,
    seed: int,
    filler: Filler,
    chat: bool = False,
) -> Prompt:
    """The prompt of `task` with `length` tokens, its needle at `depth` (0..1). See the module
    docstring; ValueError when `length` is too short for the task's fixed parts."""
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(f"ringattn-eval/{task}/{seed}/{length}/{depth:.6f}")
    needles, expected, question, lead = _needles(task, depth, rng)
    intro = _INTRO.get(task, _INTRO["niah"])
    before, after = ("", "") if not chat else codec.chat("\x00RINGATTN-MESSAGE\x00")
    head = (codec.start() if not chat else []) + codec.encode(before) + codec.encode(intro)
    tail = codec.encode(question) + codec.encode(after) + codec.encode(lead)
    needle_ids = [(d, codec.encode(text)) for d, text in needles]
    budget = length - len(head) - len(tail) - sum(len(ids) for _, ids in needle_ids)
    if budget < _MIN_FILLER:
        need = length - budget + _MIN_FILLER
        raise ValueError(f"--lengths {length} is too short for --task {task}: its question, "
                         f"needles and template take {length - budget} tokens; use lengths of "
                         f"at least {need}")  # fmt: skip
    haystack, starts = fill(codec, filler, budget)
    body, offsets = splice(haystack, starts, needle_ids)
    ids = head + body + tail
    assert len(ids) == length, (len(ids), length)
    return Prompt(ids, expected, [len(head) + o for o in offsets], question.strip())


def score(answer: str, expected: list[str]) -> float:
    """The fraction of the expected strings found in the answer (RULER's string match)."""
    return sum(e in answer for e in expected) / len(expected)
