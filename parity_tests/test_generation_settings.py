"""generation_config.json checked once (rosetta.generation.check_generation_config) for every
command that reads it: each field Hugging Face's `generate` honours is honoured the same way
(the expected tokens are `MarianMTModel.generate`'s on the same directory, never rosetta's), or
named in a one-line note; a value `translate` refuses is refused by `convert` first (every --to,
nothing written), by `generate` and `evaluate`, with the same line (issue 39, item 4)."""

from __future__ import annotations

import io
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from rosetta.backends import available_backends
from rosetta.cli import main

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from parity_tests.test_interop_marian import CONFIGS, EOS, PAD, end_some_sentences, make_marian  # noqa: E402

VOCAB = 37  # make_marian's vocab_size: one vocabulary for both sides
LENGTHS = [7, 1, 5, 3, 6, 2]  # real tokens of each source sentence, eos follows
# What save_pretrained writes, and the pad ban opus-mt adds (our search never emits pad).
BASE = {"decoder_start_token_id": PAD, "eos_token_id": EOS, "pad_token_id": PAD, "bad_words_ids": [[PAD]]}


@pytest.fixture(scope="module")
def marian(tmp_path_factory):
    """A random Marian whose eos bias ends some sentences early and not others (they run to
    generate's default 20 tokens), saved without a generation_config.json; the sources."""
    rng = np.random.default_rng(7)
    src = [[*rng.integers(3, VOCAB, size=n).tolist(), EOS] for n in LENGTHS]
    model = make_marian(CONFIGS["shared-tied-swish-scaled"], seed=2)
    padded = np.array([row + [PAD] * (8 - len(row)) for row in src])
    end_some_sentences(model, padded, steps=24)
    path = tmp_path_factory.mktemp("marian") / "m"
    model.save_pretrained(path)
    (path / "generation_config.json").unlink()
    return path, src


def with_settings(marian, directory: Path, gen: dict) -> Path:
    """A copy of the Marian directory holding `gen` as its generation_config.json."""
    directory.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(marian[0] / name, directory / name)
    (directory / "generation_config.json").write_text(json.dumps(gen))
    return directory


def theirs(directory: Path, src: list[list[int]]) -> list[list[int]]:
    """`MarianMTModel.generate` on the directory (its generation_config.json, no keywords), one
    sentence a call: the tokens after the start token, cut at eos."""
    from transformers import MarianMTModel

    model = MarianMTModel.from_pretrained(directory).eval()
    out = []
    for row in src:
        with torch.no_grad():
            tokens = model.generate(torch.tensor([row]))[0, 1:].tolist()
        out.append(tokens[: tokens.index(EOS)] if EOS in tokens else tokens)
    return out


def run(capsys, monkeypatch, argv: list[str], src: list[list[int]] | None = None) -> tuple[int, str, str]:
    """`rosetta ARGV`, the sources as id lines on stdin (translate appends eos): exit code, stdout, stderr."""
    lines = "".join(" ".join(map(str, row[:-1])) + "\n" for row in src or [])
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def ours(capsys, monkeypatch, directory: Path, src: list[list[int]], backend: str = "numpy") -> list:
    argv = ["translate", "--checkpoint", str(directory), "--backend", backend]
    code, out, err = run(capsys, monkeypatch, argv, src)
    assert code == 0 and err == "", err  # honoured: no note
    return [[int(t) for t in line.split()] for line in out.splitlines()]


# -- each honoured field, as generate does it --------------------------------------------------

MOST = "MOST"  # stands for the token generate emits most without the setting
HONOURED = {  # case: (generation_config.json, whether its tokens differ from BASE's)
    "defaults (20 new tokens)": (BASE, False),
    "max_length": ({**BASE, "max_length": 7}, True),
    "max_new_tokens": ({**BASE, "max_new_tokens": 4}, True),
    "max_new_tokens over max_length": ({**BASE, "max_new_tokens": 4, "max_length": 12}, True),
    "num_beams, length_penalty 0.6": ({**BASE, "num_beams": 4, "length_penalty": 0.6}, True),
    "num_beams, renormalize_logits": ({**BASE, "num_beams": 3, "renormalize_logits": True}, True),
    "bad_words_ids": ({**BASE, "bad_words_ids": [[PAD], [MOST], [EOS]]}, True),
    "suppress_tokens": ({**BASE, "suppress_tokens": [MOST]}, True),
    "forced_eos_token_id": ({**BASE, "max_length": 7, "forced_eos_token_id": EOS}, True),
    "eos_token_id as a list": ({**BASE, "eos_token_id": [EOS]}, False),
    "decoder_start_token_id": ({**BASE, "decoder_start_token_id": 5}, True),
    "bos_token_id for a missing start": ({**{k: v for k, v in BASE.items() if k != "decoder_start_token_id"},
                                          "bos_token_id": 5}, True),
}


