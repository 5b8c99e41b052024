"""The checkpoint file (SPEC §3): bit-exact round trips, strict refusal, atomic writes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import resource
import stat
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

import rosetta
from parity_tests.conftest import CONFIG_VARIANTS, variant_config
from parity_tests.safetensors_bytes import join, split
from rosetta import (
    PRESETS,
    CheckpointError,
    from_params,
    init_params,
    load_checkpoint,
    param_shapes,
    preset,
    save_checkpoint,
)
from rosetta.checkpoint import FORMAT
from rosetta.files import atomic_write
from rosetta.harness.trainer_state import load_trainer_state, save_trainer_state
from rosetta.params import checkpoint_size
from rosetta.parity import random_batch, relative_error, target_positions

# _refused_cheaply's allocation bound at Python's own collector thresholds (conftest.py: python_collector).
pytestmark = pytest.mark.usefixtures("python_collector")


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


def test_tensor_count_and_size_by_arithmetic_match_the_enumeration():
    # checkpoint_size is what untrusted headers are checked against before any enumeration.
    for cfg in [variant_config(v) for v in CONFIG_VARIANTS] + [preset(p) for p in PRESETS]:
        shapes = param_shapes(cfg)
        size = checkpoint_size(cfg)
        assert size.tensors == len(shapes), cfg
        assert size.params == sum(math.prod(shape) for shape in shapes.values()), cfg


# -- half-precision files in every backend (issue 11, 1) ----------------------------------------

# Relative error of a backend's default compute dtype against the float64 reference
# (rosetta.parity.TOLERANCES for float32; float64 agrees to rounding).
COMPUTE_TOLERANCE = {"float64": 1e-12, "float32": 1e-5}


@pytest.mark.parametrize("dtype,np_dtype", [("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16)])
def test_half_precision_file_runs_in_every_backend(tmp_path, backend, dtype, np_dtype):
    cfg = preset("tiny")
    rng = np.random.default_rng(1)
    # Perturbed so that zero biases and unit scales cannot hide a dropped tensor.
    params = {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(np_dtype)
              for k, v in init_params(cfg).items()}
    path = save_checkpoint(tmp_path / "m.safetensors", cfg, params, dtype=dtype)
    model = rosetta.load(path, backend=backend)
    src, tgt = random_batch(cfg, seed=2)
    upcast = {k: v.astype(np.float64) for k, v in params.items()}  # exact for both types
    want = from_params(cfg, upcast, "numpy", "float64").logits(src, tgt)
    err = relative_error(model.logits(src, tgt), want, target_positions(cfg, tgt))
    assert err <= COMPUTE_TOLERANCE[model.dtype], f"relative error {err:.2e}"
    # The weights arrive exactly: the stored half-precision values, widened.
    for name, value in model.to_params().items():
        assert np.array_equal(value.astype(np.float64), upcast[name]), name


# -- untrusted headers: checked before anything is allocated (issue 11, 2 and 3) -----------------

def _good_file(tmp_path, cfg=None):
    cfg = cfg or preset("tiny")
    path = save_checkpoint(tmp_path / "m.safetensors", cfg, init_params(cfg))
    return path, *split(path.read_bytes())


def _refused_cheaply(path, *messages, stored=None):
    """Load `path`; it must be refused naming `messages`, in well under a second, without
    allocating more than a few times the bytes the file stores (`stored`, default its size;
    NumPy and Python objects by tracemalloc, anything else shows in the peak resident memory)."""
    stored = path.stat().st_size if stored is None else stored
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(CheckpointError) as err:
            load_checkpoint(path)
    finally:
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    text = str(err.value)
    assert str(path) in text and "\n" not in text
    for message in messages:
        assert message in text
    assert peak <= 4 * stored + 2**20, f"{peak:,} bytes traced for {stored:,} stored bytes"
    assert rss_growth <= 64 * 2**20, f"resident memory grew by {rss_growth:,} bytes"
    assert elapsed < 1.0, f"{elapsed:.2f} s"


@pytest.mark.parametrize("gigabytes", [2, 4, 40])
def test_huge_tensor_declared_in_a_sparse_file_is_refused_cheaply(tmp_path, gigabytes):
    # The file's apparent size covers the tensor, its disk blocks do not: the old reader read
    # every tensor before checking names (4.2 GB for 2 GB, a panic or MemoryError beyond).
    path, header, body = _good_file(tmp_path)
    nbytes = gigabytes * 2**30
    header["huge"] = {"dtype": "F32", "shape": [nbytes // 4], "data_offsets": [len(body), len(body) + nbytes]}
    data = join(header, body)
    with open(path, "wb") as f:
        f.write(data)
        f.truncate(len(data) + nbytes)  # a hole: no data written, no disk used
    _refused_cheaply(path, "unexpected tensor(s) huge", stored=len(data))


def test_huge_tensor_declared_beyond_the_end_of_the_file_is_refused_cheaply(tmp_path):
    path, header, body = _good_file(tmp_path)
    header["huge"] = {"dtype": "F32", "shape": [2**30], "data_offsets": [len(body), len(body) + 2**32]}
    path.write_bytes(join(header, body))
    _refused_cheaply(path, "tensor huge ends at byte")


def _set_config(field, value):
    def edit(header, body):
        config = json.loads(header["__metadata__"]["config"])
        header["__metadata__"]["config"] = json.dumps({**config, field: value})
        return join(header, body)
    return edit


def _header_length(value):
    return lambda header, body: value.to_bytes(8, "little") + join(header, body)[8:]


def _set_tensor(name, **entry):
    def edit(header, body):
        header[name] = {**header[name], **entry}
        return join(header, body)
    return edit


def _overlap(header, body):
    a, b = "encoder.layers.0.self_attn.q.kernel", "encoder.layers.0.self_attn.k.kernel"
    header[b]["data_offsets"] = header[a]["data_offsets"]
    return join(header, body)


def _duplicate_name(header, body):
    text = json.dumps(header)
    name = '"encoder.layers.0.ffn_norm.bias"'
    entry = json.dumps(header["encoder.layers.0.ffn_norm.bias"])
    return join(text[:-1] + f", {name}: {entry}" + "}", body)


def _metadata_not_strings(header, body):
    header["__metadata__"]["step"] = 5
    return join(header, body)


def _nan_in_header(header, body):
    return join(json.dumps(header)[:-1] + ', "x": NaN}', body)


def _appended_bytes(header, body):
    return join(header, body) + b"\0" * 64


def _not_json(header, body):
    return join("{" + "x" * 40, body)


BIAS = "encoder.layers.0.ffn.linear1.bias"  # float32 [64]: 256 bytes
HOSTILE_HEADERS = [
    (_set_config("num_encoder_layers", 1_000_000_000), "num_encoder_layers must be <= "),
    (_set_config("max_len", 100_000_000), "max_len must be <= "),
    (_set_config("src_vocab_size", 10**12), "src_vocab_size must be <= "),
    (_set_config("layer_norm_eps", float("inf")), "refused: Infinity"),
    (_header_length(2**63), "header length"),
    (_header_length(2**20), "header length"),
    (_header_length(0), "header length"),
    (_set_tensor(BIAS, dtype="F8_E5M2", shape=[256]), f"tensor {BIAS} has dtype 'F8_E5M2'"),
    (_set_tensor(BIAS, dtype="F64"), f"tensor {BIAS}"),
    (_set_tensor(BIAS, shape=[10**30]), f"tensor {BIAS}"),
    (_set_tensor(BIAS, shape=[1] * 100), f"tensor {BIAS}"),
    (_set_tensor(BIAS, shape="64"), f"tensor {BIAS}"),
    (_set_tensor(BIAS, data_offsets=[-256, 0]), "data_offsets"),
    (_set_tensor(BIAS, data_offsets=[True, 256]), "data_offsets"),
    (_overlap, "overlaps"),
    (_duplicate_name, "duplicate key 'encoder.layers.0.ffn_norm.bias'"),
    (_metadata_not_strings, "__metadata__"),
    (_nan_in_header, "NaN"),
    (_appended_bytes, "the file holds"),
    (_not_json, "header is not valid JSON"),
]


@pytest.mark.parametrize("edit,message", HOSTILE_HEADERS,
                         ids=[f"{i}-{m[:30]}" for i, (_, m) in enumerate(HOSTILE_HEADERS)])
def test_hostile_header_is_refused_cheaply_naming_the_problem(tmp_path, edit, message):
    path, header, body = _good_file(tmp_path)
    path.write_bytes(edit(header, body))
    _refused_cheaply(path, message)


def test_unknown_dtype_of_an_extra_tensor_is_named(tmp_path):
    path, header, body = _good_file(tmp_path)
    header["extra.fp8"] = {"dtype": "F8_E5M2", "shape": [4], "data_offsets": [len(body), len(body) + 4]}
    path.write_bytes(join(header, body + b"\x01\x02\x03\x04"))
    _refused_cheaply(path, "tensor extra.fp8 has dtype 'F8_E5M2'")


def test_too_many_names_are_summarised_in_one_line(tmp_path):
    cfg = preset("tiny", num_encoder_layers=200)
    path = tmp_path / "m.safetensors"
    meta = {"format": FORMAT, "config": cfg.to_json(), "dtype": "float32"}
    _write_raw(path, {"shared_embed.embedding": np.zeros((64, 32), np.float32)}, meta)
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) .* and [\d,]+ more$"):
        load_checkpoint(path)


# -- the integrity record (issue 11, 5) ----------------------------------------------------------

def test_save_records_the_sha256_of_the_data_section(tmp_path):
    path, header, body = _good_file(tmp_path)
    assert header["__metadata__"]["sha256"] == hashlib.sha256(body).hexdigest()


@pytest.mark.parametrize("where", [0, 1000, -1])
def test_flipped_data_byte_is_refused_as_corrupted(tmp_path, where):
    path, header, body = _good_file(tmp_path)
    flipped = bytearray(body)
    flipped[where] ^= 0x01  # a low mantissa bit: a finite, plausible weight
    path.write_bytes(join(header, bytes(flipped)))
    expected, actual = header["__metadata__"]["sha256"], hashlib.sha256(flipped).hexdigest()
    _refused_cheaply(path, "corrupted", expected[:12], actual[:12])


def test_malformed_integrity_record_is_refused(tmp_path):
    path, header, body = _good_file(tmp_path)
    header["__metadata__"]["sha256"] = "not a digest"
    path.write_bytes(join(header, body))
    _refused_cheaply(path, "metadata 'sha256' is not a SHA-256 hex digest")


def test_file_without_integrity_record_still_loads(tmp_path):
    path, header, body = _good_file(tmp_path)
    del header["__metadata__"]["sha256"]
    header["__metadata__"]["step"] = "12"  # other keys are allowed and ignored (SPEC §3)
    path.write_bytes(join(header, body))
    ckpt = load_checkpoint(path)
    for name, value in init_params(preset("tiny")).items():
        assert ckpt.params[name].tobytes() == value.tobytes(), name


def _trainer_state():
    return {"step": np.asarray(7, np.int64), "optimizer.mu": np.linspace(0, 1, 12, dtype=np.float32),
            "rng.key": np.arange(4, dtype=np.uint32)}


def test_trainer_state_carries_and_checks_the_integrity_record(tmp_path):
    path = save_trainer_state(tmp_path / "s.safetensors", _trainer_state(), "torch")
    header, body = split(path.read_bytes())
    assert header["__metadata__"]["sha256"] == hashlib.sha256(body).hexdigest()
    state = load_trainer_state(path, "torch")
    for key, value in _trainer_state().items():
        assert state[key].dtype == value.dtype and np.array_equal(state[key], value), key
    flipped = bytearray(body)
    flipped[-1] ^= 0x80
    path.write_bytes(join(header, bytes(flipped)))
    with pytest.raises(CheckpointError, match="corrupted"):
        load_trainer_state(path, "torch")


def test_trainer_state_without_integrity_record_still_loads(tmp_path):
    path = tmp_path / "s.safetensors"
    safetensors.numpy.save_file(_trainer_state(), str(path),
                                metadata={"format": "rosetta-trainer-state/1", "framework": "jax"})
    assert load_trainer_state(path, "jax")["step"] == 7


# -- file modes and stale temporaries (issue 11, 10) ---------------------------------------------

@contextlib.contextmanager
def _umask(mask):
    saved = os.umask(mask)
    try:
        yield
    finally:
        os.umask(saved)


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_new_file_gets_the_mode_the_umask_gives(tmp_path, mask, mode):
    cfg = preset("tiny")
    with _umask(mask):
        path = save_checkpoint(tmp_path / "m.safetensors", cfg, init_params(cfg))
        state = save_trainer_state(tmp_path / "s.safetensors", _trainer_state(), "torch")
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert stat.S_IMODE(state.stat().st_mode) == mode


def test_replaced_file_keeps_its_mode(tmp_path):
    cfg = preset("tiny")
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"old")
    path.chmod(0o640)
    with _umask(0o077):
        save_checkpoint(path, cfg, init_params(cfg))
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert load_checkpoint(path).config == cfg


# A writer killed mid-save: it prints "writing" once its temporary exists, then sleeps.
_SLOW_WRITER = """
import sys, time
from rosetta.files import atomic_write
def write(f):
    f.write(b"partial"); f.flush(); print("writing", flush=True); time.sleep(60)
