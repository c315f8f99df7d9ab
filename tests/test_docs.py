"""The README and the docs pages: every relative link resolves to a file of the repository."""

from __future__ import annotations

import re

import pytest

from tests.helpers.harness import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(page):
    for target in LINK.findall(page.read_text()):
        if not target.startswith(("http://", "https://", "mailto:", "#")):
            yield target.split("#")[0]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    missing = [t for t in relative_links(page) if not (page.parent / t).exists()]
    assert not missing, missing


def test_the_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 320
