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
from tiers import stride
from workers_hf_families import survey  # noqa: F401 - puts scripts/ on sys.path

SURVEYED = sorted(name for name, how in EXACT.items() if how == _SURVEYED)
# the survey builds a family by its registry key; the causal LM's config names its text model
REGISTRY_KEY = {"emu3_text_model": "emu3", "mllama_text_model": "mllama"}


@pytest.mark.parametrize("model_type", stride(SURVEYED, 7, str))
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


@pytest.mark.parametrize(
    ("config", "other_modality"),
    [("DbrxConfig", False), ("MptConfig", False), ("LlamaConfig", False),
     ("LlavaConfig", True), ("Qwen2VLConfig", True)],
)  # fmt: skip
def test_decoder_sub_configs_are_no_other_modality(config, other_modality):
    """DBRX's attn_config / ffn_config and MPT's attn_config configure the text decoder's own
    layers: such a model is a text model, refused or accepted by families.py for its own reason,
    never as a vision-language model."""
    import transformers

    from ringattn.integrations.hf import vision

    assert vision.has_other_modality(getattr(transformers, config)()) is other_modality


def test_mpt_is_refused_for_its_attention(pools):
    """MPT's own tiny model (MptForCausalLM): refused on every rank because its attention does
    not go through AttentionInterface (what the survey saw with the list lifted), not as a VLM."""
    pools(2).run_expect_error(
        "workers_hf_families:refused_case", model_type="mpt", exc_type=ValueError,
        match=r"model_type='mpt'\) is refused by ringattn.hf: its attention does not go through "
              r"transformers' AttentionInterface",
    )  # fmt: skip


def _survey() -> dict:
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "results" / "family_survey.json"
    return json.loads(path.read_text())


def test_every_refusal_in_the_survey_names_the_reason_of_the_lists():
    """results/family_survey.json: each family the survey saw refused by the lists was refused
    with the reason they give it (families.REFUSED for a text model, vision.py's for a VLM), and
    one on neither list with the message for its kind: a text model (DBRX, MPT) is never refused
    as a vision-language one. A refusal by ringattn's own checks (Llama 4's chunked attention)
    never meets a family listed as exact. DBRX is exact; MPT refused for its attention."""
    import re

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ringattn.integrations.hf import vision

    found = _survey()
    assert found["families"]["dbrx"]["status"] == "exact"
    problems = []
    for key, row in found["families"].items():
        if row["status"] != "refused":
            continue
        for case, outcome in row["cases"].items():
            if outcome["status"] != "refused":
                continue
            error = outcome["error"]
            named = re.search(r"\(config\.model_type='([^']+)'\)", error)
            if named is None:  # a check inside parallelize, before the lists
                if key in EXACT or CONFIG_MAPPING[key]().get_text_config().model_type in EXACT:
                    problems.append(f"{key} {case}: listed as exact, refused: {error}")
                continue
            model_type = named.group(1)
            reason = REFUSED.get(model_type) or vision._REFUSED.get(model_type)
            if reason is None:  # on neither list: refused for its kind
                multimodal = vision.has_other_modality(CONFIG_MAPPING[key]())
                reason = ("has not been checked against one device" if multimodal
                          else "is not on ringattn.hf's list")  # fmt: skip
            if reason not in error:
                problems.append(f"{key} {case}: {error!r} does not name {reason!r}")
    assert not problems, "\n".join(problems)
    mpt = found["families"]["mpt"]["cases"]["zigzag/dense"]
    assert mpt["status"] == "refused" and REFUSED["mpt"] in mpt["error"]
