"""mkdocs hooks: the site's guide is the README, split into pages by its sections.

README.md stays the one source (GitHub and PyPI show it whole). A page includes a
section with a line ``<!-- include README: <section title> -->`` (or the part before
the first section with ``<!-- include README: intro -->``, or a whole file with
``<!-- include CHANGELOG.md -->``); the section's headings move up one level, so
that its title is the page's. The included text's links are written for the
repository root: they are made to work from the page (``docs/...`` relative to it,
a README anchor to the page that has that section, anything else outside ``docs/``
to the file on GitHub). Links of the docs pages to ``../README.md`` go to the page of
their anchor (or the home page).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[1]
BLOB = "https://github.com/celery-redlock/celery_redlock/blob/main/"

INCLUDE = re.compile(r"^<!-- include (?P<file>[\w.]+)(?:: (?P<section>[^>]+?))? -->$", re.M)
# A Markdown link or image whose target is neither a URL nor a mail address.
LINK = re.compile(r"(?P<head>!?\[[^\]]*\]\()(?P<target>(?![a-z][a-z+.-]*:)[^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def readme_sections(text: str) -> dict[str, str]:
    """README's ``## `` sections by title (code blocks are not searched).

    ``intro`` is what comes before the first.
    """
    sections: dict[str, list[str]] = {"intro": []}
    current, fenced = "intro", False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        if not fenced and line.startswith("## "):
            current = line[3:].strip()
            sections[current] = []
        sections[current].append(line)
    return {title: "\n".join(lines) + "\n" for title, lines in sections.items()}


def anchors(text: str) -> list[str]:
    """The anchors of ``text``'s headings (outside code blocks), as the toc makes them."""
    found, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        match = re.match(r"#{1,6} (.+)", line)
        if match and not fenced:
            found.append(slugify(match.group(1).strip(), "-"))
    return found


def _promote(section: str) -> str:
    """Headings one level up (``## X`` -> ``# X``), outside code blocks."""
    lines, fenced = [], False
    for line in section.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        lines.append(line[1:] if not fenced and re.match(r"#{2,6} ", line) else line)
    return "\n".join(lines) + "\n"


class Site:
    """Where each README section is included: its page, and the page of each anchor."""

    def __init__(self, docs_dir: Path) -> None:
        self.sections = readme_sections((ROOT / "README.md").read_text(encoding="utf-8"))
        self.page_of: dict[str, str] = {}  # README anchor -> page (src path)
        self.included: dict[str, str] = {}  # README section -> page
        for page in sorted(docs_dir.rglob("*.md")):
            uri = page.relative_to(docs_dir).as_posix()
            for match in INCLUDE.finditer(page.read_text(encoding="utf-8")):
                if match["file"] == "README" and match["section"]:
                    self.included[match["section"]] = uri
                    for anchor in anchors(self.sections.get(match["section"], "")):
                        self.page_of.setdefault(anchor, uri)

    def include(self, match: re.Match[str], page: str) -> str:
        """What an include line of ``page`` stands for, its links made to work there."""
        if match["file"] != "README":
            return (ROOT / match["file"]).read_text(encoding="utf-8")
        section = self.sections.get(match["section"] or "")
        if section is None:
            raise ValueError(f"{page}: README has no section {match['section']!r}")
        text = section if match["section"] == "intro" else _promote(section)
        return LINK.sub(lambda link: self._from_root(link, page), text)

    def _from_root(self, link: re.Match[str], page: str) -> str:
        """A link of README (relative to the repository root), made to work from ``page``."""
        target = link["target"]
        path, _, anchor = target.partition("#")
        if not path:
            where = self.page_of.get(anchor, page)
            target = ("" if where == page else _relative(where, page)) + f"#{anchor}"
        elif path.startswith("docs/"):
            target = _relative(path.removeprefix("docs/"), page) + (f"#{anchor}" if anchor else "")
        else:
            target = BLOB + target.removeprefix("./")
        return f"{link['head']}{target})"

    def readme_link(self, link: re.Match[str], page: str) -> str:
        """A docs page's link to ``../README.md[#anchor]``: the page with that section."""
        path, _, anchor = link["target"].partition("#")
        if posixpath.normpath(posixpath.join(posixpath.dirname(page), path)) != "../README.md":
            return link.group(0)
        where = self.page_of.get(anchor, "index.md")
        return f"{link['head']}{_relative(where, page)}{'#' + anchor if anchor else ''})"


def _relative(target: str, page: str) -> str:
    """``target`` (a path under docs/) relative to the directory of ``page``."""
    return posixpath.relpath(target, posixpath.dirname(page) or ".")


_site: Site | None = None


def on_config(config: Any) -> Any:
    """Find which page includes which README section, before any page is built."""
    global _site  # noqa: PLW0603 (the build's one table of pages)
    _site = Site(Path(config["docs_dir"]))
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace the include lines, and fix the page's links to README."""
    assert _site is not None
    uri = page.file.src_uri
    markdown = INCLUDE.sub(lambda match: _site.include(match, uri), markdown)
    return LINK.sub(lambda link: _site.readme_link(link, uri), markdown)
