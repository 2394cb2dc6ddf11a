"""Inference over a sharded KV cache: equal to the single-process decoder without a cache.

References: the same model re-run on the whole sequence for every token (inference/generate.py's
`generate`, no cache, one process), and float64 attention over the full cache for the merge.
Multi-rank cases run in worker pools (workers_inference.py).
"""

from __future__ import annotations

import pytest
import torch

from ringattn.inference import Sampling, choose_mode, next_token
from ringattn.inference.cache import LayerCache
from ringattn.inference.generate import generate as generate_without_cache
from ringattn.kernels.reference import reference_forward
from workers_inference import build_model

LAYOUTS = ("zigzag", "striped", "contiguous")


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_greedy_equals_the_decoder_without_cache(pools, world_size):
    """Every layout, prompt lengths that 2W does not divide (one shorter than W) and one it
    does, both merges."""
    model = build_model()
    cases = [
        {"prompt": _prompt(length, seed=length), "new": 8, "layout": layout, "merge": merge}
        for length, layout, merge in [
            (37, "zigzag", "allgather"), (21, "striped", "allreduce"),
            (3, "contiguous", "allgather"), (50, "zigzag", "allreduce"),
            (48, "zigzag", "allgather"),  # divisible by 2W: the dense schedule
        ]
    ]  # fmt: skip
    results = pools(world_size).run("workers_inference:greedy", cases)
    for case, *per_rank in zip(cases, *results):
        want = generate_without_cache(model, case["prompt"], case["new"])
        assert len(set(want)) > 1, "the test model must not repeat one token"
        for rank, got in enumerate(per_rank):
            assert got["tokens"] == want, (case["layout"], case["merge"], rank)


def test_window_decoding_equals_windowed_prefill(pools):
    """A sliding window of 6 earlier tokens: decoding over the evicting cache at W = 2 equals a
    windowed prefill of the whole sequence on one process (ringattn.attention with window), and
    the ranks together keep window + 1 tokens instead of the whole sequence."""
    from ringattn.inference.hf.engine import KVEngine

    model, prompt, window = build_model(), _prompt(29, seed=3), 6
    case = {"prompt": prompt, "new": 6, "layout": "zigzag", "window": window}
    results = pools(2).run("workers_inference:greedy", [case])
    want = list(prompt)
    for _ in range(case["new"]):
        engine = KVEngine(model, layout="contiguous", window=window)
        want.append(int(engine.prefill([torch.tensor(want)])[0].argmax()))
    for rank_results in results:
        assert rank_results[0]["tokens"] == want[len(prompt) :]
    # the last step's query saw itself and the 6 before it: that is all the ranks still keep
    assert sum(r[0]["cache_tokens"] for r in results) == window + 1


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("merge", ["allgather", "allreduce"])
def test_engine_decodes_several_of_our_sequences_at_once(pools, merge, paged):
    """KVEngine drives our decoder like a transformers model: three prompts of different lengths
    packed in one prefill, then each step one batched decode (three positions, three RoPE
    angles, three caches; or the server's paged cache) at W = 2; each sequence equals the
    decoder without cache."""
    model = build_model()
    prompts = [_prompt(length, seed=length) for length in (13, 30, 4)]
    wants = [generate_without_cache(model, prompt, 6) for prompt in prompts]
    for got in pools(2).run("workers_inference:engine_batch", prompts, 6, merge, paged):
        assert got == wants


def test_session_options_reach_the_engine():
    """`backend` picks the kernel every partial runs; `window` is our decoder's option only: a
    transformers model's windows are its config's, so the engine refuses one by name."""
    from ringattn.inference import Session
    from ringattn.inference.hf.engine import KVEngine

    model, prompt = build_model(), _prompt(11, seed=1)
    for backend in ("reference", "cpu_flash"):
        session = Session(model, layout="zigzag", backend=backend)
        assert session.generate(prompt, 5)[0] == generate_without_cache(model, prompt, 5)
        assert session.engine.state.kernel.name == backend
    with pytest.raises(ValueError, match="window must be None or an int >= 0"):
        Session(model, window=-1)
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4)  # fmt: skip
    with pytest.raises(ValueError, match="window=4 applies to ringattn's decoder"):
        KVEngine(transformers.AutoModelForCausalLM.from_config(config), window=4)


def test_the_removed_decoder_is_refused_by_name():
    with pytest.raises(ImportError, match="CachedDecoder was removed: KVEngine"):
        from ringattn.inference import CachedDecoder  # noqa: F401


def test_generation_stops_after_eos(pools):
    model, prompt = build_model(), _prompt(26, seed=6)
    want = generate_without_cache(model, prompt, 8)
    eos = next(t for i, t in enumerate(want) if i >= 2 and t not in want[:i])
    case = {"prompt": prompt, "new": 8, "layout": "zigzag", "eos": eos}
    for rank_results in pools(2).run("workers_inference:greedy", [case]):
        assert rank_results[0]["tokens"] == want[: want.index(eos) + 1]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("merge", ["allgather", "allreduce"])
