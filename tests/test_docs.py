"""The documentation: docs/ builds with mkdocs in strict mode, and README.md stays short and linked.

``mkdocs.yml`` makes a link to a missing page or anchor a warning, and ``--strict`` turns every
warning into an error, so the build test fails on any broken internal link in docs/. README.md is
not part of the site (GitHub renders it), so its relative links are checked here directly: each
must name a file in the repository, and a link into a Markdown file with ``#anchor`` must name
one of its headings.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest


def _root() -> Path:
    """The repository root: the nearest folder above this file that holds mkdocs.yml."""
    for folder in Path(__file__).resolve().parents:
        if (folder / "mkdocs.yml").is_file():
            return folder
    raise AssertionError("no mkdocs.yml above tests/: the docs configuration is missing")


ROOT = _root()
README = ROOT / "README.md"
README_MAX_LINES = 350

# [text](target) and ![alt](target), outside code; the target stops at whitespace or ')'.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _without_code(text: str) -> str:
    return CODE_SPAN.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """A heading's anchor as Python-Markdown's toc (mkdocs) and GitHub both make it for the
    headings these files use: punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(markdown: Path) -> set[str]:
    return {_slug(h) for h in HEADING.findall(FENCE.sub("", markdown.read_text()))}


def _relative_links(markdown: Path) -> list[str]:
    links = LINK.findall(_without_code(markdown.read_text()))
    return [t for t in links if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.IGNORECASE)]


def test_docs_build_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (it is in the dev extra: pip install -e '.[dev]')")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (
        "mkdocs build --strict failed (a broken link or anchor in docs/, or a page missing from "
        f"the nav):\n{result.stdout}\n{result.stderr}"
    )
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"
    )


def test_readme_links_resolve() -> None:
    links = _relative_links(README)
    assert links, "README.md links to nothing in the repository: the link pattern is broken"
    broken = []
    for link in links:
        path, _, anchor = link.partition("#")
        target = (ROOT / path).resolve() if path else README
        if not target.exists():
            broken.append(f"{link}: {path} does not exist")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link}: no heading of {path or 'README.md'} has the anchor #{anchor}")
    assert not broken, "README.md has broken links:\n" + "\n".join(broken)


def test_slug_matches_mkdocs() -> None:
    """The anchors README.md uses are made the way mkdocs makes them."""
    assert _slug("Re-scoring under 10% of the learner's time") == (
        "re-scoring-under-10-of-the-learners-time"
    )
    assert _slug("Engine choice at join, `echo-node doctor`") == (
        "engine-choice-at-join-echo-node-doctor"
    )
    assert _slug("real_model.py") == "real_modelpy"
