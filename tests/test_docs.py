"""The documentation site builds with no warning, and shows every README section."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="mkdocs: in the 'docs' extra (part of 'test')")

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / "scripts" / "mkdocs_hooks.py"


def _hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", HOOKS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    guide = (tmp_path / "guide" / "quickstart" / "index.html").read_text()
    assert "Uniqueness: one queued copy per key" in guide, "README sections are included"
    reference = (tmp_path / "reference" / "locks" / "index.html").read_text()
    assert "try_acquire" in reference, "the API reference comes from the docstrings"


def test_every_readme_section_is_on_a_page():
    hooks = _hooks()
    site = hooks.Site(ROOT / "docs")
    sections = set(hooks.readme_sections((ROOT / "README.md").read_text())) - {"intro"}
    assert sections - set(site.included) == set(), "add these README sections to a docs page"
    assert set(site.included) - sections - {"intro"} == set(), "pages include what README lacks"


def test_readme_links_are_made_to_work_from_a_guide_page():
    hooks = _hooks()
    site = hooks.Site(ROOT / "docs")
    match = hooks.INCLUDE.search("<!-- include README: Install -->")
    text = site.include(match, "guide/install.md")
    assert "](../compatibility.md)" in text
    assert "](docs/" not in text
    assert text.startswith("# Install")