@pytest.fixture(scope="module")
def base_tokens(marian, tmp_path_factory):
    return theirs(with_settings(marian, tmp_path_factory.mktemp("base") / "m", BASE), marian[1])


@pytest.mark.parametrize("case", list(HONOURED))
def test_each_honoured_field_translates_as_generate(marian, base_tokens, case, tmp_path, capsys, monkeypatch):
    gen, changes = HONOURED[case]
    most = Counter(t for row in base_tokens for t in row).most_common(1)[0][0]
    gen = json.loads(json.dumps(gen).replace(f'"{MOST}"', str(most)))
    directory = with_settings(marian, tmp_path / "m", gen)
    expected = theirs(directory, marian[1])
    assert ours(capsys, monkeypatch, directory, marian[1]) == expected
    assert (expected != base_tokens) == changes  # the setting mattered (or is BASE's own)
    if case.startswith("defaults"):  # sentences that do not end run to generate's 20 tokens
        assert max(map(len, expected)) == 20


def test_the_settings_hold_in_every_backend(marian, tmp_path, capsys, monkeypatch):
    gen = {**BASE, "decoder_start_token_id": 5, "num_beams": 4, "length_penalty": 1.0, "max_new_tokens": 6,
           "renormalize_logits": True, "forced_eos_token_id": EOS, "bad_words_ids": [[PAD], [9]]}
    directory = with_settings(marian, tmp_path / "m", gen)
    expected = theirs(directory, marian[1])
    for backend in available_backends():  # numpy, torch, jax where installed
        assert ours(capsys, monkeypatch, directory, marian[1], backend) == expected, backend


# -- what the search does not do: one note each, at translate and at convert --------------------

NOTED = {
    "eos_token_id=[2, 9]: generate stops at 2, 9; rosetta's search stops at the model's eos (2) only":
        {**BASE, "eos_token_id": [EOS, 9]},
    "eos_token_id=9: generate stops at 9": {**BASE, "eos_token_id": 9},
    "eos_token_id is not set": {k: v for k, v in BASE.items() if k != "eos_token_id"},
    "neither decoder_start_token_id nor bos_token_id is set (generate refuses to start)":
        {k: v for k, v in BASE.items() if k != "decoder_start_token_id"},
    "forced_eos_token_id=9 is not the model's eos (2)": {**BASE, "forced_eos_token_id": 9},
    "suppress_tokens holds the model's eos (2)": {**BASE, "suppress_tokens": [EOS]},
    "bad_words_ids does not hold pad (0): generate may emit it": {**BASE, "bad_words_ids": [[7]]},
    "max_length allows 199 new tokens, more than the model's max_len (64)": {**BASE, "max_length": 200},
    f"max_length allows {10**30 - 1} new tokens": {**BASE, "max_length": 10**30},  # no int64 margin
    "do_sample=True is not part of rosetta's search; ignored": {**BASE, "do_sample": True, "top_k": 5},
    "early_stopping=True is not part of rosetta's search": {**BASE, "num_beams": 2, "early_stopping": True},
    "no_repeat_ngram_size=3 is not part of rosetta's search": {**BASE, "no_repeat_ngram_size": 3},
    "min_new_tokens=2 is not part of rosetta's search": {**BASE, "min_new_tokens": 2},
    "begin_suppress_tokens=[5] is not part of rosetta's search": {**BASE, "begin_suppress_tokens": [5]},
}


@pytest.mark.parametrize("note", list(NOTED))
def test_what_the_search_cannot_do_is_noted(marian, note, tmp_path, capsys, monkeypatch):
    directory = with_settings(marian, tmp_path / "m", NOTED[note])
    # --backend named: its absence is said on stderr too (rosetta/cli_args.py: decoding_backend)
    translate = ["translate", "--backend", "torch", "--checkpoint"]
    code, out, err = run(capsys, monkeypatch, [*translate, str(directory)], marian[1])
    line = f"rosetta: note: {directory / 'generation_config.json'}: "
    assert code == 0 and len(out.splitlines()) == len(marian[1])
    assert err.startswith(line) and err.count("\n") == 1 and note in err, err
    # convert says the same, and the note travels: translate of the conversion repeats it
    checkpoint = tmp_path / "x.safetensors"
    code, _, converted = run(capsys, monkeypatch, ["convert", str(directory), str(checkpoint)])
    assert code == 0 and converted == err
    code, _, again = run(capsys, monkeypatch, [*translate, str(checkpoint)], marian[1])
    assert code == 0 and again == err.replace(str(directory), str(tmp_path / "x.tokenizer"))


