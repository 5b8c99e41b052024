"""M2M100 directories as text (issue 58 item 4): `rosetta translate --checkpoint DIR` and `rosetta
evaluate DIR` on the directory `rosetta example nllb` writes (parity_tests/nllb_case.py) print what
transformers' own `M2M100Tokenizer` + `M2M100ForConditionalGeneration.generate` give: the source's
language code first, the decoder started from `</s>`, the target's code forced first
(forced_bos_token_id: generation_config.json's, or --tgt-lang), greedy and beam 4, token for token.
The expected strings come from transformers, decoded without the language codes (which transformers
5.24's decode keeps: rosetta/interop/m2m100_tokenizer.py)."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest

from parity_tests.nllb_case import case_sentences
from rosetta.cli import main

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

SENTENCES = case_sentences()


def hf_ids(directory, sentences, src_lang="de", **generate) -> list[list[int]]:
    """generate's output rows for `sentences` (the directory's generation_config.json and `generate`)."""
    import torch
    from transformers import M2M100ForConditionalGeneration, M2M100Tokenizer

    tokenizer = M2M100Tokenizer.from_pretrained(directory, src_lang=src_lang)
    model = M2M100ForConditionalGeneration.from_pretrained(directory).eval()
    with torch.no_grad():
        out = model.generate(**tokenizer(sentences, return_tensors="pt", padding=True), **generate)
    return out.tolist()


def hf_text(directory, rows: list[list[int]]) -> list[str]:
    """M2M100Tokenizer.decode(skip_special_tokens=True) of each row without its language codes."""
    from transformers import M2M100Tokenizer

    tokenizer = M2M100Tokenizer.from_pretrained(directory)
    codes = set(tokenizer.lang_code_to_id.values())
    return [tokenizer.decode([t for t in row if t not in codes], skip_special_tokens=True) for row in rows]


def run(capsys, monkeypatch, *args, sentences=SENTENCES) -> tuple[int, list[str], str]:
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(s + "\n" for s in sentences)))
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def test_tokenizer_is_m2m100_tokenizer(nllb_dir):
    """encode_source = M2M100Tokenizer(text).input_ids for either source language; encode_target its
    text_target ids; decode = decode(ids without codes, skip_special_tokens=True)."""
    from transformers import M2M100Tokenizer

    from rosetta.interop.m2m100_tokenizer import M2M100TextTokenizer

    ours = M2M100TextTokenizer(nllb_dir)
    sentences = SENTENCES + ["", "  Leerzeichen  ", "__en__", "<s> <pad>"]
    for lang in ("de", "en"):
        theirs = M2M100Tokenizer.from_pretrained(nllb_dir, src_lang=lang, tgt_lang="fr")
        ours.src_lang, ours.tgt_lang = lang, "fr"
        for s in sentences:
            assert ours.encode_source(s) == theirs(s).input_ids, s
            assert ours.encode_target(s) == theirs(text_target=s).input_ids, s
    rng = np.random.default_rng(0)
    codes = set(theirs.lang_code_to_id.values())
    for _ in range(30):  # every id of the embedding: pieces, specials, codes, madeup words
        ids = rng.integers(0, ours.src_vocab_size + 8, size=12).tolist()
        assert ours.decode(ids) == theirs.decode([i for i in ids if i not in codes], skip_special_tokens=True)
    assert ours.src_vocab_size == max(codes) + 1  # the last code (5.24's len() leaves the codes out)


@pytest.mark.parametrize("backend, search", [("torch", "greedy"), ("torch", "beam"), ("jax", "beam"),
                                             ("numpy", "greedy")])
def test_translate_m2m100_directory_equals_generate(nllb_dir, backend, search, capsys, monkeypatch):
    """The directory's generation_config.json (beam 4, forced_bos_token_id = __en__, max_length 96,
    <pad> banned) sets the search; --beam 1 is generate's num_beams=1."""
    rows = hf_ids(nllb_dir, SENTENCES, **({"num_beams": 1} if search == "greedy" else {}))
    en = json.loads((nllb_dir / "generation_config.json").read_text())["forced_bos_token_id"]
    assert all(row[:2] == [2, en] for row in rows)  # decoder start </s>, then the forced code
    flags = ["--beam", "1"] if search == "greedy" else []
    code, out, err = run(capsys, monkeypatch, "translate", "--checkpoint", str(nllb_dir), "--backend",
                         backend, *flags)
    assert code == 0, err
    assert out == hf_text(nllb_dir, rows)
    assert "rosetta: note" not in err


