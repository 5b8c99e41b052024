"""Hostile Flax msgpack files (rosetta/interop/flax_msgpack.py, flax_wmt.py): a leaf is refused by
its path from the file's headers, before any array data is read, and a leaf's claimed size is
checked against the bytes present before anything is allocated. `rosetta convert` runs in a
subprocess under an address-space limit, so a reader that allocated what a header claims would die
of it instead of refusing in one line."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

from rosetta import CheckpointError, ModelConfig, init_params
from rosetta.interop import flax_msgpack
from rosetta.interop.flax_msgpack import encode_tree
from rosetta.interop.flax_wmt import is_flax_wmt, params_to_flax_wmt, read_flax_wmt

REPO = Path(__file__).resolve().parents[1]
# Importing numpy, msgpack and the converter takes ~200 MB of address space; a reader that
# allocated a 4 GiB claim (let alone 40 GB) could not under this limit.
LIMIT = 2 * 2**30
GiB4 = [2**30]  # float32 elements: 4 GiB


def tiny_tree() -> dict:
    cfg = ModelConfig(src_vocab_size=13, tgt_vocab_size=13, d_model=16, num_heads=2, num_encoder_layers=1,
                      num_decoder_layers=1, d_ff=24, norm_first=True, layer_norm_eps=1e-6,
                      attention_bias=False, positional_encoding="sinusoidal_concat_t2t", pad_id=0, bos_id=0,
                      scale_embeddings=False)
    return params_to_flax_wmt(cfg, init_params(cfg))


def record(shape: list[int], data: bytes, dtype: str = "float32") -> msgpack.ExtType:
    """flax.serialization's array record, claiming `shape` over whatever `data` is."""
    return msgpack.ExtType(1, msgpack.packb((shape, dtype, data), use_bin_type=True))


def write(path: Path, tree: dict) -> Path:
    path.write_bytes(encode_tree({"params": tree}))
    return path


def convert_limited(src: Path, dst: Path) -> subprocess.CompletedProcess:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))

    return subprocess.run([sys.executable, "-m", "rosetta.cli", "convert", str(src), str(dst)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, preexec_fn=limit)


def test_a_normal_convert_fits_the_limit(tmp_path):
    done = convert_limited(write(tmp_path / "ok.msgpack", tiny_tree()), tmp_path / "ok.safetensors")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ok.safetensors").is_file()


HOSTILE = {
    # a leaf the model has no place for, claiming 4 GiB over 16 bytes: 176 bytes on disk
    "unknown_leaf_claims_4GiB": ("decoder/junk", GiB4),
    # a leaf the model reads, claiming 10^10 floats (40 GB) over 16 bytes
    "known_leaf_claims_1e10_floats": ("decoder/encoderdecoder_norm/scale", [10**10]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_convert_refuses_a_claim_larger_than_its_bytes_naming_the_leaf(tmp_path, case):
    leaf, shape = HOSTILE[case]
    tree = tiny_tree()
    parent, name = leaf.rsplit("/", 1)
    node = tree
    for key in parent.split("/"):
        node = node[key]
    node[name] = record(shape, b"\0" * 16)
    path = write(tmp_path / "hostile.msgpack", tree)
    assert path.stat().st_size < 200_000 and is_flax_wmt(path)  # detected, so the reader must refuse
    done = convert_limited(path, tmp_path / "out.safetensors")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and leaf in lines[0] and "declares shape" in lines[0], done.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_a_length_past_the_end_of_the_file_is_refused_naming_the_leaf(tmp_path):
    # The extension header itself claims 4 GiB, and the file ends: nothing is read or allocated.
    tree = tiny_tree()
    tree["decoder"]["junk"] = msgpack.ExtType(1, b"HOSTILE!")
    data = encode_tree({"params": tree})
    at = data.index(b"\xd7\x01HOSTILE!")  # fixext 8 of type 1, rewritten as ext 32 of 2^32 - 1 bytes
    hostile = data[:at] + b"\xc9" + (2**32 - 1).to_bytes(4, "big") + b"\x01" + data[at + 2:]
    path = tmp_path / "claims.msgpack"
    path.write_bytes(hostile)
    message = r"params/decoder/junk: truncated: its extension 1 record claims 4,294,967,295 bytes"
    with pytest.raises(CheckpointError, match=message):
        read_flax_wmt(path)


@pytest.mark.parametrize("where", ["params", "top"])
def test_an_unknown_leaf_is_refused_by_path_before_any_array_is_read(tmp_path, monkeypatch, where):
    # Real data this time (4 MB): refused from the headers, no array of the file is ever loaded.
    tree = tiny_tree()
    junk = np.ones(2**20, np.float32)
    if where == "params":
        tree["encoder"]["extra_layer"] = {"kernel": junk}
        wrapped, name = {"params": tree}, "encoder/extra_layer/kernel"
    else:
        wrapped, name = {"params": tree, "junk": junk}, "'junk'"
    path = tmp_path / "m.msgpack"
    path.write_bytes(encode_tree(wrapped))
    loads = []
    monkeypatch.setattr(flax_msgpack.Lazy, "load", lambda self, source="": loads.append(self.path))
    with pytest.raises(CheckpointError, match=name):
        read_flax_wmt(path)
    assert loads == []
