"""The data pipeline of the training harness: Multi30k loading and download, the synthetic
tasks, the joint BPE tokenizer and token-budget batching (rosetta.harness.data, rosetta.tokenizer,
rosetta.harness.batching). NumPy only; no deep-learning framework is imported."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import urllib.error
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rosetta.harness.data
from rosetta import ModelConfig, preset
from rosetta.errors import RosettaError
from rosetta.harness.batching import Batch, BatchIterator, default_buckets, eval_batches, restore_order
from rosetta.harness.data import (
    DATA_DIR_ENV,
    SPLIT_SIZES,
    URL_BASE,
    DataError,
    default_data_dir,
    download_multi30k,
    load_multi30k,
    synthetic_pairs,
)

# SHA-256 of the untouched public files (../shared/data/multi30k, github.com/multi30k/dataset's
# data/task1/raw): what the package's copy, the wheel's and any copy the tests read must hold.
PUBLIC_SHA256 = {
    "README.md": "c720b4e4f40fb38e24aa3eb0884c4c9d0ea494080573c1af20194b88e8d6f0c7",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.fr.gz": "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90",
    "test_2017_flickr.de.gz": "a2c89666db00c495cd8513b9d708d5a3acc205d7de312ef2bf5fb7ebc1540aee",
    "test_2017_flickr.en.gz": "76a444ee25172e72695cddb13ae4a3bda59430617be88e0bb46b60504f054074",
    "test_2017_flickr.fr.gz": "3ba671ceb2299f3304ffafefea7a833d08632fbaf0ba18546f8a2ec2391af496",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.fr.gz": "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.fr.gz": "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9",
}
# Where the package data lands beside the package, in a checkout and in an installed wheel alike.
BUNDLED = Path(rosetta.__file__).resolve().parent / "data" / "multi30k"
# The copy the tests read: $ROSETTA_DATA_DIR, else the shared copy beside the checkout (what CI has),
# else, in a clone elsewhere, the package's own (its bytes are checked against PUBLIC_SHA256 either way).
ENV_DIR = os.environ.get(DATA_DIR_ENV)
BESIDE = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "multi30k"
SHARED = Path(ENV_DIR) if ENV_DIR else BESIDE if BESIDE.is_dir() else BUNDLED
MISSING = f"Multi30k not found at {SHARED} ($ROSETTA_DATA_DIR): a missing copy is a failure, not a skip"


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def shared_data() -> Path:
    if not (SHARED / "train.de.gz").is_file():
        pytest.fail(MISSING, pytrace=False)
    return SHARED


needs_data = pytest.mark.usefixtures("shared_data")


def gz_lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().split("\n")[:-1]


def write_gz(path: Path, lines: list[str]) -> None:
    path.write_bytes(gzip.compress("".join(line + "\n" for line in lines).encode("utf-8")))


@pytest.fixture(autouse=True)
def no_env_data_dir(monkeypatch):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)


# -- Multi30k loader ------------------------------------------------------------------------------

@needs_data
def test_bundled_copy_is_the_public_files():
    """The package's copy (the default without $ROSETTA_DATA_DIR) and the copy the tests read hold the
    untouched public files, byte for byte: every split of every language and its README."""
    assert len(PUBLIC_SHA256) == 4 * 3 + 1  # 4 splits x de, en, fr, and the README
    for folder in (BUNDLED, SHARED):
        assert sorted(p.name for p in folder.iterdir()) == sorted(PUBLIC_SHA256), folder
        for name, expected in PUBLIC_SHA256.items():
            assert digest((folder / name).read_bytes()) == expected, folder / name


@needs_data
def test_load_real_splits_from_default_dir():
    assert default_data_dir() == BUNDLED  # $ROSETTA_DATA_DIR unset (the autouse fixture)
    train = load_multi30k("train")
    assert len(train) == 29000
    first_de, first_en = gz_lines(SHARED / "train.de.gz")[0], gz_lines(SHARED / "train.en.gz")[0]
    assert train[0] == (first_de.strip(), first_en.strip())
    assert train[0][0].startswith("Zwei junge weiße Männer")
    assert len(load_multi30k("val")) == 1014
    en_fr = load_multi30k("test_2016_flickr", src_lang="en", tgt_lang="fr")
    assert len(en_fr) == SPLIT_SIZES["test_2016_flickr"]
    assert en_fr[0] == (gz_lines(SHARED / "test_2016_flickr.en.gz")[0].strip(),
                        gz_lines(SHARED / "test_2016_flickr.fr.gz")[0].strip())
    assert all(isinstance(s, str) and s == s.strip() for pair in train for s in pair)


@needs_data
def test_user_directory_and_env_var(tmp_path, monkeypatch):
    for name in ("val.de.gz", "val.en.gz"):
        shutil.copy(SHARED / name, tmp_path / name)
    expected = load_multi30k("val", data_dir=SHARED)
    assert load_multi30k("val", data_dir=tmp_path) == expected
    assert load_multi30k("val", data_dir=str(tmp_path)) == expected
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert default_data_dir() == tmp_path
    assert load_multi30k("val") == expected
    with pytest.raises(DataError, match=r"train\.de\.gz"):  # the env dir holds only val
        load_multi30k("train")


def test_missing_or_unusable_data_dir_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """`--data-dir`, $ROSETTA_DATA_DIR and the bundled default, each missing, a file, or holding a broken
    file: one line naming the folder (and how it was chosen) or the file; exit 2, nothing written."""
    from parity_tests.test_diff_training import assert_refused

    out = tmp_path / "run"
    train = ["train", "--task", "multi30k", "--steps", "1", "--out", str(out)]
    missing, a_file, broken = tmp_path / "nowhere", tmp_path / "a-file", tmp_path / "broken"
    a_file.write_text("not a folder")
    broken.mkdir()
    (broken / "train.de.gz").write_bytes(b"\x1f\x8b not gzip")
    for folder, message in ((missing, f"{str(missing)!r} (given directory) does not exist"),
                            (a_file, f"{str(a_file)!r} (given directory) is not a directory"),
                            (broken, f"cannot read data file {str(broken / 'train.de.gz')!r}")):
        assert_refused([*train, "--data-dir", str(folder)], message, capsys)
    monkeypatch.setenv(DATA_DIR_ENV, str(a_file))
    assert_refused(train, f"{str(a_file)!r} ($ROSETTA_DATA_DIR) is not a directory", capsys)
    monkeypatch.delenv(DATA_DIR_ENV)
    monkeypatch.setattr(rosetta.harness.data, "BUNDLED_DATA_DIR", missing)  # as if the wheel had lost it
    assert_refused(train, f"{str(missing)!r} (the package's bundled copy) does not exist", capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "broken"]


def test_a_file_that_inflates_past_the_bound_is_refused_in_bounded_memory(tmp_path, monkeypatch):
    """A gzip bomb in the data folder: 64 MiB of newlines in a 0.3 MB file, the bounds lowered to 16 MiB
    and 20 M lines for the test (the real ones: 2 GiB, 50 M lines): refused naming the file, with at most
    the bound and a chunk held (tracemalloc's peak), where the reader before held 1.2 GB for it (64 M
    empty strings). The line bound alone refuses it too. Every bundled Multi30k file is far below both."""
    import tracemalloc

    bomb = tmp_path / "train.de.gz"
    with gzip.open(bomb, "wb", compresslevel=1) as f:
        for _ in range(64):
            f.write(b"\n" * (1 << 20))
    assert bomb.stat().st_size < 1 << 20
    data = rosetta.harness.data
    bound, line_bound = data.MAX_DATA_FILE_BYTES, data.MAX_DATA_FILE_LINES
    monkeypatch.setattr(data, "MAX_DATA_FILE_BYTES", 16 << 20)
    monkeypatch.setattr(data, "MAX_DATA_FILE_LINES", 20_000_000)
    refusal = r"train\.de\.gz' holds more than 16,777,216 bytes or 20,000,000 lines of text decompressed"
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=refusal):
            data.read_lines(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (16 << 20) + (4 << 20), peak  # the bound, a chunk, and the list holding the chunks
    monkeypatch.setattr(data, "MAX_DATA_FILE_BYTES", bound)
    monkeypatch.setattr(data, "MAX_DATA_FILE_LINES", 1 << 20)  # 64 M newlines against 1 M lines
    with pytest.raises(DataError, match="1,048,576 lines"):
        data.read_lines(bomb)
    texts = [gzip.decompress(p.read_bytes()) for p in data.BUNDLED_DATA_DIR.glob("*.gz")]
    assert max(map(len, texts)) < bound // 100 and max(t.count(b"\n") for t in texts) < line_bound // 100


def test_missing_directory_and_file(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match="nowhere.*does not exist"):
        load_multi30k("val", data_dir=missing)
    monkeypatch.setenv(DATA_DIR_ENV, str(missing))
    with pytest.raises(DataError, match=DATA_DIR_ENV):
        load_multi30k("val")
    write_gz(tmp_path / "val.de.gz", ["ein Satz"])
    with pytest.raises(DataError, match=r"val\.en\.gz"):
        load_multi30k("val", data_dir=tmp_path)


def test_mismatched_line_counts_and_bad_names(tmp_path):
    write_gz(tmp_path / "val.de.gz", ["eins", "zwei", "drei"])
    write_gz(tmp_path / "val.en.gz", ["one", "two"])
    with pytest.raises(DataError, match=r"3 lines.*has 2"):
        load_multi30k("val", data_dir=tmp_path)
    with pytest.raises(DataError, match="unknown Multi30k split 'dev'"):
        load_multi30k("dev", data_dir=tmp_path)
    with pytest.raises(DataError, match="unknown Multi30k language 'cs'"):
        load_multi30k("val", tgt_lang="cs", data_dir=tmp_path)
    (tmp_path / "val.fr.gz").write_bytes(b"not gzip")
    with pytest.raises(DataError, match=r"val\.fr\.gz"):
        load_multi30k("val", tgt_lang="fr", data_dir=tmp_path)
    assert issubclass(DataError, RosettaError)


# -- Multi30k download ----------------------------------------------------------------------------

@needs_data
def test_download_from_local_file_url(tmp_path):
    dest = tmp_path / "m30k"
    paths = download_multi30k(dest, splits=["val"], langs=["de", "en"], url_base=SHARED.as_uri())
    assert paths == [dest / "val.de.gz", dest / "val.en.gz"]
    for p in paths:
        assert p.read_bytes() == (SHARED / p.name).read_bytes()
    assert load_multi30k("val", data_dir=dest) == load_multi30k("val", data_dir=SHARED)
    assert sorted(p.name for p in dest.iterdir()) == ["val.de.gz", "val.en.gz"]  # no temp files
    assert URL_BASE == "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw"


def test_download_skips_existing_and_is_atomic(tmp_path):
    payload = gzip.compress(b"a line\n")
    calls = []

    def opener(url, timeout):
        calls.append(url)
        return io.BytesIO(payload)

    existing = tmp_path / "val.de.gz"
    write_gz(existing, ["already here"])
    before = existing.read_bytes()
    download_multi30k(tmp_path, splits=["val"], langs=["de", "en"], url_base="https://x/raw/", opener=opener)
    assert calls == ["https://x/raw/val.en.gz"]
    assert existing.read_bytes() == before
    assert (tmp_path / "val.en.gz").read_bytes() == payload

    # A download that is not gzip (an HTML error page, a truncated body) leaves nothing behind.
    with pytest.raises(DataError, match=r"test_2016_flickr\.fr\.gz.*not a gzip"):
        download_multi30k(tmp_path, splits=["test_2016_flickr"], langs=["fr"],
                          opener=lambda url, timeout: io.BytesIO(payload[:-5]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["val.de.gz", "val.en.gz"]


def test_download_without_network_is_a_clear_error(tmp_path):
    def offline(url, timeout):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    with pytest.raises(DataError, match=r"could not download https://.*/train\.de\.gz.*no network"):
        download_multi30k(tmp_path, splits=["train"], langs=["de"], opener=offline)
    with pytest.raises(DataError, match="could not download file://"):
        download_multi30k(tmp_path, splits=["val"], langs=["de"], url_base=(tmp_path / "empty").as_uri())
    assert list(tmp_path.iterdir()) == []


# -- Synthetic tasks ------------------------------------------------------------------------------

@pytest.mark.parametrize("task", ["copy", "reverse"])
def test_synthetic_tasks(task):
    pairs = synthetic_pairs(task, num_examples=200, vocab_size=20, min_len=2, max_len=9, seed=3)
    assert len(pairs) == 200
    for src, tgt in pairs:
        assert 2 <= len(src) <= 9
        assert all(3 <= t < 20 and isinstance(t, int) for t in src)
        assert tgt == (src if task == "copy" else src[::-1])
    assert {len(s) for s, _ in pairs} == set(range(2, 10))
    assert pairs == synthetic_pairs(task, num_examples=200, vocab_size=20, min_len=2, max_len=9, seed=3)
    assert pairs != synthetic_pairs(task, num_examples=200, vocab_size=20, min_len=2, max_len=9, seed=4)


def test_synthetic_errors():
    with pytest.raises(DataError, match="unknown synthetic task 'sort'"):
        synthetic_pairs("sort")
    with pytest.raises(DataError, match="vocab_size"):
        synthetic_pairs(vocab_size=3)
    with pytest.raises(DataError, match="min_len"):
        synthetic_pairs(min_len=5, max_len=4)


# -- Tokenizer ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_corpus() -> list[str]:
    if not (SHARED / "train.de.gz").is_file():
        pytest.fail(MISSING, pytrace=False)
    train = load_multi30k("train", data_dir=SHARED)[:3000]
    return [s for pair in train for s in pair]


@pytest.fixture(scope="module")
def tok(small_corpus):
    from rosetta.tokenizer import Tokenizer

    return Tokenizer.train(small_corpus, vocab_size=2000)


def test_tokenizer_special_ids_and_size(tok):
    assert [tok.token_to_id(t) for t in ("<pad>", "<s>", "</s>", "<unk>")] == [0, 1, 2, 3]
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert 260 < tok.vocab_size <= 2000
    cfg = ModelConfig(src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size)
    assert (cfg.pad_id, cfg.bos_id, cfg.eos_id) == (tok.pad_id, tok.bos_id, tok.eos_id)


@needs_data
def test_tokenizer_round_trip(tok):
    val = load_multi30k("val", data_dir=SHARED)  # unseen in training
    sentences = [s for pair in val for s in pair]
    ids = tok.encode_batch(sentences)
    assert ids[0] == tok.encode(sentences[0])
    assert all(i not in (0, 1, 2, 3) for row in ids for i in row)  # no bos/eos added, no unk
    decoded = [tok.decode(row) for row in ids]
    exact = sum(d == s for d, s in zip(decoded, sentences, strict=True))
    assert exact == len(sentences)  # byte-level BPE is lossless on NFC text
    # Model output form: bos, tokens, eos, then anything; pad and bos skipped, eos stops.
    row = ids[0]
    assert tok.decode([1, *row, 2, 57, 0, 0]) == sentences[0]
    assert tok.decode([0, 1, *row[:2], 0, *row[2:]]) == sentences[0]
    assert tok.decode_batch(np.array([[1, *row, 2]])) == [sentences[0]]
    assert tok.decode([2, *row]) == ""
    # Special-token strings inside text are text, not control ids.
    assert not {0, 1, 2, 3} & set(tok.encode("a </s> b <pad> c <s>"))
    assert tok.decode(tok.encode("a </s> b")) == "a </s> b"
    assert tok.decode(tok.encode("Ünïcödé ✓ 日本")) == "Ünïcödé ✓ 日本"
    from rosetta.errors import TokenizerError

    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_tokenizer_save_load_and_determinism(tok, small_corpus, tmp_path):
    from rosetta.tokenizer import Tokenizer, TokenizerError

    path = tok.save(tmp_path / "sub" / "bpe.json")
    assert [p.name for p in path.parent.iterdir()] == ["bpe.json"]  # no temp file left
    loaded = Tokenizer.load(path)
    assert loaded.vocab_size == tok.vocab_size
    sample = small_corpus[::97] + ["a </s> b"]
    assert [loaded.encode(s) for s in sample] == [tok.encode(s) for s in sample]
    assert loaded.to_json() == tok.to_json()
    # Same input, same vocabulary (BPE training has no randomness to seed).
    assert Tokenizer.train(small_corpus[:2000], vocab_size=800).to_json() == \
        Tokenizer.train(small_corpus[:2000], vocab_size=800).to_json()

    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="bad.json"):
        Tokenizer.load(tmp_path / "bad.json")
    data = json.loads(tok.to_json())
    for t in data["added_tokens"]:
        t["id"] = {0: 1, 1: 0}.get(t["id"], t["id"])
    data["model"]["vocab"]["<pad>"], data["model"]["vocab"]["<s>"] = 1, 0
    (tmp_path / "swapped.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match="'<pad>' has id 1, expected 0"):
        Tokenizer.load(tmp_path / "swapped.json")
    with pytest.raises(TokenizerError, match="vocab_size"):
        Tokenizer.train(["a b"], vocab_size=100)


@needs_data
def test_end_to_end_val_batches_decode_to_the_text(tok):
    val = load_multi30k("val", data_dir=SHARED)
    ids = list(zip(tok.encode_batch([s for s, _ in val]), tok.encode_batch([t for _, t in val]), strict=True))
    batches, dropped = eval_batches(ids, max_tokens=2048, max_len=128)
    assert dropped == []
    sources = restore_order(batches, [tok.decode_batch(b.src) for b in batches], len(val))
    targets = restore_order(batches, [tok.decode_batch(b.labels) for b in batches], len(val))
    assert sources == [s for s, _ in val] and targets == [t for _, t in val]


# -- Batching -------------------------------------------------------------------------------------

PAD, BOS, EOS = 0, 1, 2


def random_pairs(n: int, seed: int, max_src: int = 70, max_tgt: int = 70) -> list[tuple[list, list]]:
    """Pairs with independent source and target lengths (target may be empty), ids >= 3."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.geometric(1 / 14, size=(n, 2)), [max_src, max_tgt])
    lengths[:, 1] -= rng.integers(0, 2, size=n)  # some empty targets
    return [(rng.integers(3, 50, size=a).tolist(), rng.integers(3, 50, size=b).tolist()) for a, b in lengths]


