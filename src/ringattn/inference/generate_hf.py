"""`ringattn generate --hf DIR`: a local transformers model decoding over a sharded KV cache.

    parent (ringattn generate --hf DIR)        rank r of W (launched by generate.run_generate)
    -----------------------------------        --------------------------------------------------
    check(cfg): the model directory and the    load the model (hf/source: from_pretrained when DIR
      prompt, ValueErrors before any launch      has weights, else from_config with --seed)
                                               model and inputs on the rank's device (CUDA
                                                 under NCCL); --tp T: a (cp, tp) DeviceMesh, the
                                                 model split by its own tp plan over tp
                                               encode the prompt: DIR's tokenizer (--chat: as a
                                                 user message through its chat template), else
                                                 bytes mod vocab_size
                                               ringattn.hf.generate (greedy, or sampled with
                                                 --temperature > 0): prefill sharded by the layout
                                                 over cp, each rank keeps its K/V shard (its tp
                                                 heads); rank 0 streams the tokens (the prefill's
                                                 progress is one updating line), then prints the
                                                 time to first token, decode tokens/s, each rank's
                                                 cache MB kept and held by its buffers

With a tokenizer the continuation is streamed as text, decoded incrementally (O(1) per token:
inference/detokenize.py; multi-byte pieces come out whole); without one the prompt's bytes mod
vocab_size are the tokens and the new token ids are printed, space-separated, after `generated
ids:`.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from ringattn.comm import all_gather_ints, backend_device, resolve_group
from ringattn.inference.detokenize import Detokenizer
from ringattn.inference.hf.generate import generate
from ringattn.inference.hf.weights import lay_out_for_decode
from ringattn.inference.sampling import Sampling
from ringattn.integrations.hf.experts import check_ep, split_experts
from ringattn.integrations.hf.source import (
    DTYPES,
    load_config,
    load_model,
    load_tokenizer,
    model_source,
)
from ringattn.integrations.hf.tensor_parallel import check_tensor_parallel, split_cp_tp
from ringattn.runtime.flags import check_choice
from ringattn.runtime.launch import init_distributed

__all__ = ["Progress", "check", "hf_worker"]


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


def _chat_text(tokenizer, text: str, where: str) -> str:
    """`text` as one user message through the tokenizer's chat template (generation prompt on)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"--chat needs a chat template, but the tokenizer in {where} has none; "
                         f"drop --chat or use a chat model's tokenizer")  # fmt: skip
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode(cfg, source, vocab_size: int) -> tuple[list[int], object, str]:
    """The prompt's token ids, the tokenizer (None: bytes mod vocab_size) and the prompt text."""
    if source.tokenizer_dir is None:
        if cfg.chat:
            raise ValueError(f"--chat needs the model's tokenizer and chat template, but "
                             f"{source.directory} has no tokenizer; drop --chat")  # fmt: skip
        return [b % vocab_size for b in _prompt_bytes(cfg)], None, ""
    tokenizer = load_tokenizer(source.tokenizer_dir)
    text = _prompt_text(cfg)
    if cfg.chat:
        text = _chat_text(tokenizer, text, source.tokenizer_dir)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])  # the template has them
    else:
        ids = list(tokenizer(text)["input_ids"])
    if not ids:
        raise ValueError(f"the tokenizer in {source.tokenizer_dir} made no tokens of the prompt")
    if max(ids) >= vocab_size:
        raise ValueError(
            f"the tokenizer in {source.tokenizer_dir} produced token id {max(ids)}, but the "
            f"model's vocab_size is {vocab_size}; use the tokenizer the model was made for"
        )
    return ids, tokenizer, text


def check(cfg) -> None:
    """Every --hf mistake as a ValueError in the parent, before any process starts."""
    if cfg.prompt is None and cfg.prompt_file is None:
        raise ValueError("--hf needs a prompt: pass --prompt TEXT or --prompt-file FILE")
    Sampling(cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed).check()
    if cfg.merge != "allgather":
        raise ValueError(f"--hf merges with allgather only; drop --merge {cfg.merge}")
    if not isinstance(cfg.tp, int) or cfg.tp < 1 or cfg.nproc % cfg.tp:
        raise ValueError(f"--tp {cfg.tp} must divide --nproc {cfg.nproc} (cp = nproc / tp)")
    check_choice("dtype", cfg.dtype, DTYPES)
    source = model_source(cfg.hf)
    config = load_config(source)
    check_tensor_parallel(config, cfg.tp)
    if cfg.ep != 1 and (
        not isinstance(cfg.ep, int) or cfg.ep < 1 or cfg.nproc % cfg.ep or cfg.tp > 1
    ):
        raise ValueError(
            f"--ep {cfg.ep} must divide --nproc {cfg.nproc}, with --tp 1 (got {cfg.tp})"
        )
    check_ep(cfg.ep, config)
    encode(cfg, source, config.get_text_config().vocab_size)


