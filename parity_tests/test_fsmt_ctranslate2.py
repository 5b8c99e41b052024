"""`rosetta convert FSMT_DIR OUT --to ctranslate2` (issue 58 item 5): a Hugging Face FSMT directory, and
the checkpoint converted from it with its NAME.tokenizer/ sidecar, exported through CTranslate2's spec
API with FSMTTokenizer's two vocabularies (rosetta/interop/ctranslate2_spec.py: write_fsmt_spec).

The expected values are transformers': `FSMTForConditionalGeneration.generate` on the same ids (greedy
and beam 4) and its teacher-forced log-probabilities; the vocabulary files are written by transformers'
own `FSMTTokenizer.save_pretrained` (JSON keys sorted, so the file order is not the id order).
"""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest
import torch
from transformers import FSMTTokenizer

from parity_tests.test_interop_fsmt import EOS, batch, end_some_sentences, hf_logits, make_fsmt
from rosetta.cli import main
from rosetta.errors import TokenizerError
from rosetta.interop.convert import convert
from rosetta.interop.ctranslate2_spec import fsmt_tokens
from rosetta.interop.fsmt import read_fsmt

ctranslate2 = pytest.importorskip("ctranslate2")

# The output projection tied to the target table (fairseq's WMT19 models), and pad 3: positions from
# row 4, where fairseq's pad 1 reads from row 2. The pad-3 model's eos is lifted so that some
# sentences end early (its projection is untied: test_interop_fsmt.end_some_sentences).
CASES = ["decoder-gelu-unscaled", "src_tgt-gelu_new-pad3"]
MARGIN = 6
# Absolute, per token: float32 on both sides, the same weights, sums ordered differently. Derived from
# test_interop_fsmt's TOLERANCE (1e-5 relative to the largest logit, float32 vs FSMT): a log-softmax
# entry moves by at most |dz_i| + max_j |dz_j| <= 2 x 1e-5 x max|z|, and these models' logits stay under
# 3.3 in size (both cases, teacher-forced, measured once): 6.6e-5 < 1e-4. Observed <= 6.6e-7, while
# dropping the position offset moves the logits by O(0.1).
LOGPROB_TOLERANCE = 1e-4


def write_tokenizer(model, path) -> None:
    """transformers' FSMTTokenizer files for the model's vocabularies: fairseq's special tokens at
    their ids (pad at the config's pad id), then side-named words (a mix-up of the sides shows)."""
    pad = model.config.pad_token_id
    special = {"<s>": 0, "</s>": EOS, "<pad>": pad, "<unk>": 3 if pad == 1 else 1}
    for side, size in (("src", model.config.src_vocab_size), ("tgt", model.config.tgt_vocab_size)):
        words = {f"{side}{i}</w>": i for i in range(4, size)}
        (path / f"in-{side}.json").write_text(json.dumps({**special, **words}))
    (path / "in-merges.txt").write_text("s r</w>\n")
    # FSMTTokenizer imports sacremoses in __init__; save_pretrained never runs its Moses step.
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "sacremoses", types.ModuleType("sacremoses"))
        tok = FSMTTokenizer(langs=["de", "en"], src_vocab_file=str(path / "in-src.json"),
                            tgt_vocab_file=str(path / "in-tgt.json"), merges_file=str(path / "in-merges.txt"))
        tok.save_pretrained(path / "m")


@pytest.fixture(scope="module", params=CASES)
def export(request, tmp_path_factory):
    """(model, cfg, source rows, FSMT_DIR, its CTranslate2 export); the export through the checkpoint
    and its sidecar is checked to be the same files."""
    root = tmp_path_factory.mktemp(request.param)
    model = make_fsmt(request.param)
    model.save_pretrained(root / "m")
    cfg, _ = read_fsmt(root / "m")
    src, _ = batch(cfg, seed=3)
    if CASES[1] == request.param:
        end_some_sentences(model, src, steps=src.shape[1] + MARGIN)
        model.save_pretrained(root / "m")
    write_tokenizer(model, root)
    convert(root / "m", root / "ct2", to_format="ctranslate2")
    convert(root / "m", root / "ours.safetensors")
    assert (root / "ours.tokenizer" / "vocab-tgt.json").is_file()
    convert(root / "ours.safetensors", root / "ct2-ours", to_format="ctranslate2")
    for name in ("model.bin", "config.json", "source_vocabulary.json", "target_vocabulary.json"):
        assert (root / "ct2" / name).read_bytes() == (root / "ct2-ours" / name).read_bytes(), name
    rows = [row[row != cfg.pad_id] for row in src]
    return model, cfg, rows, root / "m", root / "ct2"


def _vocab(path, name) -> dict[str, int]:
    return json.loads((path / name).read_text())


def _translator(out):
    # intra_threads=1: CTranslate2's default thread pool makes the rest of the process burn CPU.
    return ctranslate2.Translator(str(out), device="cpu", intra_threads=1)


