"""`ringattn plan` for MoE configs and `--ep`: a token's matmuls run its top_k experts, the
expert weights FSDP gathers shrink to 1/ep, the dispatch all-to-alls are priced and exposed.

Mixtral-8x7B's shape (config.json written here, no download): 8 experts of 14,336, top 2.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ringattn.cli.main import main
from ringattn.planner.cost import PlanSpec, step_time
from ringattn.planner.hardware import get_hardware
from ringattn.planner.memory import memory_bytes
from ringattn.planner.models import get_model
from ringattn.planner.search import Job, check_plan, model_flops_per_token, search

MIXTRAL = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
           "num_local_experts": 8, "num_experts_per_tok": 2}  # fmt: skip


@pytest.fixture
def mixtral(tmp_path):
    path = tmp_path / "mixtral" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(MIXTRAL))
    return str(path)


def _spec(model, ep: int, dp: int = 2, cp: int = 4, seq_len: int = 32768) -> PlanSpec:
    return PlanSpec(get_model(model), get_hardware("h100"), seq_len, 1, dp, cp, 1, 1, "ring",
                    "zigzag", ep=ep)  # fmt: skip


def test_moe_shape_counts_every_expert_but_runs_top_k(mixtral):
    m = get_model(mixtral)
    assert (m.experts, m.top_k, m.expert_params()) == (8, 2, 8 * 3 * 4096 * 14336)
    assert m.params() == pytest.approx(46.7e9, rel=0.01)  # Mixtral-8x7B: 46.7 B parameters
    assert m.active_layer_params() * m.n_layers == pytest.approx(12.9e9 - 0.26e9, rel=0.02)
    dense = model_flops_per_token(_spec(mixtral, 1))
    assert dense < 6 * m.params()  # MFU counts the active parameters only


def test_ep_shrinks_gathered_experts_and_prices_the_dispatch(mixtral):
    one, four, eight = (_spec(mixtral, ep) for ep in (1, 4, 8))
    mem = {ep: memory_bytes(s) for ep, s in ((1, one), (4, four), (8, eight))}
    for kind in ("parameters", "gradients", "optimizer"):  # FSDP2 over dp x cp either way
        assert mem[4][kind] == mem[1][kind] == mem[8][kind]
    assert mem[8]["fsdp_buffers"] < mem[4]["fsdp_buffers"] < mem[1]["fsdp_buffers"]
    # with a short loss chunk a block's backward, where the dispatch lives, is the peak
    block = {ep: memory_bytes(replace(s, loss_chunk=512)) for ep, s in ((1, one), (4, four))}
    assert block[1]["expert_dispatch"] == 0 < block[4]["expert_dispatch"]
    times = {ep: step_time(s) for ep, s in ((1, one), (4, four), (8, eight))}
    assert times[1]["ep_dispatch_s"] == 0 < times[4]["ep_dispatch_s"] < times[8]["ep_dispatch_s"]
    assert times[4]["fsdp_comm_s"] < times[1]["fsdp_comm_s"]


def test_ep_rules_and_the_command(mixtral, tmp_path, capsys):
    with pytest.raises(ValueError, match="multiple of cp=4 dividing dp x cp = 8"):
        check_plan(_spec(mixtral, 2))
    with pytest.raises(ValueError, match="has 0 experts per layer"):
        check_plan(_spec("llama3-8b", 4))
    with pytest.raises(ValueError, match="has 8 experts per layer, not a multiple"):
        check_plan(_spec(mixtral, 16, dp=4))
    plans = search(Job(get_model(mixtral), get_hardware("h100"), 8, 32768, 1, cp=4, tp=1, pp=1,
                       strategy="ring", layout="zigzag", ep=4))  # fmt: skip
    assert plans and all(p["ep"] == 4 for p in plans)
    argv = ["plan", "--model", mixtral, "--hardware", "h100", "--gpus", "8", "--seq-len",
            "32768", "--cp", "4", "--tp", "1", "--pp", "1", "--ep", "8"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "experts over ep 8" in out and "--ep 8" in out.splitlines()[-1], out
