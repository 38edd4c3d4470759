"""The README reads in five minutes, and every page of docs/ can be found: from docs/index.md and
from the site's nav in mkdocs.yml (``make test`` builds the site with ``mkdocs build --strict``).

The README and the docs link only to files of this repository, never outside it."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = next(p for p in Path(__file__).resolve().parents if (p / "setup.cfg").exists())
README = REPO / "README.md"
DOCS = REPO / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def pages() -> set[str]:
    return {p.name for p in DOCS.glob("*.md")}


def nav_pages(nav) -> set[str]:
    """The Markdown files a mkdocs nav names, at any depth (``- Title: page.md``, ``- page.md``, sections)."""
    found: set[str] = set()
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        if isinstance(value, list):
            found |= nav_pages(value)
        elif isinstance(value, str) and "://" not in value:
            found.add(value)
    return found


def test_the_readme_is_under_250_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines: move reference material into docs/"


def test_the_readme_starts_with_the_two_commands():
    text = README.read_text(encoding="utf-8")
    first_block = re.search(r"```sh\n(.*?)```", text, re.S).group(1)
    assert [line.split()[:2] for line in first_block.splitlines()] == [["make", "run"], ["make", "test"]]


def test_every_docs_page_is_in_the_index():
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    linked = {target.split("#")[0] for target in LINK.findall(index)}
    missing = sorted(pages() - {"index.md"} - linked)
    assert not missing, f"docs pages docs/index.md does not list: {missing}"
    stale = sorted(t for t in linked if t.endswith(".md") and t not in pages())
    assert not stale, f"docs/index.md lists pages that do not exist: {stale}"


def test_every_docs_page_is_in_the_mkdocs_nav():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["docs_dir"] == "docs" and config["site_name"] == "kilnproxy"
    nav = nav_pages(config["nav"])
    missing = sorted(pages() - nav)
    assert not missing, f"docs pages mkdocs.yml's nav does not list: {missing}"
    stale = sorted(nav - pages())
    assert not stale, f"mkdocs.yml's nav lists pages that do not exist: {stale}"


def test_the_readme_and_docs_link_only_to_files_of_the_repository():
    for doc in [README, *sorted(DOCS.glob("*.md"))]:
        text = doc.read_text(encoding="utf-8")
        assert "SPEC" not in text and "../shared" not in text, f"{doc.name} points outside the repository"
        for target in LINK.findall(text):
            path = target.split("#")[0]
            if "://" in target or target.startswith("mailto:") or not path:
                continue
            resolved = (doc.parent / path).resolve()
            assert resolved.is_relative_to(REPO), f"{doc.name} links to {target}, outside the repository"
            assert resolved.exists(), f"{doc.name} links to {target}, which does not exist"
