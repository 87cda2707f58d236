"""The documentation's links hold: every relative link in README.md and docs/*.md names a
file of the repository (and, with a #fragment into a Markdown file, one of its headings),
and nothing links or refers to files outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
# Files a user's clone does not have.
OUTSIDE = re.compile(r"\.\./shared|SPEC\.md|ARCHITECTURE\.md|\bSPEC §")


def _text(page: Path) -> str:
    """The page without its fenced code blocks (code is not a link)."""
    return FENCE.sub("", page.read_text(encoding="utf-8"))


def _links(page: Path):
    for target in LINK.findall(_text(page)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        yield target


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation (backticks included) dropped,
    letters, digits, underscores and hyphens kept, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set:
    seen: dict = {}
    out = set()
    for line in _text(page).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_pages_exist():
    names = {p.name for p in PAGES}
    assert "README.md" in names
    assert len(PAGES) > 10, [p.name for p in PAGES]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{target}: outside the repository")
            continue
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        if fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert not broken, broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_nothing_outside_the_repository(page):
    hits = [m.group(0) for m in OUTSIDE.finditer(page.read_text(encoding="utf-8"))]
    assert not hits, hits


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    listed = {t.partition("#")[0] for t in _links(ROOT / "docs" / "README.md")}
    missing = [p.name for p in PAGES if p.parent.name == "docs" and p.name != "README.md" and p.name not in listed]
    assert not missing and index, missing


def test_readme_links_every_page():
    listed = {t.partition("#")[0] for t in _links(ROOT / "README.md")}
    missing = [f"docs/{p.name}" for p in PAGES if p.parent.name == "docs" and f"docs/{p.name}" not in listed]
    assert not missing, missing


def test_slug_rule():
    assert _slug("`policy_loss`: the fused loss") == "policy_loss-the-fused-loss"
    assert _slug("Peers' equivalents") == "peers-equivalents"
    assert _slug("Vocab-parallel: `process_group`") == "vocab-parallel-process_group"
