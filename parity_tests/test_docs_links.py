"""The README and the docs/ pages point at things that exist: every relative Markdown link
resolves to a file or folder inside the repository (and, with `#anchor`, to a heading of that
page), and every repository path written in code (`rosetta/harness/loop.py`) names a file or
folder that is there, so a moved module cannot leave the documentation behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# Top-level folders of the repository: a code span starting with one of them is a path.
REPO_DIRS = ("rosetta/", "numpy_ref/", "torch_impl/", "jax_impl/", "benchmarks/", "parity_tests/", "docs/")


def _prose(text: str) -> str:
    """The page without its fenced code blocks (examples, not references)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors: set[str] = set()
    for line in _prose(page.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            slug, n = _slug(m.group(1)), 1
            while slug in anchors:  # repeated headings get -1, -2, ...
                slug, n = f"{_slug(m.group(1))}-{n}", n + 1
            anchors.add(slug)
    return anchors


def test_pages_exist():
    assert (ROOT / "docs").is_dir() and len(PAGES) > 1


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for _, target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not checked here
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(ROOT) or not dest.exists():
            broken.append(f"{target}: no such file in the repository")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_repository_paths_exist(page):
    missing = []
    for span in CODE_SPAN.findall(_prose(page.read_text())):
        if not span.startswith(REPO_DIRS) or re.search(r"[\s*<>{}…]", span):
            continue  # not a path, or a pattern such as benchmarks/results/gpu_*.json
        path = ROOT / span
        # `jax_impl/train.make_train_step`: a name inside a module.
        module = ROOT / (span.split(".")[0] + ".py")
        if not path.exists() and not module.exists():
            missing.append(span)
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"
