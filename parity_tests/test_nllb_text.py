"""NLLB-200 directories as text (issue 58): a directory whose tokenizer is `tokenizer.json` +
`tokenizer_config.json` (NllbTokenizer), no vocab.json, read by rosetta/interop/nllb_tokenizer.py.

The directories are written by transformers' own code: NllbTokenizerFast built of the BPE that
transformers 5.24 converts from the nllb case's sentencepiece.bpe.model (parity_tests/nllb_case.py),
saved with save_pretrained (`<mask>` after the pieces, then the 202 codes); a second one laid out as
NLLB-200 on the Hub (the codes after the pieces, `<mask>` last, additional_special_tokens and a
special_tokens_map.json), read by transformers the same way. The model is the nllb case's trained
M2M100ForConditionalGeneration, its embedding resized by transformers and the `deu_Latn` and
`eng_Latn` rows copied from its `__de__` and `__en__` rows, so that it translates. Every expected
id and string comes from transformers (NllbTokenizerFast, generate), none from rosetta.
"""

from __future__ import annotations

import base64
import io
import json
import re
import shutil

import numpy as np
import pytest

from parity_tests.nllb_case import case_sentences
from rosetta import json_input
from rosetta.cli import main

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SENTENCES = case_sentences() + ["Ein Hund eng_Latn bellt </s> laut <mask>."]
# Text the tokenizers must agree on: empty, runs of spaces, NFKC's forms (the precompiled charsmap),
# added tokens' strings (matched whole), an unknown character.
EDGES = ["", "  Zwei  Leerzeichen  ", "ＡＢＣ ﬁ Ärger", "deu_Latn", "<s> <pad> </s> <unk>", "x<mask>y <mask>",
         "☃ ☃"]
EXTRA_ROWS = 2  # NLLB-200's embedding has 2 rows more than its tokenizer's ids (256206 vs 256204)


def _build(nllb_dir, out, hub_layout: bool) -> None:
    import torch
    from transformers import M2M100ForConditionalGeneration, M2M100Tokenizer, NllbTokenizerFast

    spm_only = out.parent / f"{out.name}-spm"
    spm_only.mkdir()
    shutil.copy(nllb_dir / "sentencepiece.bpe.model", spm_only)
    # transformers' own conversion of the SentencePiece model (5.24 drops the codes on this path: the
    # vocabulary, merges and charsmap are taken from it, the tokenizer made anew with the codes).
    converted = json.loads(NllbTokenizerFast.from_pretrained(spm_only).backend_tokenizer.to_str())
    charsmap = base64.b64decode(converted["normalizer"]["normalizers"][0]["precompiled_charsmap"])
    tokenizer = NllbTokenizerFast(vocab=converted["model"]["vocab"], _spm_precompiled_charsmap=charsmap,
                                  merges=[tuple(m) for m in converted["model"]["merges"]],
                                  src_lang="deu_Latn", tgt_lang="eng_Latn")
    tokenizer.save_pretrained(out)
    if hub_layout:
        _hub_layout(out)
        tokenizer = NllbTokenizerFast.from_pretrained(out)
    m2m = M2M100Tokenizer.from_pretrained(nllb_dir)
    model = M2M100ForConditionalGeneration.from_pretrained(nllb_dir)
    old = model.get_input_embeddings().weight.detach().clone()
    torch.manual_seed(0)  # resize draws the new rows
    model.resize_token_embeddings(len(tokenizer) + EXTRA_ROWS)
    with torch.no_grad():
        for code, m2m_code in (("deu_Latn", "de"), ("eng_Latn", "en")):
            row = tokenizer.convert_tokens_to_ids(code)
            model.get_input_embeddings().weight[row] = old[m2m.get_lang_id(m2m_code)]
    model.save_pretrained(out)
    generation = json.loads((nllb_dir / "generation_config.json").read_text())
    generation["forced_bos_token_id"] = tokenizer.convert_tokens_to_ids("eng_Latn")
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