def expected_rows(src: list[int], tgt: list[int], length: int, src_eos: bool = True):
    """The padded rows of one pair, built the plain way."""
    s = src + ([EOS] if src_eos else [])
    return (s + [PAD] * (length - len(s)),
            [BOS] + tgt + [PAD] * (length - len(tgt) - 1),
            tgt + [EOS] + [PAD] * (length - len(tgt) - 1))


def check_batch(batch: Batch, it: BatchIterator, pairs, src_eos: bool = True) -> None:
    rows, length = batch.src.shape
    assert length in it.buckets and rows == it.max_tokens // length
    assert batch.src.shape == batch.tgt_in.shape == batch.labels.shape == (rows, length)
    assert batch.src.size <= it.max_tokens and batch.tgt_in.size <= it.max_tokens
    assert all(a.dtype == np.int64 for a in (batch.src, batch.tgt_in, batch.labels, batch.indices))
    real = batch.indices >= 0
    assert real.any() and not np.any(np.diff(real.astype(int)) > 0)  # real rows first, then padding
    for r, i in enumerate(batch.indices.tolist()):
        if i < 0:
            assert not batch.src[r].any() and not batch.tgt_in[r].any() and not batch.labels[r].any()
            continue
        src, tgt_in, labels = expected_rows(list(pairs[i][0]), list(pairs[i][1]), length, src_eos)
        assert batch.src[r].tolist() == src and batch.tgt_in[r].tolist() == tgt_in
        assert batch.labels[r].tolist() == labels
        n = len(pairs[i][1])
        assert batch.labels[r, :n].tolist() == batch.tgt_in[r, 1:n + 1].tolist()  # shifted left by one
    assert batch.num_src_tokens == int((batch.src != PAD).sum())
    assert batch.num_tgt_tokens == int((batch.labels != PAD).sum())
    assert batch.num_examples == int(real.sum())


