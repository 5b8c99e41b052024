"""`rosetta convert ... --to ctranslate2` beyond opus-mt (issue 58 item 5, issue 57's last item):

- an M2M100 directory (`rosetta example nllb`, parity_tests/nllb_case.py) -> ours -> CTranslate2,
  through CTranslate2's own TransformersConverter (its M2M100Loader): `ctranslate2.Translator` with
  the target language code as target_prefix translates as `rosetta translate --checkpoint DIR`;
- a run of `rosetta train` (our BPE, `<pad>` at 0, a learned start row), which the Marian route
  refuses: built through CTranslate2's spec API (rosetta/interop/ctranslate2_spec.py), it translates
  as our `generate` does, greedy and beam 4, token for token.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from parity_tests.nllb_case import case_sentences
from rosetta.cli import main

ctranslate2 = pytest.importorskip("ctranslate2")
pytest.importorskip("transformers")


def _translate_cli(capsys, monkeypatch, *args, sentences) -> list[str]:
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(s + "\n" for s in sentences)))
    code = main(["translate", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out.splitlines()


@pytest.fixture(scope="module")
def nllb_ct2(nllb_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("nllb-ct2")
    assert main(["convert", str(nllb_dir), str(root / "ours.safetensors")]) == 0
    assert main(["convert", str(root / "ours.safetensors"), str(root / "ct2"), "--to", "ctranslate2"]) == 0
    return root / "ct2"


@pytest.mark.parametrize("beam", [1, 4])
def test_m2m100_export_translates_as_rosetta_translate(nllb_dir, nllb_ct2, beam, capsys, monkeypatch):
    from rosetta.interop.m2m100_tokenizer import M2M100TextTokenizer

    tok = M2M100TextTokenizer(nllb_dir)
    vocab = json.loads((nllb_ct2 / "shared_vocabulary.json").read_text())
    assert vocab[:4] == ["<s>", "<pad>", "</s>", "<unk>"] and vocab[tok.lang_id("en")] == "__en__"
    assert len(vocab) == tok.src_vocab_size + 8  # the codes, then M2M100's madeup words
    sentences = case_sentences()
    ours = _translate_cli(capsys, monkeypatch, "--checkpoint", str(nllb_dir), "--backend", "torch", "--beam",
                          str(beam), sentences=sentences)
    pieces = [[vocab[i] for i in tok.encode_source(s)] for s in sentences]
    translator = ctranslate2.Translator(str(nllb_ct2), device="cpu", intra_threads=1)
    # The directory's generation_config.json: max_length 96 (95 new tokens), length_penalty 1, <pad> banned.
    results = translator.translate_batch(pieces, beam_size=beam, length_penalty=1.0, max_decoding_length=95,
                                         target_prefix=[["__en__"]] * len(pieces),
                                         suppress_sequences=[["<pad>"]])
    theirs = [tok.decode(vocab.index(p) for p in r.hypotheses[0]) for r in results]
    assert all(r.hypotheses[0][0] == "__en__" for r in results)
    assert theirs == ours


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A Multi30k de-en run of `rosetta train` (PyTorch, 150 steps, a joint BPE of 500 ids: <pad> 0):
    enough that its searches end with eos (at 40 steps every sentence runs to its limit)."""
    from rosetta.harness.loop import RunConfig, train

    out = tmp_path_factory.mktemp("run")
    train(RunConfig(backends=("torch",), out=str(out), task="multi30k", pair="de-en", vocab_size=500,
                    train_size=1000, eval_size=16, bleu_samples=4, steps=150, warmup=50, max_tokens=1024,
                    buckets=(32,), eval_every=150, checkpoint_every=150, lr_factor=1.0,
                    overrides={"d_model": 64, "d_ff": 128}, progress=False, device="cpu"))
    ct2 = out / "ct2"
    assert main(["convert", str(out / "torch"), str(ct2), "--to", "ctranslate2"]) == 0
    return out / "torch", ct2


@pytest.mark.parametrize("beam", [1, 4])
def test_our_run_exports_and_translates_as_generate(small_run, beam):
    """Our BPE puts <pad> at 0, which the Marian route refuses; the spec route keeps every id. Each
    sentence alone, CTranslate2's max_decoding_length = our limit (source length + margin)."""
    from rosetta.backends import from_params
    from rosetta.harness.translate import open_model

    run, ct2 = small_run
    opened = open_model(run)
    assert opened.config.pad_id == 0
    model = from_params(opened.config, opened.params, "torch")
    translator = ctranslate2.Translator(str(ct2), device="cpu", intra_threads=1)
    tok, margin, ended = opened.tokenizer, 8, 0
    for sentence in case_sentences(6)[:6]:
        ids = tok.encode_source(sentence)
        ours = model.generate(np.array([ids]), beam, 1.0, margin, "hf").tokens[0]
        result = translator.translate_batch([[tok.id_to_token(i) for i in ids]], beam_size=beam,
                                            length_penalty=1.0, max_decoding_length=len(ids) + margin,
                                            suppress_sequences=[["<pad>"]])
        theirs = [tok.token_to_id(t) for t in result[0].hypotheses[0]]
        assert theirs == ours, sentence
        ended += len(ours) < len(ids) + margin
    assert ended > 0  # some sentence ended with eos before its limit