def _hub_layout(out) -> None:
    """facebook/nllb-200's layout: the four, the pieces, the codes in FAIRSEQ order, `<mask>` last;
    tokenizer_config.json naming the codes as additional_special_tokens; a special_tokens_map.json."""
    path = out / "tokenizer.json"
    data = json.loads(path.read_text())
    config = json.loads((out / "tokenizer_config.json").read_text())
    codes = config.pop("extra_special_tokens")
    first = len(data["model"]["vocab"])
    mask = next(t for t in data["added_tokens"] if t["content"] == "<mask>")
    entry = {k: v for k, v in next(t for t in data["added_tokens"] if t["content"] == codes[0]).items()}
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < first] + [
        {**entry, "id": first + i, "content": code} for i, code in enumerate(codes)] + [
        {**mask, "id": first + len(codes)}]
    path.write_text(json.dumps(data, ensure_ascii=False))
    config.update(additional_special_tokens=codes, src_lang="eng_Latn", tgt_lang=None)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"additional_special_tokens": codes, "bos_token": "<s>", "cls_token": "<s>", "eos_token": "</s>",
         "mask_token": {"content": "<mask>", "lstrip": True, "normalized": True, "rstrip": False,
                        "single_word": False},
         "pad_token": "<pad>", "sep_token": "</s>", "unk_token": "<unk>"}))


@pytest.fixture(scope="module")
def nllb200_dirs(nllb_dir, tmp_path_factory):
    """{"saved": save_pretrained's layout, "hub": NLLB-200's on the Hub}. Read-only."""
    base = tmp_path_factory.mktemp("nllb200")
    dirs = {"saved": base / "saved", "hub": base / "hub"}
    for name, out in dirs.items():
        _build(nllb_dir, out, hub_layout=name == "hub")
    return dirs


@pytest.fixture(scope="module")
def nllb200_dir(nllb200_dirs):
    return nllb200_dirs["saved"]


def hf_rows(directory, sentences, src_lang="deu_Latn", **generate) -> list[list[int]]:
    """generate's output rows (the directory's generation_config.json, then `generate`)."""
    import torch
    from transformers import M2M100ForConditionalGeneration, NllbTokenizerFast

    tokenizer = NllbTokenizerFast.from_pretrained(directory, src_lang=src_lang)
    model = M2M100ForConditionalGeneration.from_pretrained(directory).eval()
    with torch.no_grad():
        return model.generate(**tokenizer(sentences, return_tensors="pt", padding=True), **generate).tolist()


def hf_text(directory, rows) -> list[str]:
    from transformers import NllbTokenizerFast

    return NllbTokenizerFast.from_pretrained(directory).batch_decode(rows, skip_special_tokens=True)


def code_id(directory, code: str) -> int:
    from transformers import NllbTokenizerFast

    return NllbTokenizerFast.from_pretrained(directory).convert_tokens_to_ids(code)


def run(capsys, monkeypatch, *args, sentences=SENTENCES) -> tuple[int, list[str], str]:
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(s + "\n" for s in sentences)))
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


@pytest.mark.parametrize("layout", ["saved", "hub", "legacy"])
def test_tokenizer_is_nllb_tokenizer_fast(nllb200_dirs, layout, tmp_path):
    """encode_source/encode_target = NllbTokenizerFast's input_ids for two languages each way, with
    legacy_behaviour too (pieces </s> code); decode = its decode(skip_special_tokens=True) over every
    id of the embedding and past it."""
    from transformers import NllbTokenizerFast

    from rosetta.interop.m2m100_tokenizer import find_text_tokenizer
    from rosetta.interop.nllb_tokenizer import NllbTextTokenizer

    directory = nllb200_dirs["hub" if layout == "hub" else "saved"]
    if layout == "legacy":
        directory = shutil.copytree(directory, tmp_path / "legacy")
        config = json.loads((directory / "tokenizer_config.json").read_text())
        (directory / "tokenizer_config.json").write_text(json.dumps({**config, "legacy_behaviour": True}))
    ours = find_text_tokenizer(directory)
    assert isinstance(ours, NllbTextTokenizer) and not (directory / "vocab.json").exists()
    for src, tgt in (("deu_Latn", "eng_Latn"), ("eng_Latn", "fra_Latn")):
        theirs = NllbTokenizerFast.from_pretrained(directory, src_lang=src, tgt_lang=tgt)
        ours.src_lang, ours.tgt_lang = src, tgt
        for text in SENTENCES + EDGES:
            assert ours.encode_source(text) == theirs(text).input_ids, text
            assert ours.encode_target(text) == theirs(text_target=text).input_ids, text
    assert ours.src_vocab_size == len(theirs)
    assert ours.lang_id("eng_Latn") == theirs.convert_tokens_to_ids("eng_Latn")
    rng = np.random.default_rng(0)
    for _ in range(40):
        ids = rng.integers(0, len(theirs) + EXTRA_ROWS, size=14).tolist()
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), ids


