"""Packed rows as long as the data needs (docs/packing.md): the row length is the longest pair rounded up
to a multiple of 16, at most the largest bucket; `rosetta train` packs by default on a GPU and not on a
CPU, and says which in its first lines, with the share of real target tokens of its batches."""

from __future__ import annotations

import pytest

from rosetta.cli import main
from rosetta.config import preset
from rosetta.harness.batching import PACK_MULTIPLE, BatchIterator, default_pack_length
from rosetta.harness.run_config import DEFAULT_BATCHING, RunConfig, resolve_batching
from rosetta.harness.tasks import load_task


def _share(iterator: BatchIterator) -> float:
    """Epoch 0's real target tokens over its target slots, from the batches themselves: labels that are
    not padding, over every label slot (rows x L, padding rows included)."""
    batches = list(iterator.epoch_batches())
    return sum(int((b.labels != 0).sum()) for b in batches) / sum(b.labels.size for b in batches)


def test_the_pack_length_of_a_small_pair_list_by_hand():
    # src = x + [eos], tgt_in = [bos] + y: lengths max(6 + 1, 1 + 3) = 7, max(2 + 1, 1 + 20) = 21,
    # max(9 + 1, 1 + 9) = 10. The longest, 21, rounds up to 32.
    pairs = [([5] * 6, [6] * 3), ([5] * 2, [6] * 20), ([5] * 9, [6] * 9)]
    it = BatchIterator(pairs, max_tokens=64, max_len=64, packing=True, shuffle=False)
    assert PACK_MULTIPLE == 16 and it.pack_length == 32 and it.shapes == [(2, 32)] and it.dropped == []
    # Row 0: pairs 0 and 1 (sources 7 + 3, targets 4 + 21 <= 32); pair 2's target (10) starts row 1.
    (batch,) = it.epoch_batches()
    assert batch.indices[:, :2].tolist() == [[0, 1], [2, -1]]
    assert it.real_token_share() == _share(BatchIterator(pairs, max_tokens=64, max_len=64, packing=True,
                                                         shuffle=False)) == (4 + 21 + 10) / 64
    # Capped by the largest bucket (max_len unless --buckets say less): the 21-token pair is dropped.
    capped = BatchIterator(pairs, max_tokens=48, max_len=64, buckets=[8, 16], packing=True)
    assert capped.pack_length == 16 and capped.dropped == [1]
    # A length already a multiple of 16 stays; no pair, or pairs of one token, still make a 16-token row.
    assert [default_pack_length(n, 256) for n in (0, 1, 16, 17, 48, 49, 300)] == [16, 16, 16, 32, 48, 64, 256]
    # 16 source ids: 17 with eos -> 32; without (src_eos=False) 16 -> 16.
    long_source = [([5] * 16, [6] * 3)]
    assert BatchIterator(long_source, max_len=64, packing=True).pack_length == 32
    assert BatchIterator(long_source, max_len=64, packing=True, src_eos=False).pack_length == 16


