"""Write docs/families.md from the allow-list (ringattn.integrations.hf.families): the page is data.

    PYTHONPATH=src python scripts/tools/families_doc.py           # rewrite docs/families.md
    PYTHONPATH=src python scripts/tools/families_doc.py --check   # exit 1 if the page is stale

The page is the header below, then one table of `EXACT` (what checked each family) and one of
`REFUSED` (why), both sorted by name. tests/test_hf_families.py asserts that the page equals
`render()`, so a change to the dicts without a rerun of this script fails a test.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from ringattn.integrations.hf.families import _HYBRID, _SURVEYED, _WHOLE, EXACT, REFUSED

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "families.md"

HEADER = """\
# Model families: which ringattn.hf makes exact, which it refuses

`ringattn.hf.parallelize`, `train --hf`, the Trainer integration, `generate --hf`, `serve --hf`
and `eval niah` accept a text model only when its `config.model_type` is on the allow-list
(`ringattn/integrations/hf/families.py`, the one place it lives; `ringattn.hf.SUPPORTED_FAMILIES`
is the same list as a sorted tuple, for code). Every listed family is proven by a test against
one process: `tests/test_hf_families.py` (one step at CP 2, zigzag, packed documents, for each
family below marked *surveyed*), `tests/test_hf_hybrid.py` (the hybrids: CP 2-4, three layouts)
and the tests named in the table for the others; a listed family without its test fails
`tests/test_hf_families.py`. A family that is not listed is refused by name, before any step, on
every rank; `ringattn check --hf DIR` shows what ringattn does with your own architecture. Where
the list came from: `scripts/tools/family_survey.py` tried every causal-LM family transformers 5.23
registers (results/family_survey.json). Vision-language models have their own list
([hf-models.md](hf-models.md#vision-language-models-qwen2-vl-llava)): Qwen2-VL and LLaVA.

Gemma 2 and VaultGemma's capped scores are capped exactly ([softcap.md](softcap.md)). PhiMoE
is exact where its router is deterministic (eval, or no router or input jitter); training with
jitter samples experts at random and is refused (`tests/test_hf_phimoe.py`). Zaya's CCA
projection and DeepSeek-V4's compressed attention (pooled windows, a top-k indexer) run on the
whole sequence like a hybrid's mixers, exact at W times their compute; their decoding is refused
([hybrid.md](hybrid.md), [deepseek-v4.md](deepseek-v4.md)).

This page is written by `scripts/tools/families_doc.py` from the dicts; edit those, then rerun it.
"""

# how each kind of EXACT entry shows in the table
CHECKED = {
    _SURVEYED: "surveyed",
    _HYBRID: "hybrid: [hybrid.md](hybrid.md)",
    _WHOLE: "compressed attention run whole: [deepseek-v4.md](deepseek-v4.md)",
}


def render() -> str:
    """The whole page, from EXACT and REFUSED."""
    lines = [HEADER, f"## Exact ({len(EXACT)} families)", ""]
    lines += ["| family (`model_type`) | checked |", "|---|---|"]
    lines += [f"| `{name}` | {CHECKED.get(EXACT[name], EXACT[name])} |" for name in sorted(EXACT)]
    lines += ["", f"## Refused, with the reason ({len(REFUSED)} families)", ""]
    lines += ["Any family not in either table is refused too (not checked).", ""]
    lines += ["| family (`model_type`) | why |", "|---|---|"]
    lines += [f"| `{name}` | {REFUSED[name]} |" for name in sorted(REFUSED)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        stale = PAGE.read_text() != text
        if stale:
            print(f"{PAGE} is stale: run python scripts/tools/families_doc.py", file=sys.stderr)
        return int(stale)
    PAGE.write_text(text)
    print(f"wrote {PAGE} ({len(EXACT)} exact, {len(REFUSED)} refused)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