def test_the_hub_layout_numbers_codes_before_mask(nllb200_dirs):
    """The two layouts differ where NLLB-200's does: <mask> after the codes, not before them."""
    from transformers import NllbTokenizerFast

    saved, hub = (NllbTokenizerFast.from_pretrained(nllb200_dirs[k]) for k in ("saved", "hub"))
    first = saved.convert_tokens_to_ids("ace_Arab") - 1
    assert saved.convert_tokens_to_ids("<mask>") == first
    assert hub.convert_tokens_to_ids(["ace_Arab", "zul_Latn", "<mask>"]) == [first, first + 201, first + 202]


@pytest.mark.parametrize("backend, beams", [("torch", 1), ("torch", 4), ("numpy", 4)])
def test_translate_equals_generate(nllb200_dir, backend, beams, capsys, monkeypatch):
    """`translate --checkpoint DIR --src-lang deu_Latn --tgt-lang eng_Latn` = generate with
    forced_bos_token_id = eng_Latn, greedy and beam 4, token for token and as text."""
    eng = code_id(nllb200_dir, "eng_Latn")
    rows = hf_rows(nllb200_dir, SENTENCES, num_beams=beams, forced_bos_token_id=eng)
    assert all(row[:2] == [2, eng] for row in rows)  # decoder start </s>, then the forced code
    code, out, err = run(capsys, monkeypatch, "translate", "--checkpoint", str(nllb200_dir), "--backend",
                         backend, "--beam", str(beams), "--src-lang", "deu_Latn", "--tgt-lang", "eng_Latn")
    assert code == 0, err
    assert out == hf_text(nllb200_dir, rows)
    assert any(line.strip() for line in out)


def test_english_to_german_and_the_hub_layout(nllb200_dirs, capsys, monkeypatch):
    """The other direction on the Hub layout (its src_lang eng_Latn by default, deu_Latn forced by
    --tgt-lang); without flags, generation_config.json's forced_bos_token_id (eng_Latn) and the config's
    src_lang apply."""
    hub = nllb200_dirs["hub"]
    english = ["A man in a red shirt.", "Two dogs play in the snow.", "A woman is singing."]
    deu = code_id(hub, "deu_Latn")
    rows = hf_rows(hub, english, src_lang="eng_Latn", num_beams=1, forced_bos_token_id=deu)
    code, out, err = run(capsys, monkeypatch, "translate", "--checkpoint", str(hub), "--backend", "torch",
                         "--beam", "1", "--tgt-lang", "deu_Latn", sentences=english)
    assert code == 0, err
    assert out == hf_text(hub, rows)
    saved = nllb200_dirs["saved"]
    rows = hf_rows(saved, SENTENCES[:3], num_beams=1)  # the directory's src_lang deu_Latn, forced eng_Latn
    code, out, err = run(capsys, monkeypatch, "translate", "--checkpoint", str(saved), "--backend", "torch",
                         "--beam", "1", sentences=SENTENCES[:3])
    assert code == 0, err
    assert out == hf_text(saved, rows)


