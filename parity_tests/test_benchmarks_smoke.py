"""The benchmark runners run end to end (tiny preset, one repeat). No timing assertions:
speed is measured by benchmarks/, on purpose never judged in unit tests."""

from __future__ import annotations

from benchmarks import decode_speed
from benchmarks.common import environment
from benchmarks.report import README, SUITES_IN_README, markdown, newest, plot, readme_block
from benchmarks.run import run


def test_benchmark_runner_smoke(tmp_path):
    result, device = run("smoke")
    rows = result["rows"]
    impls = {(r["task"], r["impl"]) for r in rows}
    assert {("train", "torch"), ("train", "jax"), ("train", "peer"), ("forward", "numpy"),
            ("decode", "jax"), ("decode", "peer")} <= impls
    assert all(r["median_s"] > 0 for r in rows)
    # Every measurement of ours has a ratio against the nn.Transformer peer where one exists.
    assert all("ratio_vs_peer" in r for r in rows if r["task"] == "train" and r["impl"] != "peer")
    result = {"environment": environment(), "settings": {"steps per repeat": 2}, **result}
    text = markdown(result)
    assert "| tiny | float32 | jax |" in text and device in text and "steps per repeat 2" in text
    png = plot(result, tmp_path / "smoke.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_decode_speed_smoke():
    result = decode_speed.run(quick=True)
    modes = {(r["backend"], r["search"], r["cache"]) for r in result["rows"]}
    assert ("jax", "beam 4", True) in modes and ("numpy", "greedy", False) in modes
    # Cached and uncached searches emit the same tokens (the benchmark compares like with like).
    tokens = {(r["backend"], r["search"]): set() for r in result["rows"]}
    for r in result["rows"]:
        tokens[r["backend"], r["search"]].add(r["tokens"])
    assert all(len(counts) == 1 for counts in tokens.values())


def test_readme_shows_the_newest_results():
    """The README's benchmark block is exactly what `python -m benchmarks.report --readme`
    renders from the newest cpu and gpu results files in benchmarks/results."""
    text = README.read_text()
    assert readme_block() in text, "run `python -m benchmarks.report --readme`"
    for suite in SUITES_IN_README:
        path = newest(suite)
        assert path is not None and path.with_suffix(".md").exists() and path.with_suffix(".png").exists()
