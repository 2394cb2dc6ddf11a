"""Rank functions for tests/test_hf_families.py: one listed family at CP 2 against one process.

The tiny configs, the data, the one-process reference and the comparison are the family survey's
(scripts/tools/family_survey.py, which surveys every family; here only those on the allow-list run).
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "tools")
)

import family_survey as survey

import ringattn.hf


def family_case(rank: int, world_size: int, *, model_type: str, layout: str, kind: str) -> dict:
    """{status, loss_rel, grad_rel, grad_name} of one family's CP case (rank 0's comparison)."""
    model = survey.build(model_type)
    reference = survey.reference(model, kind)
    parallel = ringattn.hf.parallelize(survey._copy(model, model_type), layout=layout)
    got = survey.cp_case(parallel, kind, layout, dist.group.WORLD)
    return survey.compare(reference, got)


def variant_case(
    rank: int, world_size: int, *, model_type: str, layout: str, kind: str, **overrides: object
) -> dict:
    """family_case for the family's tiny config with `overrides` (config fields) set."""
    model = survey.build(model_type, **overrides)
    reference = survey.reference(model, kind)
    parallel = ringattn.hf.parallelize(survey._copy(model, model_type), layout=layout)
    got = survey.cp_case(parallel, kind, layout, dist.group.WORLD)
    return survey.compare(reference, got)


def refused_case(rank: int, world_size: int, *, model_type: str) -> None:
    """parallelize the family's own tiny model (the survey's build): must raise its reason."""
    ringattn.hf.parallelize(survey.build(model_type), group=dist.group.WORLD)


def off_list_case(rank: int, world_size: int, *, model_type: str) -> None:
    """parallelize a tiny Llama whose config says `model_type` (off the list): must raise."""
    import transformers

    class OffList(transformers.LlamaConfig):
        pass

    OffList.model_type = model_type
    config = OffList(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    ringattn.hf.parallelize(transformers.LlamaForCausalLM(config), group=dist.group.WORLD)


def phimoe_cases(
    rank: int, world_size: int, *, cases: list, training: bool, **overrides: object
) -> list[dict]:
    """PhiMoE (config `overrides`) in training or eval mode: one comparison per (layout, kind)."""
    model = survey.build("phimoe", **overrides)
    model.train(training)
    rows = []
    for layout, kind in cases:
        reference = survey.reference(model, kind)
        parallel = ringattn.hf.parallelize(survey._copy(model, "phimoe"), layout=layout)
        parallel.train(training)
        got = survey.cp_case(parallel, kind, layout, dist.group.WORLD)
        rows.append({"case": (layout, kind), **survey.compare(reference, got)})
    return rows
