"""`ringattn eval niah --hf DIR`: the needle grid on --nproc ranks, and what rank 0 writes.

    parent (run_eval)                          rank r of W (launched, or torchrun's ranks)
    -----------------                          -------------------------------------------
    check(cfg): the model, the tokenizer,      load the model (hf/source.py: from_pretrained
      --tp, the grid (every prompt's fixed       when DIR has weights, else from_config, seeded)
      parts fit the shortest length): a        join the group; --tp T: the model split by its
      ValueError before any launch               own tp plan over a (cp, tp) mesh
    launch eval_worker on --nproc ranks        grid.evaluate: every cell, greedy, CP prefill
      (or run it here: --nproc 1, torchrun)      and the sharded KV cache
                                               rank 0: one updating progress line; then
                                                 OUT/niah.json, the length x depth table,
                                                 OUT/niah.png (matplotlib: the plot extra)

The outputs are named after the command (`niah.*`) whatever --task; the JSON's "task" says which.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch

from ringattn.comm import resolve_group
from ringattn.evals.grid import Grid, evaluate
from ringattn.evals.haystack import Codec, Filler
from ringattn.evals.report import heatmap, summary, table, write_json
from ringattn.evals.tasks import TASKS
from ringattn.integrations.hf.source import load_config, load_model, load_tokenizer, model_source
from ringattn.integrations.hf.tensor_parallel import check_tensor_parallel, split_cp_tp
from ringattn.layout import LAYOUTS
from ringattn.runtime.flags import check_at_least, check_choice
from ringattn.runtime.launch import init_distributed, launch, running_under_torchrun

__all__ = ["EvalConfig", "check", "eval_worker", "run_eval"]


@dataclass
class EvalConfig:
    """What `ringattn eval niah` runs; each field is the flag of the same name (kebab-case)."""

    hf: str = ""
    """a local Hugging Face model directory (config.json, weights, tokenizer; nothing is
    downloaded)"""
    task: str = "niah"
    """which retrieval task"""
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    """prompt lengths in tokens, e.g. 1024,4096,16384"""
    depths: list[float] = field(default_factory=lambda: [0.0, 25.0, 50.0, 75.0, 100.0])
    """a count N (N depths evenly spaced from 0 to 100 percent) or percents such as 0,50,100 (a
    single depth: 50, with the comma)"""
    nproc: int = 1
    """ranks the prefill and KV cache are split over"""
    tp: int = 1
    """tensor-parallel degree (the model's own tp plan); cp = nproc / tp"""
    chat: bool = False
    """ask through the tokenizer's chat template (one user message, then the generation prompt)"""
    seed: int = 0
    """seed of the needles and the filler"""
    haystack: str | None = None
    """filler sentences from this text file or directory of .txt/.md files (None: generated
    sentences)"""
    max_new_tokens: int = 0
    """answer budget (0: the task's: 16 for niah and multikey, 48 multivalue, 32 vartrack)"""
    layout: str = "zigzag"
    """how prompts are sharded"""
    out: str = "eval_out"
    """where niah.json and niah.png go"""


def _codec(source) -> Codec:
    vocab = load_config(source).get_text_config().vocab_size
    tokenizer = load_tokenizer(source.tokenizer_dir) if source.tokenizer_dir else None
    return Codec(tokenizer, vocab)


def _grid(cfg: EvalConfig) -> Grid:
    filler = Filler(cfg.seed, cfg.haystack)
    return Grid(cfg.task, list(cfg.lengths), list(cfg.depths), cfg.seed, filler, cfg.chat,
                cfg.max_new_tokens)  # fmt: skip


def check(cfg: EvalConfig) -> None:
    """Every flag mistake as a ValueError in the parent, before any process starts."""
    if not cfg.hf:
        raise ValueError("eval niah needs --hf DIR: a local Hugging Face model directory")
    check_choice("task", cfg.task, TASKS)
    check_choice("layout", cfg.layout, LAYOUTS)
    check_at_least("nproc", cfg.nproc, 1)
    check_at_least("max-new-tokens", cfg.max_new_tokens, 0)
    if not cfg.lengths or any(not isinstance(n, int) or n < 1 for n in cfg.lengths):
        raise ValueError(f"--lengths must be positive token counts, got {cfg.lengths}")
    if not cfg.depths or any(not 0 <= d <= 100 for d in cfg.depths):
        raise ValueError(f"--depths must be percents in [0, 100], got {cfg.depths}")
    if not isinstance(cfg.tp, int) or cfg.tp < 1 or cfg.nproc % cfg.tp:
        raise ValueError(f"--tp {cfg.tp} must divide --nproc {cfg.nproc} (cp = nproc / tp)")
    source = model_source(cfg.hf)
    config = load_config(source)
    check_tensor_parallel(config, cfg.tp)
    text = config.get_text_config()
    rotary = any(getattr(text, name, None) is not None
                 for name in ("rope_parameters", "rope_scaling", "rope_theta"))  # fmt: skip
    limit = getattr(text, "max_position_embeddings", None)
    grid = _grid(cfg)
    longest = max(cfg.lengths) + grid.new_tokens
    if not rotary and limit and longest > limit:
        raise ValueError(f"{cfg.hf} has learned positions for {limit} tokens, and --lengths "
                         f"asks for {longest} (with the answer); use lengths up to "
                         f"{limit - grid.new_tokens}")  # fmt: skip
    if cfg.chat and source.tokenizer_dir is None:
        raise ValueError(f"--chat needs the model's tokenizer and chat template, but {cfg.hf} "
                         f"has no tokenizer; drop --chat")  # fmt: skip
    codec = _codec(source)
    shortest = min(cfg.lengths)
    grid.prompt(codec, shortest, min(cfg.depths))  # ValueError when the fixed parts do not fit


def _device(world_size: int) -> torch.device:
    if world_size > 1:
        return init_distributed()
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


class _Progress:
    """One updating line on stderr (rank 0): cells done, the last cell and its outcome."""

    def __init__(self, lead: bool, task: str):
        self.lead, self.task = lead, task

    def __call__(self, done: int, total: int, r: dict) -> None:
        if not self.lead:
            return
        mark = "right" if r["correct"] else f"wrong ({r['answer'][:24]!r})"
        end = "\n" if done == total else ""
        clear = "\x1b[K" if sys.stderr.isatty() else ""  # the rest of a longer previous line
        print(f"\r{clear}[eval {self.task}] {done}/{total}: {r['length']} tokens, depth "
              f"{r['depth']:g}%: {mark}, first token {r['ttft_s']:.2f} s", end=end,
              file=sys.stderr, flush=True)  # fmt: skip


def eval_worker(cfg: EvalConfig) -> dict:
    """One rank of `ringattn eval niah`: load, join the group, answer the grid; rank 0 writes."""
    source = model_source(cfg.hf)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(cfg.seed)  # from_config: the same random weights on every rank
    model = load_model(source).eval()
    device = _device(world_size)
    model.to(device)
    group, tp_group = split_cp_tp(model, cfg.tp, world_size, device)
    lead = resolve_group(None).rank == 0
    codec = _codec(source)
    grid = _grid(cfg)
    parallel = f"{world_size} rank{'s' * (world_size > 1)}"
    if cfg.tp > 1:
        parallel = f"cp {world_size // cfg.tp} x tp {cfg.tp}"
    if lead:
        print(f"[eval {cfg.task}] {type(model).__name__} from {cfg.hf} ({source.describe()}), "
              f"tokens by {codec.name}, {len(grid.cells)} prompts ({len(cfg.lengths)} lengths x "
              f"{len(cfg.depths)} depths) on {parallel} ({device.type}); haystack: "
              f"{grid.filler.describe()}", file=sys.stderr, flush=True)  # fmt: skip
    results = evaluate(model, codec, grid, group, tp_group, cfg.layout, _Progress(lead, cfg.task))
    meta = {"model": cfg.hf, "task": cfg.task, "lengths": list(cfg.lengths),
            "depths": list(cfg.depths), "nproc": world_size, "tp": cfg.tp, "seed": cfg.seed,
            "chat": cfg.chat, "haystack": grid.filler.describe(), "tokenized_by": codec.name,
            "layout": cfg.layout}  # fmt: skip
    document = summary(meta, results)
    if lead:
        _write(cfg, document)
    return document


def _write(cfg: EvalConfig, document: dict) -> None:
    """Rank 0: the JSON, the table on stdout, the heatmap (or why it was skipped)."""
    os.makedirs(cfg.out, exist_ok=True)
    path = write_json(document, os.path.join(cfg.out, "niah.json"))
    title = (f"{cfg.task}: {os.path.basename(os.path.normpath(cfg.hf))}, accuracy "
             f"{100 * document['accuracy']:.0f}% (nproc {document['nproc']})")  # fmt: skip
    print(table(document["results"], title), flush=True)
    image = heatmap(document["results"], os.path.join(cfg.out, "niah.png"), title)
    if image:
        print(f"[eval {cfg.task}] wrote {path} and {image}", flush=True)
    else:
        print(f"[eval {cfg.task}] wrote {path}; heatmap skipped: it needs matplotlib "
              f"(pip install 'ringattn[plot]')", flush=True)  # fmt: skip


def run_eval(cfg: EvalConfig) -> int:
    """`ringattn eval niah`: check, then run the ranks (launched, torchrun's, or this process)."""
    check(cfg)
    if running_under_torchrun() or cfg.nproc == 1:
        eval_worker(cfg)
    else:
        launch(eval_worker, cfg.nproc, cfg)
    return 0
