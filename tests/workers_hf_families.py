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
