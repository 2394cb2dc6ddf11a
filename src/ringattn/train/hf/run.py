"""`ringattn train --hf DIR` around the common trainer: what it trains, the export, the plot.

    run_hf_train(cfg)                                    (the parent, or every torchrun rank)
      validate(cfg, W, HF.check)  config.py -> hf/recipe.check: every --hf mistake, before launch
      "hf" record + [hf] lines  rank 0: model source, tokenization (tokenizer or bytes), corpus
      run_train(cfg)            main.py: the ranks build their Run with hf/recipe.HF and train
      export(cfg, checkpoint)   rank 0, --export DIR: the final DCP checkpoint -> save_pretrained
      OUT_DIR/train.png         rank 0: loss and accuracy over every logged step, peak memory

The export reads the run's final checkpoint in one process: DCP gathers the FSDP2 shards that
every rank wrote into the full tensors of a plain transformers model (the same load that resumes
a run on another number of ranks), which `save_pretrained` writes with the tokenizer beside it.
It needs no memory on the training ranks, and works again on any finished run.
"""

from __future__ import annotations

import os
import warnings

from ringattn.integrations.hf.source import load_config, load_model, load_tokenizer, model_source
from ringattn.runtime import checkpoint as ckpt
from ringattn.train.config import TrainConfig, validate
from ringattn.train.hf.data import load_corpus
from ringattn.train.hf.recipe import HF, CausalLMLoss
from ringattn.train.main import run_train, world_size
from ringattn.train.plot import plot
from ringattn.train.progress import JsonLog, read_log

__all__ = ["describe", "export", "plot", "run_hf_train"]


def describe(cfg: TrainConfig) -> dict:
    """What --hf and --data resolve to (the log's "hf" record)."""
    source = model_source(cfg.hf)
    config = load_config(source)
    vocab = config.get_text_config().vocab_size
    corpus = load_corpus(cfg.data[len("text:") :], source.tokenizer_dir, vocab)
    return {
        "event": "hf", "model": source.path, "model_type": config.model_type,
        "architectures": getattr(config, "architectures", None), "init": source.describe(),
        "vocab_size": vocab, "tokenized_by": corpus.tokenized_by,
        "documents": corpus.documents, "tokens": len(corpus.tokens),
    }  # fmt: skip


def export(cfg: TrainConfig, checkpoint: str, out_dir: str) -> str:
    """Write the model of `checkpoint` as a save_pretrained directory (with the tokenizer)."""
    import torch.distributed.checkpoint as dcp

    source = model_source(cfg.hf)
    model = load_model(source, pretrained=False)  # the weights come from the checkpoint
    wrapped = CausalLMLoss(model)
    weights = {"model": wrapped.state_dict()}  # the names the ranks saved under
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(weights, checkpoint_id=checkpoint)
    wrapped.load_state_dict(weights["model"])
    model.eval().save_pretrained(out_dir)
    if source.tokenizer_dir:
        load_tokenizer(source.tokenizer_dir).save_pretrained(out_dir)
    return out_dir


def _lead() -> bool:
    return int(os.environ.get("RANK", "0")) == 0  # torchrun's rank, or the launching parent


def run_hf_train(cfg: TrainConfig) -> dict:
    """`ringattn train --hf`: validate, say what is trained, train, export, plot (rank 0)."""
    dp, cp = validate(cfg, world_size(cfg), HF.check)
    if _lead():
        os.makedirs(cfg.out_dir, exist_ok=True)
        record = describe(cfg)
        JsonLog(cfg.log_path).write(record)
        print(f"[hf] {record['model']}: {record['model_type']} ({record['init']}), trained over "
              f"dp {dp} x cp {cp}", flush=True)  # fmt: skip
        print(f"[hf] data {cfg.data}: {record['documents']} documents, {record['tokens']} "
              f"tokens, tokenized with {record['tokenized_by']}", flush=True)  # fmt: skip
    summary = run_train(cfg)
    if summary.get("rank", 0) != 0 or summary.get("stopped"):  # preempted...: no export yet
        return summary
    if cfg.export:
        checkpoint = summary.get("checkpoint") or ckpt.latest(cfg.checkpoint_path)
        summary["export"] = export(cfg, checkpoint, cfg.export)
        JsonLog(cfg.log_path).write({"event": "export", "checkpoint": checkpoint,
                                     "path": cfg.export})  # fmt: skip
        print(f"[hf] exported {checkpoint} to {cfg.export} (save_pretrained)", flush=True)
    history = [r for r in read_log(cfg.log_path) if "loss" in r]
    if history:
        title = f"ringattn train --hf {cfg.hf}: {cfg.seq_len} tokens x {cfg.batch_size}, cp {cp}"
        image = plot(
            history, os.path.join(cfg.out_dir, "train.png"), title,
            loss_label="loss (mean over supervised tokens)", accuracy_label="next-token accuracy",
        )  # fmt: skip
        print(f"[hf] log: {cfg.log_path}" + (f"; plot: {image}" if image else ""), flush=True)
    return summary
