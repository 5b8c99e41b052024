"""`rosetta diff DIR@transformers DIR@BACKEND` (issue 26, docs/diff.md "Against the original"):
Hugging Face's own MarianMTModel, its stages captured with hooks, against our backends.

Expected values come from elsewhere than the code under test: the opus-mt directories are written
by transformers' own `save_pretrained` (parity_tests/opus_mt_case.py), the stage set is our numpy
reference's, and where a difference must first show follows from the one tensor we altered.
"""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest

from rosetta.backends import from_params
from rosetta.cli import main
from rosetta.interop.convert import convert, read_model
from rosetta.parity import random_batch

pytest.importorskip("transformers")

SENTENCE = "Ein Hund läuft über die Straße."
TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json", "target_vocab.json", "tokenizer_config.json")


@pytest.fixture(params=["joint", "separate"])
def opus_dir(request):
    """Both opus-mt cases (read-only): one vocabulary, and separate source and target ones."""
    return request.getfixturevalue("opus_mt_dir" if request.param == "joint" else "opus_mt_separate_dir")


def numpy_stage_names(directory) -> set[str]:
    """The stages our float64 reference computes for this model: what the original must match."""
    cfg, params = read_model(directory)
    src, tgt = random_batch(cfg, 1, 3, 3)
    return set(from_params(cfg, params, "numpy").stages(src, tgt, fine=True))


def altered_copy(directory, tmp_path, tensor: str, factor: float = 1.01):
    """A copy of the directory whose weights differ from the original in `tensor` alone."""
    from safetensors.numpy import load_file, save_file

    out = shutil.copytree(directory, tmp_path / "altered")
    weights = load_file(out / "model.safetensors")
    assert tensor in weights
    weights[tensor] = weights[tensor] * np.float32(factor)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


# -- the original agrees with every backend at every stage ---------------------------------------

