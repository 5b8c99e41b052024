"""`rosetta convert CK OUT --to ctranslate2` (rosetta/interop/ctranslate2.py, docs/ctranslate2.md):
the export goes through CTranslate2's own converter, and `ctranslate2.Translator` then translates
exactly as Hugging Face's `MarianMTModel.generate` does; what CTranslate2 would get wrong is
refused by name, before anything is written.

The model is the opus-mt case (parity_tests/opus_mt_case.py), whose `<pad>` row (the decoder
start) is zero, as real opus-mt models hold it: Hugging Face's Marian conversion appends a zero
row for `<pad>`, and CTranslate2 starts the decoder from a zero vector.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ctranslate2 = pytest.importorskip("ctranslate2", reason="the export runs CTranslate2's converter")
torch = pytest.importorskip("torch", reason="CTranslate2's converter loads the export with torch")
transformers = pytest.importorskip("transformers", reason="the reference is Hugging Face's MarianMTModel")
pytest.importorskip("sentencepiece", reason="the opus-mt case's tokenizer is SentencePiece")

from parity_tests.opus_mt_case import (  # noqa: E402
    EXTRA_SENTENCES,
    MAX_POSITIONS,
    case_sentences,  # noqa: E402
)
from rosetta.checkpoint import save_checkpoint  # noqa: E402
from rosetta.cli import main  # noqa: E402
from rosetta.interop.convert import read_model  # noqa: E402
from rosetta.interop.marian_files import sidecar  # noqa: E402

# MarianTokenizer's advice, about a preprocessing step opus-mt's tokenizer does not take
pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")
SENTENCES = case_sentences() + EXTRA_SENTENCES
# The case's generation_config.json: max_length 96 counts the decoder start, and eos is forced in
# the last place, so Hugging Face emits at most 94 free tokens; CTranslate2's max_decoding_length
# counts the tokens it generates, eos included, and forces nothing: 94 gives the same strings
# (test_length_limits_match shows it where the limit is reached).
MAX_DECODING_LENGTH = MAX_POSITIONS - 2


def cli(*argv: object) -> int:
    return main([str(a) for a in argv])


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The one line a refusal prints."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rosetta: error: "), err
    return err


def leftovers(folder: Path) -> list[str]:
    """Temporary folders of an export beside its output (`.NAME.XXXX.tmp`)."""
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


def save_with_tokenizer(path: Path, cfg, params, tokenizer: Path) -> Path:
    """A checkpoint file with its tokenizer folder beside it, as `rosetta convert` writes one."""
    save_checkpoint(path, cfg, params)
    shutil.copytree(tokenizer, sidecar(path))
    return path


def hf_translate(directory: Path, sentences: list[str], **kwargs) -> tuple[list[str], int]:
    """Hugging Face's search on `directory` (its generation_config.json, overridden by kwargs):
    the strings, and the length of the longest output (the start token counted)."""
    tok = transformers.MarianTokenizer.from_pretrained(directory)
    model = transformers.MarianMTModel.from_pretrained(directory).eval()
    with torch.no_grad():
        out = model.generate(**tok(sentences, padding=True, return_tensors="pt"), **kwargs)
    return tok.batch_decode(out, skip_special_tokens=True), out.shape[1]


def ct2_translate(model_dir: Path, tokenizer_dir: Path, sentences: list[str], **kwargs) -> list[str]:
    """CTranslate2's search, fed as its docs show for opus-mt: the pieces of the tokenizer's ids
    (`</s>` included), the output pieces decoded by the same tokenizer. max_decoding_length: the
    case's limit unless given."""
    tok = transformers.MarianTokenizer.from_pretrained(tokenizer_dir)
    translator = ctranslate2.Translator(str(model_dir), device="cpu", intra_threads=1)
    pieces = [tok.convert_ids_to_tokens(tok(s).input_ids) for s in sentences]
    results = translator.translate_batch(pieces, **{"max_decoding_length": MAX_DECODING_LENGTH, **kwargs})
    return [tok.decode(tok.convert_tokens_to_ids(r.hypotheses[0]), skip_special_tokens=True) for r in results]


