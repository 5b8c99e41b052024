"""Every measured figure of the README and docs/ has its source (issue 40, item 4).

A figure here is a number with a unit of time, speed, ratio, share or quality (`0.78 s`,
`22,473 tokens/s`, `1.12×`, `9.5%`, `35.10 BLEU`; sizes such as `100 MB` are bounds, not
measurements). Outside generated blocks (`<!-- NAME:begin -->` ... `<!-- NAME:end -->`, each checked
against its results file by its own test) and code blocks, the paragraph holding a figure (a table
with the paragraph that introduces it) must either

1. link results files under benchmarks/results/ (of today's tree, or `COMMIT:benchmarks/results/...`
   as `git show` names an older one), and then every figure of it (of a table: every number) is a
   number of those files, rounded as written (`0.78` matches 0.7812; `9.5%` matches 0.095; the
   `.md`, `.json` and `.log` of the same name are read together); or
2. name the commit and the machine it was measured at (a hexadecimal commit of this repository's
   history; CPU, GPU, H100, ...); or
3. say that it is arithmetic, an estimate or a bound, not a measurement.

So a copied number that drifts from its results file, or a figure from nowhere, fails here, naming
page, paragraph and figure."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A ratio or share is written against its number (`1.12×`, `9.5%`; `4 × d` is a product); a time,
# speed or score after a space or not.
UNIT = r"%|×|x(?= )|\s?(?:ms|s|min|minutes|seconds|tokens/s|sentences/s|TFLOP/s|BLEU)"
FIGURE = re.compile(r"(?<![\w.\-/^·])(\d[\d,]*(?:\.\d+)?)(" + UNIT + r")(?![\w/])")
GENERATED = re.compile(r"<!-- (\S+):begin -->.*?<!-- \1:end -->", re.S)
FENCE = re.compile(r"```.*?```", re.S)
# A results file of today's tree, or of a commit as `git show` names it (`8568228:benchmarks/...`).
RESULTS_LINK = re.compile(r"(?:\b([0-9a-f]{7,40}):)?benchmarks/results/([\w.\-]+)\.(?:md|json|log|png)")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
MACHINE = re.compile(r"CPU|GPU|H100|H200|A100|EPYC|Xeon|core")
NOT_MEASURED = re.compile(r"arithmetic|not a measurement|estimate|\bbound|predict|data-sheet", re.I)
# Figures that are not measurements, each with why.
NOT_FIGURES = {
    ("checkpoint.md", "5 s"): "the property test's time limit per load",
    ("diagnose.md", "10%"): "words of a printed message",
    ("diff.md", "100%"): "top-k agreement of log-probabilities with logits, by definition",
    ("diff.md", "0.6%"): "an example of the printed line",
    ("distributed.md", "600 s"): "a timeout's default",
}
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def units(page: Path) -> list[tuple[str, str, str]]:
    """(heading, context, unit) of a page: a unit is a paragraph or a list item; its context is its
    paragraph, and for a table or a list that opens a paragraph, the paragraphs right above it too
    (what introduces it); the heading is the nearest one above."""
    text = FENCE.sub("", GENERATED.sub("", page.read_text()))
    paras = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    out, heading = [], ""
    for i, p in enumerate(paras):
        if p.startswith("#"):
            heading = p.splitlines()[0]
        j, context = i, p
        while j > 0 and paras[j].startswith(("|", "- ", "    ")):  # a table, a list, a formula
            j -= 1
            context = paras[j] + "\n" + context
        out += [(heading, context, unit) for unit in re.split(r"\n(?=- )", p)]
    return out


def results_numbers(stems: set[tuple[str, str]]) -> list[float]:
    """Every number of the named results files (each stem's .md, .json and .log; at a commit where
    one is named)."""
    text = ""
    for commit, stem in stems:
        for ext in (".md", ".json", ".log"):
            path = f"benchmarks/results/{stem}{ext}"
            if not commit:
                text += (ROOT / path).read_text() if (ROOT / path).exists() else ""
                continue
            shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{path}"], capture_output=True,
                                   text=True)
            text += shown.stdout if shown.returncode == 0 else ""
    return [float(x) for x in NUMBER.findall(text.replace(",", ""))]


def found(figure: str, unit: str, numbers: list[float]) -> bool:
    value = float(figure.replace(",", ""))
    places = len(figure.split(".")[1]) if "." in figure else 0
    scales = (1, 100) if unit == "%" else (1,)  # a share is written as a fraction in JSON
    return any(round(x * s, places) == value for x in numbers for s in scales)


def known_commits() -> set[str] | None:
    """Every commit of the history, or None in a shallow clone (then only the form is checked)."""
    git = ["git", "-C", str(ROOT)]
    shallow = subprocess.run([*git, "rev-parse", "--is-shallow-repository"], capture_output=True, text=True)
    if shallow.returncode or shallow.stdout.strip() != "false":
        return None
    log = subprocess.run([*git, "log", "--all", "--format=%H"], capture_output=True, text=True, check=True)
    return set(log.stdout.split())


CASES = [(page, heading, context, p) for page in PAGES for heading, context, p in units(page)
         if FIGURE.search(p)]


def test_the_rule_sees_the_pages_figures():
    """The rule reads figures (not nothing): the README's and the benchmark page's among them."""
    pages = {page.name for page, *_ in CASES}
    assert {"README.md", "benchmarks.md", "training.md", "decoding.md"} <= pages and len(CASES) > 50


@pytest.mark.parametrize("page, heading, context, unit", CASES,
                         ids=[f"{page.name}:{i}" for i, (page, *_) in enumerate(CASES)])
def test_every_figure_has_its_source(page, heading, context, unit):
    stems = set(RESULTS_LINK.findall(context))
    numbers = results_numbers(stems)
    missing = [f"{n}{u}" for n, u in FIGURE.findall(unit)
               if (page.name, f"{n}{u}") not in NOT_FIGURES and not found(n, u, numbers)]
    where = f"{page.name}: {unit[:120]!r}"
    if unit.lstrip().startswith("|") and stems:  # a table copied from results files: every number of it
        rows = [row for row in unit.splitlines()[2:] if row.startswith("|")]
        cells = [n for row in rows for n in re.findall(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?![\w])", row)]
        absent = [n for n in cells if not found(n, "", numbers)]
        assert not absent, f"{where}: {absent} not in {sorted(stems)}"
    marked = COMMIT.search(context) and MACHINE.search(heading + context)
    assert not missing or marked or NOT_MEASURED.search(context), (
        f"{where}: {missing} in no linked results file{f' ({sorted(stems)})' if stems else ''}, "
        "and no commit and machine named")


def test_named_commits_are_this_repositorys():
    history = known_commits()
    if history is None:
        pytest.skip("a shallow clone: the history is not there to check against")
    unknown = {(page.name, c) for page, _, context, _ in CASES for c in COMMIT.findall(context)
               if not any(h.startswith(c) for h in history)}
    assert not unknown, unknown


def test_a_figure_that_drifted_from_its_file_is_caught(tmp_path):
    """The README's time-to-quality table with one BLEU changed by 0.01: the rule names it."""
    readme = (ROOT / "README.md").read_text()
    assert "| 34.38 / **36.50** |" in readme
    page = tmp_path / "README.md"
    page.write_text(readme.replace("| 34.38 / **36.50** |", "| 34.38 / **36.51** |"))
    (_, _, context, unit), = [case for case in
                              ((page, *u) for u in units(page)) if "36.51" in case[3]]
    stems = set(RESULTS_LINK.findall(context))
    assert stems == {("", "ttq_cpu_2026-11-24")}
    numbers = results_numbers(stems)
    assert found("36.50", "", numbers) and not found("36.51", "", numbers)
    assert found("9.5", "%", [0.095]) and not found("9.6", "%", [0.095])  # a share written as a fraction