def test_default_buckets():
    assert default_buckets(256) == (8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 192, 256)
    assert default_buckets(1024)[-6:] == (192, 256, 384, 512, 768, 1024)
    assert default_buckets(100) == (8, 16, 24, 32, 40, 48, 56, 64, 96, 100)
    assert default_buckets(5) == (5,)


def test_batches_shapes_labels_coverage_and_drops(caplog):
    pairs = random_pairs(1500, seed=0)
    max_tokens, max_len = 1000, 64
    with caplog.at_level("WARNING", logger="rosetta.harness.batching"):
        it = BatchIterator(pairs, max_tokens=max_tokens, max_len=max_len, seed=7)
    too_long = [i for i, (s, t) in enumerate(pairs) if max(len(s) + 1, len(t) + 1) > max_len]
    assert too_long and it.dropped == too_long and it.num_dropped == len(too_long)
    assert f"dropped {len(too_long)} of 1500" in caplog.text
    assert it.buckets == (8, 16, 24, 32, 40, 48, 56, 64)
    seen, shapes = [], set()
    for batch in it.epoch_batches():
        check_batch(batch, it, pairs)
        seen += batch.indices[batch.indices >= 0].tolist()
        shapes.add(batch.src.shape)
    assert sorted(seen) == sorted(set(range(1500)) - set(too_long))  # each kept pair exactly once
    assert shapes == set(it.shapes) and len(shapes) <= len(it.buckets)
    assert it.state_dict()["epoch"] == 1 and it.state_dict()["index"] == 0
    # The bound: every batch is exactly (max_tokens // L) x L, at most max_tokens entries.
    assert all(r * length <= max_tokens for r, length in it.shapes)


