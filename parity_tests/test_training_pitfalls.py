"""benchmarks/training_pitfalls.py: its measurement runs at a tiny size and agrees with independent
expectations (Adam's algebra, our trainer's own weights, a cross entropy written out here), and
docs/pitfalls.md shows exactly the newest committed results, with a numbered item for every
training mistake of the catalogue. Nothing is timed here."""

from __future__ import annotations

import re

import numpy as np
import pytest

from benchmarks import training_pitfalls as tp
from rosetta.diff.training.catalogue import ENTRIES
from rosetta.diff.training.trace import read_trace

# Three updates on small batches, two of them stored whole for the diagnosis: seconds.
SMOKE = dict(tp.SETTINGS, steps=3, max_tokens=256, whole=2)
NAMES = ["schedule_from_zero", "beta2_0.999", "loss_summed", "beta2_0.98", "tf32_matmuls"]


@pytest.fixture(scope="module")
def smoke():
    return tp.run(SMOKE, NAMES)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The smoke run's plain reference (the same settings, so the same weights), kept on disk."""
    return tp.train_reference(tmp_path_factory.mktemp("reference"), SMOKE, [])


def test_the_measurement_runs_at_a_tiny_size(smoke):
    rows = {r["name"]: r for r in smoke["rows"]}
    assert sorted(rows) == sorted(NAMES) and list(smoke["references"]) == ["plain"]
    ref = smoke["references"]["plain"]
    # "Ours" is the replay without a mistake: it must be our trainer's run, to float64 rounding.
    assert ref["replay_vs_trainer"] < 1e-12
    # eq. 3 from step 0 gives the first update a rate of 0: after it the mistaken weights are still
    # θ_0, exactly one whole step (||θ_0 - θ_ours(1)|| / ||θ_ours(1) - θ_0|| = 1) behind.
    assert rows["schedule_from_zero"]["first_step"] == 1
    assert rows["schedule_from_zero"]["rel_steps"][0] == pytest.approx(1.0, rel=1e-12)
    # Bias-corrected, v̂_1 = g_1² whatever β2: the first update is the same (to rounding), the second not.
    assert rows["beta2_0.999"]["first_step"] == 2 and rows["beta2_0.999"]["rel_steps"][0] < 1e-14
    for name in ("schedule_from_zero", "beta2_0.999", "loss_summed"):
        r = rows[name]
        assert r["shown"] and r["reference"] == "plain" and len(r["rel_steps"]) == SMOKE["steps"]
        assert r["diff"]["named"] == [name] and r["diff"]["exit_code"] == 1, r["diff"]
        assert r["diff"]["first_difference"] == (2 if name == "beta2_0.999" else 1)
    assert not rows["beta2_0.98"]["shown"] and "already" in rows["beta2_0.98"]["why"]
    assert not rows["tf32_matmuls"]["shown"] and "judged by size" in rows["tf32_matmuls"]["why"]
    text = tp.markdown(smoke)
    assert text.count("\n| `") == 3 and "- `beta2_0.98`" in text and "yes (from step 2)" in text


def test_the_loss_column_is_the_cross_entropy_of_the_trainers_weights(smoke, reference):
    """Our loss after N updates, recomputed from the trainer's own traced weights with the NumPy
    reference's logits and a cross entropy written out here (log-sum-exp, pad left out)."""
    import numpy_ref.model as numpy_ref

    trace = read_trace(reference)
    last = trace.full(SMOKE["steps"])
    logits = numpy_ref.forward({k: v.astype(np.float64) for k, v in last.params.items()}, trace.cfg,
                               last.src, last.tgt_in)
    top = logits.max(-1, keepdims=True)
    log_z = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
    nll = log_z - np.take_along_axis(logits, last.labels[..., None], -1)[..., 0]
    real = last.labels != trace.cfg.pad_id
    assert smoke["references"]["plain"]["loss_ours"] == pytest.approx(nll[real].mean(), rel=1e-12)


@pytest.fixture(scope="module")
def full_batches(tmp_path_factory):
    """The measurement's batches (1,024 tokens: every token of the vocabulary in each), 3 steps."""
    return tp.train_reference(tmp_path_factory.mktemp("full"), dict(SMOKE, max_tokens=1024), [])


