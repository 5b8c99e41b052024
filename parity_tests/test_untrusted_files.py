"""Untrusted checkpoint files (issue 11). Mutated copies of a valid file (truncated, bytes
flipped in the header or the data, a changed header length, edited metadata, an edited config)
must, in every backend, either load as the correct model or be refused with a RosettaError, and
either way cheaply: no load may take long or allocate more than a few times the file's size.

The positional tables (the one allocation a hostile `max_len` could still drive) are tested
here too: they follow the sequences actually run, in both framework backends alike.
"""

from __future__ import annotations

import functools
import json
import math
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import rosetta
import rosetta.positional
from parity_tests.conftest import deadline
from parity_tests.safetensors_bytes import join, split
from rosetta import InputError, ModelConfig, RosettaError, from_params, init_params, preset, save_checkpoint
from rosetta.backends import MODEL_BACKENDS, BackendModel
from rosetta.parity import random_batch, relative_error, target_positions

# One layer each way: a 98 KB file, quick to build in every framework.
CFG = preset("tiny", num_encoder_layers=1, num_decoder_layers=1)
SRC, TGT = random_batch(CFG, batch=2, src_len=7, tgt_len=5, seed=2)
# Relative error of each backend's default compute dtype against the float64 reference.
TOLERANCE = {"float64": 1e-12, "float32": 1e-5}

# The bounds every load must keep. A valid load of this file takes milliseconds and traces
# about 3.5 times the file's size (the tensors, read once and converted once); the slack covers
# a framework's fixed cost of building a model (measured: 0.3 MB for JAX).
LOAD_SECONDS = 5.0
MEMORY_FACTOR = 4
MEMORY_SLACK = 2**20
pytestmark = pytest.mark.usefixtures("python_collector")  # the bounds at Python's own collector (conftest.py)
# Per example (three loads, and a JAX compile for an edited config): a hang fails the test
# instead of stalling the suite.
EXAMPLE_SECONDS = 20

