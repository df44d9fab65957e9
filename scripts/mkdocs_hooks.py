"""mkdocs hooks: pages that include a file of the repository, and links to the README.

The changelog lives at the repository root (``CHANGELOG.md``, where tools and users look
for it) and is on the site too: ``docs/changelog.md`` is one line,
``<!-- include CHANGELOG.md -->``, replaced by the file when the site is built, so there
is one copy. A docs page's link to ``../README.md`` (the front page, outside ``docs/``)
goes to the README on GitHub, where it is shown whole.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README_URL = "https://github.com/celery-redlock/celery_redlock#readme"

INCLUDE = re.compile(r"^<!-- include (?P<file>[\w.]+) -->$", re.M)
# A Markdown link or image whose target is neither a URL nor a mail address.
LINK = re.compile(r"(?P<head>!?\[[^\]]*\]\()(?P<target>(?![a-z][a-z+.-]*:)[^)\s]+)\)")


def include(match: re.Match[str]) -> str:
    """The text of the repository-root file an include line names."""
    return (ROOT / match["file"]).read_text(encoding="utf-8")


def readme_link(link: re.Match[str], page: str) -> str:
    """A link of ``page`` to ``../README.md``, made to reach the README on GitHub."""
    path, _, anchor = link["target"].partition("#")
    if posixpath.normpath(posixpath.join(posixpath.dirname(page), path)) != "../README.md":
        return link.group(0)
    target = README_URL if not anchor else README_URL.replace("#readme", f"#{anchor}")
    return f"{link['head']}{target})"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace the include lines, and point the page's README links at GitHub."""
    uri = page.file.src_uri
    markdown = INCLUDE.sub(include, markdown)
    return LINK.sub(lambda link: readme_link(link, uri), markdown)