def test_vocabularies_are_the_tokenizer_files_by_id(export):
    _, cfg, _, path, out = export
    for theirs, ours, size in (("vocab-src.json", "source_vocabulary.json", cfg.src_vocab_size),
                               ("vocab-tgt.json", "target_vocabulary.json", cfg.tgt_vocab_size)):
        by_id = {i: t for t, i in _vocab(path, theirs).items()}
        assert json.loads((out / ours).read_text()) == [by_id[i] for i in range(size)], ours
    config = json.loads((out / "config.json").read_text())
    assert config["decoder_start_token"] == "</s>" and config["eos_token"] == "</s>"
    assert not config["add_source_eos"]  # the source ids end with </s> already, as FSMTTokenizer's do


def _generate(model, row, beams: int, limit: int) -> list[int]:
    """transformers' search on one sentence, without the start token, cut at eos. early_stopping=True:
    CTranslate2 stops once beam_size hypotheses have finished (docs/ctranslate2.md). Pad banned, its
    probability renormalized away, as CTranslate2's suppress_sequences does: FSMT gives a generated pad
    the zero position row and does not count it in later positions (make_positions), CTranslate2 does."""
    pad = model.config.pad_token_id
    with torch.no_grad():
        out = model.generate(torch.tensor(row[None]), num_beams=beams, do_sample=False, length_penalty=1.0,
                             early_stopping=True, max_new_tokens=limit, forced_eos_token_id=None,
                             bad_words_ids=[[pad]], renormalize_logits=True)
    out = out[0, 1:].tolist()
    return out[: out.index(EOS)] if EOS in out else out


@pytest.mark.parametrize("beams", [1, 4])
def test_ctranslate2_translates_as_generate(export, beams):
    model, cfg, rows, path, out = export
    limit = max(len(row) for row in rows) + MARGIN
    theirs = [_generate(model, row, beams, limit) for row in rows]
    src_tokens = {i: t for t, i in _vocab(path, "vocab-src.json").items()}
    tgt_ids = _vocab(path, "vocab-tgt.json")
    results = _translator(out).translate_batch([[src_tokens[int(i)] for i in row] for row in rows],
                                               beam_size=beams, length_penalty=1.0, max_decoding_length=limit,
                                               suppress_sequences=[["<pad>"]])
    ours = [[tgt_ids[t] for t in r.hypotheses[0]] for r in results]
    assert ours == theirs
    assert any(len(t) > 1 for t in theirs), theirs
    if cfg.pad_id == 3:  # the lifted eos: some sentences end before the limit, some run on
        assert any(len(t) < limit for t in theirs) and any(len(t) > 0 for t in theirs), theirs


def test_ctranslate2_scores_as_transformers(export):
    """score_batch's log-probability of each token (eos included) of transformers' greedy outputs,
    against log_softmax of FSMT's teacher-forced logits: every position of the decoder and the
    encoder, not only the argmax, so a shifted positional table cannot pass."""
    model, cfg, rows, path, out = export
    limit = max(len(row) for row in rows) + MARGIN
    src_tokens = {i: t for t, i in _vocab(path, "vocab-src.json").items()}
    tgt_tokens = {i: t for t, i in _vocab(path, "vocab-tgt.json").items()}
    targets = [_generate(model, row, 1, limit) for row in rows]
    scored = _translator(out).score_batch([[src_tokens[int(i)] for i in row] for row in rows],
                                          [[tgt_tokens[i] for i in t] for t in targets])
    for row, target, result in zip(rows, targets, scored, strict=True):
        logits = hf_logits(model, row[None], np.array([[cfg.bos_id, *target]]))[0]
        logp = torch.log_softmax(torch.tensor(logits), -1).numpy()
        theirs = logp[np.arange(len(target) + 1), [*target, EOS]]
        error = np.max(np.abs(np.array(result.log_probs) - theirs))
        assert error <= LOGPROB_TOLERANCE, (result.log_probs, theirs)


# -- refusals ------------------------------------------------------------------------------------

def test_a_place_that_is_not_the_id_is_refused(tmp_path):
    path = tmp_path / "vocab-tgt.json"
    path.write_text(json.dumps({"<s>": 0, "<pad>": 1, "</s>": 3}))
    with pytest.raises(TokenizerError, match=r"'</s>' has id 3 at place 2.*CTranslate2 numbers tokens"):
        fsmt_tokens(path, 3)
    path.write_text(json.dumps({"<s>": 0, "<pad>": "1"}))
    with pytest.raises(TokenizerError, match="ids are integers"):
        fsmt_tokens(path, 2)


def test_another_models_vocabulary_is_refused_in_one_line(tmp_path, capsys):
    model = make_fsmt(CASES[0])
    model.save_pretrained(tmp_path / "m")
    write_tokenizer(model, tmp_path)
    vocab = _vocab(tmp_path / "m", "vocab-tgt.json")
    del vocab["tgt5</w>"]  # a gap at id 5: CTranslate2 would put tgt6 at place 5
    (tmp_path / "m" / "vocab-tgt.json").write_text(json.dumps(vocab))
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "ct2"), "--to", "ctranslate2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vocab-tgt.json" in err, err
    assert not (tmp_path / "ct2").exists()
    for name in ("vocab-src.json", "vocab-tgt.json", "merges.txt"):
        (tmp_path / "m" / name).unlink()
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "ct2"), "--to", "ctranslate2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs the model's tokenizer" in err, err
    assert not (tmp_path / "ct2").exists()
