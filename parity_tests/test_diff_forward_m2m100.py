"""`rosetta diff` on an M2M100 directory (issue 58): its tokenizer (sentencepiece.bpe.model +
vocab.json + the language codes, rosetta/interop/m2m100_tokenizer.py) reads --src and --tgt as text,
and `DIR@transformers` runs Hugging Face's own M2M100ForConditionalGeneration with the hooks of
Marian's (test_diff_forward_transformers.py).

Expected values come from elsewhere than the code under test: the directory is written by
transformers' own `save_pretrained` (`rosetta example nllb`, parity_tests/nllb_case.py), the
tokenizer's ids by M2M100Tokenizer's, the stage set is our numpy reference's, and where a difference
must first show follows from the one tensor altered.
"""

from __future__ import annotations

import json

import pytest

from parity_tests.test_diff_forward_transformers import altered_copy, numpy_stage_names
from rosetta.cli import main
from rosetta.interop.convert import read_model

pytest.importorskip("transformers")

SENTENCE = "Ein Hund läuft über die Straße."


def m2m100_ids(directory, text: str, target: bool = False) -> list[int]:
    """transformers' M2M100Tokenizer's ids (src_lang de, tgt_lang en: the directory's)."""
    from transformers import M2M100Tokenizer

    tok = M2M100Tokenizer.from_pretrained(directory)
    return tok(text_target=text).input_ids if target else tok(text).input_ids


def test_on_text_every_stage_agrees_and_the_source_is_m2m100s_ids(nllb_dir, backend, tmp_path, capsys):
    out_json = tmp_path / "d.json"
    code = main(["diff", f"{nllb_dir}@transformers", f"{nllb_dir}@{backend}", "--src", SENTENCE,
                 "--json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.splitlines()[-1] == "no difference at any stage (tolerance 1e-05)"
    said = out.splitlines()[0]
    assert said.startswith(f"src ids {m2m100_ids(nllb_dir, SENTENCE)}")  # __de__ pieces </s>
    cfg = read_model(nllb_dir)[0]
    assert f"decoder input ids [{cfg.bos_id}, " in said  # </s>, then our greedy translation
    record = json.loads(out_json.read_text())
    assert {row["stage"] for row in record["rows"]} == numpy_stage_names(nllb_dir)
    assert record["tolerance"] == 1e-5 and not record["differ"]


def test_a_text_target_is_the_start_token_then_m2m100s_target_ids(nllb_dir, capsys):
    """--tgt: `</s>` (decoder start), then `__en__ pieces` (M2M100Tokenizer's target, eos dropped)."""
    target = "A dog runs across the street."
    code = main(["diff", f"{nllb_dir}@transformers", str(nllb_dir), "--src", SENTENCE, "--tgt", target])
    out = capsys.readouterr().out
    assert code == 0, out
    expected = [read_model(nllb_dir)[0].bos_id, *m2m100_ids(nllb_dir, target, target=True)[:-1]]
    assert f"decoder input ids {expected}" in out.splitlines()[0]
    assert "no difference at any stage" in out


def test_on_a_random_padded_batch_every_stage_agrees(nllb_dir, capsys):
    """Rows padded on both sides: at the positions the contract counts, M2M100's and ours agree."""
    code = main(["diff", f"{nllb_dir}@transformers", f"{nllb_dir}@torch", "--batch", "random"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "no difference at any stage" in out


def test_the_diagnostic_batchs_all_pad_source_differs_at_cross_attention_only_there(nllb_dir, capsys):
    """The diagnostic batch's row 2 is a source of nothing but padding: its queries attend uniformly
    to pad keys (SPEC §2), whose encoder outputs the contract leaves open, and M2M100 gives a pad the
    zero position row where we give it its position. So the first difference is that cross-attention,
    and every stage before it agrees (docs/diff.md)."""
    code = main(["diff", f"{nllb_dir}@transformers", f"{nllb_dir}@torch"])
    out = capsys.readouterr().out
    assert code == 1
    assert out.splitlines()[-1].startswith("first difference at decoder.layers.0.cross_attn ")


@pytest.mark.parametrize("tensor, first", [
    ("model.decoder.layers.1.fc2.weight", "decoder.layers.1.ffn"),
    ("model.encoder.layer_norm.weight", "encoder"),
])
def test_an_altered_tensor_is_found_at_its_stage(nllb_dir, tmp_path, tensor, first, capsys):
    altered = altered_copy(nllb_dir, tmp_path, tensor)
    assert main(["diff", f"{altered}@transformers", str(nllb_dir), "--src", SENTENCE]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"first difference at {first} ")
