"""`ringattn train --hf DIR` around the common trainer: what it trains, the export, the plot.

    run_hf_train(cfg)                                    (the parent, or every torchrun rank)
      validate(cfg, W, HF.check)  config.py -> hf/recipe.check: every --hf mistake, before launch
      "hf" record + [hf] lines  rank 0: model source, tokenization (tokenizer or bytes), corpus
      run_train(cfg)            main.py: the ranks build their Run with hf/recipe.HF and train
      export(cfg, checkpoint)   rank 0, --export DIR: the final DCP checkpoint -> save_pretrained
      OUT_DIR/train.png         rank 0: loss and accuracy over every logged step, peak memory

The export is in the dtype the model came in (config.json's `dtype`: a bfloat16 checkpoint is
trained with float32 master weights and written back in bfloat16), or --export-dtype's.

The export reads the run's final checkpoint in one process: DCP gathers the FSDP2 shards that
every rank wrote into the full tensors of a plain transformers model (the same load that resumes
a run on another number of ranks), which `save_pretrained` writes with the tokenizer beside it.
It needs no memory on the training ranks, and works again on any finished run. The files are
written beside the export directory, fsync'ed, then renamed into it
(runtime/checkpoint/durable.publish_into).
"""

from __future__ import annotations

import os
import shutil
import warnings

import torch

from ringattn.integrations.hf.source import load_config, load_model, load_tokenizer, model_source
from ringattn.runtime import checkpoint as ckpt
from ringattn.train.config import TrainConfig, validate
from ringattn.train.hf.context import extended_config
from ringattn.train.hf.data import PackedConversations
from ringattn.train.hf.recipe import EXPORT_DTYPES, HF, CausalLMLoss, dataset
from ringattn.train.main import run_train, world_size
from ringattn.train.plot import plot
from ringattn.train.progress import JsonLog, read_log

__all__ = ["EXPORT_DTYPES", "describe", "export", "export_dtype", "plot", "run_hf_train"]


def describe(cfg: TrainConfig) -> dict:
    """What --hf and --data resolve to (the log's "hf" record)."""
    source = model_source(cfg.hf)
    config = load_config(source)
    data = dataset(cfg)
    corpus = data.corpus
    record = {
        "event": "hf", "model": source.path, "model_type": config.model_type,
        "architectures": getattr(config, "architectures", None), "init": source.describe(),
        "vocab_size": config.get_text_config().vocab_size, "tokenized_by": corpus.tokenized_by,
        "documents": corpus.documents, "tokens": len(corpus.tokens),
        "token_files": corpus.directory,
    }  # fmt: skip
    extended = extended_config(cfg)
    if extended is not None:
        text = extended.get_text_config()
        record["rope_parameters"] = text.rope_parameters
        record["max_position_embeddings"] = text.max_position_embeddings
    if isinstance(data, PackedConversations):
        record["supervised_tokens"] = int(corpus.supervised.sum())
        record["longer_than_seq_len"] = data.split
        record["long_conversations"] = f"split into pieces of --seq-len {cfg.seq_len} tokens"
    return record


def export_dtype(cfg: TrainConfig) -> torch.dtype:
    """--export-dtype, else the dtype of the model --hf points to (config.json), else float32."""
    if cfg.export_dtype:
        return getattr(torch, cfg.export_dtype)
    dtype = getattr(load_config(model_source(cfg.hf)), "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def export(cfg: TrainConfig, checkpoint: str, out_dir: str) -> str:
    """Write the model of `checkpoint` as a save_pretrained directory (with the tokenizer), in
    `export_dtype(cfg)`."""
    import torch.distributed.checkpoint as dcp

    source = model_source(cfg.hf)
    dtype = export_dtype(cfg)
    # the weights come from the checkpoint; the config with --rope-scaling's RoPE, if any
    model = load_model(source, pretrained=False, config=extended_config(cfg))
    wrapped = CausalLMLoss(model)
    weights = {"model": wrapped.state_dict()}  # the names the ranks saved under
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(weights, checkpoint_id=checkpoint)
    wrapped.load_state_dict(weights["model"])
    parent, name = os.path.split(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-export-{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.to(dtype).eval().save_pretrained(tmp)
        if source.tokenizer_dir:
            load_tokenizer(source.tokenizer_dir).save_pretrained(tmp)
        ckpt.publish_into(tmp, out_dir)  # fsync'ed, then renamed: never a half-written export
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
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
              f"tokens, tokenized with {record['tokenized_by']} ({record['token_files']})",
              flush=True)  # fmt: skip
        if "max_position_embeddings" in record:
            print(f"[hf] context extended: rope {record['rope_parameters']}, max positions "
                  f"{record['max_position_embeddings']}", flush=True)  # fmt: skip
        if "longer_than_seq_len" in record:
            print(f"[hf] chat: {record['supervised_tokens']} assistant tokens supervised; "
                  f"{record['longer_than_seq_len']} conversations longer than --seq-len "
                  f"{cfg.seq_len} were split into pieces of --seq-len tokens",
                  flush=True)  # fmt: skip
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
