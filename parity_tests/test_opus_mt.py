"""Real opus-mt models end to end: a directory laid out as Helsinki-NLP publishes them
(parity_tests/opus_mt_case.py: SentencePiece models trained on Multi30k, opus-mt's vocabulary
layout, a small MarianMTModel trained here, opus-mt's generation_config.json), translated by
`rosetta translate --checkpoint DIR` in every backend and compared with what Hugging Face's own
`MarianTokenizer` + `MarianMTModel.generate` print: the expected strings come from transformers,
never from rosetta.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from parity_tests.opus_mt_case import EXTRA_SENTENCES, case_sentences
from rosetta.cli import main

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

SENTENCES = case_sentences(6) + EXTRA_SENTENCES[:2]


@pytest.fixture(params=["joint", "separate"], scope="module")
def case(request, opus_mt_dir, opus_mt_separate_dir):
    return opus_mt_dir if request.param == "joint" else opus_mt_separate_dir


def hf_translate(directory, sentences, **generate):
    """What `MarianTokenizer` + `MarianMTModel.generate` (its generation_config.json, and
    `generate`'s keywords) print."""
    import torch
    from transformers import MarianMTModel, MarianTokenizer

    tokenizer = MarianTokenizer.from_pretrained(directory)
    model = MarianMTModel.from_pretrained(directory).eval()
    with torch.no_grad():
        out = model.generate(**tokenizer(sentences, return_tensors="pt", padding=True), **generate)
    return [tokenizer.decode(row, skip_special_tokens=True) for row in out]


def translate(capsys, monkeypatch, *args, sentences=SENTENCES):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("".join(s + "\n" for s in sentences)))
    code = main(["translate", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out.splitlines()


def test_tokenizer_is_marian_tokenizer(case):
    """encode_source = MarianTokenizer(text).input_ids; decode = decode(ids, skip_special_tokens=True)."""
    from transformers import MarianTokenizer

    from rosetta.tokenizer import SentencePieceTokenizer

    theirs, ours = MarianTokenizer.from_pretrained(case), SentencePieceTokenizer(case)
    sentences = case_sentences(40) + EXTRA_SENTENCES + ["", "  Leerzeichen  ", ">>en<<", ">>xx<< unbekannt"]
    for s in sentences:
        assert ours.encode_source(s) == theirs(s).input_ids, s
        assert ours.encode_target(s) == theirs(text_target=s).input_ids, s
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, ours.tgt_vocab_size, size=12).tolist()
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), ids
    assert ours.src_vocab_size == len(theirs.encoder)


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_translate_marian_directory(case, backend, search, capsys, monkeypatch):
    """`rosetta translate --checkpoint DIR` prints Hugging Face's strings: greedy (`--beam 1`
    with the directory's other settings) and beam 4 with `--length-rule hf` (the directory's
    generation_config.json: num_beams 4, length_penalty 1.0, renormalized, eos forced at max_length)."""
    expected = hf_translate(case, SENTENCES, **({"num_beams": 1} if search == "greedy" else {}))
    flags = ["--beam", "1"] if search == "greedy" else ["--beam", "4", "--length-rule", "hf"]
    assert translate(capsys, monkeypatch, "--checkpoint", str(case), "--backend", backend, *flags) == expected


def test_generation_config_sets_the_search(opus_mt_dir, capsys, monkeypatch):
    """Without flags the directory's generation_config.json sets the search (beam 4 here), as the
    translation pipeline does; a flag overrides it."""
    expected = hf_translate(opus_mt_dir, SENTENCES)
    assert translate(capsys, monkeypatch, "--checkpoint", str(opus_mt_dir)) == expected
    greedy = hf_translate(opus_mt_dir, SENTENCES, num_beams=1)
    assert translate(capsys, monkeypatch, "--checkpoint", str(opus_mt_dir), "--beam", "1") == greedy


def test_convert_keeps_the_tokenizer(case, tmp_path, capsys, monkeypatch):
    """DIR -> ours: the tokenizer and generation config go to the sidecar `ours.tokenizer/`, where
    translate finds them; ours -> --to marian: Hugging Face translates as DIR did."""
    ours = tmp_path / "ours.safetensors"
    assert main(["convert", str(case), str(ours)]) == 0
    sidecar = tmp_path / "ours.tokenizer"
    for name in ("source.spm", "target.spm", "vocab.json", "tokenizer_config.json", "generation_config.json"):
        assert (sidecar / name).read_bytes() == (case / name).read_bytes(), name
    assert (sidecar / "target_vocab.json").is_file() == (case / "target_vocab.json").is_file()
    capsys.readouterr()
    expected = hf_translate(case, SENTENCES, num_beams=1)
    assert translate(capsys, monkeypatch, "--checkpoint", str(ours), "--beam", "1") == expected
    back = tmp_path / "hf-again"
    assert main(["convert", str(ours), str(back), "--to", "marian"]) == 0
    from transformers import AutoTokenizer, MarianTokenizer

    original, written = MarianTokenizer.from_pretrained(case), AutoTokenizer.from_pretrained(back)
    assert [written(s).input_ids for s in SENTENCES] == [original(s).input_ids for s in SENTENCES]
    assert hf_translate(back, SENTENCES) == hf_translate(case, SENTENCES)
    assert hf_translate(back, SENTENCES, num_beams=1) == expected


