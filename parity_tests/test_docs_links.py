"""The README and the docs/ pages point at things that exist: every relative Markdown link
resolves to a file or folder inside the repository (and, with `#anchor`, to a heading of that
page), and every repository path written in code (`rosetta/harness/loop.py`) names a file or
folder that is there, so a moved module cannot leave the documentation behind.

Citations of the contract and of the porting pitfalls resolve inside the repository too. The
rule, in README.md, docs/*.md and every .py file under the code folders (CITING below):

- `SPEC §N` names section §N of docs/contract.md, a heading `## §N. Title`. More numbers may
  follow, each optionally with its own §: `SPEC §1-2` (a range: every section from 1 to 2),
  `SPEC §1, §3`, `SPEC §1 and 3`. A bare `§N` without `SPEC` right before it is the paper's
  section (`§5.4`) and is not checked.
- `PITFALLS N` names item N of the numbered list in docs/pitfalls.md, a heading `### N. Title`;
  `PITFALLS 2, 3`, `PITFALLS 1-12` and `PITFALLS 4 and 12` name every number written (all of a
  range). `PITFALLS` without a number (a table column, "the PITFALLS number") is not checked.
- A Markdown link whose text is one such citation (`[PITFALLS 14](pitfalls.md#14-...)`,
  `[SPEC §2](contract.md#2-...)`) must point at that item's own heading, not only at some
  heading of the page.

A failure names file:line and the citation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# Top-level folders of the repository: a code span starting with one of them is a path.
REPO_DIRS = ("rosetta/", "numpy_ref/", "torch_impl/", "jax_impl/", "peer_impl/", "benchmarks/",
             "parity_tests/", "docs/")
CONTRACT, PITFALLS_PAGE = ROOT / "docs" / "contract.md", ROOT / "docs" / "pitfalls.md"
# Where "SPEC §N" and "PITFALLS N" may be written: the pages and the code (comments, docstrings).
CODE_DIRS = ("rosetta", "numpy_ref", "torch_impl", "jax_impl", "peer_impl", "benchmarks", "parity_tests")
CITING = PAGES + sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py"))
# "SPEC §2", "SPEC §1-2", "SPEC §1, §3"; "PITFALLS 14", "PITFALLS 2, 3", "PITFALLS 1-12".
# "1, 2" is taken as a list only when what follows the comma is a bare number.
_MORE = r"(?:\s*(?:[-–,]|and)\s*{sign}\d+\b)*"
SPEC_REF = re.compile(r"\bSPEC §(\d+\b" + _MORE.format(sign="§?") + ")")
PITFALLS_REF = re.compile(r"\bPITFALLS (\d+\b" + _MORE.format(sign="") + ")")
SECTION = re.compile(r"## §(\d+)\. ")  # docs/contract.md: "## §2. The mathematics"
ITEM = re.compile(r"### (\d+)\. ")  # docs/pitfalls.md: "### 14. A parameter whose ..."


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


def _numbered(page: Path, heading: re.Pattern) -> dict[int, str]:
    """The numbered headings of a page: number -> the heading's anchor."""
    found: dict[int, str] = {}
    for line in _prose(page.read_text()).splitlines():
        if m := heading.match(line):
            found[int(m.group(1))] = _slug(line.lstrip("#"))
    return found


def _numbers(written: str) -> list[int]:
    """'1-3, 5' -> [1, 2, 3, 5]: each number written, ranges expanded."""
    numbers: list[int] = []
    for part in re.split(r"\s*(?:,|and)\s*", written.replace("§", "")):
        lo, _, hi = re.sub("\u2013", "-", part).partition("-")
        numbers += range(int(lo), int(hi or lo) + 1)
    return numbers


def bad_citations(path: Path, sections: dict[int, str], items: dict[int, str]) -> list[str]:
    """Every citation in `path` that names no section or item, or a link that misses it."""
    bad = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{n}"
        for regex, known, page in ((SPEC_REF, sections, CONTRACT), (PITFALLS_REF, items, PITFALLS_PAGE)):
            for m in regex.finditer(line):
                missing = [k for k in _numbers(m.group(1)) if k not in known]
                if missing:
                    bad.append(f"{where}: {m.group(0)!r} cites {missing}, not in {page.relative_to(ROOT)}")
        if path.suffix == ".md":
            for text, target in LINK.findall(line):
                cited = SPEC_REF.fullmatch(text) or PITFALLS_REF.fullmatch(text)
                if not cited or len(_numbers(cited.group(1))) != 1:
                    continue
                known, page = (sections, CONTRACT) if text.startswith("SPEC") else (items, PITFALLS_PAGE)
                want = known.get(_numbers(cited.group(1))[0])
                file, _, anchor = target.partition("#")
                lands = (path.parent / file).resolve() if file else path
                if want is None or lands != page or anchor != want:
                    bad.append(f"{where}: [{text}]({target}) should link {page.name}#{want}")
    return bad


def test_contract_and_pitfalls_are_numbered():
    """The targets exist: contract.md's sections §1-§4 and pitfalls.md's items 1-23 (17-23: the
    training loop's)."""
    assert set(_numbered(CONTRACT, SECTION)) >= {1, 2, 3, 4}
    assert sorted(_numbered(PITFALLS_PAGE, ITEM)) == list(range(1, 24))


def test_citations_resolve():
    """Every SPEC §N and PITFALLS N in the pages and the code names a section or item that
    exists in docs/contract.md or docs/pitfalls.md (the module docstring has the rule)."""
    sections, items = _numbered(CONTRACT, SECTION), _numbered(PITFALLS_PAGE, ITEM)
    bad = [b for path in CITING for b in bad_citations(path, sections, items)]
    assert not bad, "citations that do not resolve:\n" + "\n".join(bad)


def test_a_bad_citation_is_caught(tmp_path):
    """The checker itself: a scratch file with good and bad citations (never the repository)."""
    sections, items = _numbered(CONTRACT, SECTION), _numbered(PITFALLS_PAGE, ITEM)
    scratch = tmp_path / "scratch.md"
    spec, pitfalls = "SPEC" " §", "PITFALLS" " "  # split, so this file itself cites nothing bad
    scratch.write_text(f"fine: {spec}2, {spec}1-2, {pitfalls}2, 3 and {pitfalls}1-12; paper §5.4\n"
                       "not a citation: the PITFALLS column\n"
                       f"[{pitfalls}14]({PITFALLS_PAGE}#{items[14]})\n"
                       f"bad: {spec}9\nbad: {pitfalls}14, 99\nbad: {spec}1-7\n"
                       f"[{pitfalls}14]({PITFALLS_PAGE}#{items[13]})\n")
    bad = bad_citations(scratch, sections, items)
    assert [b.split(":")[1] for b in bad] == ["4", "5", "6", "7"], bad
    assert "[99]" in bad[1] and "[5, 6, 7]" in bad[2] and "should link pitfalls.md" in bad[3]


def test_cli_page_names_every_command():
    """docs/cli.md's opening paragraph names every subcommand `rosetta --help` lists, and says
    how many there are (it once counted nine and left out `average` and `evaluate`)."""
    import argparse

    from rosetta.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    commands = list(sub.choices)
    opening = (ROOT / "docs" / "cli.md").read_text().split("\n\n")[1]
    missing = [c for c in commands if f"`{c}`" not in opening]
    assert not missing, f"docs/cli.md does not name {missing}"
    words = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen".split()
    assert f"has {words[len(commands) - 1]} commands" in opening, f"docs/cli.md should count {len(commands)}"
