"""Rank functions for `ringattn eval` (see harness.py): a saved tiny model answers a grid."""

from __future__ import annotations

from ringattn.evals.grid import Grid, evaluate
from ringattn.evals.haystack import Codec
from ringattn.integrations.hf.source import load_model, load_tokenizer, model_source

_MODELS: dict = {}


def answers(rank: int, world_size: int, directory: str, grid: Grid) -> list:
    """This rank's answers to `grid` (the whole group is the CP group)."""
    if directory not in _MODELS:
        model = load_model(model_source(directory)).eval()
        _MODELS[directory] = (model, Codec(load_tokenizer(directory), model.config.vocab_size))
    model, codec = _MODELS[directory]
    results = evaluate(model, codec, grid)
    return [(r["answer"], r["expected"], r["score"]) for r in results]