SETTINGS = settings(max_examples=40, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# -- the original file and its reference ---------------------------------------------------------

def _params() -> dict[str, np.ndarray]:
    # Perturbed so that zero biases and unit scales cannot hide a dropped or swapped tensor.
    rng = np.random.default_rng(1)
    return {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(np.float32)
            for k, v in init_params(CFG, seed=0).items()}


PARAMS = _params()


@functools.cache
def reference_logits(cfg: ModelConfig) -> np.ndarray:
    """The float64 reference on the original weights, for whatever config the file now holds."""
    upcast = {k: v.astype(np.float64) for k, v in PARAMS.items()}
    return from_params(cfg, upcast, "numpy", "float64").logits(SRC, TGT)


class Original(bytes):
    """The valid file's bytes; a short repr keeps hypothesis's failure reports readable."""

    def __repr__(self) -> str:
        return f"<the original file, {len(self):,} bytes>"


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Original:
    path = save_checkpoint(tmp_path_factory.mktemp("original") / "m.safetensors", CFG, PARAMS)
    for backend in MODEL_BACKENDS:  # import and compile once, outside the timed loads
        rosetta.load(path, backend=backend).logits(SRC, TGT)
    return Original(path.read_bytes())


def _header_end(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


# -- what every load must do ---------------------------------------------------------------------

def _load(path, backend: str) -> BackendModel | RosettaError:
    """rosetta.load within the time and memory bounds; any exception but a RosettaError fails."""
    size = path.stat().st_size
    tracemalloc.start()
    start = time.perf_counter()
    try:
        return rosetta.load(path, backend=backend)
    except RosettaError as e:
        return e
    finally:
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert elapsed <= LOAD_SECONDS, f"{backend}: load took {elapsed:.1f} s"
        assert peak <= MEMORY_FACTOR * size + MEMORY_SLACK, (
            f"{backend}: load traced {peak:,} bytes for a {size:,}-byte file")


def _check_model(model: BackendModel) -> None:
    """A model that loaded must hold the original weights exactly (in whatever dtype the backend
    keeps them) and compute what the reference computes for the config it loaded."""
    for name, value in model.to_params().items():
        assert np.array_equal(np.asarray(value, np.float64), PARAMS[name].astype(np.float64)), (
            f"{model.name}: weights of {name} changed")
    cfg = model.config
    try:
        logits = model.logits(SRC, TGT)
    except InputError:
        # A config edit may shorten max_len below the batch: refused when run, as it must be.
        assert max(SRC.shape[1], TGT.shape[1]) > cfg.max_len
        return
    err = relative_error(logits, reference_logits(cfg), target_positions(cfg, TGT))
    assert err <= TOLERANCE[model.dtype], f"{model.name}: relative error {err:.2e}"


def _check_every_backend(tmp_path, data: bytes, refusal: str | None = None) -> None:
    """Load `data` in every backend: the correct model or a clean one-line refusal. With
    `refusal` the file must be refused, with that text in the message ("": any message)."""
    path = tmp_path / "mutated.safetensors"
    path.write_bytes(data)
    with deadline(EXAMPLE_SECONDS):
        for backend in MODEL_BACKENDS:
            outcome = _load(path, backend)
            event("loaded" if not isinstance(outcome, RosettaError) else type(outcome).__name__)
            if isinstance(outcome, RosettaError):
                assert "\n" not in str(outcome), f"{backend}: refusal is not one line"
                assert refusal is None or refusal in str(outcome), f"{backend}: {outcome}"
            else:
                assert refusal is None, f"{backend}: loaded a file that must be refused ({refusal})"
                _check_model(outcome)


# -- mutations -----------------------------------------------------------------------------------

@SETTINGS
@given(cut=st.floats(0.0, 1.0, exclude_max=True))
def test_truncated_file(tmp_path, original, cut):
    _check_every_backend(tmp_path, original[:int(cut * len(original))], refusal="")


def _flips(low: float, high: float) -> st.SearchStrategy:
    """1 to 3 (relative position in [low, high), xor mask) pairs."""
    return st.lists(st.tuples(st.floats(low, high, exclude_max=True), st.integers(1, 255)),
                    min_size=1, max_size=3)


def _flip(data: bytes, start: int, stop: int, flips) -> bytes:
    out = bytearray(data)
    for where, mask in flips:
        out[start + int(where * (stop - start))] ^= mask
    return bytes(out)


@SETTINGS
@given(flips=_flips(0.0, 1.0))
def test_bytes_flipped_in_the_header(tmp_path, original, flips):
    # The 8-byte length and the JSON: most flips break the JSON or the layout; some (padding
    # turned into other whitespace, a digit of the dropout rate) leave a valid file.
    _check_every_backend(tmp_path, _flip(original, 0, _header_end(original), flips))


@SETTINGS
@given(flips=_flips(0.0, 1.0))
def test_bytes_flipped_in_the_data(tmp_path, original, flips):
    # The integrity record covers every data byte: any change is refused as corruption.
    data = _flip(original, _header_end(original), len(original), flips)
    assume(data != original)  # two flips of one byte with one mask cancel out
    _check_every_backend(tmp_path, data, refusal="corrupted")


@SETTINGS
@given(length=st.one_of(st.integers(0, 2**64 - 1), st.integers(-64, 64)))
def test_changed_header_length(tmp_path, original, length):
    n = int.from_bytes(original[:8], "little")
    new = length if length > 64 else n + length  # arbitrary, or near the true length
    if new == n or not 0 <= new < 2**64:
        new = n + 1
    _check_every_backend(tmp_path, new.to_bytes(8, "little") + original[8:], refusal="")


METADATA_KEYS = ["format", "config", "dtype", "sha256", "step", "ported_from"]
METADATA_VALUES = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["rosetta-transformer/1", "float32", "float16", "bfloat16", "0" * 64, "F" * 64,
                     "{}", "[]", "null"]),
)


@SETTINGS
@given(edits=st.lists(st.tuples(st.sampled_from(METADATA_KEYS), st.none() | METADATA_VALUES),
                      min_size=1, max_size=3))
def test_edited_metadata(tmp_path, original, edits):
    header, body = split(original)
    for key, value in edits:  # None deletes the key
        if value is None:
            header["__metadata__"].pop(key, None)
        else:
            header["__metadata__"][key] = value
    _check_every_backend(tmp_path, join(header, body))


CONFIG_FIELDS = [f for f in CFG.to_dict()] + ["colour"]
SIZE_FIELDS = ["src_vocab_size", "tgt_vocab_size", "d_model", "num_heads", "num_encoder_layers",
               "num_decoder_layers", "d_ff", "max_len"]
FLOAT_FIELDS = ["dropout", "activation_dropout", "attention_dropout", "layer_norm_eps"]
# Mostly hostile values; a few valid ones, from a small pool, so that the configs that do load
# (and each cost JAX a compile) are few and repeat.
CONFIG_VALUES = st.one_of(
    st.sampled_from([-1, 0, 1, 2, 3, 31, 33, 64, 65, 2**31, 2**63, 10**9, 10**30, 10**400]),
    st.sampled_from([0.0, 0.3, 1.0, -0.5, 1e-6, 1e-300, 1e300, float("nan"), float("inf"),
                     float("-inf")]),
    st.sampled_from(["relu", "gelu", "all", "none", "sinusoidal_concat", "", "x" * 1000]),
    st.booleans(), st.none(), st.just([1, 2]), st.just({"d_model": 32}),
)