def test_every_field_of_generation_config_is_placed():
    """A field a later transformers adds to GenerationConfig fails here until it is honoured,
    noted or shown to change no token."""
    from transformers import GenerationConfig

    from rosetta.generation import HONOURED as FIELDS
    from rosetta.generation import SAMPLING, UNSUPPORTED, WITHOUT_EFFECT

    placed = set(FIELDS) | set(UNSUPPORTED) | SAMPLING | WITHOUT_EFFECT
    assert set(GenerationConfig().to_dict()) - placed == set()


# -- what translate refuses, every command refuses first, with the same line --------------------

TARGET = f"in [0, {VOCAB}) (the target vocabulary)"
BEAMS = (f"num_beams must be an integer >= 1 and <= {VOCAB} (the target vocabulary: each step scores "
         f"num_beams x vocabulary candidates), got ")
LENGTH = "max_length must be an integer >= 2 (it counts the decoder start token), got "
PENALTY = "length_penalty must be a number >= 0 and finite, got "
WORDS = "bad_words_ids must be a list of non-empty token id lists, got "
ID, IDS = f"must be a token id {TARGET}, got ", f"must be a token id {TARGET}, or a list of them, got "
REFUSED = [  # (field, value, the message after "FILE: ")
    ("num_beams", 0, BEAMS + "0"), ("num_beams", -1, BEAMS + "-1"), ("num_beams", "4", BEAMS + "'4'"),
    ("num_beams", 2.5, BEAMS + "2.5"), ("num_beams", True, BEAMS + "True"),
    ("num_beams", 1e9, BEAMS + "1000000000.0"), ("num_beams", 10**9, BEAMS + "1000000000"),
    ("max_length", 0, LENGTH + "0"), ("max_length", -1, LENGTH + "-1"), ("max_length", 1, LENGTH + "1"),
    ("max_length", "x", LENGTH + "'x'"),
    ("max_new_tokens", 0, "max_new_tokens must be an integer >= 1, got 0"),
    ("max_new_tokens", "4", "max_new_tokens must be an integer >= 1, got '4'"),
    ("length_penalty", 1e308, "length_penalty must be at most 5, got 1e+308"),
    ("length_penalty", "x", PENALTY + "'x'"), ("length_penalty", -1.0, PENALTY + "-1.0"),
    ("length_penalty", True, PENALTY + "True"),
    ("renormalize_logits", "yes", "renormalize_logits must be true or false, got 'yes'"),
    ("bad_words_ids", "x", WORDS + "'x'"), ("bad_words_ids", [5], WORDS + "[5]"),
    ("bad_words_ids", [[]], WORDS + "[[]]"),
    ("bad_words_ids", [["a"]], f"bad_words_ids entry ['a'] must be token ids {TARGET}, got ['a']"),
    ("bad_words_ids", [[VOCAB]], f"bad_words_ids entry [37] must be token ids {TARGET}, got [37]"),
    ("bad_words_ids", [[-1]], f"bad_words_ids entry [-1] must be token ids {TARGET}, got [-1]"),
    ("bad_words_ids", [[5, 6]], "bad_words_ids entry [5, 6]: rosetta's search bans single tokens only"),
    ("eos_token_id", "x", "eos_token_id " + IDS + "'x'"), ("eos_token_id", -1, "eos_token_id " + IDS + "-1"),
    ("eos_token_id", VOCAB, "eos_token_id " + IDS + "37"), ("eos_token_id", [], "eos_token_id " + IDS + "[]"),
    ("eos_token_id", [EOS, "x"], "eos_token_id " + IDS + "[2, 'x']"),
    ("eos_token_id", True, "eos_token_id " + IDS + "True"),
    ("forced_eos_token_id", 10**6, "forced_eos_token_id " + IDS + "1000000"),
    ("decoder_start_token_id", 10**6, "decoder_start_token_id " + ID + "1000000"),
    ("decoder_start_token_id", [PAD], "decoder_start_token_id " + ID + "[0]"),
    ("bos_token_id", -1, "bos_token_id " + ID + "-1"), ("pad_token_id", VOCAB, "pad_token_id " + ID + "37"),
    ("suppress_tokens", [VOCAB], "suppress_tokens " + IDS + "[37]"),
]