def test_order_is_seeded_and_differs_by_epoch():
    pairs = random_pairs(600, seed=1)

    def order(seed: int, epochs: int = 1) -> list[list[int]]:
        it = BatchIterator(pairs, max_tokens=512, max_len=64, seed=seed)
        return [next(it).indices.tolist() for _ in range(epochs * it.batches_per_epoch)]

    first = order(5, epochs=2)
    assert first == order(5, epochs=2)
    assert first[: len(first) // 2] != order(6)
    epoch0, epoch1 = first[: len(first) // 2], first[len(first) // 2:]
    assert epoch0 != epoch1  # each epoch is reshuffled
    assert sorted(i for b in epoch0 for i in b if i >= 0) == sorted(i for b in epoch1 for i in b if i >= 0)


def test_resume_gives_exactly_the_next_batches():
    pairs = random_pairs(400, seed=2)
    kwargs = dict(max_tokens=1024, max_len=64, seed=11)
    full = BatchIterator(pairs, **kwargs)
    assert 10 < full.batches_per_epoch < 20  # the 20 batches cross an epoch boundary
    uninterrupted = [next(full) for _ in range(20)]

    first = BatchIterator(pairs, **kwargs)
    for _ in range(10):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["epoch"] == 0 and state["index"] == 10
    resumed = BatchIterator(pairs, **kwargs)
    resumed.load_state_dict(state)
    for expected, got in zip(uninterrupted[10:], (next(resumed) for _ in range(10)), strict=True):
        for name in ("src", "tgt_in", "labels", "indices"):
            np.testing.assert_array_equal(getattr(got, name), getattr(expected, name))

    with pytest.raises(DataError, match="seed 11"):
        BatchIterator(pairs, max_tokens=1024, max_len=64, seed=12).load_state_dict(state)
    with pytest.raises(DataError, match="batches per epoch"):
        BatchIterator(pairs[:200], **kwargs).load_state_dict(state)
    with pytest.raises(DataError, match="out of range"):
        resumed.load_state_dict({"epoch": 0, "index": 10_000})


def test_eval_batches_keep_original_order():
    pairs = random_pairs(300, seed=3)
    batches, dropped = eval_batches(pairs, max_tokens=400, max_len=64)
    assert dropped == [i for i, (s, t) in enumerate(pairs) if max(len(s) + 1, len(t) + 1) > 64]
    lengths = [b.src.shape[1] for b in batches]
    assert lengths == sorted(lengths)  # buckets in order, no shuffle
    for b in batches:
        real = b.indices[b.indices >= 0]
        assert real.tolist() == sorted(real.tolist())  # original order within a bucket
    outputs = [[f"out{i}" for i in b.indices.tolist()] for b in batches]
    restored = restore_order(batches, outputs, len(pairs))
    assert restored == [None if i in dropped else f"out{i}" for i in range(len(pairs))]
    again, _ = eval_batches(pairs, max_tokens=400, max_len=64)
    assert [b.indices.tolist() for b in again] == [b.indices.tolist() for b in batches]


def test_from_config_and_argument_errors():
    cfg = preset("tiny", bos_id=5, eos_id=6, max_len=40)
    pairs = [([7, 8, 9], [10, 11]), ([12], [])]
    it = BatchIterator.from_config(pairs, cfg, max_tokens=80, seed=0)
    assert it.buckets == (8, 16, 24, 32, 40)
    batch = next(it)
    assert batch.src.shape == (10, 8)
    row = batch.indices.tolist().index(0)
    assert batch.src[row, :4].tolist() == [7, 8, 9, 6]
    assert batch.tgt_in[row, :3].tolist() == [5, 10, 11] and batch.labels[row, :3].tolist() == [10, 11, 6]
    no_eos = BatchIterator(pairs, max_tokens=64, max_len=64, src_eos=False)
    assert next(no_eos).num_src_tokens == 4

    with pytest.raises(DataError, match="max_tokens"):
        BatchIterator(pairs, max_tokens=100, max_len=256)
    with pytest.raises(DataError, match="token id 0"):
        BatchIterator([([3, 0, 4], [5])], max_tokens=64, max_len=64)
    with pytest.raises(DataError, match="no pairs to batch"):
        BatchIterator([(list(range(3, 100)), [3])], max_tokens=64, max_len=64)
    with pytest.raises(DataError, match="strictly increasing"):
        BatchIterator(pairs, buckets=[16, 8], max_tokens=64, max_len=64)
    with pytest.raises(DataError, match="exceeds max_len"):
        BatchIterator(pairs, buckets=[8, 512], max_len=256)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=40),
    max_tokens=st.integers(40, 300),
    seed=st.integers(0, 2**32 - 1),
    src_eos=st.booleans(),
)
def test_property_padding_and_shifted_labels(lengths, max_tokens, seed, src_eos):
    rng = np.random.default_rng(seed)
    pairs = [(rng.integers(3, 30, size=a).tolist(), rng.integers(3, 30, size=b).tolist()) for a, b in lengths]
    max_len = 40
    needed = [max(len(s) + src_eos, len(t) + 1) for s, t in pairs]
    if all(n > max_len for n in needed):
        with pytest.raises(DataError, match="no pairs"):
            BatchIterator(pairs, max_tokens=max_tokens, max_len=max_len, seed=seed, src_eos=src_eos)
        return
    it = BatchIterator(pairs, max_tokens=max_tokens, max_len=max_len, seed=seed, src_eos=src_eos)
    assert it.dropped == [i for i, n in enumerate(needed) if n > max_len]
    seen = []
    for batch in it.epoch_batches():
        check_batch(batch, it, pairs, src_eos)
        seen += batch.indices[batch.indices >= 0].tolist()
        length = batch.src.shape[1]
        buckets = np.asarray(it.buckets)
        for i in batch.indices[batch.indices >= 0].tolist():  # the smallest bucket that fits
            assert length == buckets[buckets >= needed[i]][0]
    assert sorted(seen) == [i for i, n in enumerate(needed) if n <= max_len]
