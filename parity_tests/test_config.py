"""The configuration (SPEC §1): paper defaults, presets, JSON round trip, validation."""

from __future__ import annotations

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
