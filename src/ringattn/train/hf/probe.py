"""`train --hf --eval-niah-every K`: a small needle grid answered by the model being trained.

    every K steps and after the last (loop.py, on every rank at once):
      grid     niah at --seq-len / 2 and --seq-len tokens (a length too short for the prompt's
               fixed parts is left out) x depths 0, 50, 100 %, seed --seed: the same prompts at
               every probe, so the scores are comparable step to step
      answer   evals/grid.evaluate on the trained model itself (no copy): the FSDP2 root's own
               parameters gathered for the probe (each block gathers its own as it runs), the
               prefill context-parallel over the run's cp group, the sharded KV cache; greedy
      record   {"event": "niah", "step", "niah_accuracy", "niah_score_<length>", "niah_answers"}
               -> the JSON log, TensorBoard (niah_accuracy, niah_score_<length>), one line

Every dp row runs the probe over its own cp group (the same prompts, the same answers). The probe
is read-only: no gradient, the model back in training mode after it, so training continues as if
it had not run.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ringattn.evals.grid import Grid, evaluate
from ringattn.evals.haystack import Codec, Filler
from ringattn.integrations.hf.source import load_config, load_tokenizer, model_source
from ringattn.train.config import TrainConfig

__all__ = ["check_probe", "niah_grid", "probe"]

DEPTHS = [0.0, 50.0, 100.0]


@functools.lru_cache(maxsize=4)
def _codec(hf: str) -> Codec:
    source = model_source(hf)
    tokenizer = load_tokenizer(source.tokenizer_dir) if source.tokenizer_dir else None
    return Codec(tokenizer, load_config(source).get_text_config().vocab_size)


def niah_grid(cfg: TrainConfig) -> Grid:
    """The probe's grid: the lengths of --seq-len / 2 and --seq-len that fit the prompt."""
    codec = _codec(cfg.hf)
    fits = []
    for length in sorted({max(1, cfg.seq_len // 2), cfg.seq_len}):
        try:
            Grid("niah", [length], DEPTHS, cfg.seed, Filler(cfg.seed)).prompt(codec, length, 50)
        except ValueError:
            continue
        fits.append(length)
    return Grid("niah", fits, DEPTHS, cfg.seed, Filler(cfg.seed))


def check_probe(cfg: TrainConfig) -> None:
    """ValueError when --eval-niah-every is negative or --seq-len cannot hold a needle prompt."""
    if cfg.eval_niah_every < 0:
        raise ValueError(f"--eval-niah-every must be >= 0, got {cfg.eval_niah_every}")
    if cfg.eval_niah_every and not niah_grid(cfg).lengths:
        raise ValueError(f"--eval-niah-every: --seq-len {cfg.seq_len} is too short for a "
                         f"needle prompt with this tokenizer; use a longer --seq-len or drop "
                         f"the flag")  # fmt: skip


def probe(model: nn.Module, cfg: TrainConfig, step: int, cp_group) -> dict:
    """Answer the grid with the trained model (CausalLMLoss, maybe FSDP2-wrapped) over
    `cp_group`; the log record (see the module docstring). Collective over the whole world."""
    hf = model.model
    grid = niah_grid(cfg)
    sharded = isinstance(model, FSDPModule)
    if sharded:
        model.unshard()  # the root's parameters (embeddings, norm, head); blocks gather their own
    hf.eval()
    try:
        with torch.no_grad():
            results = evaluate(hf, _codec(cfg.hf), grid, group=cp_group, layout=cfg.layout)
    finally:
        hf.train()
        if sharded:
            model.reshard()
    record = {"event": "niah", "step": step,
              "niah_accuracy": sum(r["correct"] for r in results) / len(results)}  # fmt: skip
    for length in grid.lengths:
        scores = [r["score"] for r in results if r["length"] == length]
        record[f"niah_score_{length}"] = sum(scores) / len(scores)
    record["niah_answers"] = [[r["length"], r["depth"], r["answer"], r["expected"]]
                              for r in results]  # fmt: skip
    return record