def test_decode_merge_is_exact(pools, world_size, merge):
    """A query over a cache split unevenly (one rank empty) equals float64 attention over the
    whole cache, GQA 4:2; shift 0 is the plain all-reduce, 300 forces its overflow fallback."""
    gen = torch.Generator().manual_seed(world_size)
    q = torch.randn(1, 4, 1, 24, generator=gen)
    k, v = torch.randn(2, 1, 2, 53, 24, generator=gen).unbind(0)
    split = [0, 20, 33] if world_size == 3 else [41, 12]
    want, want_lse = reference_forward(q.double(), k.double(), v.double(), None, 24**-0.5)
    for shift in (0.0, 300.0) if merge == "allreduce" else (0.0,):
        outs = pools(world_size).run("workers_inference:merge_case", q, k, v, split, merge, shift)
        for out, lse in outs:
            assert out.dtype == torch.float32
            torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=1e-5)
            torch.testing.assert_close(lse.double(), want_lse, atol=2e-6, rtol=1e-5)
        assert all(torch.equal(out, outs[0][0]) for out, _ in outs)  # every rank the same bits


def test_one_collective_per_layer_per_decoded_token(pools):
    """5 decode steps of a 2-layer model at W = 3: 10 collectives with either merge (the
    all-reduce's second pass only runs on overflow)."""
    results = pools(3).run("workers_inference:count_collectives", _prompt(17, seed=2), 5)
    assert all(r == {"allgather": 10, "allreduce": 10} for r in results), results


@pytest.mark.parametrize("world_size", [2, 3])
def test_follow_up_turns_are_exact(pools, world_size):
    """Three turns over one persistent cache, forced pass-KV and forced pass-Q: every reply equals
    the decoder without cache re-run on the whole conversation so far."""
    model = build_model()
    turns = [_prompt(23, seed=1), _prompt(5, seed=2), _prompt(11, seed=4)]
    history, want = [], []
    for prompt in turns:
        history += prompt
        reply = generate_without_cache(model, history, 4)
        want.append(reply)
        history += reply
    for mode in ("pass-kv", "pass-q"):
        results = pools(world_size).run("workers_inference:follow_up", turns, 4, mode)
        for got in results:
            assert got["replies"] == want, mode
            assert got["modes"] == ["prefill", mode, mode]


def test_pass_kv_and_pass_q_logits_match_recomputation(pools):
    """The follow-up's last logits by either mode equal the single-process model's logits for
    the whole sequence (striped layout, W = 3)."""
    model = build_model()
    prompt, more = _prompt(31, seed=7), _prompt(9, seed=8)
    with torch.no_grad():
        tokens = torch.tensor([prompt + more])
        want = model(tokens, torch.arange(tokens.shape[1]))[0, -1]
    for got in pools(3).run("workers_inference:follow_up_logits", prompt, more):
        for mode in ("pass-kv", "pass-q"):
            torch.testing.assert_close(got[mode], want, atol=1e-4, rtol=1e-4)


def test_mode_rule():
    """Fewer bytes: pass-Q while T * Hq * (D e + 4 (D + 1)) < (T + P_kept) * 2 * Hkv * D e,
    unless pass-KV's transfer hides (D = 128, e = 2 by default)."""
    assert choose_mode(10, 990, 32, 8, 4) == "pass-q"  # 1 % new < 50 %
    assert choose_mode(600, 400, 32, 8, 4) == "pass-kv"  # 60 % new >= 50 %
    assert choose_mode(4, 96, 8, 1, 2) == "pass-q"  # 4 % < 25 %
    assert choose_mode(30, 70, 8, 1, 2) == "pass-kv"
    # break-even at T / (T + P) = Hkv / Hq for float32 (e = 4): 8 / 32 = 25 %
    assert choose_mode(24, 76, 32, 8, 4, head_dim=1024, elem_bytes=4) == "pass-q"
    assert choose_mode(26, 74, 32, 8, 4, head_dim=1024, elem_bytes=4) == "pass-kv"
    # a window keeps 100 of the 1,000 cached tokens: 10 new ones no longer pay for pass-Q
    assert choose_mode(10, 990, 32, 8, 4) == "pass-q"
    assert choose_mode(10, 990, 32, 8, 4, kept_tokens=20) == "pass-kv"
    # T >= N C Hkv e / (2 Hq BW) = 4 * 1e15 * 8 * 2 / (2 * 32 * 1e11) = 10,000 tokens
    hide = {"flops_per_s": 1e15, "bytes_per_s": 1e11, "elem_bytes": 2}
    assert choose_mode(20_000, 1_000_000, 32, 8, 4, **hide) == "pass-kv"
    assert choose_mode(5_000, 1_000_000, 32, 8, 4, **hide) == "pass-q"


