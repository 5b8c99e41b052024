"""The configuration (SPEC §1): paper defaults, presets, JSON round trip, validation."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from parity_tests.conftest import CONFIG_VARIANTS, variant_config
from rosetta import PRESETS, ConfigError, ModelConfig, preset


def test_defaults_are_the_papers_base_model():
    cfg = ModelConfig(src_vocab_size=37000, tgt_vocab_size=37000)
    # Vaswani et al. 2017, Table 3 "base" row and §5.4.
    assert (cfg.d_model, cfg.num_heads, cfg.d_ff) == (512, 8, 2048)
    assert (cfg.num_encoder_layers, cfg.num_decoder_layers) == (6, 6)
    assert cfg.dropout == 0.1 and cfg.d_head == 64
    assert cfg.norm_first is False and cfg.has_final_norm is False
    assert cfg.positional_encoding == "sinusoidal_interleaved"


def test_big_preset_is_table_3_big():
    cfg = preset("big")
    assert (cfg.d_model, cfg.num_heads, cfg.d_ff, cfg.dropout) == (1024, 16, 4096, 0.3)


def test_resolved_defaults_follow_their_fields():
    cfg = preset("tiny", dropout=0.3, norm_first=True)
    assert cfg.activation_dropout_rate == 0.3 and cfg.has_final_norm is True
    cfg = preset("tiny", dropout=0.3, activation_dropout=0.0, norm_first=True, final_norm=False)
    assert cfg.activation_dropout_rate == 0.0 and cfg.has_final_norm is False


@pytest.mark.parametrize("name", sorted(PRESETS) + [f"variant:{v}" for v in CONFIG_VARIANTS])
def test_json_round_trip(name):
    cfg = variant_config(name[8:]) if name.startswith("variant:") else preset(name)
    assert ModelConfig.from_json(cfg.to_json()) == cfg


def test_left_out_fields_take_defaults():
    cfg = ModelConfig.from_json('{"src_vocab_size": 10, "tgt_vocab_size": 10}')
    assert cfg == ModelConfig(10, 10)


BAD_CONFIGS = [
    ({"colour": "red"}, "unknown config field(s): colour"),
    ({"d_model": 33, "num_heads": 3}, "d_model must be even"),
    ({"d_model": 32, "num_heads": 6}, "divisible by num_heads"),
    ({"num_encoder_layers": 0}, "num_encoder_layers must be >= 1"),
    ({"num_decoder_layers": 0}, "num_decoder_layers must be >= 1"),
    ({"pad_id": 64}, "pad_id 64 is outside the vocabularies"),
    ({"share_embeddings": "none", "src_vocab_size": 10, "pad_id": 12}, "pad_id 12"),
    ({"bos_id": 64}, "bos_id 64 is outside the target vocabulary"),
    ({"eos_id": -1}, "eos_id must be >= 0"),
    ({"src_vocab_size": 50}, "share_embeddings='all' needs equal vocab sizes"),
    ({"src_vocab_size": 50, "share_embeddings": "src_tgt"}, "needs equal vocab sizes"),
    ({"activation": "tanh"}, "activation must be one of"),
    ({"positional_encoding": "learned"}, "positional_encoding must be one of"),
    ({"share_embeddings": "yes"}, "share_embeddings must be one of"),
    ({"dropout": 1.5}, "dropout must be a number in [0, 1)"),
    ({"attention_dropout": -0.1}, "attention_dropout"),
    ({"activation_dropout": "0.1"}, "activation_dropout"),
    ({"layer_norm_eps": 0}, "layer_norm_eps must be a positive number"),
    ({"num_heads": True}, "num_heads must be an integer"),
    ({"d_ff": 64.0}, "d_ff must be an integer"),
    ({"norm_first": 1}, "norm_first must be true or false"),
    ({"final_norm": "no"}, "final_norm must be true or false"),
    ({"max_len": 0}, "max_len must be >= 1"),
    ({"position_offset": -1}, "position_offset must be >= 0"),
    ({"position_offset": True}, "position_offset must be an integer"),
    ({"position_offset": 2.0}, "position_offset must be an integer"),
    ({"max_len": 2**20, "position_offset": 1}, "max_len + position_offset must be <= 1,048,576"),
]


@pytest.mark.parametrize("overrides,message", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_bad_config_is_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict({**PRESETS["tiny"], **overrides})
    assert message in str(err.value)


def test_missing_required_field_is_named():
    with pytest.raises(ConfigError, match="missing required config field.*tgt_vocab_size"):
        ModelConfig.from_dict({"src_vocab_size": 10})


def test_bad_json_and_unknown_preset():
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json("{d_model: 3")
    with pytest.raises(ConfigError, match="config must be a JSON object"):
        ModelConfig.from_json("[1, 2]")
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset("huge")


# -- untrusted configs: finite, bounded, unambiguous (issue 11) --------------------------------

NONFINITE_OR_OUT_OF_RANGE = [
    ({"layer_norm_eps": float("inf")}, "layer_norm_eps must be a positive number"),
    ({"layer_norm_eps": float("nan")}, "layer_norm_eps must be a positive number"),
    ({"layer_norm_eps": -1e-5}, "layer_norm_eps must be a positive number"),
    ({"layer_norm_eps": 1e-300}, "layer_norm_eps"),  # flushes to zero in float32
    ({"layer_norm_eps": 5.0}, "layer_norm_eps"),  # not a small guard
    ({"dropout": float("nan")}, "dropout must be a number in [0, 1)"),
    ({"dropout": float("inf")}, "dropout must be a number in [0, 1)"),
    ({"attention_dropout": float("nan")}, "attention_dropout must be a number in [0, 1)"),
    ({"activation_dropout": float("-inf")}, "activation_dropout must be a number in [0, 1)"),
]


@pytest.mark.parametrize("overrides,message", NONFINITE_OR_OUT_OF_RANGE,
                         ids=[str(o) for o, _ in NONFINITE_OR_OUT_OF_RANGE])
def test_float_fields_must_be_finite_and_in_range(overrides, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict({**PRESETS["tiny"], **overrides})
    assert message in str(err.value)


# Sizes real models use, from their papers and configs: every one must be accepted.
REAL_MODELS = {
    "paper_big": dict(d_model=1024, num_heads=16, d_ff=4096, src_vocab_size=37000, tgt_vocab_size=37000),
    "marian_big": dict(d_model=1024, num_heads=16, d_ff=4096, src_vocab_size=58101,
                       tgt_vocab_size=58101, max_len=1024),
    "t5_11b_widths": dict(d_model=1024, num_heads=128, d_ff=65536, src_vocab_size=32128,
                          tgt_vocab_size=32128),
    "mt5_xxl": dict(d_model=4096, num_heads=64, d_ff=10240, src_vocab_size=250112,
                    tgt_vocab_size=250112, num_encoder_layers=24, num_decoder_layers=24),
    "deepnet_1000_layers": dict(num_encoder_layers=500, num_decoder_layers=500),
    "million_token_vocab": dict(src_vocab_size=1_000_000, tgt_vocab_size=1_000_000),
    "long_documents": dict(max_len=65536),
}


@pytest.mark.parametrize("name", sorted(REAL_MODELS))
def test_bounds_admit_every_real_model(name):
    cfg = ModelConfig.from_dict({**PRESETS["base"], **REAL_MODELS[name]})
    assert ModelConfig.from_json(cfg.to_json()) == cfg


HOSTILE = [
    ({"num_encoder_layers": 1_000_000_000}, "num_encoder_layers must be <= "),
    ({"num_decoder_layers": 10**30}, "num_decoder_layers must be <= "),
    ({"max_len": 100_000_000}, "max_len must be <= "),
    ({"d_model": 2**40, "num_heads": 1}, "d_model must be <= "),
    ({"d_ff": 10**12}, "d_ff must be <= "),
    ({"num_heads": 2**20, "d_model": 2**20}, "must be <= "),
    ({"src_vocab_size": 10**10, "tgt_vocab_size": 10**10}, "src_vocab_size must be <= "),
    ({"tgt_vocab_size": 10**10, "share_embeddings": "none"}, "tgt_vocab_size must be <= "),
]


@pytest.mark.parametrize("overrides,message", HOSTILE, ids=[str(o) for o, _ in HOSTILE])
def test_hostile_sizes_are_refused_with_the_reason(overrides, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict({**PRESETS["tiny"], **overrides})
    assert message in str(err.value)
    assert "untrusted" in str(err.value)  # the reason, not just the number


def test_hostile_config_json_is_refused_at_once():
    # A billion layers used to hang in param_shapes until memory ran out.
    text = json.dumps({**PRESETS["tiny"], "num_encoder_layers": 1_000_000_000})
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="num_encoder_layers must be <= "):
        ModelConfig.from_json(text)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("text,message", [
    ('{"src_vocab_size": 64, "tgt_vocab_size": 64, "src_vocab_size": 64}',
     "duplicate key 'src_vocab_size'"),
    ('{"src_vocab_size": 64, "tgt_vocab_size": 64, "layer_norm_eps": NaN}', "NaN"),
    ('{"src_vocab_size": 64, "tgt_vocab_size": 64, "layer_norm_eps": Infinity}', "Infinity"),
    ('{"src_vocab_size": 64, "tgt_vocab_size": 64, "dropout": -Infinity}', "-Infinity"),
    ('{"src_vocab_size": 64, "tgt_vocab_size": 64, "layer_norm_eps": 1e400}', "out of range"),
    ('{"src_vocab_size": 64, "tgt_vocab_size": 64, "d_model": ' + "9" * 5000 + "}", "config"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
])
def test_json_that_python_accepts_but_json_does_not_mean_is_refused(text, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_json(text)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


# -- logit_scale (SPEC §1-2): validated, and left out of the JSON at 1.0 ---------------------

# What `preset("tiny").to_json()` wrote before logit_scale existed (the code at HEAD 1ffaa10).
TINY_JSON_BEFORE_LOGIT_SCALE = (
    '{"activation": "relu", "activation_dropout": null, "attention_bias": true, "attention_dropout": 0.0, '
    '"bos_id": 1, "d_ff": 64, "d_model": 32, "dropout": 0.1, "eos_id": 2, "ffn_bias": true, '
    '"final_norm": null, "layer_norm_eps": 1e-05, "max_len": 128, "norm_first": false, '
    '"num_decoder_layers": 2, "num_encoder_layers": 2, "num_heads": 4, "output_bias": false, "pad_id": 0, '
    '"positional_encoding": "sinusoidal_interleaved", "scale_embeddings": true, "share_embeddings": "all", '
    '"src_vocab_size": 64, "tgt_vocab_size": 64}')


@pytest.mark.parametrize("value", [0, -0.5, float("nan"), float("inf"), float("-inf"), 1e-300, 1e39,
                                   10**400, True, "0.5", None])
def test_logit_scale_must_be_positive_and_finite(value):
    with pytest.raises(ConfigError, match="logit_scale must be a positive finite number"):
        preset("tiny", logit_scale=value)


def test_logit_scale_is_left_out_of_the_json_at_one_and_read_back_otherwise():
    cfg = preset("tiny")
    assert cfg.logit_scale == 1.0
    assert "logit_scale" not in cfg.to_dict() and cfg.to_json() == TINY_JSON_BEFORE_LOGIT_SCALE
    assert preset("tiny", logit_scale=1).to_json() == TINY_JSON_BEFORE_LOGIT_SCALE  # the int 1 too
    flax = preset("tiny", logit_scale=32 ** -0.5)  # Flax examples/wmt's logits_via_embedding, d = 32
    assert json.loads(flax.to_json())["logit_scale"] == 32 ** -0.5
    back = ModelConfig.from_json(flax.to_json())
    assert back == flax and back.logit_scale == 32 ** -0.5  # exactly: JSON keeps every float64 bit
    assert ModelConfig.from_json(TINY_JSON_BEFORE_LOGIT_SCALE) == cfg  # an earlier file: 1.0


def test_default_checkpoint_metadata_is_unchanged_by_logit_scale(tmp_path):
    """A checkpoint of a config with logit_scale 1.0 carries the config JSON the code wrote before
    the field existed, byte for byte; one with another scale carries the field and reads it back."""
    from rosetta import init_params, load_checkpoint, save_checkpoint
    from rosetta.checkpoint import read_header

    cfg = preset("tiny")
    path = save_checkpoint(tmp_path / "m.safetensors", cfg, init_params(cfg))
    assert dict(read_header(path).metadata)["config"] == TINY_JSON_BEFORE_LOGIT_SCALE
    scaled = cfg.replace(logit_scale=0.3)
    path = save_checkpoint(tmp_path / "s.safetensors", scaled, init_params(scaled))
    assert json.loads(dict(read_header(path).metadata)["config"])["logit_scale"] == 0.3
    assert load_checkpoint(path).config == scaled


# -- position_offset (SPEC §1-2): left out of the JSON at 0, read back otherwise; the table shifts --

def test_position_offset_is_left_out_of_the_json_at_zero_and_read_back_otherwise():
    assert preset("tiny").position_offset == 0 and "position_offset" not in preset("tiny").to_dict()
    assert preset("tiny", position_offset=0).to_json() == TINY_JSON_BEFORE_LOGIT_SCALE
    fairseq = preset("tiny", pad_id=1, position_offset=2)
    assert json.loads(fairseq.to_json())["position_offset"] == 2
    assert ModelConfig.from_json(fairseq.to_json()) == fairseq
    assert ModelConfig.from_json(TINY_JSON_BEFORE_LOGIT_SCALE).position_offset == 0  # an older file


@pytest.mark.parametrize("kind", ["sinusoidal_interleaved", "sinusoidal_concat", "sinusoidal_concat_t2t"])
def test_model_table_row_t_is_the_formula_at_t_plus_position_offset(kind):
    """Row t of the table every backend holds is PE[t + position_offset], PE written out here from
    the formulas (paper §3.5; tensor2tensor's get_timing_signal_1d for _t2t), not from the code."""
    from rosetta.positional import model_table

    d, k = 8, 3
    cfg = preset("tiny", d_model=d, num_heads=2, positional_encoding=kind, max_len=10, position_offset=k)
    p = np.arange(k, k + 10, dtype=np.float64)[:, None]
    i = np.arange(d // 2)[None, :]
    if kind == "sinusoidal_concat_t2t":
        angles = p * np.exp(-i * np.log(10000.0) / (d // 2 - 1))
    else:
        angles = p / 10000.0 ** (2 * i / d)
    if kind == "sinusoidal_interleaved":
        want = np.stack([np.sin(angles), np.cos(angles)], axis=-1).reshape(10, d)
    else:
        want = np.concatenate([np.sin(angles), np.cos(angles)], axis=1)
    np.testing.assert_allclose(model_table(cfg), want, rtol=0, atol=1e-12)
    assert np.array_equal(model_table(cfg.replace(position_offset=0))[k:], model_table(cfg)[: 10 - k])
