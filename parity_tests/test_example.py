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


def _fake_write(out, *args):
    """Stands in for the build (the files and the rename are what these tests look at)."""
    (out / "config.json").write_text("built")


def test_a_name_too_long_beside_dir_is_refused_before_any_work(tmp_path, capsys):
    """Issue 57: a DIR name that fits the file system alone but not with the build folder's prefix and
    suffix (`.NAME.partial-PID-XXXXXXXX`) was a traceback (File name too long); now one line naming
    both sizes, as is a missing parent folder whose own name is too long; nothing is created."""
    import os

    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    extra = len(".") + len(".partial-") + len(str(os.getpid())) + len("-") + 8
    name = "a" * (limit - 5)
    assert_refused(["example", "opus-mt", str(tmp_path / name), "--steps", "1"],
                   f"its name is {limit - 5} bytes, too long here: the build's folder beside it "
                   f"(.NAME.partial-PID-XXXXXXXX) adds {extra} and the file system of {tmp_path} "
                   f"allows {limit} "
                   f"(PC_NAME_MAX); name a folder of at most {limit - extra} bytes", capsys)
    assert_refused(["example", "opus-mt", str(tmp_path / ("b" * (limit + 1)) / "ex")],
                   f"the folder name {'b' * 40}... is {limit + 1} bytes; the file system of {tmp_path} "
                   f"allows {limit}", capsys)
    assert list(tmp_path.iterdir()) == []


def test_dir_as_a_symlink(tmp_path, monkeypatch, capsys):
    """Issue 57: a symlink to an empty folder built the whole model, then failed with NotADirectoryError
    at the rename; it is now followed (the files go into the folder it names, the link stays). A
    dangling symlink is refused in one line naming its target, before any work."""
    from rosetta.harness import example

    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    assert_refused(["example", "opus-mt", str(dangling)],
                   f"{dangling}: a symlink to {tmp_path / 'nowhere'}, which does not exist", capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling"]
    target = tmp_path / "real" / "empty"
    target.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(target)
    monkeypatch.setattr(example, "_write", _fake_write)
    assert example.build_opus_mt_dir(link) == link
    assert link.is_symlink() and (target / "config.json").read_text() == "built"
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["empty"]  # no partial, no lock left
    assert_refused(["example", "opus-mt", str(link)], f"{link}: exists and is not empty", capsys)


def test_two_builds_of_one_dir(tmp_path, monkeypatch, capsys):
    """Issue 57: a second `rosetta example` on the DIR another is building built for nothing and then
    died with `Directory not empty`. It is refused at once, naming the builder's process, and the first
    build's result is intact; one that read its data while the other finished is refused under the lock;
    a file someone else puts in DIR during the build is kept and the build discarded, in one line."""
    import os
    import threading

    from rosetta.errors import RosettaError
    from rosetta.harness import example

    out = tmp_path / "ex"
    started, finish = threading.Event(), threading.Event()

    def slow_write(work, *args):
        _fake_write(work)
        started.set()
        assert finish.wait(60)

    monkeypatch.setattr(example, "_write", slow_write)
    winner = threading.Thread(target=example.build_opus_mt_dir, args=(out,))
    winner.start()
    try:
        assert started.wait(60)
        assert_refused(["example", "opus-mt", str(out)], f"{out}: another rosetta example (process "
                       f"{os.getpid()}) is building it now; wait for it to finish, or name another folder",
                       capsys)
    finally:
        finish.set()
        winner.join(60)
    assert [p.name for p in out.iterdir()] == ["config.json"] and (out / "config.json").read_text() == "built"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ex"]

    late = tmp_path / "late"
    read = example.multi30k

    def finished_meanwhile(*args, **kwargs):  # the other build completes while this one reads its data
        late.mkdir(exist_ok=True)
        (late / "config.json").write_text("other")
        return read(*args, **kwargs)

    monkeypatch.setattr(example, "multi30k", finished_meanwhile)
    with pytest.raises(RosettaError, match="exists and is not empty"):
        example.build_opus_mt_dir(late)
    assert (late / "config.json").read_text() == "other"
    monkeypatch.setattr(example, "multi30k", read)

    intruded = tmp_path / "intruded"

    def intruder(work, *args):
        _fake_write(work)
        intruded.mkdir()
        (intruded / "notes.txt").write_text("mine")

    monkeypatch.setattr(example, "_write", intruder)
    with pytest.raises(RosettaError, match=f"{intruded}: something wrote into it during the build"):
        example.build_opus_mt_dir(intruded)
    assert [p.name for p in intruded.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ex", "intruded", "late"]