def test_auto_mode_follows_the_rule(pools):
    """8 query heads over 1 K/V head of 4 dims in float32: pass-Q below 2 * 4 * 4 / (8 * 36) = 11 %
    new tokens (the bytes), pass-KV above. Turn 2 has 2 new (1 + the last reply token) over 21
    cached (9 %), turn 3 has 13 over 24 (35 %); the replies equal the decoder without cache."""
    model = build_model(heads=8, kv_heads=1)
    turns = [_prompt(20, 1), _prompt(1, 2), _prompt(12, 3)]
    history, want = [], []
    for prompt in turns:
        history += prompt
        want.append(generate_without_cache(model, history, 2))
        history += want[-1]
    results = pools(2).run("workers_inference:follow_up", turns, 2, "auto", 8, 1)
    for got in results:
        assert got["modes"] == ["prefill", "pass-q", "pass-kv"]
        assert got["replies"] == want


@pytest.mark.parametrize("world_size", [2, 3])
def test_sampling_is_the_same_on_every_rank_and_one_process(pools, world_size):
    """Temperature, top-k and top-p with one seed: every rank draws the same tokens, equal to a
    single process drawing from the decoder without cache's logits with the same seed."""
    model, prompt = build_model(), _prompt(19, seed=5)
    for options in ({"temperature": 1.3, "seed": 7}, {"temperature": 0.9, "top_k": 20,
                    "top_p": 0.8, "seed": 11}):  # fmt: skip
        sampling = Sampling(**options)
        results = pools(world_size).run("workers_inference:sampled", prompt, 10, options)
        generator, tokens = sampling.generator(), list(prompt)
        with torch.no_grad():
            for _ in range(10):
                logits = model(torch.tensor([tokens]), torch.arange(len(tokens)))[0, -1]
                tokens.append(next_token(logits, sampling, generator))
        want = tokens[len(prompt) :]
        assert len(set(want)) > 3
        assert all(got == want for got in results), options


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
    draws = {
        next_token(logits, Sampling(temperature=1.0, top_k=2), torch.Generator().manual_seed(s))
        for s in range(40)
    }  # fmt: skip
    assert draws == {1, 3}
    probs = torch.softmax(logits, 0)  # 0.64, 0.24, ... : top_p 0.7 keeps tokens 1 and 3
    assert probs[1] < 0.7 <= probs[1] + probs[3]
    draws = {
        next_token(logits, Sampling(temperature=1.0, top_p=0.7), torch.Generator().manual_seed(s))
        for s in range(40)
    }
    assert draws == {1, 3}
    assert next_token(logits, Sampling(), torch.Generator()) == 1


@pytest.mark.parametrize("world_size", [2, 4])
def test_kv_shards_are_balanced(pools, world_size):
    """After a 203-token prompt and 41 decoded tokens each rank keeps <= 1/W + 5 % of the cache
    one process keeps, and together exactly the whole of it."""
    case = {"prompt": _prompt(203, seed=9), "new": 42, "layout": "zigzag"}
    single = pools(1).run("workers_inference:greedy", [case])[0][0]
    results = pools(world_size).run("workers_inference:greedy", [case])
    per_rank = [r[0]["cache_bytes"] for r in results]
    assert sum(per_rank) == single["cache_bytes"]
    assert max(per_rank) <= (1 / world_size + 0.05) * single["cache_bytes"]


@pytest.mark.parametrize(
    "case, needle",
    [
        ("empty", "prompt is empty"),
        ("negative", "max_new_tokens must be an int >= 0, got -1"),
        ("vocab", "outside the vocabulary [0, 256)"),
        ("top_p", "top_p must be in (0, 1]"),
        ("disagree", "ranks disagree"),
    ],
)
def test_bad_input_fails_on_every_rank(pools, case, needle):
    results = pools(3).run("workers_inference:bad_input", case)
    assert all(r.startswith("ValueError") and needle in r for r in results), results


def test_layer_cache_window_evicts_a_prefix_and_compacts():
    k = torch.randn(1, 2, 10, 4)
    cache = LayerCache(k, -k, torch.arange(0, 20, 2))  # positions 0, 2, ..., 18
    cache.evict_before(7)  # 8 .. 18 stay; 4 dead rows of 10 are kept in place
    kept_k, kept_v, pos = cache.kept()
    assert pos.tolist() == [8, 10, 12, 14, 16, 18] and cache.k.shape[2] == 10
    assert torch.equal(kept_k, k[:, :, 4:]) and torch.equal(kept_v, -k[:, :, 4:])
    cache.evict_before(13)  # 7 dead rows of 10: compacted to the 3 live ones
    assert cache.kept()[2].tolist() == [14, 16, 18] and cache.k.shape[2] == 3
    assert torch.equal(cache.kept()[0], k[:, :, 7:])
    cache.append(torch.ones(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), torch.tensor([20]))
    assert cache.kept()[2].tolist() == [14, 16, 18, 20] and cache.k.shape[2] == 6  # doubled
    assert torch.equal(cache.kept()[0][:, :, 3], torch.ones(1, 2, 4))
    assert cache.nbytes == 4 * 2 * (2 * 4) * 4  # tokens x (k, v) x (heads x dim) x 4 bytes