def _with_field(text: str, field: str, literal: str) -> str:
    """`text` (a JSON object) with `field` set to the raw JSON `literal`, replacing any value."""
    config = json.loads(text)
    config.pop(field, None)
    return json.dumps(config)[:-1] + f', "{field}": {literal}}}'


@st.composite
def config_texts(draw) -> str:
    text = CFG.to_json()
    kind = draw(st.sampled_from(["set", "size", "nonfinite", "delete", "duplicate", "raw"]))
    if kind == "set":
        return _with_field(text, draw(st.sampled_from(CONFIG_FIELDS)), json.dumps(draw(CONFIG_VALUES)))
    if kind == "size":  # what used to hang or allocate gigabytes: a small file asking for a lot
        literal = str(draw(st.sampled_from([10**6, 10**8, 10**9, 2**40, 10**30])))
        return _with_field(text, draw(st.sampled_from(SIZE_FIELDS)), literal)
    if kind == "nonfinite":  # literals Python's json accepts and JSON does not have
        literal = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e400"]))
        return _with_field(text, draw(st.sampled_from(FLOAT_FIELDS)), literal)
    if kind == "delete":
        config = json.loads(text)
        config.pop(draw(st.sampled_from(CONFIG_FIELDS[:-1])))
        return json.dumps(config)
    if kind == "duplicate":  # Python's json would keep the last value
        return text[:-1] + f', "{draw(st.sampled_from(CONFIG_FIELDS[:-1]))}": 1}}'
    where = draw(st.integers(0, len(text) - 1))
    return text[:where] + draw(st.text(min_size=0, max_size=4)) + text[where + 1:]


def _unambiguous_json(text: str) -> bool:
    """Whether `text` is JSON that every reader reads alike: no duplicate keys, no NaN or
    Infinity, no number beyond float range (an independent check, not rosetta's parser)."""
    def pairs(items):
        keys = [k for k, _ in items]
        if len(keys) != len(set(keys)):
            raise ValueError("duplicate key")
        return dict(items)

    def finite(literal):
        if not math.isfinite(float(literal)):
            raise ValueError("out of range")
        return float(literal)

    def constant(name):
        raise ValueError(name)

    try:
        json.loads(text, object_pairs_hook=pairs, parse_float=finite, parse_constant=constant)
    except (ValueError, RecursionError):
        return False
    return True


@SETTINGS
@given(config=config_texts())
def test_edited_config_json(tmp_path, original, config):
    header, body = split(original)
    header["__metadata__"]["config"] = config
    # An ambiguous config must be refused; any other may load, if it is valid and fits.
    _check_every_backend(tmp_path, join(header, body), refusal=None if _unambiguous_json(config) else "")


# -- positional tables follow the sequences run, not max_len ------------------------------------

def test_hostile_max_len_allocates_no_table(tmp_path, original):  # `original`: frameworks warmed up
    # Within LIMITS, yet a table this long would be 256 MB in float64: each framework builds
    # the first POSITION_ROWS rows, as for any config, and the file loads as the right model.
    cfg = CFG.replace(max_len=1_000_000)
    path = save_checkpoint(tmp_path / "m.safetensors", cfg, PARAMS)
    for backend in ("torch", "jax"):
        model = _load(path, backend)
        assert not isinstance(model, RosettaError), model
        assert model.module.positions.shape[0] <= 1024
        _check_model(model)


@pytest.mark.ported
def test_longer_sequences_grow_the_table_with_the_reference_values(monkeypatch, backend):
    # A 4-row table built with the model: every longer sequence, in every entry point (the
    # forward pass, step-by-step decoding with its cache, beam search), must still see the
    # reference's positions.
    monkeypatch.setattr(rosetta.positional, "POSITION_ROWS", 4)
    cfg = CFG.replace(max_len=40)
    src, tgt = random_batch(cfg, batch=2, src_len=13, tgt_len=11, seed=3)
    reference = from_params(cfg, {k: v.astype(np.float64) for k, v in PARAMS.items()}, "numpy", "float64")
    model = from_params(cfg, PARAMS, backend)
    assert model.module.positions.shape[0] == 4
    where = target_positions(cfg, tgt)
    assert relative_error(model.logits(src, tgt), reference.logits(src, tgt), where) <= 1e-5
    pad_free = tgt[:1]
    assert relative_error(model.step_logits(src[:1], pad_free),
                          reference.step_logits(src[:1], pad_free)) <= 1e-5
    assert model.generate(src, beam_size=2).tokens == reference.generate(src, beam_size=2).tokens
