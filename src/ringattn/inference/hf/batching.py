"""The arguments of `ringattn.hf.generate`, checked and spread to one setting per prompt.

`input_ids` is one (1, S) tensor or a list of prompts, each (1, S_i) or 1-D. Every per-sequence
argument (max_new_tokens, temperature, top_k, top_p, seed) is either one value for all prompts or
a list with one value per prompt, so that a server can batch requests that asked for different
things. The checks run on every rank before any communication (`validated`): a bad argument is
the same ValueError everywhere, and the signature makes sure the ranks passed the same prompts.

Seeds. `seed=None` draws a fresh seed on the group's first rank and shares it (every rank must
draw the same tokens, and a new call must not replay an old stream); a scalar seed s gives prompt
i the seed s + i (so a one-prompt call with seed s is prompt 0 of a batch with seed s); a list
gives each prompt its own. Each sequence draws from its own torch.Generator on the logits' device.
"""

from __future__ import annotations

import dataclasses
import secrets
import zlib
from dataclasses import dataclass

import torch

from ringattn.comm import GroupInfo, all_gather_ints
from ringattn.inference.sampling import Sampling
from ringattn.layout import get_layout

GREEDY = Sampling()


@dataclass
class Request:
    """One prompt of a call and how to continue it."""

    prompt: torch.Tensor  # (S,) int64
    max_new_tokens: int
    sampling: Sampling
    fresh_seed: bool = False  # seed=None: drawn by `fresh_seeds`


def _per_prompt(name: str, value: object, n: int) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} values for {n} prompts; pass one value or "
                             f"one per prompt")  # fmt: skip
        return list(value)
    return [value] * n


def _prompts(input_ids: object) -> tuple[list[torch.Tensor], bool]:
    """(prompts as (S,) tensors, whether a list was passed)."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be a (1, S) tensor of the whole prompt (or a list of "
                             f"prompts), got {tuple(input_ids.shape)}")  # fmt: skip
        items, is_list = [input_ids], False
    elif isinstance(input_ids, (list, tuple)) and input_ids:
        items, is_list = list(input_ids), True
    else:
        raise ValueError(f"input_ids must be a (1, S) tensor or a non-empty list of prompts, got "
                         f"{type(input_ids).__name__} {input_ids!r:.60}")  # fmt: skip
    prompts = []
    for i, item in enumerate(items):
        if not isinstance(item, torch.Tensor) or not (
            item.dim() == 1 or (item.dim() == 2 and item.shape[0] == 1)
        ):
            shape = tuple(item.shape) if isinstance(item, torch.Tensor) else type(item).__name__
            raise ValueError(f"prompt {i} must be a (1, S) or 1-D tensor, got {shape}")
        if item.numel() == 0 or item.is_floating_point():
            raise ValueError(f"input_ids must hold at least one integer token, got {item.dtype} "
                             f"{tuple(item.shape)} (prompt {i})")  # fmt: skip
        prompts.append(item.reshape(-1))
    return prompts, is_list


def check_call(input_ids, max_new_tokens, layout, do_sample, temperature, top_k, top_p, seed,
               vocab_size: int) -> tuple[tuple[list[Request], bool], tuple]:  # fmt: skip
    """The requests and whether input_ids was a list, and the signature every rank must share."""
    get_layout(layout)
    prompts, is_list = _prompts(input_ids)
    n = len(prompts)
    for i, prompt in enumerate(prompts):
        low, high = int(prompt.min()), int(prompt.max())
        if low < 0 or high >= vocab_size:
            raise ValueError(f"prompt {i} holds token id {low if low < 0 else high}, outside the "
                             f"vocabulary [0, {vocab_size})")  # fmt: skip
    news = _per_prompt("max_new_tokens", max_new_tokens, n)
    for new in news:
        if not isinstance(new, int) or isinstance(new, bool) or new < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {new!r}")
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be a bool, got {do_sample!r}")
    seeds = _per_prompt("seed", seed, n)
    if not isinstance(seed, (list, tuple)) and seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed must be None, an int or a list of ints, got {seed!r}")
        seeds = [seed + i for i in range(n)]
    samplings = []
    temperatures = _per_prompt("temperature", temperature, n)
    top_ks, top_ps = _per_prompt("top_k", top_k, n), _per_prompt("top_p", top_p, n)
    for t, k, p, s in zip(temperatures, top_ks, top_ps, seeds):
        if not do_sample:
            samplings.append(GREEDY)
            continue
        sampling = Sampling(temperature=t, top_k=k, top_p=p, seed=0 if s is None else s)
        sampling.check()
        samplings.append(sampling)
    fresh = [do_sample and s is None for s in seeds]
    requests = [Request(*r) for r in zip(prompts, news, samplings, fresh)]
    crc = zlib.crc32(b"".join(p.cpu().to(torch.int64).numpy().tobytes() for p in prompts))
    signature = (("op", "hf.generate"), ("prompts", tuple(p.numel() for p in prompts)),
                 ("crc", crc), ("max_new_tokens", tuple(news)), ("layout", layout),
                 ("sampling", str(samplings)), ("fresh", tuple(fresh)))  # fmt: skip
    return (requests, is_list), signature


def fresh_seeds(requests: list[Request], groups: list[GroupInfo], device: torch.device) -> None:
    """Give every request still without a seed a fresh one, drawn on the first rank of each
    group in turn and shared (tp then cp: afterwards every rank of the mesh holds rank 0's)."""
    missing = [i for i, r in enumerate(requests) if r.fresh_seed]
    if not missing:
        return
    base = secrets.randbits(62)
    for info in groups:
        if info.world_size > 1:
            base = all_gather_ints([base], info, device)[0][0]
    for offset, i in enumerate(missing):
        requests[i].sampling = dataclasses.replace(requests[i].sampling, seed=base + offset)
        requests[i].fresh_seed = False


def eos_ids(model: torch.nn.Module, eos_token_id: object) -> set[int]:
    """The ids that end a sequence: `eos_token_id`, default the model's generation_config's."""
    if eos_token_id is None:
        config = getattr(model, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}