@pytest.mark.parametrize("mistake", ["scheduler_before_optimizer", "schedule_scaled"])
def test_a_larger_first_rate_fits_no_l2_decay_without_nan(mistake, full_batches, tmp_path):
    """A's first update larger than B's rate in every coordinate (the next step's rate, eq. 3 times 2):
    the L2 entries' λ inversion had no coordinate to invert and divided 0 by 0, a NaN λ and a
    RuntimeWarning on `rosetta diff --diagnose`'s stderr. Now λ is 0 there, and the entry is named."""
    import warnings

    from rosetta.diff.training.catalogue import BY_NAME, Settings, replay

    trace = read_trace(full_batches)
    train = Settings.from_trace(trace.train_config)
    steps = list(replay(trace, train, BY_NAME[mistake].variant(train), SMOKE["steps"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        found = tp.diagnosis(full_batches, trace, steps, tmp_path, SMOKE["whole"])
    assert found["named"] == [mistake] and found["first_difference"] == 1


def test_every_replayed_entry_has_its_numbered_item():
    """Each catalogue entry judged by a replay belongs to a numbered item of docs/pitfalls.md, and
    that item names it (so a new entry needs a place on the page)."""
    page = tp.PAGE.read_text()
    replayed = {e.name for e in ENTRIES if e.judged == "replay"}
    assert replayed == set(tp.PITFALLS), "place the new entry in benchmarks/training_pitfalls.PITFALLS"
    for number in sorted(set(tp.PITFALLS.values())):
        section = re.search(rf"^### {number}\. .*?(?=^### |^## )", page, re.S | re.M)
        assert section, f"docs/pitfalls.md has no item {number}"
        for name in (n for n, k in tp.PITFALLS.items() if k == number):
            assert f"`{name}`" in section.group(0), f"item {number} does not name `{name}`"


def test_the_items_quote_the_measured_block():
    """Every measured number the items 17-23 quote (`6.2e-04`, a loss `4.1054`) is one the block shows,
    so a new measurement that moves it fails here until the prose follows."""
    page = tp.PAGE.read_text()
    items = page[page.index("### 17. "):page.index("\n## ", page.index("### 17. "))]
    quoted = re.findall(r"\d\.\de[-+]\d\d|\b\d\.\d{4}\b", items)
    assert len(quoted) > 20
    block = tp.page_block()
    assert [q for q in quoted if q not in block] == []


def test_page_shows_the_newest_results():
    """The block of docs/pitfalls.md is exactly what `python -m benchmarks.training_pitfalls --docs`
    renders from the newest benchmarks/results/training_pitfalls_<date>.json, which covers every
    catalogue entry (measured, or why not) at the module's settings."""
    assert tp.page_block() in tp.PAGE.read_text(), "run `python -m benchmarks.training_pitfalls --docs`"
    path = tp.newest()
    result = tp.load(path)
    assert result["settings"] == tp.SETTINGS
    assert {r["name"] for r in result["rows"]} == {e.name for e in ENTRIES}, (
        "the catalogue changed: run `python -m benchmarks.training_pitfalls`")
    assert path.with_suffix(".md").exists()


def test_bad_results_file_is_named(tmp_path):
    bad = tmp_path / "training_pitfalls_2026-01-01.json"
    bad.write_text('{"rows": [], "references": {}}')
    with pytest.raises(SystemExit, match="missing environment"):
        tp.load(bad)
    bad.write_text("garbage")
    with pytest.raises(SystemExit, match="not valid JSON"):
        tp.page_block(tmp_path)


def test_the_command_refuses_docs_without_results(tmp_path, monkeypatch, capsys):
    """`--docs` with no results file: one line, exit 2, nothing written."""
    monkeypatch.setattr(tp, "RESULTS", tmp_path)
    with pytest.raises(SystemExit) as exit_:
        tp.main(["--docs"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith("benchmarks.training_pitfalls: error: no training_pitfalls_")
    assert list(tmp_path.iterdir()) == []