def test_generate_and_evaluate_take_a_marian_directory(opus_mt_dir, tmp_path, capsys, monkeypatch):
    """`generate --checkpoint DIR` (ids in) and `evaluate DIR` (a Multi30k split) read the directory too."""
    import io

    from transformers import MarianTokenizer

    ids = MarianTokenizer.from_pretrained(opus_mt_dir)(SENTENCES[0]).input_ids
    monkeypatch.setattr("sys.stdin", io.StringIO(" ".join(map(str, ids)) + "\n"))
    assert main(["generate", "--checkpoint", str(opus_mt_dir), "--beam", "1"]) == 0
    out = capsys.readouterr().out.split()
    expected = hf_translate(opus_mt_dir, SENTENCES[:1], num_beams=1)[0]
    assert MarianTokenizer.from_pretrained(opus_mt_dir).decode([int(t) for t in out]) == expected
    report = tmp_path / "report.json"
    code = main(["evaluate", str(opus_mt_dir), "--split", "test_2016_flickr", "--limit", "4", "--beam", "1",
                 "--out", str(report), "--hyps", str(tmp_path / "hyps.txt")])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "hyps.txt").read_text(encoding="utf-8").splitlines() == hf_translate(
        opus_mt_dir, case_sentences(4), num_beams=1)
    assert json.loads(report.read_text())["beam"] == 1


def _broken_copy(source, tmp_path, change):
    directory = tmp_path / "broken"
    shutil.copytree(source, directory)
    change(directory)
    return directory


def _vocab_edit(edit):
    def change(directory):
        vocab = json.loads((directory / "vocab.json").read_text())
        (directory / "vocab.json").write_text(json.dumps(edit(vocab)))
    return change


BROKEN = {
    "missing spm": (lambda d: (d / "source.spm").unlink(), "source.spm: missing"),
    "corrupt spm": (lambda d: (d / "target.spm").write_bytes(b"not a model"),
                    "target.spm: not a SentencePiece model: its bytes do not parse as a ModelProto"),
    "huge spm": (lambda d: os.truncate(d / "source.spm", 4 << 30),  # sparse: refused from its size
                 "source.spm: 4,294,967,296 bytes, more than a SentencePiece model may hold (67,108,864)"),
    "vocab size": (_vocab_edit(lambda v: {k: i for k, i in v.items() if i != 5}), "vocab.json: "),
    "id out of range": (_vocab_edit(lambda v: {**v, "<pad>": 10**6}), "vocab.json: '<pad>' has id 1000000"),
    "duplicate ids": (_vocab_edit(lambda v: {**v, "▁zzz": 3}), "both have id 3"),
    "generation config": (lambda d: (d / "generation_config.json").write_text("{num_beams: 4"),
                          "generation_config.json"),
}


@pytest.mark.parametrize("problem", sorted(BROKEN))
def test_broken_directory_is_one_line(opus_mt_dir, tmp_path, problem, capsys, monkeypatch):
    """Each problem: exit 2, one line naming the file (and the field), nothing translated."""
    change, expected = BROKEN[problem]
    directory = _broken_copy(opus_mt_dir, tmp_path, change)
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("Ein Hund.\n"))
    assert main(["translate", "--checkpoint", str(directory)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("rosetta: error: "), err
    assert expected in err, err
    # convert refuses the same before writing anything
    assert main(["convert", str(directory), str(tmp_path / "x.safetensors")]) == 2
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "x.tokenizer").exists()


def test_search_defaults_read_generation_config_as_transformers_does(tmp_path):
    """generation_config.json -> our search: GenerationConfig's defaults for absent fields
    (greedy, length_penalty 1.0, 20 new tokens: transformers 5's default max_length counts them
    after the start token), [pad] and [eos] dropped from the bans as HF drops [eos], a note for each
    setting our search does not have; multi-token bad words refused."""
    from rosetta import preset
    from rosetta.errors import ConfigError
    from rosetta.interop.marian_files import search_defaults

    cfg = preset("tiny")  # pad 0, eos 2
    assert search_defaults(tmp_path, cfg) == ({}, [])  # no file: our (the paper's) search
    (tmp_path / "generation_config.json").write_text("{}")
    settings, notes = search_defaults(tmp_path, cfg)
    assert (settings["beam"], settings["alpha"], settings["max_new_tokens"], settings["length_rule"]) == \
        (1, 1.0, 20, "hf")
    # generate reads the special tokens from this file alone: without them it neither stops nor starts
    assert [n.split(": ")[1].split(" ")[0] for n in notes] == ["eos_token_id", "neither", "bad_words_ids"]
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"num_beams": 5, "length_penalty": 0.6, "max_length": 40, "bad_words_ids": [[0], [2], [7]],
         "renormalize_logits": True, "forced_eos_token_id": 2, "do_sample": True, "no_repeat_ngram_size": 3,
         "decoder_start_token_id": 1, "eos_token_id": 2}))
    settings, notes = search_defaults(tmp_path, cfg)
    assert settings == {"beam": 5, "alpha": 0.6, "length_rule": "hf", "margin": 39, "max_new_tokens": 39,
                        "banned": (7,), "renormalize": True, "forced_eos": True,
                        "forced_first": None}
    assert [n.split(": ")[1].split("=")[0] for n in notes] == ["do_sample", "no_repeat_ngram_size"]
    (tmp_path / "generation_config.json").write_text(json.dumps({"bad_words_ids": [[5, 6]]}))
    with pytest.raises(ConfigError, match=r"bad_words_ids entry \[5, 6\]"):
        search_defaults(tmp_path, cfg)
