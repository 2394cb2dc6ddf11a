"""`ringattn.hf.generate`: a transformers model decoding over a sharded KV cache.

    tokens = ringattn.hf.generate(model, input_ids, max_new_tokens=64, group=None, layout="zigzag")
    tokens = ringattn.hf.generate(model, input_ids, 64, do_sample=True, temperature=0.8,
                                  top_p=0.95, seed=1)
    outs = ringattn.hf.generate(model, [p0, p1, p2], [16, 64, 8])   # a ragged batch

`input_ids` (1, S) is the whole prompt, the same on every rank; every rank returns the same
(1, S + new) tensor, greedy: equal to `model.generate(input_ids, do_sample=False, ...)` on one
device. A list of prompts, each (1, S_i) or 1-D, returns a list of (1, S_i + new_i), each equal to
the greedy `model.generate` of that prompt alone, each stopping at its own end-of-sequence token.

    prefill   the prompts packed as documents into one context-parallel forward (cu_seqlens);
              each rank keeps its rows' K/V in that sequence's cache (engine.py, kv_attention.py),
              then reserves its share of max_new_tokens (up to RESERVE_AHEAD) in every layer
    decode    each step feeds one token per live sequence as one batch (L, 1); a sequence leaves
              the batch at its end-of-sequence token, its max_new_tokens, or when `on_token`
              returns True (a stop string, a client gone)

Sampling (`do_sample=True`): temperature, top-k, top-p (inference/sampling.py), each sequence from
its own torch.Generator on the logits' device seeded from `seed` (batching.py: None draws a fresh
seed on rank 0 and shares it). Every rank holds the same logits; rank 0's tokens (greedy or
drawn) are still broadcast each step, so every rank keeps the same tokens whatever its hardware
does. Non-finite logits raise NonFiniteLogits on every rank (rank 0's verdict, sent with them).

The model needs no `parallelize` (its attention implementation is switched for each forward and
restored). With tensor parallelism (`tensor_parallel.py`) pass the cp group as `group` and the tp
group as `tp_group`. Follow-up turns over the cache: `ringattn.hf.Session` (session.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ringattn.comm import all_gather_ints, backend_device, resolve_group
from ringattn.inference.hf.batching import Request, check_call, eos_ids, fresh_seeds
from ringattn.inference.hf.engine import KVEngine
from ringattn.inference.sampling import next_token
from ringattn.inference.session import TurnStats
from ringattn.integrations.hf import vision
from ringattn.validate import validated

# decoded tokens reserved up front per sequence; beyond, the buffers double as they fill (a
# request for the whole remaining context must not hold it all before its first token)
RESERVE_AHEAD = 4096

__all__ = ["NonFiniteLogits", "decode_loop", "generate"]


NONFINITE, CANCELLED = -1, -2  # what rank 0 sends in place of a token


class NonFiniteLogits(RuntimeError):
    """A sequence's logits hold NaN or inf (a server-side failure, the same on every rank)."""


def _choose(logits: torch.Tensor, live: list[int], requests: list[Request], generators: list,
            cancel: Callable[[int], bool] | None) -> list[int]:  # fmt: skip
    """This rank's next token of each live sequence (row j of logits is live[j]): one host sync
    for every greedy argmax and the finiteness of every row; NONFINITE or CANCELLED instead."""
    checks = torch.stack([logits.argmax(-1), torch.isfinite(logits).all(-1).long()])
    greedy, finite = checks.tolist()  # (2, L): the one host sync of the greedy rows
    tokens = []
    for row, i in enumerate(live):
        if cancel is not None and cancel(i):
            tokens.append(CANCELLED)
        elif not finite[row]:
            tokens.append(NONFINITE)
        elif requests[i].sampling.greedy:
            tokens.append(greedy[row])
        else:
            tokens.append(next_token(logits[row], requests[i].sampling, generators[i]))
    return tokens


