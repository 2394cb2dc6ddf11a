"""`ringattn.hf.generate` contracts: ragged batches, sampling, follow-up turns, bad input.

The reference is always the same tiny random transformers model (workers_hf.py) on this one
process: `model.generate` of each prompt alone (greedy), or a loop over its full forward drawing
with `inference.sampling.next_token` from the same seed (sampling).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import workers_hf
from ringattn.inference.sampling import Sampling, next_token


def _prompt(length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, workers_hf.VOCAB, (1, length), generator=gen)


def _greedy(model, prompt: torch.Tensor, new: int, eos=None) -> torch.Tensor:
    prompt = prompt.reshape(1, -1)
    # an explicit mask: generate would otherwise mask every token equal to pad_token_id
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                          max_new_tokens=new, eos_token_id=eos, pad_token_id=0)  # fmt: skip


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt_oss"])
@pytest.mark.slow
def test_ragged_batch_equals_each_prompt_alone(pools, world_size, arch):
    """Prompts of 13, 1, 21 and 6 tokens (1-D and (1, S)), max_new_tokens of 7, 3, 9, 0, and an
    EOS that one sequence meets after 2 tokens: each result equals its prompt generated alone."""
    model = workers_hf.build(arch)
    prompts = [_prompt(13, 1), _prompt(1, 2)[0], _prompt(21, 3), _prompt(6, 4)[0]]
    news = [7, 3, 9, 0]
    eos = int(_greedy(model, prompts[2], 2)[0, -1])  # sequence 2 stops at its 2nd new token
    want = [_greedy(model, p, n, eos) if n else p.reshape(1, -1) for p, n in zip(prompts, news)]
    assert want[2].shape[1] <= 21 + 2
    options = {"max_new_tokens": news, "eos_token_id": eos, "layout": "zigzag"}
    for got in pools(world_size).run("workers_generate:batch", arch, prompts, options, timeout=600):
        assert len(got) == len(prompts)
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), (arch, i, g, w)


def _sample_reference(model, prompt: torch.Tensor, new: int, sampling: Sampling) -> list[int]:
    generator, tokens = torch.Generator().manual_seed(sampling.seed), prompt[0].tolist()
    with torch.no_grad():
        for _ in range(new):
            logits = model(torch.tensor([tokens]), use_cache=False).logits[0, -1].float()
            tokens.append(next_token(logits, sampling, generator))
    return tokens


def test_sampling_is_the_same_everywhere_and_fresh_per_call(pools):
    """W = 2: a seeded draw is the same on both ranks and equals the one-process draw with that
    seed; the same seed twice gives the same tokens; seed=None twice gives different streams
    (both ranks agreeing); top_k=1 is greedy."""
    model, prompt = workers_hf.build("mistral"), _prompt(15, 7)
    options = {"max_new_tokens": 12, "do_sample": True, "temperature": 1.5, "top_k": 40,
               "top_p": 0.9}  # fmt: skip
    calls = [{**options, "seed": 5}, {**options, "seed": 5}, {**options, "seed": None},
             {**options, "seed": None}, {**options, "top_k": 1}]  # fmt: skip
    results = pools(2).run("workers_generate:calls", "mistral", prompt, calls, timeout=600)
    want = _sample_reference(model, prompt, 12, Sampling(1.5, 40, 0.9, 5))
    for got in results:
        assert got[0][0].tolist() == want
        assert torch.equal(got[0], got[1])
        assert not torch.equal(got[2], got[3])  # 12 draws at temperature 1.5: never equal
        assert torch.equal(got[4], _greedy(model, prompt, 12))
    for a, b in zip(results[0], results[1]):
        assert torch.equal(a, b)


def test_sampling_in_a_batch_equals_each_prompt_alone(pools):
    """A scalar seed s gives prompt i the seed s + i: the batch equals the calls alone."""
    prompts = [_prompt(9, 11), _prompt(4, 12)]
    options = {"max_new_tokens": 6, "do_sample": True, "temperature": 1.2, "seed": 3}
    model = workers_hf.build("llama")
    got = pools(2).run("workers_generate:batch", "llama", prompts, options, timeout=600)
    for i, prompt in enumerate(prompts):
        want = _sample_reference(model, prompt, 6, Sampling(1.2, 0, 1.0, 3 + i))
        for rank_result in got:
            assert rank_result[i][0].tolist() == want


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt_oss", "gemma2"])
@pytest.mark.slow
def test_follow_up_turns_equal_model_generate_of_the_conversation(pools, world_size, arch):
    """Three turns over the cache, pass-KV and pass-Q: each reply equals model.generate of the
    whole conversation so far (sliding layers, sinks and softcapping included)."""
    model = workers_hf.build(arch)
    turns = [_prompt(17, 21), _prompt(3, 22), _prompt(9, 23)]
    history, want = torch.zeros(1, 0, dtype=torch.int64), []
    for prompt in turns:
        history = torch.cat([history, prompt], dim=1)
        full = _greedy(model, history, 4)
        want.append(full[:, history.shape[1] - prompt.shape[1] :])
        history = full
    for mode in ("pass-kv", "pass-q"):
        results = pools(world_size).run(
            "workers_generate:conversation", arch, turns, 4, mode, timeout=600
        )
        for got in results:
            assert [m for _, m in got[1:]] == [mode, mode]
            for turn, ((tokens, _), w) in enumerate(zip(got, want)):
                assert torch.equal(tokens, w), (arch, mode, turn)


def test_bad_arguments_raise_the_same_error_on_every_rank(pools):
    cases = [
        ({"max_new_tokens": [3, 4]}, "max_new_tokens has 2 values for 1 prompts"),
        ({"max_new_tokens": -1}, "max_new_tokens must be an int >= 0"),
        ({"do_sample": True, "temperature": -1.0}, "temperature must be >= 0"),
        ({"do_sample": True, "top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"input_ids": [torch.ones(2, 3, dtype=torch.int64)]}, "prompt 0 must be a (1, S)"),
        ({"input_ids": torch.ones(1, 3)}, "at least one integer token"),
        ({"input_ids": torch.full((1, 3), 500)}, "outside the vocabulary [0, 100)"),
    ]
    for options, needle in cases:
        for got in pools(2).run("workers_generate:bad_call", dict(options), False, timeout=600):
            assert needle in got, (options, got)
    for got in pools(2).run("workers_generate:bad_call", {"max_new_tokens": 2}, True, timeout=600):
        assert "different" in got or "signature" in got or "rank" in got, got


def test_the_cache_reserves_the_generation_once_and_reports_what_it_holds():
    """One process, no EOS: after the prefill every layer reserves max_new_tokens - 1 rows, so the
    buffers end exactly full (no doubling at the first decoded token), and the stats say so."""
    import ringattn.hf

    model, prompt = workers_hf.build("llama"), _prompt(23, 41)
    _, stats = ringattn.hf.generate(model, prompt, 9, eos_token_id=[], return_stats=True)
    per_token = 2 * 2 * 8 * 4 * 2  # (k, v) x 2 K/V heads x 8 dims x 4 bytes x 2 layers
    assert stats.cache_bytes == (23 + 8) * per_token == stats.cache_capacity_bytes
    _, offloaded = ringattn.hf.generate(model, prompt, 9, eos_token_id=[], return_stats=True,
                                        offload_kv=True)  # fmt: skip
    assert offloaded.cache_capacity_bytes == stats.cache_capacity_bytes


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_opened_sequences_prefill_packed_then_extend_and_decode_as_alone(pools, world_size, arch):
    """The server's packed first chunks (`KVEngine.prefill(seqs=...)`, the model held on the
    engine's attention): each stage's logits equal the model's full forward of that prefix
    (sliding layers included), on every rank."""
    model = workers_hf.build(arch)
    prompts = [_prompt(11, 31)[0], _prompt(14, 32)[0]]
    split = 6
    with torch.no_grad():

        def last(ids):
            return model(ids[None], use_cache=False).logits[0, -1].float()

        first = torch.stack([last(p[:split]) for p in prompts])
        rest = torch.stack([last(p) for p in prompts])
        tokens = [int(r.argmax()) for r in rest]
        step = torch.stack(
            [last(torch.cat([p, torch.tensor([t])])) for p, t in zip(prompts, tokens)]
        )
    for got in pools(world_size).run("workers_generate:opened_prefill", arch, prompts, split,
                                     timeout=600):  # fmt: skip
        for stage, (g, w) in enumerate(zip(got, [first, rest, step])):
            assert torch.allclose(g, w, rtol=1e-4, atol=1e-4), (arch, stage, (g - w).abs().max())


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt_oss"])
def test_a_step_packs_decodes_new_prompts_and_chunks_in_one_forward_as_alone(pools, world_size,
                                                                             arch):  # fmt: skip
    """`KVEngine.step` (the server's one forward per step): every mix of new prompts, later
    chunks of cached ones and decode tokens gives each row the logits of the model's full
    forward of that sequence's prefix (sliding layers, attention sinks and a mixture of experts
    included), on every rank."""
    model = workers_hf.build(arch)
    prompts = [_prompt(11, 41)[0], _prompt(14, 42)[0], _prompt(9, 43)[0]]
    cuts = [6, 5, 4]
    with torch.no_grad():

        def last(ids):
            return model(ids[None], use_cache=False).logits[0, -1].float()

        a, b, c = prompts
        first = torch.stack([last(a[:6]), last(b[:5])])
        second = torch.stack([last(a), last(b), last(c[:4])])
        grown = [torch.cat([p, second[i].argmax().view(1)]) for i, p in enumerate((a, b))]
        decoded = torch.stack([last(g) for g in grown])
        third = last(c)
        grown = [torch.cat([g, decoded[i].argmax().view(1)]) for i, g in enumerate(grown)]
        grown.append(torch.cat([c, third.argmax().view(1)]))
        final = torch.stack([last(g) for g in grown])
    want = [first, second, decoded, third, final]
    for got in pools(world_size).run("workers_generate:packed_steps", arch, prompts, cuts,
                                     timeout=600):  # fmt: skip
        for stage, (g, w) in enumerate(zip(got, want)):
            assert torch.allclose(g, w, rtol=1e-4, atol=1e-4), (arch, stage, (g - w).abs().max())
