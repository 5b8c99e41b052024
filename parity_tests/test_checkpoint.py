"""The checkpoint file (SPEC §3): bit-exact round trips, strict refusal, atomic writes."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from parity_tests.conftest import CONFIG_VARIANTS, variant_config
from rosetta import CheckpointError, init_params, load_checkpoint, param_shapes, preset, save_checkpoint
from rosetta.checkpoint import FORMAT


@pytest.mark.parametrize("variant", sorted(CONFIG_VARIANTS))
def test_round_trip_is_bit_exact(tmp_path, variant):
    cfg = variant_config(variant)
    params = init_params(cfg, seed=3)
    save_checkpoint(tmp_path / "m.safetensors", cfg, params)
    ckpt = load_checkpoint(tmp_path / "m.safetensors")
    assert ckpt.config == cfg and ckpt.dtype == "float32"
    assert list(ckpt.params) == list(param_shapes(cfg))
    for name, value in params.items():
        assert ckpt.params[name].dtype == np.float32
        assert ckpt.params[name].tobytes() == value.tobytes(), name


@pytest.mark.parametrize("dtype,np_dtype", [("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)])
def test_half_precision_round_trip_is_bit_exact(tmp_path, dtype, np_dtype):
    cfg = preset("tiny")
    params = {k: v.astype(np_dtype) for k, v in init_params(cfg).items()}
    save_checkpoint(tmp_path / "m.safetensors", cfg, params, dtype=dtype)
    ckpt = load_checkpoint(tmp_path / "m.safetensors")
    assert ckpt.dtype == dtype
    for name, value in params.items():
        assert ckpt.params[name].dtype == np_dtype
        assert ckpt.params[name].tobytes() == value.tobytes(), name


def test_file_carries_format_config_and_dtype(tmp_path):
    cfg = preset("tiny", norm_first=True)
    save_checkpoint(tmp_path / "m.safetensors", cfg, init_params(cfg))
    with open(tmp_path / "m.safetensors", "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(header_len))["__metadata__"]
    assert meta["format"] == "rosetta-transformer/1" and meta["dtype"] == "float32"
    assert json.loads(meta["config"])["norm_first"] is True


# -- malformed files -----------------------------------------------------------------------

def _write_raw(path, tensors, metadata):
    safetensors.numpy.save_file(tensors, str(path), metadata=metadata)


def _good(cfg):
    meta = {"format": FORMAT, "config": cfg.to_json(), "dtype": "float32"}
    return dict(init_params(cfg)), meta


def _missing(t, m):
    del t["decoder.layers.1.ffn.linear2.bias"]


def _extra(t, m):
    t["encoder.final_norm.scale"] = np.ones(32, np.float32)


def _misshapen(t, m):
    t["encoder.layers.0.self_attn.q.kernel"] = np.ones((32, 16), np.float32)


def _wrong_type(t, m):
    t["encoder.layers.0.ffn.linear1.kernel"] = t["encoder.layers.0.ffn.linear1.kernel"].astype(np.float16)


def _nan(t, m):
    t["decoder.layers.0.cross_attn.v.bias"] = np.full(32, np.nan, np.float32)


def _wrong_format(t, m):
    m["format"] = "pytorch"


def _no_config(t, m):
    del m["config"]


def _bad_config_json(t, m):
    m["config"] = "{not json"


def _bad_config_field(t, m):
    m["config"] = json.dumps({**json.loads(m["config"]), "d_model": 31})


def _config_mismatch(t, m):
    m["config"] = json.dumps({**json.loads(m["config"]), "d_model": 64, "d_ff": 128})


def _unknown_dtype(t, m):
    m["dtype"] = "float8"


MALFORMED = [
    (_missing, "missing tensor(s) decoder.layers.1.ffn.linear2.bias"),
    (_extra, "unexpected tensor(s) encoder.final_norm.scale"),
    (_misshapen, "tensor encoder.layers.0.self_attn.q.kernel has shape (32, 16)"),
    (_wrong_type, "tensor encoder.layers.0.ffn.linear1.kernel is stored as float16"),
    (_nan, "tensor decoder.layers.0.cross_attn.v.bias holds NaN"),
    (_wrong_format, "metadata 'format' is 'pytorch'"),
    (_no_config, "metadata has no 'config'"),
    (_bad_config_json, "bad config in metadata: config is not valid JSON"),
    (_bad_config_field, "bad config in metadata: d_model must be even"),
    (_config_mismatch, "tensor shared_embed.embedding has shape (64, 32), the config expects (64, 64)"),
    (_unknown_dtype, "metadata 'dtype' 'float8'"),
]


@pytest.mark.parametrize("corrupt,message", MALFORMED, ids=[f.__name__[1:] for f, _ in MALFORMED])
def test_malformed_checkpoint_is_refused_naming_it(tmp_path, corrupt, message):
    tensors, meta = _good(preset("tiny"))
    corrupt(tensors, meta)
    _write_raw(tmp_path / "bad.safetensors", tensors, meta)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path / "bad.safetensors")
    assert message in str(err.value)


@pytest.mark.parametrize("cut", [1, 100, 5000])
def test_truncated_file_is_refused(tmp_path, cut):
    cfg = preset("tiny")
    path = save_checkpoint(tmp_path / "m.safetensors", cfg, init_params(cfg))
    data = path.read_bytes()
    path.write_bytes(data[:-cut])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(path)


@pytest.mark.parametrize("content", [b"", b"hello world", b"\xff" * 64])
def test_garbage_file_is_refused(tmp_path, content):
    (tmp_path / "junk.safetensors").write_bytes(content)
    with pytest.raises(CheckpointError, match="junk.safetensors"):
        load_checkpoint(tmp_path / "junk.safetensors")


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        load_checkpoint(tmp_path / "nope.safetensors")


def test_save_refuses_params_that_do_not_match_the_config(tmp_path):
    cfg = preset("tiny")
    params = init_params(cfg)
    params["generator.kernel"] = np.zeros((32, 64), np.float32)  # tied config has none
    with pytest.raises(CheckpointError, match="unexpected tensor.*generator.kernel"):
        save_checkpoint(tmp_path / "m.safetensors", cfg, params)
    assert not list(tmp_path.iterdir())


# -- atomic writes -------------------------------------------------------------------------

def test_crash_mid_save_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    cfg = preset("tiny")
    path = save_checkpoint(tmp_path / "m.safetensors", cfg, init_params(cfg, seed=1))
    before = path.read_bytes()

    def crash(src, dst):
        raise OSError("disk pulled out mid-rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk pulled out"):
        save_checkpoint(path, cfg, init_params(cfg, seed=2))
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


def test_refused_save_never_touches_the_existing_file(tmp_path):
    cfg = preset("tiny")
    path = save_checkpoint(tmp_path / "m.safetensors", cfg, init_params(cfg))
    before = path.read_bytes()
    bad = init_params(cfg)
    bad["encoder.layers.0.ffn.linear1.bias"][3] = np.inf
    with pytest.raises(CheckpointError, match="linear1.bias holds NaN or infinity"):
        save_checkpoint(path, cfg, bad)
    assert path.read_bytes() == before
