"""Bad inputs refused in one line (exit code 2), never a traceback, a silent wrong answer or
unbounded memory: activation dumps that claim more than they hold (compression bombs),
converter inputs whose broken file must be named, checkpoints whose weights overflow float32 in
the search, an unbounded length-penalty exponent, and the checkpoint integrity record.
"""

from __future__ import annotations

import io
import resource
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest

from rosetta import from_params, init_params, preset, save_checkpoint
from rosetta.backends import BACKENDS
from rosetta.diff.shared.dump import dump_model
from rosetta.parity import random_batch

CFG = preset("tiny", num_encoder_layers=1, num_decoder_layers=1)
REPO = Path(__file__).resolve().parents[1]
# Address space for a `rosetta diff` subprocess: a normal diff of the tiny model fits with room
# to spare; reading either bomb below would not (they claim 3.5 GB and 40 GB).
MEMORY_LIMIT = 3 * 2**30


def _rosetta(*args: str, stdin: str = "", limit: int | None = None) -> subprocess.CompletedProcess:
    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return subprocess.run([sys.executable, "-m", "rosetta.cli", *args], input=stdin, capture_output=True,
                          text=True, cwd=REPO, timeout=300, preexec_fn=limit_memory if limit else None)


def _one_line_error(done: subprocess.CompletedProcess, *parts: str) -> str:
    """The single stderr line of a refusal (exit code 2), checked to hold every part."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("rosetta: error: "), done.stderr
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


# -- 3. activation dumps whose members claim more than they hold -----------------------------

def _npy_header(shape: tuple[int, ...], dtype: str = "<f4") -> bytes:
    header = np.lib.format.header_data_from_array_1_0(np.zeros((0,), dtype))
    header["shape"] = shape
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, header)
    return out.getvalue()


def _write_zip(path: Path, members: list[tuple[str, bytes, int, int, int]]) -> None:
    """A zip of raw members (name, deflated bytes, crc32, uncompressed size, method): what
    np.savez_compressed writes, but with bodies built here (no zip64: sizes under 4 GiB)."""
    local, central = bytearray(), bytearray()
    for name, body, crc, size, method in members:
        fields = (20, 0, method, 0, 0x21, crc, len(body), size, len(name.encode()), 0)
        central += struct.pack("<IH", 0x02014B50, 20) + struct.pack("<HHHHHIIIHH", *fields) \
            + struct.pack("<HHHII", 0, 0, 0, 0, len(local)) + name.encode()
        local += struct.pack("<I", 0x04034B50) + struct.pack("<HHHHHIIIHH", *fields) + name.encode() + body
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central), len(local), 0)
    path.write_bytes(bytes(local + central + end))


def _deflated_zeros(prefix: bytes, size: int) -> tuple[bytes, int]:
    """Raw deflate of `prefix` then zeros up to `size` bytes, and its crc32, built in seconds:
    after a full flush the compressor starts afresh, so every 1 MiB block of zeros deflates to
    the same bytes, which are repeated."""
    block = bytes(2**20)
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = packer.compress(prefix) + packer.flush(zlib.Z_FULL_FLUSH)
    one = packer.compress(block) + packer.flush(zlib.Z_FULL_FLUSH)
    assert packer.compress(block) + packer.flush(zlib.Z_FULL_FLUSH) == one
    blocks, rest = divmod(size - len(prefix), len(block))
    assert rest == 0
    crc = zlib.crc32(prefix)
    for _ in range(blocks):
        crc = zlib.crc32(block, crc)
    return head + one * blocks + packer.flush(), crc


@pytest.fixture(scope="module")
def dump_case(tmp_path_factory):
    """A checkpoint, a valid dump of it, and its members (name -> stored .npy bytes)."""
    root = tmp_path_factory.mktemp("dumps")
    params = init_params(CFG, seed=0)
    checkpoint = save_checkpoint(root / "m.safetensors", CFG, params)
    src, tgt = random_batch(CFG, batch=2, src_len=7, tgt_len=5, seed=2)
    dump = dump_model(from_params(CFG, params, "numpy"), root / "good.npz", src, tgt)
    with zipfile.ZipFile(dump) as archive:
        members = {info.filename: archive.read(info) for info in archive.infolist()}
    return root, checkpoint, dump, members


def _stored(members: dict[str, bytes]) -> list[tuple[str, bytes, int, int, int]]:
    return [(name, data, zlib.crc32(data), len(data), zipfile.ZIP_STORED) for name, data in members.items()]


def test_a_normal_diff_runs_under_the_memory_limit(dump_case):
    _, checkpoint, dump, _ = dump_case
    done = _rosetta("diff", str(dump), str(checkpoint), limit=MEMORY_LIMIT)
    assert done.returncode == 0, done.stderr
    assert "no difference at any stage" in done.stdout


def test_a_member_claiming_ten_billion_floats_is_refused_before_reading(dump_case):
    root, checkpoint, _, members = dump_case
    members = dict(members)
    members["encoder.npy"] = _npy_header((10**10,)) + bytes(64)  # tiny on disk
    bomb = root / "claim.npz"
    _write_zip(bomb, _stored(members))
    done = _rosetta("diff", str(bomb), str(checkpoint), limit=MEMORY_LIMIT)
    _one_line_error(done, f"{bomb}: member 'encoder.npy'", "claims shape (10000000000,) of float32",
                    "holds 64 bytes of data")


def test_a_compressed_member_of_a_wrong_large_shape_is_refused_before_reading(dump_case):
    root, checkpoint, _, members = dump_case
    header = _npy_header((2, 13 * 2**20, 32))  # 3.5 GB of zeros, deflated to 3.4 MB
    size = len(header) + 2 * 13 * 2**20 * 32 * 4
    body, crc = _deflated_zeros(header, size)
    bomb = root / "bomb.npz"
    entries = _stored({k: v for k, v in members.items() if k != "encoder.npy"})
    _write_zip(bomb, entries + [("encoder.npy", body, crc, size, zipfile.ZIP_DEFLATED)])
    assert bomb.stat().st_size < 5 * 2**20
    done = _rosetta("diff", str(bomb), str(checkpoint), limit=MEMORY_LIMIT)
    _one_line_error(done, f"{bomb}: dump: stage 'encoder' has shape (2, 13631488, 32); with src (2, 7) "
                          f"and tgt (2, 5) it must be [B, S, d]")


def test_a_dump_that_unpacks_far_beyond_its_size_is_refused(dump_case, monkeypatch):
    """Shapes right for the batch, sizes honest, but a compression ratio no activations have
    (floor and ratio lowered here to fit the tiny model's 30 KB dump of zeros)."""
    from rosetta.diff.shared import dump as dump_module
    from rosetta.errors import CheckpointError

    root, _, _, members = dump_case
    zeros = root / "zeros.npz"
    with zipfile.ZipFile(zeros, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            header_size = len(data) - np.lib.format.read_array(io.BytesIO(data)).nbytes
            archive.writestr(name, data if name in ("src.npy", "tgt.npy") else
                             data[:header_size] + bytes(len(data) - header_size))
    monkeypatch.setattr(dump_module, "EXPANSION_FLOOR", 0)
    monkeypatch.setattr(dump_module, "MAX_EXPANSION", 3)
    with pytest.raises(CheckpointError, match=rf"^{zeros}: member '.*\.npy' unpacks to .* more than 3 "
                                              rf"times its .* on disk \(a compression bomb"):
        dump_module.read_dump(zeros)


# -- 4. convert names the broken file, not the one beside it --------------------------------

@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory):
    from rosetta.interop import marian

    cfg = preset("tiny", num_encoder_layers=1, num_decoder_layers=1, positional_encoding="sinusoidal_concat")
    return marian.write_marian(tmp_path_factory.mktemp("marian") / "opus-mt", cfg, init_params(cfg))


@pytest.mark.parametrize("cut", ["empty", "truncated"])
def test_a_marian_directory_with_a_broken_config_json_is_blamed_on_config_json(tmp_path, marian_dir, cut):
    broken = tmp_path / "opus-mt"
    broken.mkdir()
    for file in Path(marian_dir).iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    text = (broken / "config.json").read_text()
    (broken / "config.json").write_text("" if cut == "empty" else text[: len(text) // 2])
    done = _rosetta("convert", str(broken), str(tmp_path / "out.safetensors"))
    line = _one_line_error(done, f"{broken / 'config.json'}: not valid JSON: ")
    assert "model.safetensors" not in line
    assert not (tmp_path / "out.safetensors").exists()


def test_a_truncated_msgpack_is_named_as_such(tmp_path):
    from rosetta.interop.convert import write_model

    cfg = preset("tiny", num_encoder_layers=1, num_decoder_layers=1, norm_first=True, final_norm=True,
                 layer_norm_eps=1e-6, positional_encoding="sinusoidal_concat_t2t", bos_id=0)
    whole = write_model(tmp_path / "params.msgpack", cfg, init_params(cfg), "flax-wmt")
    cut = tmp_path / "cut.msgpack"
    cut.write_bytes(whole.read_bytes()[:1000])
    done = _rosetta("convert", str(cut), str(tmp_path / "out.safetensors"))
    _one_line_error(done, f"{cut}: not a valid flax msgpack file (truncated?): ")


# -- 5. weights that overflow float32: the search refuses non-finite scores -------------------

SEARCH_SRC = np.array([[5, 6, 7, 2], [9, 9, 2, 0]])


@pytest.fixture(scope="module")
def overflow_checkpoint(tmp_path_factory):
    """Every value finite in the file, but embeddings of 3e38 times sqrt(d_model) pass float32."""
    params = init_params(CFG, seed=0)
    params["shared_embed.embedding"] = np.full_like(params["shared_embed.embedding"], 3e38)
    return save_checkpoint(tmp_path_factory.mktemp("overflow") / "big.safetensors", CFG, params)


@pytest.mark.parametrize("beam", [1, 2])
def test_a_search_with_non_finite_scores_is_refused(overflow_checkpoint, backend, beam):
    from rosetta import RosettaError, load

    model = load(overflow_checkpoint, backend)
    with pytest.raises(RosettaError, match=rf"^non-finite scores in the search \(the weights overflow "
                                           rf"float32\?\): backend {backend} at "):
        model.generate(SEARCH_SRC, beam, max_len_margin=3)


def test_generate_refuses_the_overflow_checkpoint(overflow_checkpoint, monkeypatch, capsys):
    """`rosetta generate` through the CLI's main in this process (a subprocess would only import
    torch again: the refusal is main's, and test_cli.py runs the entry point itself)."""
    from types import SimpleNamespace

    from rosetta.cli import main

    for backend in ("numpy", "torch"):
        monkeypatch.setattr(sys, "stdin", io.StringIO("5 6 7 2\n"))
        capsys.readouterr()
        code = main(["generate", "--checkpoint", str(overflow_checkpoint), "--backend", backend])
        out, err = capsys.readouterr()
        _one_line_error(SimpleNamespace(returncode=code, stderr=err),
                        "non-finite scores in the search (the weights overflow float32?)")
        assert out == ""


@pytest.mark.parametrize("beam", [1, 3])
def test_a_normal_checkpoint_decodes_alike_in_every_backend(beam):
    params = init_params(CFG, seed=0)
    reference = from_params(CFG, params, "numpy").generate(SEARCH_SRC, beam, max_len_margin=6)
    assert np.isfinite(reference.scores).all()
    for backend in ("torch", "jax"):
        out = from_params(CFG, params, backend).generate(SEARCH_SRC, beam, max_len_margin=6)
        assert out.tokens == reference.tokens
        np.testing.assert_allclose(out.scores, reference.scores, rtol=1e-5)


def test_banned_tokens_with_log_probability_minus_infinity_are_not_refused(monkeypatch, backend):
    """A -inf log-probability (a banned token) is legitimate: it never wins a sentence's score,
    so the scores the search returns stay finite."""
    import importlib

    # This backend's search module only: a machine without JAX still runs the numpy and torch cases.
    decode = importlib.import_module(BACKENDS[backend].model.rsplit(".", 1)[0] + ".decode")
    banned = [16, 21, 45]  # the tokens this model's searches pick without the ban
    params = init_params(CFG, seed=0)
    src = np.array([[5, 6, 7, 8, 2], [9, 9, 2, 0, 0], [7, 2, 0, 0, 0]])  # a shape JAX has not compiled
    if backend == "numpy":
        plain = decode.next_log_probs

        def next_log_probs(*args):
            logp = plain(*args)
            logp[:, banned] = -np.inf
            return logp

        monkeypatch.setattr(decode, "next_log_probs", next_log_probs)
    elif backend == "torch":  # a -inf logit is a -inf log-probability, on every path of the search
        plain = decode.Steps.logits

        def logits(self, *args):
            out = plain(self, *args)
            out[:, banned] = -np.inf
            return out

        monkeypatch.setattr(decode.Steps, "logits", logits)
    else:
        steps = decode.Steps
        plain = steps.next_log_probs

        def next_log_probs(self, *args):
            logp, cache = plain(self, *args)
            return logp.at[:, np.array(banned)].set(-np.inf), cache

        monkeypatch.setattr(steps, "next_log_probs", next_log_probs)
    for beam in (1, 3):
        out = from_params(CFG, params, backend).generate(src, beam, max_len_margin=4)
        assert np.isfinite(out.scores).all()
        assert not {tok for row in out.tokens for tok in row} & set(banned)


# -- 6. the length-penalty exponent is bounded ------------------------------------------------

def test_alpha_past_its_bound_is_refused_by_the_cli_and_the_library(dump_case):
    from rosetta import InputError, load

    _, checkpoint, _, _ = dump_case
    done = _rosetta("generate", "--checkpoint", str(checkpoint), "--beam", "2", "--alpha", "1e300",
                    stdin="5 6 7 2\n")
    _one_line_error(done, "argument --alpha: must be a finite number >= 0 and <= 5, got '1e300'")
    assert "Warning" not in done.stderr
    model = load(checkpoint)
    with pytest.raises(InputError, match=r"^alpha must be at most 5, got 1e\+300: the length penalty"):
        model.generate(SEARCH_SRC, 2, alpha=1e300)
    out = model.generate(SEARCH_SRC, 2, alpha=5.0)  # the bound itself: finite, non-zero scores
    assert np.isfinite(out.scores).all() and (out.scores < 0).all()


# -- 12. the integrity record: reported by `rosetta parity --checkpoint` -----------------------

def _without_record(path: Path, out: Path) -> Path:
    from parity_tests.safetensors_bytes import join, split

    header, body = split(path.read_bytes())
    del header["__metadata__"]["sha256"]
    out.write_bytes(join(header, body))
    return out


def test_parity_reports_the_integrity_record(dump_case, tmp_path):
    _, checkpoint, _, _ = dump_case
    done = _rosetta("parity", "--checkpoint", str(checkpoint), "--backends", "numpy")
    assert done.returncode == 0, done.stderr
    assert "integrity: sha256 record present, verified" in done.stdout.splitlines()

    bare = _without_record(Path(checkpoint), tmp_path / "bare.safetensors")
    done = _rosetta("parity", "--checkpoint", str(bare), "--backends", "numpy")
    assert done.returncode == 0, done.stderr
    assert "integrity: no sha256 record (data bytes not verified)" in done.stdout.splitlines()


def test_a_flipped_data_byte_is_refused_with_the_record_and_loads_without(dump_case, tmp_path):
    from parity_tests.safetensors_bytes import join, split

    _, checkpoint, _, _ = dump_case
    header, body = split(Path(checkpoint).read_bytes())
    flipped = bytearray(body)
    flipped[len(body) // 2] ^= 0x01  # a low mantissa bit: still a finite float
    tampered = tmp_path / "tampered.safetensors"
    tampered.write_bytes(join(header, bytes(flipped)))
    done = _rosetta("parity", "--checkpoint", str(tampered), "--backends", "numpy")
    _one_line_error(done, f"{tampered}: corrupted: the tensor data's SHA-256 is ")

    # Without the record the same bytes load: what docs/checkpoint.md says the record is for.
    del header["__metadata__"]["sha256"]
    bare = tmp_path / "bare-tampered.safetensors"
    bare.write_bytes(join(header, bytes(flipped)))
    done = _rosetta("parity", "--checkpoint", str(bare), "--backends", "numpy")
    assert done.returncode == 0, done.stderr
    assert "integrity: no sha256 record (data bytes not verified)" in done.stdout
