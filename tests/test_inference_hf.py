"""ringattn.hf.generate: greedy tokens equal transformers' own `model.generate` on one process.

Tiny random models of workers_hf.py (Llama, Qwen2, Qwen3, Mistral with a sliding window of 4,
Gemma 3 with sliding and full layers, gpt-oss with sinks, Gemma 2 with attention logit
softcapping), prompts longer than the window and of
lengths 2W does not divide, more new tokens than the window (so the cache evicts).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import workers_hf

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "gpt_oss", "gemma2")
LAYOUTS = ("zigzag", "striped", "contiguous")


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.slow
def test_hf_generate_equals_model_generate(pools, world_size):
    cases = []
    for index, arch in enumerate(ARCHS):
        length = 13 + 4 * index  # 13, 17, ..., 33
        prompt = torch.randint(3, workers_hf.VOCAB, (1, length),
                               generator=torch.Generator().manual_seed(index))  # fmt: skip
        cases.append({"arch": arch, "prompt": prompt, "new": 7,
                      "layout": LAYOUTS[(index + world_size) % 3]})  # fmt: skip
    results = pools(world_size).run("workers_inference:hf_generate", cases)
    for i, case in enumerate(cases):
        model = workers_hf.build(case["arch"])
        want = model.generate(case["prompt"], do_sample=False, max_new_tokens=case["new"])
        assert model.config._attn_implementation == "eager"
        for rank, got in enumerate(results):
            assert torch.equal(got[i], want), (case["arch"], case["layout"], rank)


def test_hf_generate_rejects_bad_input(pools):
    import ringattn.hf

    model = workers_hf.build("llama")
    with pytest.raises(ValueError, match="at least one integer token"):
        ringattn.hf.generate(model, torch.zeros(1, 0, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0"):
        ringattn.hf.generate(model, torch.ones(1, 3, dtype=torch.int64), -1)


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_a_windowed_layer_holds_its_window_and_one_block_after_300_decodes(arch):
    """generate and Session (an engine without a server's pool): a sliding window of 8 bounds
    what a windowed layer holds to the window and one block of rows (16), after a 20-token
    prompt and 300 decoded tokens, and `nbytes` counts what each layer holds. Gemma 3's full
    layer keeps every row (on the pages). Every step's logits equal the model's own windowed
    forward over the whole sequence. Before the fix the pages held all 320 rows of every
    layer and nbytes counted the 8 visible ones."""
    from ringattn.inference.hf.engine import KVEngine
    from ringattn.inference.paged import PagedView

    model = workers_hf.build(arch, sliding_window=8, max_position_embeddings=512)
    ids = torch.randint(3, workers_hf.VOCAB, (320,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids[None]).logits[0]  # (320, vocab)
        engine = KVEngine(model, layout="zigzag")
        got = [engine.prefill([ids[:20]])[0]]
        for t in range(20, 320):
            got.append(engine.decode([0], [int(ids[t])])[0])  # fed token t: logits of t
    torch.testing.assert_close(torch.stack(got), want[19:], atol=2e-5, rtol=1e-5)
    text = model.config.get_text_config()
    row = 2 * text.num_key_value_heads * text.head_dim * 4  # K and V of one token, float32
    kinds = getattr(text, "layer_types", None) or ["sliding_attention"] * 2
    paged = engine.state.paged
    for layer, kind in enumerate(kinds):
        cache = engine.state.caches[(layer, 0)]
        if kind == "sliding_attention":
            assert cache.tokens == 8 and cache.nbytes == 8 * row
            assert cache.capacity_bytes <= (8 + paged.block) * row
        else:  # the full layer: its 320 rows on the pages, and counted
            assert isinstance(cache, PagedView) and cache.nbytes == 320 * row
    full = [layer for layer, kind in enumerate(kinds) if kind != "sliding_attention"]
    assert sorted(paged.k) == full  # the pages hold the full layers' rows only
    assert paged.used * paged.block <= (320 + paged.block if full else 0)
