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
