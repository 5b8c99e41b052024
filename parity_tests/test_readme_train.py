"""The README's "Train your own translation model" block, run as written (issue 46, item 3): line by
line in an empty folder, offline, each command through the same runner as docs/journeys.md's
(parity_tests/test_journeys.py), then what the paragraph under it says is checked against the files."""

from __future__ import annotations

import json
import re
from pathlib import Path

from parity_tests.test_journeys import run
from rosetta.checkpoint import load_checkpoint

README = Path(__file__).resolve().parent.parent / "README.md"


def block() -> list[str]:
    text = README.read_text(encoding="utf-8")
    start = text.index("\n## Train your own translation model")
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)[1]
    return [line for line in block.splitlines() if line.strip()]


def test_train_translate_evaluate_resume_average_as_the_readme_writes(tmp_path, monkeypatch, capsys):
    lines = block()
    commands = [line.split()[1] for line in lines if line.startswith("rosetta")]
    assert commands == ["train", "evaluate", "train", "average"]
    outputs = run(lines, tmp_path, monkeypatch, capsys)
    run_dir = tmp_path / "runs" / "m30k" / "torch"
    translation = outputs[1].splitlines()
    assert len(translation) == 1  # one line in, one line out (after 4 steps: not yet a translation)
    report = json.loads((tmp_path / "runs" / "m30k" / "test2016.json").read_text())
    assert (report["backend"], report["split"], report["sentences"]) == ("torch", "test_2016_flickr", 20)
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert checkpoints[-1] == "step-00000008"  # --resume went on to the new --steps
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000008"
    averaged = load_checkpoint(tmp_path / "runs" / "m30k" / "averaged.safetensors")
    newest = load_checkpoint(run_dir / "checkpoints" / "step-00000008" / "model.safetensors")
    assert averaged.config == newest.config
    for name in ("log.jsonl", "result.json", "plot.png", "averaged.safetensors", "run.json"):
        assert (run_dir / name).is_file(), name
    assert (tmp_path / "runs" / "m30k" / "summary.md").is_file()