@pytest.fixture(scope="module")
def case(opus_mt_dir, tmp_path_factory) -> SimpleNamespace:
    """DIR (the case) -> ours.safetensors (+ ours.tokenizer/) -> ct2/, by the CLI."""
    base = tmp_path_factory.mktemp("ct2")
    hf_dir = opus_mt_dir
    assert cli("convert", hf_dir, base / "ours.safetensors") == 0
    assert cli("convert", base / "ours.safetensors", base / "ct2", "--to", "ctranslate2") == 0
    cfg, params = read_model(base / "ours.safetensors")
    return SimpleNamespace(base=base, hf_dir=hf_dir, ours=base / "ours.safetensors", ct2=base / "ct2",
                           tokenizer=sidecar(base / "ours.safetensors"), cfg=cfg, params=params)


def test_export_holds_the_vocabulary_without_the_added_pad(case):
    vocab = json.loads((case.hf_dir / "vocab.json").read_text(encoding="utf-8"))
    shared = json.loads((case.ct2 / "shared_vocabulary.json").read_text(encoding="utf-8"))
    assert shared == sorted(vocab, key=vocab.get)[:-1] and "<pad>" not in shared
    assert sorted(p.name for p in case.ct2.iterdir()) == ["config.json", "model.bin",
                                                          "shared_vocabulary.json"]
    assert leftovers(case.base) == []


def test_greedy_translations_are_transformers(case):
    hf, longest = hf_translate(case.hf_dir, SENTENCES, num_beams=1)
    assert all(hf)  # some run to max_length (the case's loops): the limits must agree too
    assert ct2_translate(case.ct2, case.hf_dir, SENTENCES, beam_size=1) == hf


def test_beam_translations_are_transformers_with_its_stopping_rule(case):
    # Both divide a finished hypothesis' log-probability by length ** 1 (eos counted) and neither
    # can emit <pad> (CTranslate2 dropped its row; Hugging Face bans it and renormalize_logits
    # renormalizes without it). They stop by different rules unless told: CTranslate2 once
    # beam_size x patience (1) hypotheses have finished, which is Hugging Face's
    # early_stopping=True; the case's generation_config.json (as opus-mt's) leaves it False, where
    # Hugging Face searches on while an open beam could still win and some strings come out longer.
    hf, _ = hf_translate(case.hf_dir, SENTENCES, num_beams=4, early_stopping=True)
    assert ct2_translate(case.ct2, case.hf_dir, SENTENCES, beam_size=4, length_penalty=1.0, patience=1) == hf


def test_length_limits_match(case):
    # Hugging Face's max_length 10 (start token + 8 free tokens + forced eos) is CTranslate2's 8.
    hf, longest = hf_translate(case.hf_dir, SENTENCES, num_beams=1, max_length=10)
    assert longest == 10  # some sentences reach the limit
    assert ct2_translate(case.ct2, case.hf_dir, SENTENCES, beam_size=1, max_decoding_length=8) == hf


def test_separate_tables_over_one_vocabulary_convert(case):
    # CTranslate2's loader copies the encoder table, the decoder table and lm_head one by one:
    # unshared tables are fine while the vocabulary is one.
    rng = np.random.default_rng(0)
    table, bos = case.params["shared_embed.embedding"], case.cfg.bos_id

    def nudged() -> np.ndarray:
        return (table + 0.05 * rng.standard_normal(table.shape)).astype(table.dtype)

    params = {k: v for k, v in case.params.items() if k != "shared_embed.embedding"}
    params.update({"src_embed.embedding": nudged(), "tgt_embed.embedding": nudged(),
                   "generator.kernel": nudged().T.copy()})
    params["tgt_embed.embedding"][bos] = 0
    ours = save_with_tokenizer(case.base / "none.safetensors", case.cfg.replace(share_embeddings="none"),
                               params, case.tokenizer)
    assert cli("convert", ours, case.base / "none-hf") == 0
    assert cli("convert", ours, case.base / "none-ct2", "--to", "ctranslate2") == 0
    hf, _ = hf_translate(case.base / "none-hf", SENTENCES, num_beams=1)
    assert ct2_translate(case.base / "none-ct2", case.hf_dir, SENTENCES, beam_size=1) == hf


