"""`ringattn.hf.Session`: a conversation with a transformers model over a persistent sharded cache.

    session = ringattn.hf.Session(model, group=None, layout="zigzag")
    reply = session.generate(prompt_ids, 64)            # (1, S + new): the first turn's prefill
    more = session.generate(follow_up_ids, 64, do_sample=True, seed=3)   # over the cache

As `inference/session.Session` does for our decoder: every rank calls `generate` with the same
arguments and returns the same tokens. The first turn is `ringattn.hf.generate`'s prefill; a
follow-up turn's tokens attend everything cached through pass-KV or pass-Q (`mode`, "auto":
the fewer bytes, inference/turns.choose_mode), sharded by the layout like a prompt, and their
K/V join the cache. The last token of a reply is not fed to the model until it is needed: the
next turn starts with it. Greedy turns equal `model.generate` of the whole conversation so far.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ringattn.comm import backend_device, resolve_group
from ringattn.inference.hf.batching import check_call, eos_ids, fresh_seeds
from ringattn.inference.hf.engine import KVEngine
from ringattn.inference.hf.generate import decode_loop
from ringattn.inference.session import TurnStats
from ringattn.inference.turns import check_mode
from ringattn.validate import validated

__all__ = ["Session"]


class Session:
    """Turns of one conversation with `model` over the ranks of `group` (module docstring)."""

    def __init__(self, model: torch.nn.Module, group: object = None, layout: str = "zigzag", *,
                 offload_kv: bool = False, tp_group: object = None):  # fmt: skip
        self.model, self.group, self.layout = model, group, layout
        self.info = resolve_group(group)
        self.tp_info = resolve_group(tp_group) if tp_group is not None else None
        self.engine = KVEngine(model, group=group, layout=layout, offload=offload_kv)
        self.pending: int | None = None  # the last reply token, not fed yet
        self.turns = 0
        self.last_mode: str | None = None

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 64,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        eos_token_id: int | list[int] | None = None,
        mode: str = "auto",
        on_token: Callable[[int], bool | None] | None = None,
        return_stats: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, TurnStats]:
        """This turn's `input_ids` (1, T) continued by up to `max_new_tokens`: (1, T + new)."""
        model, info = self.model, self.info
        vocab = model.config.get_text_config().vocab_size
        device = next(model.parameters()).device

        def build():
            check_mode(mode)
            (requests, _), signature = check_call(
                input_ids, max_new_tokens, self.layout, do_sample, temperature, top_k, top_p,
                seed, vocab,
            )  # fmt: skip
            if not isinstance(input_ids, torch.Tensor):
                raise TypeError("a Session turn takes one (1, T) tensor, not a list of prompts")
            return requests, (*signature, ("turn", self.turns), ("mode", mode))

        requests = validated(info, device, build)
        groups = [self.tp_info, info] if self.tp_info is not None else [info]
        fresh_seeds(requests, groups, backend_device(info, device))
        request = requests[0]
        stats = TurnStats(prompt_tokens=request.prompt.numel())
        start = time.perf_counter()
        engine = self.engine
        if self.turns == 0:
            logits = engine.prefill([request.prompt])
            stats.mode = "prefill"
        else:
            fed = [] if self.pending is None else [self.pending]
            pending = torch.tensor(fed, dtype=request.prompt.dtype, device=request.prompt.device)
            tokens = torch.cat([pending, request.prompt])
            logits = engine.extend(0, tokens, mode)[None]
            stats.mode = self.last_mode = engine.last_mode
        self.turns += 1
        engine.reserve([0], [max(0, request.max_new_tokens - 1)])
        stats.prefill_s = time.perf_counter() - start
        callback = None if on_token is None else (lambda _, token: on_token(token))
        out = decode_loop(engine, [0], requests, logits, eos_ids(model, eos_token_id), callback,
                          stats, start, groups)[0]  # fmt: skip
        self.pending = out[-1] if out else None  # no reply: the turn's tokens were all fed
        stats.cache_bytes = engine.state.nbytes
        stats.cache_capacity_bytes = engine.state.capacity_bytes
        stats.cache_tokens = engine.state.kept_tokens(0)
        prompt = request.prompt.to(device)
        tokens = torch.cat([prompt, torch.tensor(out, dtype=prompt.dtype, device=device)])[None]
        return (tokens, stats) if return_stats else tokens
