"""One grid of retrieval prompts answered by a transformers model over a CP group.

    for length in lengths, depth in depths:          (every rank, the same order)
      prompt = tasks.build_prompt(codec, task, length, depth, seed, filler, chat)
      greedy answer: ringattn.hf.generate (inference/hf/generate.py) over `group` (the
                     prompt's prefill context-parallel, each rank keeping its shard of the KV
                     cache; with `tp_group`, its heads)
      score: the expected strings found in the answer (tasks.score)

The prompts are pure functions of their arguments and decoding is greedy, so every rank (and every
number of ranks) answers the same. The single-answer tasks (niah, multikey) stop at the first
line break after the answer began; the list tasks at the end-of-sequence token or the token
budget. `evaluate` serves `ringattn eval niah` (worker.py) and `train --hf --eval-niah-every`
(the training model, between steps).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ringattn.evals.haystack import Codec, Filler
from ringattn.evals.tasks import NEW_TOKENS, build_prompt, score
from ringattn.inference.hf.generate import generate  # ringattn.hf.generate, without the extra

__all__ = ["Grid", "depth_list", "evaluate"]


@dataclass
class Grid:
    """What to ask: the task, the lengths (tokens), the depths (percent), the seed, the filler."""

    task: str
    lengths: list[int]
    depths: list[float]
    seed: int = 0
    filler: Filler | None = None
    chat: bool = False
    max_new_tokens: int = 0
    """Answer budget; 0: the task's default (tasks.NEW_TOKENS)."""

    @property
    def cells(self) -> list[tuple[int, float]]:
        return [(n, d) for n in self.lengths for d in self.depths]

    @property
    def new_tokens(self) -> int:
        return self.max_new_tokens or NEW_TOKENS[self.task]

    def prompt(self, codec: Codec, length: int, depth: float):
        filler = self.filler or Filler(self.seed)
        return build_prompt(codec, self.task, length, depth / 100, self.seed, filler, self.chat)


def depth_list(spec: str | int) -> list[float]:
    """--depths: a count N (N evenly spaced depths from 0 to 100 %) or percents "0,25,100"."""
    text = str(spec).strip()
    try:
        if "," not in text and "." not in text:
            count = int(text)
            if count < 1:
                raise ValueError
            if count == 1:
                return [50.0]
            return [round(100 * i / (count - 1), 2) for i in range(count)]
        depths = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        depths = []
    if not depths or any(not 0 <= d <= 100 for d in depths):
        raise ValueError(f"--depths {spec!r}: give a count N >= 1 (evenly spaced from 0 to 100 "
                         f"%) or percents in [0, 100] such as 0,50,100")  # fmt: skip
    return sorted(set(depths))


def evaluate(
    model: torch.nn.Module,
    codec: Codec,
    grid: Grid,
    group: object = None,
    tp_group: object = None,
    layout: str = "zigzag",
    on_cell: Callable[[int, int, dict], None] | None = None,
) -> list[dict]:
    """Answer every cell of `grid` greedily over `group`; the results (tasks' JSON records), the
    same on every rank. `on_cell(done, total, result)` follows the progress."""
    device = next(model.parameters()).device
    single = grid.task in ("niah", "multikey")
    results = []
    cells = grid.cells
    for done, (length, depth) in enumerate(cells, 1):
        prompt = grid.prompt(codec, length, depth)
        new: list[int] = []

        def on_token(token: int, new: list[int] = new) -> bool:
            new.append(token)
            return single and "\n" in codec.decode(new).strip()

        start = time.perf_counter()
        _, stats = generate(
            model, torch.tensor([prompt.ids], device=device), grid.new_tokens, group=group,
            layout=layout, on_token=on_token, tp_group=tp_group, return_stats=True,
        )  # fmt: skip
        answer = codec.decode(new).strip()
        if single:
            answer = answer.split("\n")[0].strip()
        got = score(answer, prompt.expected)
        result = {
            "length": length, "depth": depth, "correct": got == 1.0, "score": got,
            "answer": answer, "expected": prompt.expected[0] if single else prompt.expected,
            "ttft_s": round(stats.first_token_s, 4), "prompt_tokens": len(prompt.ids),
            "seconds": round(time.perf_counter() - start, 4),
        }  # fmt: skip
        results.append(result)
        if on_cell is not None:
            on_cell(done, len(cells), result)
    return results
