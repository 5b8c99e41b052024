"""Hugging Face M2M100 / NLLB-200 <-> the canonical checkpoint, checked against transformers' own
M2M100ForConditionalGeneration.

The expected values come from Hugging Face's code: an `M2M100ForConditionalGeneration` built here from
`M2M100Config` (random weights), saved with `save_pretrained`, is the reference for logits, greedy and
beam search; the float64 comparison reads fairseq's positional table from its formula, written out
here (modeling_m2m_100.M2M100SinusoidalPositionalEmbedding.get_embedding, in float64).
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import safetensors.numpy
import torch
from transformers import M2M100Config, M2M100ForConditionalGeneration

import rosetta
from rosetta.backends import MODEL_BACKENDS
from rosetta.errors import ConfigError
from rosetta.interop.convert import convert, detect_format
from rosetta.interop.m2m100 import is_m2m100, params_to_m2m100, read_m2m100, write_m2m100

EOS = 2  # fairseq's dictionary: <s> 0, <pad> 1, </s> 2, <unk> 3; the decoder starts from </s>
LANG = 20  # a "language code" token of the tiny vocabulary, forced at the first step as NLLB's are
BASE = dict(vocab_size=24, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
            pad_token_id=1, eos_token_id=EOS, decoder_start_token_id=EOS, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0)
# (M2M100Config fields, how the test ties the untied tables, the sharing they then show). The default
# (one shared table), untied tables in every sharing, relu / gelu / gelu_new, scaling on and off,
# fairseq's pad 1 and another (pad 3: positions from row 4).
CONFIGS = {
    "all-relu-scaled": (dict(activation_function="relu"), None, "all"),
    "none-gelu-unscaled": (dict(activation_function="gelu", scale_embedding=False, tie_word_embeddings=False),
                           None, "none"),
    "src_tgt-gelu_new-pad3": (dict(activation_function="gelu_new", pad_token_id=3, tie_word_embeddings=False),
                              "encoder", "src_tgt"),
    "decoder-relu": (dict(tie_word_embeddings=False), "output", "decoder"),
}
# Relative, float32 Hugging Face vs each backend: float32 rounds each of the few hundred operations on
# a logit's path by 6e-8 relative; LayerNorm and the 0.3-scale random weights amplify it at most ~10x,
# and HF's float32 positional table (frequencies and angles rounded: about 3 * 2^-24 * p absolute at
# row p < 40, i.e. < 1e-5 x 0.7) adds < 1e-6: a bound of 1e-5 keeps a margin, while a convention error
# (position_offset 0 instead of pad + 1, post-norm, no final norm) moves logits by O(0.1).
TOLERANCE = 1e-5
# Relative, float64 vs float64: 1.1e-16 per operation through the same amplification, ~1e-14 at most;
# 1e-12 is above it and far below any convention error.
TOLERANCE_64 = 1e-12


def make_m2m100(name: str, seed: int = 0) -> M2M100ForConditionalGeneration:
    """An M2M100ForConditionalGeneration of CONFIGS[name], every parameter drawn at a useful scale, its
    untied tables made equal as the case says."""
    overrides, tie, _ = CONFIGS[name]
    torch.manual_seed(seed)
    model = M2M100ForConditionalGeneration(M2M100Config(**{**BASE, **overrides})).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():  # tied tensors appear once: ties survive
            p.normal_(1.0 if "layer_norm.weight" in pname else 0.0, 0.3)
        inner = model.model
        if tie == "output":
            model.lm_head.weight.copy_(inner.decoder.embed_tokens.weight)
        if tie == "encoder":
            inner.encoder.embed_tokens.weight.copy_(inner.decoder.embed_tokens.weight)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def m2m_dir(request, tmp_path_factory):
    model = make_m2m100(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


def batch(cfg: rosetta.ModelConfig, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Source ids ending in eos with right padding (the padding both agree on: module docstring);
    decoder input [</s>, tokens..., pad...]; tokens from 4 up (no special id)."""
    rng = np.random.default_rng(seed)
    src, tgt = np.full((3, 7), cfg.pad_id), np.full((3, 6), cfg.pad_id)
    for b, (n, m) in enumerate([(6, 5), (3, 2), (1, 4)]):
        src[b, :n] = rng.integers(4, cfg.src_vocab_size, size=n)
        src[b, n] = EOS
        tgt[b, 0] = cfg.bos_id
        tgt[b, 1: m + 1] = rng.integers(4, cfg.tgt_vocab_size, size=m)
    return src, tgt