atomic_write(sys.argv[1], write)
"""


def _start_writer(path):
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(path)], stdout=subprocess.PIPE,
                            cwd=Path(__file__).resolve().parents[1], text=True)
    assert proc.stdout.readline().strip() == "writing"
    return proc


def _temporaries(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_temporary_of_a_killed_save_is_removed_by_the_next_save(tmp_path):
    cfg = preset("tiny")
    proc = _start_writer(tmp_path / "m.safetensors")
    proc.kill()
    proc.wait()
    assert len(_temporaries(tmp_path)) == 1  # what the killed save left
    save_checkpoint(tmp_path / "m.safetensors", cfg, init_params(cfg))
    assert _temporaries(tmp_path) == []
    assert load_checkpoint(tmp_path / "m.safetensors").config == cfg


def test_temporary_of_a_live_writer_is_kept(tmp_path):
    cfg = preset("tiny")
    proc = _start_writer(tmp_path / "m.safetensors")
    try:
        live = _temporaries(tmp_path)
        save_checkpoint(tmp_path / "m.safetensors", cfg, init_params(cfg))
        assert _temporaries(tmp_path) == live
    finally:
        proc.kill()
        proc.wait()


def test_temporary_of_a_live_thread_of_this_process_is_kept(tmp_path):
    cfg = preset("tiny")
    started, release = threading.Event(), threading.Event()

    def write(f):
        f.write(b"partial")
        started.set()
        release.wait(30)

    thread = threading.Thread(target=atomic_write, args=(tmp_path / "m.safetensors", write))
    thread.start()
    try:
        assert started.wait(30)
        live = _temporaries(tmp_path)
        save_checkpoint(tmp_path / "m.safetensors", cfg, init_params(cfg))
        assert _temporaries(tmp_path) == live and len(live) == 1
    finally:
        release.set()
        thread.join()
    assert _temporaries(tmp_path) == []
    assert (tmp_path / "m.safetensors").read_bytes() == b"partial"  # the thread's rename came last


@pytest.mark.parametrize("age_hours,removed", [(48, True), (0, False)])
def test_old_style_temporary_is_removed_only_when_long_untouched(tmp_path, age_hours, removed):
    # tempfile.mkstemp's names, as earlier versions wrote them: no pid to ask about.
    old = tmp_path / ".m.safetensors.k2j_8x0q.tmp"
    old.write_bytes(b"partial")
    then = time.time() - age_hours * 3600
    os.utime(old, (then, then))
    other = tmp_path / ".other.safetensors.k2j_8x0q.tmp"  # another target's: never touched
    other.write_bytes(b"partial")
    os.utime(other, (then, then))
    cfg = preset("tiny")
    save_checkpoint(tmp_path / "m.safetensors", cfg, init_params(cfg))
    assert old.exists() is not removed
    assert other.exists()
