"""`ringattn generate --hf DIR`: a local transformers model decoding over a sharded KV cache.

    parent (ringattn generate --hf DIR)        rank r of W (launched by generate.run_generate)
    -----------------------------------        --------------------------------------------------
    check(cfg): the model directory and the    load the model (hf/source: from_pretrained when DIR
      prompt, ValueErrors before any launch      has weights, else from_config with --seed)
                                               encode the prompt: DIR's tokenizer, else bytes mod
                                                 vocab_size
                                               ringattn.hf.generate (greedy): prefill sharded by
                                                 the layout, each rank keeps its K/V shard; rank 0
                                                 streams the tokens, then prints the time to first
                                                 token, decode tokens/s, each rank's cache MB

With a tokenizer the continuation is streamed as text (the decoded prefix grows token by token,
so multi-byte pieces come out whole); without one the prompt's bytes mod vocab_size are the
tokens and the new token ids are printed, space-separated, after `generated ids:`.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import ringattn.hf
from ringattn.comm import all_gather_ints, resolve_group
from ringattn.integrations.hf.source import load_config, load_model, load_tokenizer, model_source
from ringattn.runtime.launch import init_distributed

__all__ = ["check", "hf_worker"]


def _prompt_text(cfg) -> str:
    if cfg.prompt_file is not None:
        with open(cfg.prompt_file, "rb") as f:
            return f.read().decode("utf-8", errors="replace")
    return cfg.prompt


def _prompt_bytes(cfg) -> bytes:
    if cfg.prompt_file is not None:
        with open(cfg.prompt_file, "rb") as f:
            return f.read()
    return cfg.prompt.encode()


def encode(cfg, source, vocab_size: int) -> tuple[list[int], object]:
    """The prompt's token ids and the tokenizer (None: bytes mod vocab_size)."""
    if source.tokenizer_dir is None:
        return [b % vocab_size for b in _prompt_bytes(cfg)], None
    tokenizer = load_tokenizer(source.tokenizer_dir)
    ids = list(tokenizer(_prompt_text(cfg))["input_ids"])
    if not ids:
        raise ValueError(f"the tokenizer in {source.tokenizer_dir} made no tokens of the prompt")
    if max(ids) >= vocab_size:
        raise ValueError(
            f"the tokenizer in {source.tokenizer_dir} produced token id {max(ids)}, but the "
            f"model's vocab_size is {vocab_size}; use the tokenizer the model was made for"
        )
    return ids, tokenizer


def check(cfg) -> None:
    """Every --hf mistake as a ValueError in the parent, before any process starts."""
    if cfg.prompt is None and cfg.prompt_file is None:
        raise ValueError("--hf needs a prompt: pass --prompt TEXT or --prompt-file FILE")
    if cfg.temperature != 0 or cfg.top_k != 0 or cfg.top_p != 1.0:
        raise ValueError(
            f"--hf decodes greedily (ringattn.hf.generate); got --temperature {cfg.temperature} "
            f"--top-k {cfg.top_k} --top-p {cfg.top_p}: drop them (sampling is --checkpoint only)"
        )
    if cfg.merge != "allgather":
        raise ValueError(f"--hf merges with allgather only; drop --merge {cfg.merge}")
    source = model_source(cfg.hf)
    config = load_config(source)
    encode(cfg, source, config.get_text_config().vocab_size)


def hf_worker(cfg) -> dict:
    """One rank of `ringattn generate --hf`: load, join the group, generate, rank 0 prints."""
    source = model_source(cfg.hf)
    torch.manual_seed(cfg.seed)  # from_config: the same random weights on every rank
    model = load_model(source).eval()  # before the group exists: a plain local load
    vocab_size = model.config.get_text_config().vocab_size
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        init_distributed()
    info = resolve_group(None)
    lead = info.rank == 0
    prompt, tokenizer = encode(cfg, source, vocab_size)
    if tokenizer is not None:
        how = f"the model's tokenizer ({type(tokenizer).__name__})"
    else:
        how = f"bytes mod vocab_size {vocab_size} (no tokenizer in {source.directory})"
    if lead:
        print(f"model {type(model).__name__} from {cfg.hf} ({source.describe()}), "
              f"{len(prompt)} prompt tokens by {how} on {info.world_size} ranks ({cfg.layout})",
              file=sys.stderr, flush=True)  # fmt: skip
        print(_prompt_text(cfg) + "|" if tokenizer is not None else "generated ids:", end="",
              flush=True)  # fmt: skip
    new: list[int] = []
    shown = [""]  # the decoded text printed so far

    def on_token(token: int) -> None:
        new.append(token)
        if not lead:
            return
        if tokenizer is None:
            print(f" {token}", end="", flush=True)
            return
        text = tokenizer.decode(new)
        if not text.endswith("\ufffd"):  # a multi-byte piece still incomplete: wait for it
            print(text[len(shown[0]) :], end="", flush=True)
            shown[0] = text

    def on_prefill(done: int, total: int) -> None:
        if lead:
            print(f"[prefill] layer {done}/{total}", file=sys.stderr, flush=True)

    start = time.perf_counter()
    tokens, stats = ringattn.hf.generate(
        model, torch.tensor([prompt], device=model.device), cfg.max_new_tokens, layout=cfg.layout,
        eos_token_id=cfg.eos_id, on_token=on_token, on_prefill=on_prefill, return_stats=True,
    )  # fmt: skip
    total_s = time.perf_counter() - start
    cache_bytes = [
        row[0] for row in all_gather_ints([stats.cache_bytes], info, torch.device("cpu"))
    ]
    if lead:
        if tokenizer is not None and len(shown[0]) < len(text := tokenizer.decode(new)):
            print(text[len(shown[0]) :], end="")
        print(flush=True)
        per_rank = ", ".join(f"{b / 2**20:.3f}" for b in cache_bytes)
        print(f"[generate] time to first token {stats.first_token_s * 1e3:.1f} ms (prefill of "
              f"{len(prompt)} tokens), {stats.new_tokens} tokens in {total_s:.2f} s, decode "
              f"{stats.decode_tokens_per_s:.1f} tokens/s; KV cache per rank: {per_rank} MB",
              file=sys.stderr, flush=True)  # fmt: skip
    return {"tokens": tokens[0, len(prompt) :].tolist(), "cache_bytes": stats.cache_bytes,
            "rank": info.rank}  # fmt: skip
