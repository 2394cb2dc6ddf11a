"""The README is a front page and every relative link in the docs resolves.

- README.md stays at most 200 lines and starts with the two commands (.ci/run runs the second);
- every relative link `[text](path)` or `[text](path#anchor)` in README.md, BENCHMARKS.md and
  docs/*.md names a file that exists, and an anchor names a heading of that file (GitHub's slugs:
  lower case, punctuation dropped, spaces to dashes);
- docs/README.md, the map, links every page in docs/;
- every page in docs/ is at most 200 lines, one topic.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PAGE_CAP = 200


def _slug(heading: str) -> str:
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # GitHub drops punctuation but dashes and underscores
    return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    anchors, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


def _links(path: pathlib.Path) -> list[str]:
    text = re.sub(r"(?ms)^```.*?^```", "", path.read_text())  # code blocks hold no links
    return [m for m in LINK.findall(text) if not m.startswith(("http://", "https://", "mailto:"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for link in _links(page):
        target, _, anchor = link.partition("#")
        resolved = (page.parent / target).resolve() if target else page
        if not resolved.exists():
            broken.append(f"{link}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{link}: no heading #{anchor} in {resolved.name}")
    assert not broken, f"{page.name}:\n" + "\n".join(broken)


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; details go to docs/"
    # the second command is the test command .ci/run runs, character for character
    (ci,) = [x for x in (ROOT / ".ci" / "run").read_text().splitlines() if "-m pytest" in x]
    command = ci.partition(" || ")[0]
    assert command.startswith(".venv/bin/python -m pytest -q"), ci
    assert f"bash scripts/setup.sh && {command}" in lines[:6]


def test_the_map_links_every_page():
    mapped = {link.partition("#")[0] for link in _links(ROOT / "docs" / "README.md")}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages <= mapped, f"docs/README.md does not link {sorted(pages - mapped)}"


def test_slugs_follow_github():
    assert _slug("`ringattn serve`: an OpenAI-compatible server") == (
        "ringattn-serve-an-openai-compatible-server"
    )
    assert "the-documentation" in _anchors(ROOT / "docs" / "README.md")


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_every_docs_page_is_at_most_200_lines(page):
    lines = len(page.read_text().splitlines())
    assert lines <= PAGE_CAP, f"docs/{page.name} has {lines} lines; split it along its sections"