def test_evaluate_and_a_converted_checkpoint_equal_generate(nllb200_dir, tmp_path, capsys, monkeypatch):
    """`evaluate DIR` decodes Multi30k as generate does; `convert DIR x.safetensors` carries
    tokenizer.json and its config to x.tokenizer/, where translate reads them."""
    sentences = case_sentences(4)[:4]
    expected = hf_text(nllb200_dir, hf_rows(nllb200_dir, sentences, num_beams=1))
    hyps = tmp_path / "hyps.txt"
    code = main(["evaluate", str(nllb200_dir), "--split", "test_2016_flickr", "--limit", "4", "--beam", "1",
                 "--backend", "torch", "--out", str(tmp_path / "report.json"), "--hyps", str(hyps)])
    assert code == 0, capsys.readouterr().err
    assert hyps.read_text(encoding="utf-8").splitlines() == expected
    ours = tmp_path / "ours.safetensors"
    assert main(["convert", str(nllb200_dir), str(ours)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "ours.tokenizer" / name).read_bytes() == (nllb200_dir / name).read_bytes(), name
    capsys.readouterr()
    code, out, err = run(capsys, monkeypatch, "translate", "--checkpoint", str(ours), "--backend", "torch",
                         "--beam", "1", sentences=sentences)
    assert code == 0, err
    assert out == expected


def test_a_converted_checkpoint_keeps_the_special_tokens_map(nllb200_dirs, tmp_path):
    """`convert DIR x.safetensors` on the Hub layout carries special_tokens_map.json to x.tokenizer/
    byte for byte (an older download lists its codes there only), and the tokenizer read from the
    sidecar gives the directory's ids."""
    from rosetta.interop.nllb_tokenizer import NllbTextTokenizer

    hub, ours = nllb200_dirs["hub"], tmp_path / "hub.safetensors"
    assert main(["convert", str(hub), str(ours)]) == 0
    sidecar = tmp_path / "hub.tokenizer"
    name = "special_tokens_map.json"
    assert (sidecar / name).read_bytes() == (hub / name).read_bytes()
    sentence = "Ein Hund läuft. </s> eng_Latn"
    ids = NllbTextTokenizer(hub).encode_source(sentence)
    assert NllbTextTokenizer(sidecar).encode_source(sentence) == ids


@pytest.mark.parametrize("forced", ["eng_Latn", "deu_Latn"])
def test_diff_translates_its_input_with_the_code_forced(nllb200_dir, forced, tmp_path, capsys):
    """`rosetta diff DIR@transformers DIR --src TEXT`: the decoder input is the start token, then the
    greedy translation with generation_config.json's forced_bos_token_id first: generate's own row
    without its eos (no decoder input)."""
    directory = shutil.copytree(nllb200_dir, tmp_path / forced)
    generation = json.loads((directory / "generation_config.json").read_text())
    generation["forced_bos_token_id"] = code_id(directory, forced)
    (directory / "generation_config.json").write_text(json.dumps(generation))
    sentence = SENTENCES[0]
    row = hf_rows(directory, [sentence], num_beams=1)[0]
    assert row[1] == code_id(directory, forced) and row[-1] == 2
    code = main(["diff", f"{directory}@transformers", str(directory), "--src", sentence])
    out = capsys.readouterr().out
    assert code == 0, out
    shown = re.search(r"decoder input ids (\[[0-9, ]*\])", out.splitlines()[0])
    assert json.loads(shown[1]) == row[:-1]
    assert "no difference at any stage" in out


def test_refusals_are_one_line(nllb200_dir, tmp_path, capsys, monkeypatch):
    """An unknown code (either flag, or the config's src_lang), a missing, corrupt, oversized or
    renumbered tokenizer.json: exit 2 and one line naming the flag or the file, before decoding."""
    for flag, value in (("--tgt-lang", "xx"), ("--src-lang", "__de__"), ("--tgt-lang", "<mask>")):
        code, out, err = run(capsys, monkeypatch, "translate", "--checkpoint", str(nllb200_dir), flag, value)
        assert code == 2 and out == [] and len(err.splitlines()) == 1, err
        assert err.startswith(f"rosetta: error: {flag} {value!r} is not a language code of {nllb200_dir} "
                              f"(202 codes: eng_Latn, deu_Latn, fra_Latn, ...)"), err

    def broken(name: str, change) -> tuple[str, str]:
        copy = shutil.copytree(nllb200_dir, tmp_path / name)
        change(copy)
        code, out, err = run(capsys, monkeypatch, "translate", "--checkpoint", str(copy))
        assert code == 2 and out == [] and len(err.splitlines()) == 1, err
        return str(copy), err

    where, err = broken("missing", lambda d: (d / "tokenizer.json").unlink())
    assert err == (f"rosetta: error: {where}/tokenizer.json: missing (NllbTokenizer reads NLLB-200's ids "
                   f"from its tokenizer.json, as transformers 5.24 does)\n")
    where, err = broken("cut", lambda d: (d / "tokenizer.json").write_bytes(
        (d / "tokenizer.json").read_bytes()[:5000]))
    assert err.startswith(f"rosetta: error: {where}/tokenizer.json: not valid JSON: ")
    where, err = broken("merges", lambda d: _edit(d / "tokenizer.json",
                                                  lambda j: j["model"]["merges"].append(7)))
    assert err.startswith(f"rosetta: error: {where}/tokenizer.json: model.merges[") and "two pieces" in err

    def renumber(data):  # <mask> (after the pieces) moved far out: transformers closes the gap it leaves
        next(t for t in data["added_tokens"] if t["content"] == "<mask>")["id"] = 5000
    where, err = broken("renumbered", lambda d: _edit(d / "tokenizer.json", renumber))
    from transformers import NllbTokenizerFast

    first = NllbTokenizerFast.from_pretrained(nllb200_dir).convert_tokens_to_ids("ace_Arab")
    assert NllbTokenizerFast.from_pretrained(where).convert_tokens_to_ids("ace_Arab") == first - 1
    assert err.startswith(f"rosetta: error: {where}/tokenizer.json: added token 'ace_Arab' has id {first}, "
                          f"but transformers 5.24 numbers it {first - 1} ")
    where, err = broken("src_lang", lambda d: _edit(d / "tokenizer_config.json",
                                                    lambda c: c.update(src_lang="klingon")))
    assert err.startswith(f"rosetta: error: {where}/tokenizer_config.json: src_lang 'klingon' is not a "
                          f"language code")
    size = (nllb200_dir / "tokenizer.json").stat().st_size
    monkeypatch.setattr(json_input, "DEFAULT_LIMIT", size - 1)
    code, out, err = run(capsys, monkeypatch, "translate", "--checkpoint", str(nllb200_dir))
    assert code == 2 and out == [] and len(err.splitlines()) == 1
    assert err == (f"rosetta: error: {nllb200_dir}/tokenizer.json: {size:,} bytes, more than a tokenizer "
                   f"file may hold ({size - 1:,})\n")


@pytest.fixture(scope="module")
def nllb200_ct2(nllb200_dirs, tmp_path_factory):
    """{"saved": the saved layout exported `--to ctranslate2` straight from its directory, "hub": the Hub
    layout through `ours.safetensors` (its tokenizer files in the ours.tokenizer/ sidecar)}."""
    pytest.importorskip("ctranslate2")
    root = tmp_path_factory.mktemp("nllb200-ct2")
    assert main(["convert", str(nllb200_dirs["saved"]), str(root / "saved"), "--to", "ctranslate2"]) == 0
    assert main(["convert", str(nllb200_dirs["hub"]), str(root / "hub.safetensors")]) == 0
    assert main(["convert", str(root / "hub.safetensors"), str(root / "hub"), "--to", "ctranslate2"]) == 0
    return {"saved": root / "saved", "hub": root / "hub"}


@pytest.mark.parametrize("layout", ["saved", "hub"])
@pytest.mark.parametrize("beam", [1, 4])
def test_ctranslate2_export_translates_as_rosetta_translate(nllb200_dirs, nllb200_ct2, layout, beam, capsys,
                                                            monkeypatch):
    """`convert DIR OUT --to ctranslate2` goes through CTranslate2's TransformersConverter (its
    M2M100Loader, NllbTokenizer's vocabulary): the vocabulary is NllbTokenizerFast's tokens by id, then
    madeup words for the embedding's extra rows; `ctranslate2.Translator` on NllbTokenizerFast's source
    pieces with target_prefix eng_Latn gives what `rosetta translate --src-lang deu_Latn --tgt-lang
    eng_Latn` prints, greedy and beam 4, on both layouts (the Hub's through a checkpoint file)."""
    import ctranslate2
    from transformers import NllbTokenizerFast

    directory, ct2 = nllb200_dirs[layout], nllb200_ct2[layout]
    theirs = NllbTokenizerFast.from_pretrained(directory, src_lang="deu_Latn")
    vocab = json.loads((ct2 / "shared_vocabulary.json").read_text(encoding="utf-8"))
    assert vocab[:len(theirs)] == theirs.convert_ids_to_tokens(list(range(len(theirs))))
    assert vocab[len(theirs):] == [f"madeupword{i}" for i in range(EXTRA_ROWS)]
    assert json.loads((ct2 / "config.json").read_text())["decoder_start_token"] == "</s>"
    code, ours, err = run(capsys, monkeypatch, "translate", "--checkpoint", str(directory), "--backend",
                          "torch", "--beam", str(beam), "--src-lang", "deu_Latn", "--tgt-lang", "eng_Latn")
    assert code == 0, err
    generation = json.loads((directory / "generation_config.json").read_text())
    pieces = [theirs.convert_ids_to_tokens(theirs(s).input_ids) for s in SENTENCES]
    banned = [[vocab[i] for i in ids] for ids in generation["bad_words_ids"]]  # <pad>
    # One thread: CTranslate2's default pool keeps spinning and slows the rest of the process.
    translator = ctranslate2.Translator(str(ct2), device="cpu", intra_threads=1)
    # generate's max_length counts the decoder start token; CTranslate2's limit counts the prefix and eos.
    results = translator.translate_batch(pieces, beam_size=beam, length_penalty=1.0,
                                         max_decoding_length=generation["max_length"] - 1,
                                         target_prefix=[["eng_Latn"]] * len(pieces),
                                         suppress_sequences=banned)
    assert all(r.hypotheses[0][0] == "eng_Latn" for r in results)
    rows = [theirs.convert_tokens_to_ids(r.hypotheses[0]) for r in results]
    assert theirs.batch_decode(rows, skip_special_tokens=True) == ours
    assert any(line.strip() for line in ours)


def test_ctranslate2_places_are_the_tokenizers_ids(nllb200_dir, tmp_path):
    """The export's check on the converted vocabulary: NllbTokenizerFast's tokens by id, then madeup
    words, pass; a vocabulary with two tokens swapped, or one cut short, is refused in one line naming
    the first place that is not our id's token (CTranslate2 numbers tokens by place)."""
    from transformers import NllbTokenizerFast

    from rosetta.errors import CheckpointError
    from rosetta.interop.ctranslate2 import _check_places
    from rosetta.interop.nllb_tokenizer import NllbTextTokenizer

    theirs = NllbTokenizerFast.from_pretrained(nllb200_dir)
    vocabulary = theirs.convert_ids_to_tokens(list(range(len(theirs)))) + ["madeupword0", "madeupword1"]
    ours = NllbTextTokenizer(nllb200_dir)
    _check_places(vocabulary, ours, tmp_path)
    code = theirs.convert_tokens_to_ids("deu_Latn")
    swapped = [*vocabulary[:code], vocabulary[code + 1], vocabulary[code], *vocabulary[code + 2:]]
    cut = vocabulary[:len(theirs) - 3]
    for changed, place, placed in ((swapped, code, vocabulary[code + 1]), (cut, len(theirs) - 3, None)):
        with pytest.raises(CheckpointError) as e:
            _check_places(changed, ours, tmp_path)
        assert str(e.value) == (f"{tmp_path}: CTranslate2's vocabulary has {placed!r} at place {place}, "
                                f"where {nllb200_dir}/tokenizer.json has {vocabulary[place]!r}: CTranslate2 "
                                f"numbers tokens by their place, so the export would read other tokens")


def test_the_ctranslate2_note_names_the_target_prefix(nllb200_dir):
    """`convert --to ctranslate2`'s note on generation_config.json (a CTranslate2 model holds no search
    settings) names forced_bos_token_id, eng_Latn's id, as what goes in target_prefix."""
    from rosetta.interop.ctranslate2 import search_note
    from rosetta.interop.m2m100 import config_from_m2m100
    from rosetta.interop.marian_files import read_generation_settings

    cfg = config_from_m2m100(json.loads((nllb200_dir / "config.json").read_text()))
    note = search_note(read_generation_settings(nllb200_dir, cfg), cfg)
    assert f", target_prefix with the piece of id {code_id(nllb200_dir, 'eng_Latn')}" in note, note


def _edit(path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