def decode_loop(
    engine: KVEngine,
    seqs: list[int],
    requests: list[Request],
    logits: torch.Tensor,
    eos: set[int],
    on_token: Callable[[int, int], bool | None] | None,
    stats: TurnStats,
    start: float,
    groups: list,
    cancel: Callable[[int], bool] | None = None,
) -> list[list[int]]:
    """New tokens of each request from the first logits (n, vocab), decoding the live ones.

    Rank 0's choice of every token is sent to every rank each step (greedy too: an argmax
    near-tie must not split the ranks), and with it rank 0's verdicts: `cancel(i)` True ends
    sequence i at once (its caches freed), non-finite logits raise NonFiniteLogits everywhere."""
    device = logits.device
    generators = [torch.Generator(device=device).manual_seed(r.sampling.seed) for r in requests]
    outs: list[list[int]] = [[] for _ in requests]
    live = [i for i, r in enumerate(requests) if r.max_new_tokens > 0]
    logits = logits[live]
    decode_start = None
    while live:
        tokens = _choose(logits, live, requests, generators, cancel)
        for info in groups:  # rank 0's tokens on every rank of every group (tp first, then cp)
            if info.world_size > 1:
                tokens = all_gather_ints(tokens, info, backend_device(info, device))[0]
        if NONFINITE in tokens:
            bad = [i for i, t in zip(live, tokens) if t == NONFINITE]
            raise NonFiniteLogits(f"the logits of sequence(s) {bad} hold NaN or inf")
        if decode_start is None:
            decode_start = time.perf_counter()
            stats.first_token_s = decode_start - start
        still = []
        for i, token in zip(live, tokens):
            if token == CANCELLED:
                engine.release(seqs[i])
                continue
            outs[i].append(token)
            stop = on_token(i, token) if on_token is not None else None
            if not (stop or token in eos or len(outs[i]) == requests[i].max_new_tokens):
                still.append(i)
        if not still:
            break
        logits = engine.decode([seqs[i] for i in still], [outs[i][-1] for i in still])
        live = still
    if decode_start is not None:
        stats.decode_s = time.perf_counter() - decode_start
    stats.new_tokens = sum(len(out) for out in outs)
    return outs


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor | list[torch.Tensor],
    max_new_tokens: int | list[int] = 64,
    group: object = None,
    layout: str = "zigzag",
    *,
    do_sample: bool = False,
    temperature: float | list[float] = 1.0,
    top_k: int | list[int] = 0,
    top_p: float | list[float] = 1.0,
    seed: int | list[int] | None = None,
    eos_token_id: int | list[int] | None = None,
    on_token: Callable[..., bool | None] | None = None,
    on_prefill: Callable[[int, int], None] | None = None,
    offload_kv: bool = False,
    tp_group: object = None,
    cancel: Callable[[int], bool] | None = None,
    return_stats: bool = False,
    **multimodal: torch.Tensor,
) -> torch.Tensor | list[torch.Tensor] | tuple[object, TurnStats]:
    """Continue `input_ids` by up to `max_new_tokens` tokens, stopping after an end-of-sequence
    token (`eos_token_id`, default the model's generation_config's). See the module docstring.

    Greedy unless `do_sample` (then `temperature`, `top_k` (0: all), `top_p` (1: all), `seed`;
    each one value or one per prompt). `on_token(token)` (one prompt) or `on_token(index, token)`
    (a list) is called on every rank as each new token is chosen; returning True ends that
    sequence. `cancel(index)` (read on rank 0 each step) True ends that sequence on every rank
    at that step, its caches freed. `on_prefill(layers_done, layers)` follows the prefill.
    `offload_kv` keeps the cache in host memory (inference/cache.py). With `return_stats`, also
    this rank's `TurnStats` (time to first token, decode time, the K/V bytes kept and the bytes
    the buffers hold). A vision-language model (Qwen2-VL, LLaVA; one prompt) also takes the
    processor's image inputs as keywords (`pixel_values`, `image_grid_thw`, ...:
    vision.MULTIMODAL_KEYS), the same on every rank.
    """
    info = resolve_group(group)
    tp_info = resolve_group(tp_group) if tp_group is not None else None
    vocab = model.config.get_text_config().vocab_size
    device = next(model.parameters()).device

    def build():
        unknown = sorted(set(multimodal) - set(vision.MULTIMODAL_KEYS))
        if unknown:
            raise ValueError(f"ringattn.hf.generate does not know the inputs {unknown}; it takes "
                             f"input_ids and {list(vision.MULTIMODAL_KEYS)}")  # fmt: skip
        checked, signature = check_call(input_ids, max_new_tokens, layout, do_sample,
                                        temperature, top_k, top_p, seed, vocab)  # fmt: skip
        is_list = checked[1]
        if is_list and any(v is not None for v in multimodal.values()):
            raise ValueError("image inputs go with one (1, S) prompt, not a list of prompts")
        return checked, signature

    requests, is_list = validated(info, device, build)
    images = {key: value for key, value in multimodal.items() if value is not None}
    if images or vision.is_multimodal(model):  # a VLM takes the whole prompt
        vision.check_family(model)
        vision.install(model)
    groups = [tp_info, info] if tp_info is not None else [info]
    fresh_seeds(requests, groups, backend_device(info, device))
    engine = KVEngine(model, group=group, layout=layout, offload=offload_kv)
    layers = engine.n_layers
    progress = None if on_prefill is None else (lambda layer: on_prefill(layer + 1, layers))
    stats = TurnStats(prompt_tokens=sum(r.prompt.numel() for r in requests))
    start = time.perf_counter()
    seqs = list(range(len(requests)))
    whole = images if (images or vision.is_multimodal(model)) else None
    logits = engine.prefill([r.prompt for r in requests], progress, whole)
    engine.reserve(seqs, [min(max(0, r.max_new_tokens - 1), RESERVE_AHEAD) for r in requests])
    stats.prefill_s = time.perf_counter() - start
    callback = on_token
    if on_token is not None and not is_list:
        callback = lambda _, token: on_token(token)
    outs = decode_loop(engine, seqs, requests, logits, eos_ids(model, eos_token_id), callback,
                       stats, start, groups, cancel)  # fmt: skip
    stats.cache_bytes = engine.state.nbytes
    stats.cache_capacity_bytes = engine.state.capacity_bytes
    stats.cache_tokens = sum(engine.state.kept_tokens(s) for s in seqs)
    results = []
    for r, out in zip(requests, outs):
        prompt = r.prompt.to(device)
        new = torch.tensor(out, dtype=prompt.dtype, device=device)
        results.append(torch.cat([prompt, new])[None])  # (1, S_i + new_i)
    result = results if is_list else results[0]
    return (result, stats) if return_stats else result
