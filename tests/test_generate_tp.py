"""Ring attention + tensor parallelism for transformers models: cp x tp ranks equal one process.

The model's own tp plan (`base_model_tp_plan`) over the tp dim of a (cp, tp) DeviceMesh, the
KV cache over cp x tp (tokens over cp, K/V heads over tp); greedy tokens of a ragged batch and of
a follow-up turn equal `model.generate` on this process, and each rank keeps 1 / (cp x tp) of the
cache.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import workers_hf
from test_generate_batch import _greedy, _prompt


@pytest.mark.parametrize(("world_size", "arch"), [(2, "llama"), (4, "qwen3"), (4, "gemma3")])
@pytest.mark.slow
def test_cp_times_tp_equals_one_process(pools, world_size, arch):
    tp = 2
    model = workers_hf.build(arch)
    prompts = [_prompt(19, 31), _prompt(6, 32)]
    want = [_greedy(model, p, 5) for p in prompts]
    turn2 = _greedy(model, torch.cat([want[0], prompts[1]], dim=1), 5)[:, want[0].shape[1] :]
    results = pools(world_size).run(
        "workers_generate:tensor_parallel", arch, prompts, 5, tp, timeout=600
    )
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for got in results:
        assert got["k_rows"] == config.num_key_value_heads // tp * head_dim
        for g, w in zip(got["batch"], want):
            assert torch.equal(g, w), arch
        assert torch.equal(got["turns"][0], want[0]) and torch.equal(got["turns"][1], turn2)
    total = sum(got["cache_bytes"] for got in results)
    # every layer keeps all (windowed: the kept) tokens of both prompts + 4 fed tokens each,
    # 2 x Hkv heads x D x 4 bytes, split over cp x tp
    if arch != "gemma3":
        tokens = sum(p.shape[1] + 4 for p in prompts)
        per_layer = tokens * 2 * config.num_key_value_heads * head_dim * 4
        assert total == per_layer * config.num_hidden_layers


def test_tp_rejects_models_it_cannot_split():
    from ringattn.integrations.hf.tensor_parallel import check_tensor_parallel

    with pytest.raises(ValueError, match="declares no tensor-parallel plan"):
        check_tensor_parallel(workers_hf.build("gpt_oss").config, 2)
    with pytest.raises(ValueError, match="num_key_value_heads = 2 does not split over --tp 4"):
        check_tensor_parallel(workers_hf.build("llama").config, 4)