def _device(world_size: int) -> torch.device:
    """This rank's device: init_distributed's (CUDA under NCCL, one GPU per local rank), or for a
    single process the first GPU when there is one."""
    if world_size > 1:
        return init_distributed()
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


class Progress:
    """Prefill progress as one updating line on stderr (rank 0), ended at the first token."""

    def __init__(self, lead: bool):
        self.lead, self.open = lead, False

    def layer(self, done: int, total: int) -> None:
        if self.lead:
            print(f"\r[prefill] layer {done}/{total}", end="", file=sys.stderr, flush=True)
            self.open = True

    def end(self) -> None:
        if self.open:
            print(file=sys.stderr, flush=True)
            self.open = False


def hf_worker(cfg) -> dict:
    """One rank of `ringattn generate --hf`: load, join the group, generate, rank 0 prints."""
    source = model_source(cfg.hf)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(cfg.seed)  # from_config: the same random weights on every rank
    model = load_model(source, dtype=cfg.dtype).eval()  # before the group: a plain local load
    vocab_size = model.config.get_text_config().vocab_size
    device = _device(world_size)
    # split first (--tp): each weight reaches the device as this rank's shard, one at a time,
    # so no GPU holds the whole model; then the rest (embeddings, norms) to the device
    group, tp_group = split_cp_tp(model, cfg.tp, world_size, device)
    split_experts(model, cfg.ep, device)  # --ep: this rank's experts only, before the move
    model.to(device)  # model and inputs on the rank's device (NCCL needs CUDA tensors)
    lay_out_for_decode(model, device)  # the same weights' layout as ringattn serve's
    world = resolve_group(None)
    lead = world.rank == 0
    prompt, tokenizer, text = encode(cfg, source, vocab_size)
    if tokenizer is not None:
        how = f"the model's tokenizer ({type(tokenizer).__name__})"
    else:
        how = f"bytes mod vocab_size {vocab_size} (no tokenizer in {source.directory})"
    parallel = f"cp {world_size // cfg.tp} x tp {cfg.tp}" if cfg.tp > 1 else f"{world_size} ranks"
    parallel += f", experts over ep {cfg.ep}" if cfg.ep > 1 else ""
    if lead:
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        print(f"model {type(model).__name__} from {cfg.hf} ({source.describe()}, {dtype}), "
              f"{len(prompt)} prompt tokens by {how} on {parallel} ({cfg.layout}, {device.type}"
              f"{', --chat' if cfg.chat else ''})", file=sys.stderr, flush=True)  # fmt: skip
        print(text + "|" if tokenizer is not None else "generated ids:", end="", flush=True)
    new: list[int] = []
    text_out = Detokenizer(tokenizer, skip_special_tokens=False) if tokenizer else None  # O(1)
    progress = Progress(lead)

    def on_token(token: int) -> None:
        progress.end()
        new.append(token)
        if not lead:
            return
        if tokenizer is None:
            print(f" {token}", end="", flush=True)
            return
        piece = text_out.push(token)  # "" while a multi-byte character is incomplete
        if piece:
            print(piece, end="", flush=True)

    start = time.perf_counter()
    tokens, stats = generate(
        model, torch.tensor([prompt], device=device), cfg.max_new_tokens, group=group,
        layout=cfg.layout, do_sample=cfg.temperature > 0, temperature=cfg.temperature,
        top_k=cfg.top_k, top_p=cfg.top_p, seed=cfg.seed, eos_token_id=cfg.eos_id,
        on_token=on_token, on_prefill=progress.layer, offload_kv=cfg.offload_kv,
        tp_group=tp_group, return_stats=True,
    )  # fmt: skip
    total_s = time.perf_counter() - start
    progress.end()
    figures = all_gather_ints([stats.cache_bytes, stats.cache_capacity_bytes], world,
                              backend_device(world, device))  # fmt: skip
    if lead:
        if text_out is not None:
            print(text_out.flush(), end="")
        print(flush=True)
        kept = ", ".join(f"{row[0] / 2**20:.3f}" for row in figures)
        held = ", ".join(f"{row[1] / 2**20:.3f}" for row in figures)
        where = " (host memory: --offload-kv)" if cfg.offload_kv else ""
        print(f"[generate] time to first token {stats.first_token_s * 1e3:.1f} ms (prefill of "
              f"{len(prompt)} tokens), {stats.new_tokens} tokens in {total_s:.2f} s, decode "
              f"{stats.decode_tokens_per_s:.1f} tokens/s; KV cache per rank: {kept} MB "
              f"(buffers {held} MB){where}", file=sys.stderr, flush=True)  # fmt: skip
    return {"tokens": tokens[0, len(prompt) :].tolist(), "cache_bytes": stats.cache_bytes,
            "cache_capacity_bytes": stats.cache_capacity_bytes, "rank": world.rank,
            "first_token_s": stats.first_token_s, "decode_tokens_per_s": stats.decode_tokens_per_s,
            "prefill_s": stats.prefill_s}  # fmt: skip