def test_on_text_every_stage_agrees_and_the_decoder_reads_a_translation(opus_dir, backend, tmp_path, capsys):
    out_json = tmp_path / "d.json"
    code = main(["diff", f"{opus_dir}@transformers", f"{opus_dir}@{backend}", "--src", SENTENCE,
                 "--json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.splitlines()[-1] == "no difference at any stage (tolerance 1e-05)"
    # The batch: the sentence's ids, and the start token (<pad> in opus-mt) then a translation.
    cfg = read_model(opus_dir)[0]
    said = out.splitlines()[0]
    assert said.startswith("src ids [") and f"decoder input ids [{cfg.bos_id}, " in said
    assert said.split(" = the start token + ")[1].strip("'")  # a non-empty English sentence
    record = json.loads(out_json.read_text())
    assert {row["stage"] for row in record["rows"]} == numpy_stage_names(opus_dir)
    assert record["tolerance"] == 1e-5 and not record["differ"]


@pytest.mark.parametrize("args", [[], ["--ids", "--src", "5 6 7 0", "--tgt", "{bos} 8 9 10"]],
                         ids=["random_padded_batch", "ids"])
def test_on_ids_every_stage_agrees(opus_mt_dir, backend, args, capsys):
    """The random batch pads rows 1-3 on both sides: the masks must be the contract's."""
    bos = read_model(opus_mt_dir)[0].bos_id
    code = main(["diff", f"{opus_mt_dir}@transformers", f"{opus_mt_dir}@{backend}",
                 *(a.format(bos=bos) for a in args)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "no difference at any stage" in out


def test_the_side_has_every_fine_stage_at_float32(opus_mt_separate_dir):
    from rosetta.diff.forward.sides import parse_side

    side = parse_side(f"{opus_mt_separate_dir}@transformers")
    assert side.model is None and side.tolerance == 1e-5
    assert side.config == read_model(opus_mt_separate_dir)[0]
    stages = side.stages(*random_batch(side.config, seed=3))
    assert set(stages) == numpy_stage_names(opus_mt_separate_dir)
    assert {str(v.dtype) for v in stages.values()} == {"float32"}


# -- an altered tensor is found where it first acts ----------------------------------------------

@pytest.mark.parametrize("tensor, first", [
    ("model.decoder.layers.1.fc2.weight", "decoder.layers.1.ffn"),
    ("model.encoder.layers.0.self_attn.v_proj.weight", "encoder.layers.0.self_attn"),
])
def test_an_altered_tensor_is_found_at_its_stage(opus_mt_dir, tmp_path, tensor, first, capsys):
    altered = altered_copy(opus_mt_dir, tmp_path, tensor)
    assert main(["diff", f"{altered}@transformers", str(opus_mt_dir), "--src", SENTENCE]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"first difference at {first} ")


# -- the library function on a model without layers -------------------------------------------------

def test_marian_stages_without_layers_takes_the_embeddings_from_the_stacks():
    import torch
    from transformers import MarianConfig, MarianMTModel

    from rosetta.diff.forward.transformers_side import marian_stages

    torch.manual_seed(0)
    model = MarianMTModel(MarianConfig(vocab_size=20, d_model=8, encoder_layers=0, decoder_layers=0,
                                       encoder_attention_heads=2, decoder_attention_heads=2, pad_token_id=19,
                                       decoder_start_token_id=19, scale_embedding=True,
                                       max_position_embeddings=16))  # training mode, as built
    src, tgt = np.array([[3, 4, 5, 0]]), np.array([[19, 6, 7]])
    stages = marian_stages(model, src, tgt)
    assert list(stages) == ["src_embed", "encoder", "tgt_embed", "decoder", "logits"]
    table = model.model.shared.weight.detach().numpy() * np.sqrt(8)
    positions = model.model.encoder.embed_positions.weight.detach().numpy()
    np.testing.assert_allclose(stages["src_embed"][0], table[src[0]] + positions[:4], rtol=1e-6)
    np.testing.assert_allclose(stages["tgt_embed"][0], table[tgt[0]] + positions[:3], rtol=1e-6)
    assert model.training and not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


# -- one line for bad input ---------------------------------------------------------------------------

def refused(args, capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("rosetta: error:"), err
    return err


def test_without_a_tokenizer_ids_are_read_and_text_is_refused(opus_mt_dir, tmp_path, capsys):
    bare = shutil.copytree(opus_mt_dir, tmp_path / "bare")
    for name in TOKENIZER_FILES:
        (bare / name).unlink(missing_ok=True)
    assert main(["diff", f"{bare}@transformers", str(bare), "--src", "5 6 7 0"]) == 0
    assert "no difference at any stage" in capsys.readouterr().out
    err = refused(["diff", f"{bare}@transformers", str(bare), "--src", SENTENCE], capsys)
    assert "--src: 'Ein' is not a token id" in err and "text needs a tokenizer" in err


def test_transformers_on_what_is_not_a_marian_directory_is_refused(opus_mt_dir, tmp_path, capsys):
    checkpoint = convert(opus_mt_dir, tmp_path / "m.safetensors").path
    err = refused(["diff", f"{checkpoint}@transformers", str(checkpoint)], capsys)
    assert "@transformers runs a Hugging Face Marian directory" in err


def test_transformers_missing_is_refused_naming_the_install(opus_mt_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    err = refused(["diff", f"{opus_mt_dir}@transformers", str(opus_mt_dir)], capsys)
    assert "needs transformers, not installed here: pip install transformers" in err


@pytest.mark.parametrize("args, message", [
    (["{d}@transformers:bfloat16", "{d}"], "runs Hugging Face's model at float32 only"),
    (["{d}@transformers", "{d}", "--tgt", "A dog."], "--tgt and --ids go with --src"),
    (["{d}@transformers", "{d}@transformers", "--src", SENTENCE], "no side is one; give --tgt"),
])
def test_bad_arguments_are_refused_in_one_line(opus_mt_dir, args, message, capsys):
    assert message in refused(["diff", *(a.format(d=opus_mt_dir) for a in args)], capsys)
