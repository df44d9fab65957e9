"""Build hook: the long description is README.md with its relative links made absolute.

Everything else is in pyproject.toml. README.md keeps relative links, which work on
GitHub and in a checkout; on PyPI they would point nowhere, so the package metadata
gets them as URLs into the repository (images as raw files, so that they display).
"""

from __future__ import annotations

import re
from pathlib import Path

from setuptools import setup

REPOSITORY = "https://github.com/celery-redlock/celery_redlock"
BLOB = f"{REPOSITORY}/blob/main/"
RAW = "https://raw.githubusercontent.com/celery-redlock/celery_redlock/main/"

# A Markdown link or image whose target is neither a URL nor a mail address.
RELATIVE_LINK = re.compile(
    r"(?P<bang>!?)\[(?P<text>[^\]]*)\]\((?P<target>(?![a-z][a-z+.-]*:)[^)\s]+)\)"
)


def absolute_links(markdown: str) -> str:
    """Return ``markdown`` with every relative link and image target made absolute."""

    def rewrite(match: re.Match[str]) -> str:
        target = match["target"]
        if target.startswith("#"):
            url = f"{REPOSITORY}{target}"  # an anchor of the README as GitHub shows it
        else:
            url = (RAW if match["bang"] else BLOB) + target.removeprefix("./")
        return f"{match['bang']}[{match['text']}]({url})"

    return RELATIVE_LINK.sub(rewrite, markdown)


setup(
    long_description=absolute_links(
        (Path(__file__).resolve().parent / "README.md").read_text(encoding="utf-8")
    ),
    long_description_content_type="text/markdown",
)
