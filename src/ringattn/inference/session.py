"""A conversation over a persistent sharded KV cache: prompt, generate, follow up, generate...

    session = Session(model, group=group, layout="zigzag")
    reply = session.generate(prompt, 64, sampling=Sampling(temperature=0.8, top_p=0.9, seed=1))
    more = session.generate(follow_up, 64)          # over the cache: pass-KV or pass-Q

Every rank calls `generate` with the same arguments and returns the same tokens. The model runs
on `KVEngine` (hf/engine.py through native.py), the engine `ringattn.hf.Session` and the server
use too: sequence 0 of the engine is the conversation, its first turn a prefill, each later turn
an `extend` over the cache. Arguments are
checked on every rank before any communication (the same ValueError everywhere), then one
agreement check makes sure the ranks really passed the same prompt, lengths and seed. The last
token of a reply is not fed to the model until it is needed: the next turn starts with it.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ringattn.inference.hf.engine import KVEngine
from ringattn.inference.sampling import Sampling, next_token
from ringattn.inference.turns import check_mode
from ringattn.models import Transformer
from ringattn.validate import validated

GREEDY = Sampling()


@dataclass
class TurnStats:
    """Timings of one `generate` call on this rank (seconds)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    """Prompt (or follow-up) through the model, up to the first logits."""
    first_token_s: float = 0.0
    """From the call to the first new token chosen."""
    decode_s: float = 0.0
    """The tokens after the first one."""
    mode: str = "prefill"
    """"prefill" for the first turn, else the follow-up mode used: "pass-kv" or "pass-q"."""
    cache_bytes: int = 0
    """Bytes of K/V this rank keeps."""
    cache_capacity_bytes: int = 0
    """Bytes this rank's cache buffers hold (kept plus reserved for the tokens to come)."""
    cache_tokens: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.new_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


def check_prompt(prompt: object, vocab_size: int) -> list[int]:
    """The prompt as a list of ints; ValueError if empty or out of the vocabulary."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.is_floating_point():
            raise ValueError(
                f"prompt must be a 1-D integer tensor, got {prompt.dtype} {tuple(prompt.shape)}"
            )
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
        raise ValueError(f"prompt must be a list of token ids, got {type(prompt).__name__}")
    if len(prompt) == 0:
        raise ValueError("the prompt is empty; pass at least one token")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt holds {len(bad)} token ids outside the vocabulary [0, {vocab_size}), e.g. "
            f"{bad[0]}; tokenize with the model's tokenizer"
        )
    return list(prompt)


@dataclass
class Session:
    """Generation with `model` over the ranks of `group` (see module docstring).

    `window`: the earlier tokens each query sees (a sliding-window model; None: all), which
    also bounds the cache; `merge`: "allgather" or "allreduce" (partials.py); `backend`: the
    attention kernel; `offload_kv`: keep the cache in host memory (cache.py)."""

    model: Transformer
    group: object = None
    layout: str = "zigzag"
    window: int | None = None
    merge: str = "allgather"
    backend: str = "auto"
    offload_kv: bool = False
    engine: KVEngine = field(init=False)
    pending: int | None = field(init=False, default=None)  # last token, not yet fed
    turns: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.engine = KVEngine(
            self.model, group=self.group, layout=self.layout, offload=self.offload_kv,
            window=self.window, merge=self.merge, backend=self.backend,
        )  # fmt: skip

    @torch.no_grad()
    def generate(
        self,
        prompt: list[int] | torch.Tensor,
        max_new_tokens: int,
        *,
        sampling: Sampling = GREEDY,
        eos_id: int | None = None,
        mode: str = "auto",
        on_token: Callable[[int], None] | None = None,
        on_prefill: Callable[[int, int], None] | None = None,
    ) -> tuple[list[int], TurnStats]:
        """Continue the conversation with `prompt`; up to `max_new_tokens` new tokens (stopping
        after `eos_id`), and this rank's timings. `on_token(token)` sees each token as it comes,
        `on_prefill(layers_done, n_layers)` the prompt's progress; `mode` picks pass-KV / pass-Q
        for a follow-up turn ("auto": Meta's rule)."""

        def build() -> tuple[list[int], tuple]:
            vocab = self.model.cfg.vocab_size
            tokens = check_prompt(prompt, vocab)
            if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
                raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
            sampling.check()
            if eos_id is not None and not (isinstance(eos_id, int) and 0 <= eos_id < vocab):
                raise ValueError(
                    f"eos_id must be None or a token id in [0, {vocab}), got {eos_id!r}"
                )
            check_mode(mode)
            signature = (
                ("op", "generate"), ("turn", self.turns), ("prompt_len", len(tokens)),
                ("prompt_crc", zlib.crc32(str(tokens).encode())),
                ("max_new_tokens", max_new_tokens), ("sampling", str(sampling)), ("eos_id", eos_id),
                ("mode", mode), ("layout", self.layout), ("merge", self.merge),
                ("window", self.window),
            )  # fmt: skip
            return tokens, signature

        # local checks on every rank, then one exchange: every rank raises the same error
        engine = self.engine
        prompt = validated(engine.info, torch.device("cpu"), build)
        self.turns += 1
        stats = TurnStats(prompt_tokens=len(prompt))
        start = time.perf_counter()
        tokens = torch.tensor(([] if self.pending is None else [self.pending]) + prompt,
                              device=engine.device)  # fmt: skip
        if 0 not in engine.lengths:  # the first turn: sequence 0 starts with its prefill
            layers = engine.n_layers
            progress = None if on_prefill is None else (lambda i: on_prefill(i + 1, layers))
            logits = engine.prefill([tokens], progress)[0]
        else:
            logits = engine.extend(0, tokens, mode)
            stats.mode = engine.last_mode
        self.pending = None
        engine.reserve([0], [max(0, max_new_tokens - 1)])  # the last token is not fed
        stats.prefill_s = time.perf_counter() - start
        generator = sampling.generator(logits.device)
        out: list[int] = []
        decode_start = None
        while len(out) < max_new_tokens:
            if out:
                logits = engine.decode([0], [out[-1]])[0]
            token = next_token(logits, sampling, generator)
            out.append(token)
            if decode_start is None:
                decode_start = time.perf_counter()
                stats.first_token_s = decode_start - start
            if on_token is not None:
                on_token(token)
            if token == eos_id:
                break
        if decode_start is not None:
            stats.decode_s = time.perf_counter() - decode_start
        self.pending = out[-1] if out else None
        stats.new_tokens = len(out)
        stats.cache_bytes, stats.cache_tokens = engine.state.nbytes, engine.state.kept_tokens(0)
        stats.cache_capacity_bytes = engine.state.capacity_bytes
        return out, stats
