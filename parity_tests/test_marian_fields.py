"""Issue 48 item 2: every Marian config.json field handled as transformers' MarianMTModel handles it
(rosetta/interop/marian_fields.py). The expected values are transformers' own: for every activation
name in its table (activations.ACT2CLS), MarianMTModel's logits where our model computes that
function, a refusal naming the field and value where it cannot; for the fields MarianMTModel never
reads, its logits unchanged by them (so it ignores them) and ours equal to them, with a note."""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import MarianMTModel
from transformers.activations import ACT2CLS

import rosetta
from parity_tests.test_interop_marian import BASE, PAD, batch, hf_logits, make_marian, relative
from rosetta.errors import ConfigError
from rosetta.interop.marian import ACTIVATIONS_IN, read_marian

# Relative, MarianMTModel in float32 against our float64 NumPy reference: float32's unit roundoff
# 6e-8 grown through 2 + 2 layers of d_model 16 (sums of <= 32 terms, softmax, LayerNorm) stays
# below 1e-5, test_interop_marian.py's bound for the same models; gelu_fast's constant 0.7978845608
# for sqrt(2/pi) adds 4e-12.
TOLERANCE = 1e-5
SCALE = dict(share_encoder_decoder_embeddings=True, tie_word_embeddings=True, scale_embedding=True)


def saved(tmp_path, overrides=None, edit=None):
    """A MarianMTModel of BASE saved to tmp_path, its config.json edited by `edit` (a dict)."""
    model = make_marian({**SCALE, **(overrides or {})})
    model.save_pretrained(tmp_path)
    if edit:
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
    return model


def our_logits(path):
    cfg, params = read_marian(path)
    src, tgt = batch(cfg)
    real = tgt != PAD
    real[:, 0] = True
    return np.asarray(rosetta.from_params(cfg, params, backend="numpy").logits(src, tgt), np.float64), \
        (src, tgt, real)


@pytest.mark.parametrize("name", sorted(ACT2CLS))
def test_every_hugging_face_activation_is_honoured_or_refused(name, tmp_path):
    if name not in ACTIVATIONS_IN:  # a function our model does not compute: refused, naming it
        (tmp_path / "config.json").write_text(json.dumps({**BASE, "activation_function": name}))
        refusal = f"activation_function '{name}': rosetta's model cannot compute"
        with pytest.raises(ConfigError, match=refusal):
            read_marian(tmp_path)
        return
    model = saved(tmp_path, {"activation_function": name})
    ours, (src, tgt, real) = our_logits(tmp_path)
    assert relative(ours, hf_logits(model, src, tgt), real) <= TOLERANCE


def test_the_activations_we_honour_are_those_the_issue_names():
    assert {"gelu_new", "gelu_fast", "silu", "swish", "relu", "gelu"} <= set(ACTIVATIONS_IN) <= set(ACT2CLS)


IGNORED = {  # fields MarianMTModel never reads, each set to a value claiming another model
    "normalize_before": True, "add_bias_logits": True, "static_position_embeddings": False,
    "normalize_embedding": True, "add_final_layer_norm": True, "architectures": ["BertModel"],
    "my_own_field": 3,
}


@pytest.mark.parametrize("field", sorted(IGNORED))
def test_a_field_marian_ignores_is_ignored_with_one_note(field, tmp_path, capsys):
    model = saved(tmp_path, edit={field: IGNORED[field]})
    reloaded = MarianMTModel.from_pretrained(tmp_path).eval()
    capsys.readouterr()
    ours, (src, tgt, real) = our_logits(tmp_path)
    our_logits(tmp_path)  # read twice: noted once
    notes = capsys.readouterr().err.splitlines()
    where = tmp_path / "config.json"
    assert len(notes) == 1 and notes[0].startswith(f"rosetta: note: {where}: {field}"), notes
    assert "ignore" in notes[0]
    theirs = hf_logits(reloaded, src, tgt)
    assert np.array_equal(theirs, hf_logits(model, src, tgt))  # transformers: the field changes nothing
    assert relative(ours, theirs, real) <= TOLERANCE


def test_fields_as_marian_itself_writes_them_are_read_silently(tmp_path, capsys):
    """save_pretrained's config.json (every field it writes, is_decoder and the layerdrops included)."""
    saved(tmp_path / "a")
    capsys.readouterr()
    read_marian(tmp_path / "a")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("edit", [{"dtype": "int8"}, {"torch_dtype": "int8"}])
def test_a_non_floating_dtype_is_refused_as_from_pretrained_refuses_it(edit, tmp_path):
    saved(tmp_path)
    config = {k: v for k, v in json.loads((tmp_path / "config.json").read_text()).items() if k != "dtype"}
    (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match="not a floating-point dtype"):  # transformers' own refusal
        MarianMTModel.from_pretrained(tmp_path)
    key = next(iter(edit))
    with pytest.raises(ConfigError, match=f"{key} 'int8' is not a floating-point type"):
        read_marian(tmp_path)


def test_an_alias_is_read_as_its_field_and_a_contradiction_refused(tmp_path):
    """MarianConfig.attribute_map: num_hidden_layers is encoder_layers (transformers builds that many)."""
    saved(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["encoder_layers"]
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2, "hidden_size": 16}))
    theirs = MarianMTModel.from_pretrained(tmp_path).config
    cfg, _ = read_marian(tmp_path)
    assert (cfg.num_encoder_layers, cfg.d_model) == (theirs.encoder_layers, theirs.d_model) == (2, 16)
    (tmp_path / "config.json").write_text(json.dumps({**config, "encoder_layers": 2, "num_hidden_layers": 5}))
    with pytest.raises(ConfigError, match="num_hidden_layers 5 contradicts encoder_layers 2"):
        read_marian(tmp_path)


@pytest.mark.parametrize("fields,named", [
    ({"dtype": None, "torch_dtype": "float16"}, "torch_dtype float16"),  # dtype null: torch_dtype read
    ({"torch_dtype": "float16", "zzz_unknown": 1}, "torch_dtype float16"),  # an unknown field last
    ({"dtype": "bfloat16", "dropout": 0.1, "activation_dropout": 0.2}, "dtype bfloat16"),  # an ignored last
])
def test_the_half_precision_note_names_its_field_whatever_comes_after_it(fields, named, capsys):
    """Issue 57: the note was skipped or named the loop's last field (resolve_fields reused `key`)."""
    from rosetta.interop.marian_fields import resolve_fields

    source = f"half-{sorted(fields)}"  # one source a case: each note is printed once a source
    resolve_fields(fields, set(), source)
    notes = [n for n in capsys.readouterr().err.splitlines() if "transformers computes in it" in n]
    assert notes == [f"rosetta: note: {source}: {named}: transformers computes in it; rosetta computes in "
                     "the dtype you choose (--dtype, float32 by default)"]


def test_a_string_architectures_of_another_model_is_noted(capsys):
    from rosetta.interop.marian_fields import resolve_fields

    resolve_fields({"architectures": "BartForConditionalGeneration"}, set(), "arch-string")
    assert "architectures ['BartForConditionalGeneration'] is ignored" in capsys.readouterr().err
