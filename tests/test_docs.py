"""The documentation: the site builds strict, generated pages are current, and the README
stays a front page (short, code early, links that resolve, no history)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="mkdocs: in the 'docs' extra (part of 'test')")

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

#: What README.md may hold at most: a front page, not the manual.
README_MAX_LINES = 400
#: The first Python a reader runs starts within this many lines.
FIRST_CODE_BY_LINE = 60
#: History and tracker references belong in CHANGELOG.md, not in the front page or manual.
HISTORY = re.compile(
    r"issue [0-9]+|invariant [0-9]+|DESIGN §|[0-9a-f]{7,40}\b.*(commit|run)|this (round|session)"
)
#: Pages the history check leaves alone: changelog.md only includes CHANGELOG.md, which
#: may name issues and dates.
HISTORY_EXEMPT = {"changelog.md"}
# A Markdown link or image whose target is neither a URL nor a mail address.
RELATIVE_LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>(?![a-z][a-z+.-]*:)[^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _headings(text: str) -> list[str]:
    """The Markdown headings of ``text`` outside code blocks."""
    found, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        match = re.match(r"#{1,6} (.+)", line)
        if match and not fenced:
            found.append(match.group(1).strip())
    return found


def _github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_the_site_builds_strict(tmp_path):
    """`mkdocs build --strict`: a broken link, reference or include fails the build."""
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    guide = (tmp_path / "guide" / "uniqueness" / "index.html").read_text()
    assert "Uniqueness: one queued copy per key" in guide
    reference = (tmp_path / "reference" / "locks" / "index.html").read_text()
    assert "try_acquire" in reference, "the API reference comes from the docstrings"
    changelog = (tmp_path / "changelog" / "index.html").read_text()
    assert "Keep a Changelog" in changelog, "the changelog page includes CHANGELOG.md"


def test_the_benchmark_page_and_readme_table_are_current():
    """docs/benchmarks.md and README's headline table are what the results files give."""
    from benchmarks import render

    regenerate = "regenerate: python -m benchmarks --render-docs"
    assert (DOCS / "benchmarks.md").read_text() == render.render_page(), regenerate
    readme = README.read_text()
    assert render.with_headline(readme, render.render_headline()) == readme, regenerate
    assert render.render_headline().count("\n| ") == 10, "ten headline rows"


def test_the_benchmark_page_stamps_machine_and_versions():
    """Every section says where and with what it ran, and no commit it ran at."""
    from benchmarks import render

    page = render.render_page()
    sections = page.split("\n## ")[1:]
    assert sections
    for section in sections:
        assert re.search(r"Measured \d{4}-\d\d-\d\d .*Python \d", section), section[:200]
    assert "commit" not in page


def test_the_readme_is_a_front_page():
    """At most 400 lines, and the first Python block starts within the first 60."""
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES
    first = next(n for n, line in enumerate(lines, 1) if line.startswith("```python"))
    assert first <= FIRST_CODE_BY_LINE, f"first Python block at line {first}"


def test_every_readme_link_resolves():
    """A relative link reaches a file of the repository, and its anchor a heading there."""
    text = README.read_text()
    targets = [match["target"] for match in RELATIVE_LINK.finditer(text)]
    assert targets, "the README links into docs/"
    for target in targets:
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else README
        assert file.exists(), target
        if anchor and file.suffix == ".md":
            slugs = {_github_slug(h) for h in _headings(file.read_text())}
            assert anchor in slugs, target


def test_no_history_in_the_readme_the_manual_or_the_code():
    """No commit hashes, tracker tags or round-by-round narrative outside CHANGELOG.md:
    the front page, the manual and the package's code prose (comments, docstrings, Lua
    headers) give reasons, not history."""
    package = ROOT / "celery_redlock"
    pages = [README] + [
        page
        for page in sorted(DOCS.rglob("*.md"))
        if page.relative_to(DOCS).as_posix() not in HISTORY_EXEMPT
    ]
    pages += sorted([*package.rglob("*.py"), *package.rglob("*.lua")])
    found = [
        f"{page.relative_to(ROOT)}:{number}: {line}"
        for page in pages
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert found == []


def test_the_settings_reference_is_generated():
    """docs/reference/settings.md holds the table generated from the settings table."""
    from celery_redlock.integration.settings import reference

    assert reference() in (DOCS / "reference" / "settings.md").read_text(), (
        "regenerate: python -c 'from celery_redlock.integration.settings import reference; "
        "print(reference())'"
    )