@pytest.mark.parametrize("task, settings", [
    ("multi30k", {"vocab_size": 8000}),  # the recipe's joint BPE, de-en
    ("copy", {"vocab_size": 1000}),  # rosetta train's default synthetic task (16 ids at most)
    ("copy", {"vocab_size": 1000, "synthetic_max_len": 63}),  # the GPU suite's training batches (64 a side)
])
def test_multi30k_and_the_copy_task_pack_into_rows_of_128_or_less(task, settings):
    data = load_task(task, bpe_vocab_size=8000, **settings)
    longest = max(max(len(x) + 1, len(y) + 1) for x, y in data.train_pairs)  # as the batches count them
    want = -(-longest // 16) * 16
    cfg = preset("base")  # max_len 1,024: the old default row length
    it = BatchIterator.from_config(data.train_pairs, cfg, max_tokens=25000, packing=True)
    assert it.pack_length == want <= 128 and it.dropped == []
    assert it.real_token_share() == pytest.approx(_share(it), rel=1e-12)


def test_the_default_batching_is_packed_on_a_gpu_and_bucketed_on_a_cpu():
    """The documented choice (docs/packing.md): bucketed on a CPU, where the newest batches benchmark
    (benchmarks/results/batches_small_float32_cpu_2026-11-27.md) measured packed rows no faster."""
    assert DEFAULT_BATCHING == {"gpu": "packed", "cpu": "bucketed"}
    assert RunConfig().batching is None  # the flag's default: resolved from the devices
    assert resolve_batching(None, ("torch",), ["cuda:0"]) == "packed"
    assert resolve_batching(None, ("jax",), ["gpu:0"]) == "packed"
    assert resolve_batching(None, ("torch", "jax"), ["cuda:0", "cpu:0"]) == "packed"  # the same batches
    assert resolve_batching(None, ("torch", "jax"), ["cpu", "cpu:0"]) == "bucketed"
    assert resolve_batching(None, ("peer",), ["cuda:0"]) == "bucketed"  # nn.Transformer takes no segments
    assert resolve_batching("bucketed", ("torch",), ["cuda"]) == "bucketed"  # the flag wins
    assert resolve_batching("packed", ("torch",), ["cpu"]) == "packed"


def test_rosetta_train_says_in_its_first_lines_that_it_packs(tmp_path, capsys):
    """`--batching packed` on the CPU: the line after "training ..." names the row length (the longest
    copy pair, 16 ids + eos, rounded up: 32) and the real-token share of epoch 0's batches; the run
    records the resolved setting. Without the flag the CPU run is bucketed and says so."""
    args = ["train", "--backend", "torch", "--device", "cpu", "--steps", "1", "--train-size", "300",
            "--eval-size", "4", "--bleu-samples", "4", "--eval-every", "0", "--checkpoint-every", "0",
            "--no-progress", "--max-tokens", "1024"]
    assert main([*args, "--batching", "packed", "--out", str(tmp_path / "packed")]) == 0
    lines = capsys.readouterr().err.splitlines()
    pairs = load_task("copy", vocab_size=preset("tiny").src_vocab_size, train_size=300).train_pairs
    it = BatchIterator.from_config(pairs, preset("tiny"), max_tokens=1024, packing=True)
    assert it.pack_length == 32
    assert lines[0].startswith("rosetta: torch: training tiny")
    assert lines[1] == (f"rosetta: torch: packing: rows of 32 tokens, {_share(it):.0%} real target tokens in "
                        "epoch 0; --batching bucketed to turn off (docs/packing.md)")
    assert '"batching": "packed"' in (tmp_path / "packed" / "torch" / "run.json").read_text()
    assert main([*args, "--out", str(tmp_path / "default")]) == 0
    line = capsys.readouterr().err.splitlines()[1]
    assert line.startswith("rosetta: torch: bucketed: ") and line.endswith("--batching packed to pack rows")
    assert '"batching": "bucketed"' in (tmp_path / "default" / "torch" / "run.json").read_text()


def test_resume_matches_the_resolved_batching_and_reads_an_older_run_as_bucketed(tmp_path):
    """run.json records the resolved --batching (not None); a resume resolves it again and must match,
    and a run saved before --batching existed (no such identity key) resumes as the bucketed run it was."""
    import dataclasses
    import json

    from rosetta.errors import RosettaError
    from rosetta.harness.loop import train

    run = RunConfig(backends=("torch",), device="cpu", out=str(tmp_path), steps=1, train_size=100,
                    eval_size=4, bleu_samples=4, eval_every=0, checkpoint_every=1, progress=False)
    train(run)
    saved = tmp_path / "torch" / "run.json"
    record = json.loads(saved.read_text())
    assert record["identity"]["batching"] == "bucketed" and record["args"]["batching"] == "bucketed"
    with pytest.raises(RosettaError, match=r"batching='bucketed' \(now 'packed'\)"):
        train(dataclasses.replace(run, steps=2, resume=True, batching="packed"))
    del record["identity"]["batching"]
    saved.write_text(json.dumps(record))
    train(dataclasses.replace(run, steps=2, resume=True))
    assert json.loads((tmp_path / "torch" / "result.json").read_text())["backend"] == "torch"