def hf_logits(model: M2M100ForConditionalGeneration, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    pad = model.config.pad_token_id
    with torch.no_grad():
        return model(input_ids=torch.tensor(src), attention_mask=torch.tensor(src != pad),
                     decoder_input_ids=torch.tensor(tgt), use_cache=False).logits.double().numpy()


def relative(a: np.ndarray, b: np.ndarray, where: np.ndarray) -> float:
    return float(np.linalg.norm((a - b)[where]) / np.linalg.norm(b[where]))


def fairseq_table(rows: int, d: int, pad: int) -> torch.Tensor:
    """get_embedding of modeling_m2m_100.py in float64: exp(-i ln(1e4) / (d/2 - 1)), [sin | cos],
    row pad 0."""
    half = d // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float64) * -(math.log(10000) / (half - 1)))
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * freq[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    table[pad] = 0
    return table


def test_m2m100_logits_in_every_backend(m2m_dir, backend):
    name, model, path = m2m_dir
    assert is_m2m100(path) and detect_format(path) == "m2m100"
    cfg, params = read_m2m100(path)
    assert cfg.share_embeddings == CONFIGS[name][2]
    assert cfg.position_offset == model.config.pad_token_id + 1 and cfg.norm_first and cfg.has_final_norm
    src, tgt = batch(cfg)
    ours = rosetta.from_params(cfg, params, backend=backend).logits(src, tgt)
    assert relative(np.asarray(ours, np.float64), hf_logits(model, src, tgt), tgt != cfg.pad_id) <= TOLERANCE


def test_m2m100_logits_in_float64(m2m_dir, backend):
    """Every backend in float64 against Hugging Face in float64, its positional tables replaced by
    fairseq's formula in float64 (it computes them in float32)."""
    _, model, path = m2m_dir
    cfg, params = read_m2m100(path)
    hf = copy.deepcopy(model).double()
    for stack in (hf.model.encoder, hf.model.decoder):
        stack.embed_positions.weights = fairseq_table(*stack.embed_positions.weights.shape, cfg.pad_id)
    src, tgt = batch(cfg, seed=2)
    ours = rosetta.from_params(cfg, params, backend=backend, dtype="float64").logits(src, tgt)
    assert relative(np.asarray(ours), hf_logits(hf, src, tgt), tgt != cfg.pad_id) <= TOLERANCE_64


def test_m2m100_to_ours_to_m2m100_is_bit_exact(m2m_dir):
    _, _, path = m2m_dir
    stored = safetensors.numpy.load_file(str(path / "model.safetensors"))
    cfg, params = read_m2m100(path)
    back = params_to_m2m100(cfg, params)
    # untied: model.shared is read by nothing M2M100 computes; we write the source table there
    assert set(back) == set(stored)
    for name, value in stored.items():
        if name == "model.shared.weight" and cfg.share_embeddings != "all":
            continue
        assert back[name].dtype == value.dtype and np.array_equal(back[name], value), name


@pytest.mark.parametrize("share", ["all", "src_tgt", "decoder", "none"])
def test_ours_to_m2m100_to_ours_and_from_pretrained(tmp_path, share):
    """A checkpoint of ours, `rosetta convert --to m2m100`: the config and weights come back exactly,
    and transformers' from_pretrained computes our logits."""
    cfg = rosetta.ModelConfig(src_vocab_size=19, tgt_vocab_size=19, d_model=16, num_heads=2,
                              num_encoder_layers=1, num_decoder_layers=2, d_ff=24, dropout=0.0,
                              activation_dropout=0.0, attention_dropout=0.0, activation="gelu_tanh",
                              max_len=40,
                              norm_first=True, final_norm=True, positional_encoding="sinusoidal_concat_t2t",
                              position_offset=2, share_embeddings=share, pad_id=1, bos_id=EOS, eos_id=EOS)
    rng = np.random.default_rng(0)
    params = {k: (v + 0.2 * rng.standard_normal(v.shape)).astype(np.float32)
              for k, v in rosetta.init_params(cfg, seed=0).items()}
    rosetta.save_checkpoint(tmp_path / "ours.safetensors", cfg, params)
    result = convert(tmp_path / "ours.safetensors", tmp_path / "hf", to_format="m2m100")
    assert result.to_format == "m2m100"
    cfg2, params2 = read_m2m100(tmp_path / "hf")
    assert cfg2 == cfg
    assert set(params2) == set(params) and all(np.array_equal(params2[k], params[k]) for k in params)
    hf = M2M100ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    src, tgt = batch(cfg)
    ours = rosetta.from_params(cfg, params, backend="numpy").logits(src, tgt)
    assert relative(ours, hf_logits(hf, src, tgt), tgt != cfg.pad_id) <= TOLERANCE


# -- search against generate ---------------------------------------------------------------------

def hf_search(model: M2M100ForConditionalGeneration, src_row: np.ndarray, max_new_tokens: int, beams: int = 1,
              alpha: float = 1.0, forced: int | None = None) -> list[int]:
    """Hugging Face's search on one sentence (beam: early_stopping=False), without the start token,
    cut at eos, pad never generated (as ours); `forced`: generate's forced_bos_token_id."""
    pad = model.config.pad_token_id
    with torch.no_grad():
        out = model.generate(torch.tensor(src_row[None]), num_beams=beams, do_sample=False,
                             length_penalty=alpha, early_stopping=False, max_new_tokens=max_new_tokens,
                             bad_words_ids=[[pad]], forced_eos_token_id=None,
                             forced_bos_token_id=forced)[0, 1:].tolist()
    return [t for t in (out[: out.index(EOS)] if EOS in out else out) if t != pad]


def end_some_sentences(model: M2M100ForConditionalGeneration, src: np.ndarray, steps: int) -> None:
    """Lift eos's logit so that greedy search ends some sentences early and not others (random
    weights rarely choose eos). The logits have no bias: coordinate 0 of the decoder's final
    LayerNorm is made the constant 1 (scale 0, bias 1), so column 0 of the (untied) lm_head is one;
    eos's entry is then the median, over the sentences, of the least gap by which eos trails the
    best token along the greedy path."""
    norm, out = model.model.decoder.layer_norm, model.lm_head
    pad = model.config.pad_token_id
    with torch.no_grad():
        norm.weight[0], norm.bias[0] = 0.0, 1.0
        out.weight[:, 0] = 0.0
    gaps = []
    for row in src:
        row = row[row != pad]
        path = [model.config.decoder_start_token_id] + hf_search(model, row, steps)
        logits = hf_logits(model, row[None], np.array([path]))[0]
        gaps.append(float((logits.max(-1) - logits[:, EOS]).min()))
    with torch.no_grad():
        out.weight[EOS, 0] = float(np.median(gaps)) + 1e-3


@pytest.fixture(scope="module")
def ending_dir(tmp_path_factory):
    """An untied model (an lm_head to lift eos in) whose greedy search ends some sentences early."""
    name = "none-gelu-unscaled"
    model = make_m2m100(name)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    cfg, _ = read_m2m100(path)
    src, _ = batch(cfg, seed=3)
    end_some_sentences(model, src, steps=src.shape[1] + 6)
    model.save_pretrained(path)
    cfg, params = read_m2m100(path)
    return model, cfg, params, src


def test_m2m100_greedy_equals_generate(ending_dir):
    model, cfg, params, src = ending_dir
    margin = 6
    limits = (src != cfg.pad_id).sum(axis=1) + margin
    theirs = [hf_search(model, row[row != cfg.pad_id], int(limit))
              for row, limit in zip(src, limits, strict=True)]
    for backend in MODEL_BACKENDS:
        assert rosetta.from_params(cfg, params, backend=backend).generate(
            src, beam_size=1, max_len_margin=margin).tokens == theirs, backend
    lengths = [len(t) for t in theirs]
    assert any(n < limit for n, limit in zip(lengths, limits, strict=True)), lengths  # some ended with eos
    assert any(n > 0 for n in lengths), lengths


@pytest.mark.parametrize("alpha", [0.6, 1.0])
def test_m2m100_beam_4_with_the_hugging_face_rule_equals_generate(ending_dir, alpha):
    model, cfg, params, src = ending_dir
    margin = 5
    limits = (src != cfg.pad_id).sum(axis=1) + margin
    theirs = [hf_search(model, row[row != cfg.pad_id], int(limit), beams=4, alpha=alpha)
              for row, limit in zip(src, limits, strict=True)]
    for backend in MODEL_BACKENDS:
        ours = rosetta.from_params(cfg, params, backend=backend).generate(
            src, beam_size=4, alpha=alpha, max_len_margin=margin, length_rule="hf")
        assert ours.tokens == theirs, backend


@pytest.mark.parametrize("beams, alpha", [(1, 1.0), (4, 0.6)])
def test_m2m100_search_with_a_forced_language_code_equals_generate(ending_dir, beams, alpha):
    """generate with forced_bos_token_id (the target language code) emits [</s>, LANG, ...]; our
    search with forced_first=LANG gives the same tokens, LANG first, in every backend."""
    model, cfg, params, src = ending_dir
    margin = 6
    limits = (src != cfg.pad_id).sum(axis=1) + margin
    theirs = [hf_search(model, row[row != cfg.pad_id], int(limit), beams=beams, alpha=alpha, forced=LANG)
              for row, limit in zip(src, limits, strict=True)]
    assert all(row[0] == LANG for row in theirs)
    for backend in MODEL_BACKENDS:
        ours = rosetta.from_params(cfg, params, backend=backend).generate(
            src, beam_size=beams, alpha=alpha, max_len_margin=margin, length_rule="hf", forced_first=LANG)
        assert ours.tokens == theirs, backend


# -- refusals ------------------------------------------------------------------------------------

def _saved(tmp_path, name="all-relu-scaled"):
    path = tmp_path / "m"
    make_m2m100(name).save_pretrained(path)
    return path


@pytest.mark.parametrize("field, value", [
    ("decoder_attention_heads", 2), ("decoder_ffn_dim", 16), ("activation_function", "quick_gelu"),
    ("decoder_start_token_id", 1), ("eos_token_id", [2, 3]), ("pad_token_id", None),
    ("decoder_start_token_id", None), ("dtype", "int8"), ("scale_embedding", "yes"), ("model_type", "bart")])
def test_config_fields_m2m100_computes_and_we_cannot_are_refused(tmp_path, field, value):
    """Each is refused naming the field: heads or widths per stack, an activation, a start token equal
    to pad (M2M100 gives it the zero position row), several end tokens, no pad or start id, a non-float
    dtype, a mistyped field, another model."""
    path = _saved(tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ConfigError, match=field):
        read_m2m100(path)


def test_fields_m2m100_ignores_are_noted_once(tmp_path, capsys):
    path = _saved(tmp_path)
    config = json.loads((path / "config.json").read_text())
    assert config["encoder_layerdrop"] == 0.05  # M2M100Config's default: every real config is noted
    extra = {"normalize_before": False, "hidden_size": 16, "my_field": 1}
    (path / "config.json").write_text(json.dumps({**config, **extra}))
    read_m2m100(path)
    read_m2m100(path)
    err = capsys.readouterr().err
    for field in ("encoder_layerdrop", "decoder_layerdrop", "normalize_before", "my_field"):
        assert err.count(field) == 1, (field, err)
    assert "hidden_size" not in err  # an alias of d_model, agreeing with it


@pytest.mark.parametrize("field, value", [
    ("norm_first", False), ("final_norm", False), ("positional_encoding", "sinusoidal_concat"),
    ("position_offset", 0), ("layer_norm_eps", 1e-6), ("output_bias", True), ("logit_scale", 0.5),
    ("bos_id", 1), ("src_vocab_size", 21)])
def test_unrepresentable_config_is_refused_and_nothing_written(tmp_path, field, value):
    base = dict(src_vocab_size=19, tgt_vocab_size=19, d_model=8, num_heads=2, num_encoder_layers=1,
                num_decoder_layers=1, d_ff=8, norm_first=True, positional_encoding="sinusoidal_concat_t2t",
                position_offset=2, pad_id=1, bos_id=EOS, eos_id=EOS)
    changes = {field: value, **({"share_embeddings": "none"} if field == "src_vocab_size" else {})}
    cfg = rosetta.ModelConfig(**{**base, **changes})
    with pytest.raises(ConfigError, match=field):
        write_m2m100(tmp_path / "hf", cfg, rosetta.init_params(cfg, seed=0))
    assert not (tmp_path / "hf").exists()


def test_cli_convert_detects_m2m100_and_writes_it_back(m2m_dir, tmp_path):
    """`rosetta convert DIR ck.safetensors` detects the format from config.json's model_type; `--to
    m2m100` writes a directory from_pretrained loads, with the model's own logits."""
    from rosetta.cli import main

    _, model, path = m2m_dir
    assert main(["convert", str(path), str(tmp_path / "ck.safetensors")]) == 0
    assert main(["convert", str(tmp_path / "ck.safetensors"), str(tmp_path / "back"), "--to", "m2m100"]) == 0
    back = M2M100ForConditionalGeneration.from_pretrained(tmp_path / "back").eval()
    cfg, _ = read_m2m100(path)
    src, tgt = batch(cfg)
    np.testing.assert_array_equal(hf_logits(back, src, tgt), hf_logits(model, src, tgt))
