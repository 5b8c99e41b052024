"""`rosetta example opus-mt DIR` (rosetta/harness/example.py): the small trained opus-mt-style
directory built offline from Multi30k. What it writes is read by Hugging Face's own
`MarianMTModel.from_pretrained` and translated by `rosetta translate --checkpoint DIR` as
`MarianMTModel.generate` translates it; the Multi30k folder comes from `--data-dir`, else
$ROSETTA_DATA_DIR (the package's one reader); everything refusable is refused in one line before
any work, and an interrupted build leaves nothing under DIR.
"""

from __future__ import annotations

import gzip
import json
import sys

import pytest

from parity_tests.test_diff_training import assert_refused
from parity_tests.test_opus_mt import hf_translate, translate
from rosetta.cli import main
from rosetta.harness.data import default_data_dir

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

FILES = {"source.spm", "target.spm", "vocab.json", "tokenizer_config.json", "config.json",
         "model.safetensors", "generation_config.json"}
MARKER = "Zzqxjw"  # a word that is in no Multi30k sentence: in the vocabulary only if our copy was read


@pytest.fixture
def marked_data(tmp_path):
    """A copy of the Multi30k training files in which every German line ends in MARKER."""
    data = tmp_path / "data"
    data.mkdir()
    for lang in ("de", "en"):
        lines = gzip.decompress((default_data_dir() / f"train.{lang}.gz").read_bytes()).decode().splitlines()
        lines = [f"{line} {MARKER}" if lang == "de" else line for line in lines[:3000]]
        (data / f"train.{lang}.gz").write_bytes(gzip.compress("".join(f"{x}\n" for x in lines).encode()))
    return data


def _build(capsys, *argv: str) -> str:
    capsys.readouterr()
    code = main(["example", "opus-mt", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_example_from_rosetta_data_dir_translates_as_transformers(marked_data, tmp_path, monkeypatch, capsys):
    """ROSETTA_DATA_DIR names the data read (its marker word is a vocabulary piece); the directory has
    opus-mt's files, loads in MarianMTModel, and translates as MarianMTModel.generate (greedy)."""
    from transformers import MarianMTModel

    monkeypatch.setenv("ROSETTA_DATA_DIR", str(marked_data))
    out = tmp_path / "ex"
    assert f"wrote {out}" in _build(capsys, str(out), "--steps", "2")
    assert {p.name for p in out.iterdir()} == FILES
    vocab = json.loads((out / "vocab.json").read_text(encoding="utf-8"))
    assert f"▁{MARKER}" in vocab and list(vocab)[:2] == ["</s>", "<unk>"] and list(vocab)[-1] == "<pad>"
    model = MarianMTModel.from_pretrained(out)
    assert model.config.vocab_size == len(vocab) and model.config.decoder_start_token_id == vocab["<pad>"]
    sentences = ["Ein Hund läuft.", "Zwei Männer spielen Fußball."]
    expected = hf_translate(out, sentences, num_beams=1)
    got = translate(capsys, monkeypatch, "--checkpoint", str(out), "--backend", "torch", "--beam", "1",
                    sentences=sentences)
    assert got == expected and len(got) == 2


def test_data_dir_flag_wins_and_separate_vocabularies(marked_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ROSETTA_DATA_DIR", str(tmp_path / "missing"))
    out = tmp_path / "sep"
    out.mkdir()  # an empty folder is taken
    _build(capsys, str(out), "--data-dir", str(marked_data), "--separate", "--steps", "1", "--seed", "3")
    assert {p.name for p in out.iterdir()} == FILES | {"target_vocab.json"}
    source = json.loads((out / "vocab.json").read_text(encoding="utf-8"))
    target = json.loads((out / "target_vocab.json").read_text(encoding="utf-8"))
    assert f"▁{MARKER}" in source and f"▁{MARKER}" not in target
    assert json.loads((out / "tokenizer_config.json").read_text())["separate_vocabs"] is True


def test_refusals_before_any_work(tmp_path, monkeypatch, capsys):
    """A used DIR, a file as DIR, a missing data folder, a missing package, a bad flag: one line
    naming it, exit 2, nothing written."""
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    assert_refused(["example", "opus-mt", str(used)], f"{used}: exists and is not empty", capsys)
    assert [p.name for p in used.iterdir()] == ["notes.txt"]
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert_refused(["example", "opus-mt", str(a_file)], f"{a_file}: exists and is not a folder", capsys)
    assert_refused(["example", "opus-mt", str(a_file / "sub")], "is a file, not a directory", capsys)
    assert_refused(["example", "opus-mt", str(tmp_path / "x"), "--steps", "0"], "--steps", capsys)
    assert_refused(["example", "opus-ct", str(tmp_path / "x")], "invalid choice: 'opus-ct'", capsys)
    missing = tmp_path / "no-data"
    monkeypatch.setenv("ROSETTA_DATA_DIR", str(missing))
    assert_refused(["example", "opus-mt", str(tmp_path / "x")], f"{str(missing)!r} ($ROSETTA_DATA_DIR) does "
                   "not exist", capsys)
    monkeypatch.delenv("ROSETTA_DATA_DIR")
    assert_refused(["example", "opus-mt", str(tmp_path / "x"), "--data-dir", str(missing)],
                   f"{str(missing)!r} (given directory) does not exist", capsys)
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # as if not installed
    assert_refused(["example", "opus-mt", str(tmp_path / "x")], "needs 'sentencepiece'", capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "used"]


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    """A build stopped part-way (here after its tokenizer files) leaves no DIR and no partial folder."""
    from rosetta.harness import example

    def stop(out, *args):
        (out / "source.spm").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(example, "_write", stop)
    with pytest.raises(KeyboardInterrupt):
        example.build_opus_mt_dir(tmp_path / "ex")
    assert list(tmp_path.iterdir()) == []
