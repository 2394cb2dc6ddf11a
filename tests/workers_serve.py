"""Rank functions for the server's rank loop on several ranks (see harness.py)."""

from __future__ import annotations

import torch
import transformers

import serve_model
from ringattn.serve.protocol import Request
from ringattn.serve.worker import Sink, run_isolated


class _Recorder:
    """A Job's stand-in on every rank: the events of one request."""

    cancelled = False

    def __init__(self):
        self.events, self.arrived = [], 0.0

    def emit(self, *event) -> None:
        self.events.append(event)


def isolated(rank: int, world_size: int, prompts: list[str], fail_at: int | None) -> list:
    """serve's run_isolated over the tiny chat model on every rank, the `fail_at`-th forward
    raising once (a torch forward hook, the same call on every rank): each request's text."""
    tok = serve_model.tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=192,
    )  # fmt: skip
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    calls = [0]

    def fail_once(module, args, output):
        calls[0] += 1
        if calls[0] == fail_at:
            raise torch.OutOfMemoryError("simulated")

    model.register_forward_hook(fail_once)
    requests = [Request(tok(p)["input_ids"], 8) for p in prompts]
    sinks = [Sink(_Recorder()) for _ in requests]
    finishes = run_isolated(model, tok, requests, [tok.eos_token_id], "zigzag", sinks)
    texts = ["".join(e[1] for e in s.job.events if e[0] == "text") for s in sinks]
    return [texts, finishes, calls[0]]