@pytest.mark.parametrize("field, value, message", REFUSED, ids=[f"{f}={v!r}" for f, v, _ in REFUSED])
def test_hostile_settings_are_refused_by_convert_and_translate(marian, field, value, message, tmp_path,
                                                              capsys, monkeypatch):
    directory = with_settings(marian, tmp_path / "m", {**BASE, field: value})
    line = f"rosetta: error: {directory / 'generation_config.json'}: {message}"
    for argv in (["convert", str(directory), str(tmp_path / "x.safetensors")],
                 ["convert", str(directory), str(tmp_path / "out"), "--to", "marian"],
                 ["translate", "--checkpoint", str(directory)]):
        code, out, err = run(capsys, monkeypatch, argv, marian[1])
        assert (code, out) == (2, "") and err.count("\n") == 1 and err.startswith(line), (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # nothing written


SIDECAR_CASES = [case for case in REFUSED if case[:2] in (("num_beams", 0), ("length_penalty", 1e308),
                                                          ("bad_words_ids", [[5, 6]]))]


@pytest.mark.parametrize("field, value, message", SIDECAR_CASES, ids=[f for f, _, _ in SIDECAR_CASES])
def test_a_hostile_sidecar_is_refused_by_every_command(marian, field, value, message, tmp_path, capsys,
                                                       monkeypatch):
    """A checkpoint file's NAME.tokenizer/generation_config.json: every export refuses it with the
    line translate, generate and evaluate print, writing nothing."""
    directory = with_settings(marian, tmp_path / "m", BASE)
    checkpoint = tmp_path / "x.safetensors"
    assert run(capsys, monkeypatch, ["convert", str(directory), str(checkpoint)])[0] == 0
    sidecar = tmp_path / "x.tokenizer" / "generation_config.json"
    sidecar.write_text(json.dumps({**BASE, field: value}))
    line = f"rosetta: error: {sidecar}: {message}"
    before = sorted(p.name for p in tmp_path.iterdir())
    for argv in (["convert", str(checkpoint), str(tmp_path / "out"), "--to", "marian"],
                 ["convert", str(checkpoint), str(tmp_path / "ct2"), "--to", "ctranslate2"],
                 ["convert", str(checkpoint), str(tmp_path / "y.safetensors")],
                 ["translate", "--checkpoint", str(checkpoint)],
                 ["generate", "--checkpoint", str(checkpoint)],
                 ["evaluate", str(checkpoint), "--out", str(tmp_path / "r.json")]):
        code, out, err = run(capsys, monkeypatch, argv, marian[1])
        assert (code, out) == (2, "") and err.count("\n") == 1 and err.startswith(line), (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# -- exports: what the written model does not carry is said -------------------------------------

def test_a_marian_export_without_a_tokenizer_is_noted(marian, tmp_path, capsys, monkeypatch):
    checkpoint = tmp_path / "x.safetensors"
    assert run(capsys, monkeypatch, ["convert", str(marian[0]), str(checkpoint)])[0] == 0
    argv = ["convert", str(checkpoint), str(tmp_path / "out"), "--to", "marian"]
    code, out, err = run(capsys, monkeypatch, argv)
    assert code == 0 and out.startswith("wrote ")
    assert err == (f"rosetta: note: {checkpoint}: no tokenizer goes with the model (a Marian directory's own "
                   f"files, a checkpoint file's NAME.tokenizer/ folder), so {tmp_path / 'out'} gets none; "
                   f"MarianTokenizer needs one, and `rosetta translate` its --tokenizer\n")


def test_the_ctranslate2_note_gives_translate_batch_the_settings():
    """CTranslate2 reads no generation_config.json; max_decoding_length counts generated tokens
    with eos and forces nothing, so generate's forced eos at max_length L is L - 2 (docs/ctranslate2.md)."""
    from rosetta import preset
    from rosetta.generation import check_generation_config
    from rosetta.interop.ctranslate2 import search_note

    cfg = preset("tiny", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, max_len=96)  # pad 0, bos 1, eos 2
    gen = {**BASE, "decoder_start_token_id": 1, "num_beams": 4, "max_length": 96, "forced_eos_token_id": EOS,
           "bad_words_ids": [[PAD], [7]]}
    assert search_note(check_generation_config(gen, cfg, "g.json"), cfg) == (
        "g.json: a CTranslate2 model holds no search settings: give translate_batch beam_size=4, "
        "length_penalty=1, max_decoding_length=94, suppress_sequences with the pieces of ids 7 "
        "(docs/ctranslate2.md)")
    gen.update(decoder_start_token_id=5, forced_eos_token_id=None)
    other = check_generation_config(gen, cfg, "")
    assert search_note(other, cfg).endswith(
        "max_decoding_length=95, suppress_sequences with the pieces of ids 7; its decoder_start_token_id 5 "
        "is not config.json's (1), and CTranslate2 starts from a zero vector (docs/ctranslate2.md)")