# -- refusals: one line naming the field, nothing written -------------------------------------

def test_separate_vocabularies_are_refused(opus_mt_separate_dir, tmp_path, capsys):
    assert cli("convert", opus_mt_separate_dir, tmp_path / "ct2", "--to", "ctranslate2") == 2
    assert "tokenizer_config.json: separate_vocabs is true" in error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_a_start_row_that_is_not_zero_is_refused(case, tmp_path, capsys):
    params = dict(case.params)
    table = params["shared_embed.embedding"] = case.params["shared_embed.embedding"].copy()
    table[case.cfg.bos_id, 3] = 0.01
    ours = save_with_tokenizer(tmp_path / "start.safetensors", case.cfg, params, case.tokenizer)
    assert cli("convert", ours, tmp_path / "ct2", "--to", "ctranslate2") == 2
    line = error_line(capsys)
    assert f"bos_id={case.cfg.bos_id}" in line and "start_from_zero_embedding" in line
    assert not (tmp_path / "ct2").exists() and leftovers(tmp_path) == []


def test_pad_that_is_not_the_last_id_is_refused(case, tmp_path, capsys):
    # The same model with <pad> and id 2 swapped (rows, bias entries and vocab.json alike).
    pad, other = case.cfg.pad_id, 2
    order = np.arange(case.cfg.src_vocab_size)
    order[[pad, other]] = order[[other, pad]]
    params = dict(case.params, **{"shared_embed.embedding": case.params["shared_embed.embedding"][order],
                                  "generator.bias": case.params["generator.bias"][order]})
    tokenizer = shutil.copytree(case.tokenizer, tmp_path / "tokenizer")
    vocab = json.loads((tokenizer / "vocab.json").read_text(encoding="utf-8"))
    swap = {pad: other, other: pad}
    vocab = {piece: swap.get(i, i) for piece, i in vocab.items()}
    (tokenizer / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    cfg = case.cfg.replace(pad_id=other, bos_id=other)
    ours = save_with_tokenizer(tmp_path / "swapped.safetensors", cfg, params, tokenizer)
    assert cli("convert", ours, tmp_path / "ct2", "--to", "ctranslate2") == 2
    assert "pad_id=2 is not the last id of the vocabulary" in error_line(capsys)
    assert not (tmp_path / "ct2").exists()


def test_a_model_without_its_tokenizer_is_refused(case, tmp_path, capsys):
    save_checkpoint(tmp_path / "bare.safetensors", case.cfg, case.params)
    assert cli("convert", tmp_path / "bare.safetensors", tmp_path / "ct2", "--to", "ctranslate2") == 2
    assert "--to ctranslate2 needs the model's tokenizer" in error_line(capsys)
    assert not (tmp_path / "ct2").exists()


def test_missing_ctranslate2_is_one_line(case, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2.converters", None)  # import fails as if absent
    assert cli("convert", case.ours, tmp_path / "ct2", "--to", "ctranslate2") == 2
    assert "needs the ctranslate2 package: pip install" in error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_is_not_empty_needs_overwrite(case, tmp_path, capsys, monkeypatch):
    out = tmp_path / "ct2"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "source_vocabulary.json").write_text("[]")  # an earlier export's, of another layout
    assert cli("convert", case.ours, out, "--to", "ctranslate2") == 2
    assert "--overwrite" in error_line(capsys)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "source_vocabulary.json"]

    assert cli("convert", case.ours, out, "--to", "ctranslate2", "--overwrite") == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.bin", "notes.txt",
                                                     "shared_vocabulary.json"]
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()

    def fail(self, *args, **kwargs):
        raise RuntimeError("no space left on device\nmore detail")

    monkeypatch.setattr(ctranslate2.converters.TransformersConverter, "convert", fail)
    assert cli("convert", case.ours, out, "--to", "ctranslate2", "--overwrite") == 2
    assert "CTranslate2's converter failed: no space left on device" in error_line(capsys)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the earlier export stays
    assert leftovers(tmp_path) == []
