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

from ringattn.integrations.hf.families import _HYBRID, _SURVEYED, _WHOLE, EXACT, REFUSED
from test_hf_hybrid import FAMILIES as HYBRIDS
from workers_hf_families import survey  # noqa: F401 - puts scripts/ on sys.path

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


@pytest.mark.parametrize("model_type", ["deepseek_v3", "minicpm3"])
def test_mla_with_value_heads_narrower_than_key_heads_is_exact(pools, model_type):
    """MLA as released (DeepSeek-V3: keys 192 wide, values 128): ringattn.hf pads the values
    with zero columns for the attention and cuts them off after (the survey's configs have both
    16 wide)."""
    row = pools(2).run(
        "workers_hf_families:variant_case", model_type=model_type, layout="zigzag",
        kind="packed", v_head_dim=8,
    )[0]  # fmt: skip
    assert row["status"] == "exact", row


def test_every_listed_family_has_a_test():
    """Walk the allow-list: each family must be on a list that an equivalence test runs.

    surveyed: test_listed_family_is_exact_at_cp2 above runs it (its tiny config must build from
    the survey's registry); hybrid, or compressed attention run whole (DeepSeek-V4):
    tests/test_hf_hybrid.py's FAMILIES. Any other kind of entry has no test here, and fails.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    hybrids = {"qwen3_5_text" if h == "qwen3_5_wide" else h for h in HYBRIDS}
    untested = []
    for name, how in sorted(EXACT.items()):
        if how == _SURVEYED:
            tested = name in SURVEYED and (
                REGISTRY_KEY.get(name, name) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            )
        elif how in (_HYBRID, _WHOLE):
            tested = name in hybrids
        else:
            tested = False
        if not tested:
            untested.append(f"{name} ({how})")
    assert not untested, f"listed as exact without an equivalence test: {untested}"


def test_supported_families_is_the_documented_public_list():
    import ringattn.hf

    assert "SUPPORTED_FAMILIES" in ringattn.hf.__all__
    assert ringattn.hf.SUPPORTED_FAMILIES == tuple(sorted(EXACT))
    assert not set(ringattn.hf.SUPPORTED_FAMILIES) & set(REFUSED)


def test_the_docs_page_is_written_from_the_lists():
    """docs/families.md is scripts/tools/families_doc.py's rendering of EXACT and REFUSED."""
    import families_doc

    assert families_doc.PAGE.read_text() == families_doc.render(), (
        "docs/families.md is stale: run PYTHONPATH=src python scripts/tools/families_doc.py"
    )


@pytest.mark.parametrize(
    ("model_type", "match"),
    [
        ("mystery_lm", r"model_type='mystery_lm'\) is not on ringattn.hf's list .* check --hf"),
        ("llama4_text", r"model_type='llama4_text'\) is refused by ringattn.hf: chunked"),
        ("doge", r"model_type='doge'\) is refused by ringattn.hf: a dense 4-D attention mask"),
    ],
)
def test_a_family_off_the_list_is_refused_on_every_rank(pools, model_type, match):
    """parallelize raises ValueError naming the family on every rank, before any collective."""
    pools(2).run_expect_error(
        "workers_hf_families:off_list_case", model_type=model_type, match=match,
        exc_type=ValueError,
    )  # fmt: skip
