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


def test_the_supported_versions_are_compats():
    """The README's supported-versions line, the versions page, CI's installs and pyproject's floor name the releases
    `vlmcp_patch.compat` declares (OLDEST, NEWEST); pyproject has no ceiling."""
    from vlmcp_patch.compat import NEWEST, OLDEST, TESTED

    readme = (ROOT / "README.md").read_text()
    assert f"Supported transformers: {OLDEST} to {NEWEST}, tested at both ends" in readme
    assert f"| transformers {NEWEST}: default and integration tiers |" in readme
    assert f"| transformers {OLDEST}: the core tests" in readme
    versions = (ROOT / "docs" / "versions.md").read_text()
    floor = f"`>={OLDEST.major}.{OLDEST.minor}`"
    assert f"| transformers | {floor} | CI: the default and integration tiers on {NEWEST}" in versions
    assert f"`{TESTED}`" in versions
    ci = (ROOT / ".ci" / "run").read_text()
    assert f'--no-deps "transformers=={NEWEST}"' in ci and f'"transformers=={OLDEST}"' in ci
    requirement = re.search(r'"transformers([^"]*)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert requirement == f">={OLDEST.major}.{OLDEST.minor}"
