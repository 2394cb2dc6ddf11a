"""The family allow-list (ringattn.integrations.hf.families) is proven, entry by entry.

Every family listed as exact from the survey trains one step at CP 2 in the zigzag layout (two runs
per rank) on packed documents, equal to one process running each document alone (loss 1e-5
relative, gradients 1e-4 of each tensor's largest entry). The hybrids are proven in
tests/test_hf_hybrid.py; a family that is neither listed nor known is refused by name, and so is a
listed-as-refused one.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from ringattn.integrations.hf.families import _SURVEYED, EXACT
from test_hf_hybrid import FAMILIES as HYBRIDS

SURVEYED = sorted(name for name, how in EXACT.items() if how == _SURVEYED)
# the survey builds a family by its registry key; the causal LM's config names its text model
REGISTRY_KEY = {"emu3_text_model": "emu3", "mllama_text_model": "mllama"}


@pytest.mark.parametrize("model_type", SURVEYED)
def test_listed_family_is_exact_at_cp2(pools, model_type):
    row = pools(2).run(
        "workers_hf_families:family_case",
        model_type=REGISTRY_KEY.get(model_type, model_type),
        layout="zigzag",
        kind="packed",
    )[0]
    assert row["status"] == "exact", row


def test_every_listed_family_has_a_test():
    hybrids = {name for name, how in EXACT.items() if how != _SURVEYED}
    tested = {"qwen3_5_text" if h == "qwen3_5_wide" else h for h in HYBRIDS}
    assert hybrids <= tested, sorted(hybrids - tested)


def test_the_docs_table_is_the_list():
    """docs/families.md shows exactly the allow-list and the refusals, with their reasons."""
    import pathlib
    import re

    from ringattn.integrations.hf.families import REFUSED

    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "families.md").read_text()
    exact_part, refused_part = page.split("## Refused")
    row = re.compile(r"^\| `([^`]+)` \| (.+) \|$", re.MULTILINE)
    assert {m[0] for m in row.findall(exact_part)} == set(EXACT)
    assert dict(row.findall(refused_part)) == REFUSED


def test_an_unlisted_or_refused_family_is_refused_by_name():
    import transformers

    from ringattn.hf import parallelize

    class Mystery(transformers.LlamaConfig):
        model_type = "mystery_lm"

    config = Mystery(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError, match=r"model_type='mystery_lm'\) is not on ringattn.hf's list"):
        parallelize(model)
    gemma2 = transformers.AutoModelForCausalLM.from_config(
        transformers.Gemma2Config(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        )
    )
    with pytest.raises(ValueError, match=r"'gemma2'\) is refused by ringattn.hf: attention logit"):
        parallelize(gemma2)