def test_language_flags_equal_generate(nllb_dir, capsys, monkeypatch):
    """--src-lang en --tgt-lang de: English sources marked __en__, __de__ forced first."""
    from transformers import M2M100Tokenizer

    english = ["A man in a red shirt.", "Two dogs play in the snow.", "A woman is singing."]
    de = M2M100Tokenizer.from_pretrained(nllb_dir).get_lang_id("de")
    for beams in (1, 4):
        rows = hf_ids(nllb_dir, english, src_lang="en", num_beams=beams, forced_bos_token_id=de)
        assert all(row[1] == de for row in rows)
        code, out, err = run(capsys, monkeypatch, "translate", "--checkpoint", str(nllb_dir), "--backend",
                             "torch", "--beam", str(beams), "--src-lang", "en", "--tgt-lang", "de",
                             sentences=english)
        assert code == 0, err
        assert out == hf_text(nllb_dir, rows)


def test_evaluate_and_a_converted_checkpoint_equal_generate(nllb_dir, tmp_path, capsys, monkeypatch):
    """`evaluate DIR` decodes a Multi30k split as generate does; `convert DIR ours.safetensors` keeps
    the tokenizer (sentencepiece.bpe.model and all) in ours.tokenizer/, where translate finds it."""
    expected = hf_text(nllb_dir, hf_ids(nllb_dir, case_sentences(4)[:4], num_beams=1))
    hyps, report = tmp_path / "hyps.txt", tmp_path / "report.json"
    code = main(["evaluate", str(nllb_dir), "--split", "test_2016_flickr", "--limit", "4", "--beam", "1",
                 "--backend", "torch", "--out", str(report), "--hyps", str(hyps)])
    assert code == 0, capsys.readouterr().err
    assert hyps.read_text(encoding="utf-8").splitlines() == expected
    ours = tmp_path / "ours.safetensors"
    assert main(["convert", str(nllb_dir), str(ours)]) == 0
    for name in ("sentencepiece.bpe.model", "vocab.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "ours.tokenizer" / name).read_bytes() == (nllb_dir / name).read_bytes(), name
    capsys.readouterr()
    code, out, err = run(capsys, monkeypatch, "translate", "--checkpoint", str(ours), "--backend", "torch",
                         "--beam", "1", sentences=case_sentences(4)[:4])
    assert code == 0, err
    assert out == expected


def test_refusals_are_one_line(nllb_dir, tmp_path, capsys, monkeypatch):
    """An unknown language code, a missing sentencepiece.bpe.model, --tgt-lang without codes: exit 2,
    one line naming the flag or file, before any decoding."""
    code, out, err = run(capsys, monkeypatch, "translate", "--checkpoint", str(nllb_dir), "--tgt-lang", "xx")
    assert code == 2 and out == [] and len(err.splitlines()) == 1
    assert err.startswith("rosetta: error: --tgt-lang 'xx' is not a language code of ")
    code, _, err = run(capsys, monkeypatch, "translate", "--checkpoint", str(nllb_dir), "--src-lang",
                       "klingon")
    assert code == 2 and err.startswith("rosetta: error: --src-lang 'klingon' is not a language code")
    broken = tmp_path / "broken"
    shutil.copytree(nllb_dir, broken)
    (broken / "sentencepiece.bpe.model").unlink()
    code, out, err = run(capsys, monkeypatch, "translate", "--checkpoint", str(broken))
    assert code == 2 and out == [] and len(err.splitlines()) == 1
    assert err == (f"rosetta: error: {broken / 'sentencepiece.bpe.model'}: missing (M2M100's tokenizer needs "
                   f"sentencepiece.bpe.model and vocab.json)\n")
    code, _, err = run(capsys, monkeypatch, "evaluate", str(broken), "--out", str(tmp_path / "r.json"))
    assert code == 2 and "sentencepiece.bpe.model: missing" in err
    ckpt = tmp_path / "tiny.safetensors"  # a model without a tokenizer: lines are ids, no codes
    assert main(["init", "--preset", "tiny", "--out", str(ckpt)]) == 0
    code, _, err = run(capsys, monkeypatch, "translate", "--checkpoint", str(ckpt), "--tgt-lang", "en",
                       sentences=["5 6 7"])
    assert code == 2 and len(err.splitlines()) == 1
    assert "--tgt-lang: the tokenizer of" in err and "has no language codes" in err
